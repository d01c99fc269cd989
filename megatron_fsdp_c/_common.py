"""Small helpers shared across the package. A leaf: it imports nothing from megatron_fsdp_c, so
every module may import it without forming an import circle (tests/test_structure.py checks)."""
from __future__ import annotations

import dataclasses
import logging
from typing import List

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["STRATEGY_NAMES", "contiguous_stride", "grad_tensors", "in_backward", "logger", "parse_strategy"]

logger = logging.getLogger("megatron_fsdp_c")

# Megatron-FSDP's zero_dp_strategy names, by number.
STRATEGY_NAMES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def parse_strategy(value) -> int:
    """zero_dp_strategy as 0..3, from a number or one of STRATEGY_NAMES (either API)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= int(value) <= 3:
        return int(value)  # (True/False are ints in Python; never a strategy)
    if isinstance(value, str) and value.lower() in STRATEGY_NAMES:
        return STRATEGY_NAMES.index(value.lower())
    raise ValueError(
        f"unknown zero_dp_strategy {value!r}: use 0/'no_shard', 1/'optim', 2/'optim_grads' or "
        "3/'optim_grads_params'"
    )


def in_backward() -> bool:
    """Is autograd running a backward on this thread (e.g. activation recomputation)?"""
    return torch._C._current_graph_task_id() != -1


def grad_tensors(tree) -> List[torch.Tensor]:
    """The tensors of `tree` that require grad, looking into dataclasses too (pytree does not)."""
    out = []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += grad_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return out


def contiguous_stride(shape) -> tuple:
    """The strides of a contiguous tensor of `shape` (a DTensor's global stride)."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))
