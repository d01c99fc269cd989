"""Small helpers shared across the package. Near the floor: it imports only _torch_compat (a leaf)
from megatron_fsdp_c, so every module may import it without forming an import circle
(tests/test_structure.py checks)."""
from __future__ import annotations

import dataclasses
import enum
import logging
import weakref
from typing import List

import torch
from torch.utils._pytree import tree_flatten

from ._torch_compat import STORAGE_SWAP

__all__ = ["ShardingStrategy", "contiguous_stride", "grad_tensors", "in_backward", "logger", "move_storage",
           "parse_strategy", "weak_call"]

logger = logging.getLogger("megatron_fsdp_c")

class ShardingStrategy(enum.IntEnum):
    """Megatron-FSDP's zero_dp_strategy: what is sharded (the member's name, lower-cased, is the
    string form either API takes). The one place the numbers 0..3 mean something."""
    NO_SHARD = 0
    OPTIM = 1
    OPTIM_GRADS = 2
    OPTIM_GRADS_PARAMS = 3

    @property
    def label(self) -> str:
        """The string form: 'no_shard', 'optim', 'optim_grads', 'optim_grads_params'."""
        return self.name.lower()


def parse_strategy(value, allowed=tuple(ShardingStrategy), what: str = "zero_dp_strategy") -> ShardingStrategy:
    """A ShardingStrategy from a member, a number or its label (either API); `allowed` limits it
    (outer_dp_sharding_strategy takes NO_SHARD and OPTIM only)."""
    for s in allowed:  # (True/False are ints in Python; never a strategy)
        if (isinstance(value, int) and not isinstance(value, bool) and value == s) or \
                (isinstance(value, str) and value.lower() == s.label):
            return s
    if what != "zero_dp_strategy":
        raise ValueError(f"unknown {what} {value!r}: use " + " or ".join(f"{s.label!r}" for s in allowed))
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


def move_storage(t: torch.Tensor, src: torch.Tensor, moved: set) -> bool:
    """[Note: local shards keep their storage]
    Makes the storage of `t` hold the memory of `src` (same dtype, shape and device; each the
    whole of its storage), by swapping the two storages' data pointers: every tensor over t's
    storage -- t itself, and the detached copies a state dict or a DTensor made of it, which are
    other tensor objects over the same storage -- then reads and writes src's memory, and src's
    storage holds t's old memory (freed with src). The per-module API's lazy init moves each
    pre-engine local shard into the engine's main weights so (param_buffer.build_dist_params), as
    FSDP2's sharded parameters never change storage: a state dict taken before the first forward
    keeps aliasing the parameters (torch's test_cached_state_dict); release_engine moves them back
    out. `moved` holds the storages moved so far in one pass: a storage shared by two tensors
    (one tensor assigned under two names) moves once, the second keeps its own tensor. Returns
    False where nothing was moved (the caller then replaces the tensor object, as before).
    torch 2.11 cannot swap storages (_torch_compat.STORAGE_SWAP): there the caller replaces the
    tensor object, and t's old storage is released with an error message, so that a tensor
    still over it (a state dict taken before the first forward) raises at its next use, naming
    the cause, instead of silently keeping the values it had then."""
    s, v = t.untyped_storage(), src.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if (t.device != src.device or t.dtype != src.dtype or t.shape != src.shape or nbytes == 0
            or not t.is_contiguous() or not src.is_contiguous() or t.storage_offset() or src.storage_offset()
            or s.nbytes() != nbytes or v.nbytes() != nbytes or s._cdata in moved):
        return False
    moved.add(s._cdata)
    if not STORAGE_SWAP:
        torch._C._set_storage_data_ptr_access_error_msg(s._cdata, (
            "this tensor is a stale alias of a parameter sharded by megatron_fsdp_c's per-module fully_shard "
            f"(taken before the model's engine was built, or before a .to() rebuilt it): torch {torch.__version__} "
            "cannot move its memory into the engine (torch 2.12+ can). Take the state dict (or the local tensor) "
            "again after the first forward"))
        return False
    s._swap_data_ptr_(v)
    return True


def weak_call(owner, method: str, *args, **kwargs):
    """A hook calling owner.<method>(*args, *hook_args, **kwargs), holding owner weakly: a no-op
    once the owner is gone.

    [Note: hooks hold their owner weakly]
    A parameter's hook lives in the parameter's hook dict, and a hook manager reaches that
    parameter through its owner's records: a strong reference makes a cycle through the tensor.
    torch's collector does not traverse a tensor's hooks while C++ may still hold the tensor, so
    such a cycle is never collected: every sharded model, with its engine and buffers, lived as
    long as the process (measured: 38 more parameter records alive per GPT built and dropped, in
    both APIs; tests/test_reliability.py::test_dropped_models_are_freed)."""
    ref = weakref.ref(owner)

    def hook(*hook_args):
        o = ref()
        if o is not None:
            getattr(o, method)(*args, *hook_args, **kwargs)
    return hook


def transformers_initialiser(module: torch.nn.Module):
    """A transformers model's own initialiser of one of its submodules (PreTrainedModel's
    _init_weights, bound: what from_config and from_pretrained run on every module, norms and
    rotary embeddings' buffers included), or None for any other model. Told by class name, so
    transformers need not be installed."""
    if any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(module).__mro__):
        return getattr(module, "_init_weights", None)
    return None
