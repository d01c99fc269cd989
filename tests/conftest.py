"""pytest set-up: the multi-rank grids learn which cells this session reads (see [Note: one
spawn per world size] in rank_grid.py)."""
import functools

import pytest

import rank_grid
from megatron_fsdp_c.testing import run_on_ranks


def pytest_collection_finish(session):
    rank_grid.set_session_items(session.items)


def pytest_sessionfinish(session, exitstatus):
    rank_grid.end_session()


@functools.lru_cache(maxsize=None)
def _cached_run(fn, world, *args):
    try:
        return ("ok", run_on_ranks(fn, world, *args))
    except Exception as e:  # noqa: BLE001 - reported by every test that reads it
        return ("error", str(e))


def get_run(fn, world, *args):
    """Deprecated: run_on_ranks memoised per (function, world, args), a spawn of its own. New
    multi-rank tests register rank_grid cells instead, which share one spawn per world size."""
    status, value = _cached_run(fn, world, *args)
    if status == "error":
        pytest.fail(value, pytrace=False)
    return value
