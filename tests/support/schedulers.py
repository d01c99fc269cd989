"""LR schedulers in users' loops (tests/test_user_loops.py, tests/test_transformers_models.py)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


class MirroredSchedule:
    """Stands in for a scheduler that could not be built on the sharded optimizer: it runs the
    same scheduler on a one-parameter stand-in optimizer and copies the factor into the real
    optimizer's learning rates, so the rest of the loop can still be compared with DDP."""

    def __init__(self, factory: Callable, optimizer):
        import warnings
        self.optimizer = optimizer
        self.base = [g["lr"] for g in optimizer.param_groups]
        self.stand_in = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        self.scheduler = factory(self.stand_in)
        self._warnings = warnings
        self._apply()

    def _apply(self):
        factor = self.stand_in.param_groups[0]["lr"]
        for g, base in zip(self.optimizer.param_groups, self.base):
            g["lr"] = base * factor

    def step(self):
        with self._warnings.catch_warnings():
            self._warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
            self.scheduler.step()
        self._apply()

    def get_last_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]


def build_scheduler(factory: Callable, optimizer):
    """(scheduler, '') or, when building it on this optimizer raises, (MirroredSchedule, why)."""
    try:
        return factory(optimizer), ""
    except Exception as e:  # noqa: BLE001 - reported as a check by the caller
        return MirroredSchedule(factory, optimizer), f"{type(e).__name__}: {e}"
