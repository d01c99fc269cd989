"""Shared fixtures: multi-process runs are expensive (a spawn per world size), so each test
module computes its grid once per world size and the parametrised tests read from it."""
import functools

import pytest

from megatron_fsdp_c.testing import run_on_ranks


@functools.lru_cache(maxsize=None)
def cached_run(fn, world, *args):
    """run_on_ranks, memoised per (function, world, args) for the whole session. A failure is
    cached too and re-raised by every test that reads it."""
    try:
        return ("ok", run_on_ranks(fn, world, *args))
    except Exception as e:  # noqa: BLE001 - reported per test
        return ("error", str(e))


def get_run(fn, world, *args):
    status, value = cached_run(fn, world, *args)
    if status == "error":
        pytest.fail(value, pytrace=False)
    return value
