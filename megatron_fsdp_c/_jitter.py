"""A test-only switch: random sleeps at the hand-offs between the autograd thread and the
optimizer's threads, so that a stress run (benchmarks/stress.py) tries interleavings a quiet
machine never schedules.

[Note: jitter at the hand-offs]
With MFSDP_TEST_JITTER_MS=<ms> in the environment when this module is imported, `pause(site)`
sleeps a random time in [0, ms] milliseconds; without it `pause` is a function that returns at
once (one call per hand-off, nothing else). The sites are where one thread hands work or memory
to another: a bucket submitted to the step (`submit`), the sealer starting and its gradients
landed (`seal`, `landed`), the worker starting and about to write the weights (`step`, `update`),
and the autograd thread joining them (`join`). `seed(n)` makes the sleeps of the calling process
a function of n (benchmarks/stress.py seeds each repetition), as far as thread scheduling allows.
Never set in training: it only slows a run down.
"""
from __future__ import annotations

import os
import random
import threading
import time

__all__ = ["pause", "seed", "ENABLED_MS"]

ENABLED_MS = float(os.environ.get("MFSDP_TEST_JITTER_MS", "0") or 0)
_rng = random.Random(0)
_lock = threading.Lock()  # pause runs on several threads; one generator, drawn in turn


def seed(n: int) -> None:
    with _lock:
        _rng.seed(n)


def _sleep(site: str) -> None:
    with _lock:
        s = _rng.random() * ENABLED_MS / 1000.0
    time.sleep(s)


def _nothing(site: str) -> None:
    return None


pause = _sleep if ENABLED_MS > 0 else _nothing
