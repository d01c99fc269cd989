"""fully_shard per module (Megatron-FSDP v2's second API), a drop-in for torch's FSDP2 on the C engine.

[Note: per-module groups]
Each fully_shard call forms one group: the parameters of its module(s) that are not already in
the group of a submodule (fully_shard is applied bottom-up, as with FSDP2). The call turns them
into DTensor parameters at once -- torch's Shard(0) rows, or Replicate() for no_shard groups,
fsdp_no_shard marks and 0-d parameters -- so an optimizer built afterwards holds them, and it
swaps the module's class to FSDP<Class>. Nothing is communicated yet.

At the first forward of a group with no sharded ancestor, the root, one engine is built for
every group under it (a lazy init, as FSDP2 does). The groups become the engine's units, in
module order, each with its own strategy and mixed precision. The DTensor parameters keep
their identity and their local tensors are re-pointed at the engine's buffers (FSDP2 re-points
its own after lazy init), so an optimizer made before the first forward keeps working. From then
on a step runs exactly as under fully_shard_model: the same hooks and shared collective orders
(see [Note: gather order] in ../hooks.py), buckets, kernels and transports.

The user's optimizer steps the DTensor parameters directly, so the engine notices the update
through the parameters' version counters at the next forward and refreshes what it keeps
gathered (ZeRO-1/2 full weights, a group that does not reshard, a cast compute copy).

This module is the entry point (fully_shard, FSDPModule, UnshardHandle); a group's formation and
DTensor conversion are in _group.py, the root state (lazy init, the forward hooks) in _root.py,
the policy checks and casts in _policy.py.
"""
from __future__ import annotations

import functools
from typing import Iterable, List, Optional, Union

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._common import parse_strategy
from ..no_shard import mark_by_name
from ._group import ShardGroup, form_group, group_of
from ._policy import check_policies
from ._root import RootState, post_forward, pre_forward, state_of

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle"]


def fully_shard(module: Union[nn.Module, List[nn.Module]], *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: bool = True, shard_placement_fn=None, mp_policy=None, offload_policy=None,
                ignored_params: Optional[Iterable[nn.Parameter]] = None,
                zero_dp_strategy: Union[int, str] = "optim_grads_params"):
    """Shards `module` (or a list of modules, one group) the way torch's FSDP2 fully_shard does
    (apply it bottom-up: blocks first, then the root), on megatron_fsdp_c's C engine. Returns the
    module, whose class becomes FSDP<Class> in place (see [Note: per-module groups]).

    Beyond torch's arguments: zero_dp_strategy (default "optim_grads_params") gives the group
    Megatron-FSDP's strategies: "no_shard" (0), "optim" (1), "optim_grads" (2). mp_policy takes
    torch's MixedPrecisionPolicy (param_dtype, reduce_dtype, output_dtype, cast_forward_inputs) or
    megatron_fsdp_c's. shard_placement_fn may return None or Shard(0); offload_policy takes
    torch's default OffloadPolicy() (CPUOffloadPolicy is not supported yet)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError("fully_shard expects an nn.Module or a non-empty list of nn.Modules")
    for m in modules:
        if isinstance(m, FSDPModule) or getattr(m, "_mfsdp_group", None) is not None:
            raise RuntimeError(f"fully_shard was already applied to this {type(m).__name__}: apply it once per module, "
                               "bottom-up (blocks first, then their parent)")
        if getattr(m, "_megatron_fsdp_wrapper", None) is not None:
            raise RuntimeError(f"this {type(m).__name__} is already sharded by megatron_fsdp_c.fully_shard (the "
                               "Megatron-FSDP API); use one API per model")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r} (resharding to a "
                        "smaller world is not supported)")
    if mp_policy is None:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        mp_policy = TorchPolicy()
    check_policies(mp_policy, offload_policy, shard_placement_fn)
    strategy = parse_strategy(zero_dp_strategy)
    ignored = set(ignored_params or ())
    for m in modules:
        mark_by_name(m)
    group = form_group(modules, mesh, strategy, mp_policy, reshard_after_forward, ignored, shard_placement_fn)
    for m in group.modules:
        m.__class__ = _fsdp_class(type(m))
        m.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(post_forward, prepend=False)
    return module


@functools.lru_cache(maxsize=None)
def _fsdp_class(cls: type) -> type:
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})


# -- FSDPModule -----------------------------------------------------------------------------------

class UnshardHandle:
    """What unshard(async_op=True) returns: wait() makes the full parameters usable."""

    def __init__(self, state: RootState, buckets: List[int]):
        self._state, self._buckets = state, buckets

    def wait(self) -> None:
        if self._buckets:
            self._state.param_buffer.engine.wait_unshard(self._buckets)
            self._buckets = []


class FSDPModule:
    """The methods a module gains from megatron_fsdp_c.experimental.fully_shard (FSDP2's, plus
    zero_dp_strategy at fully_shard time). Settings with `recurse` apply to every sharded module
    under this one."""

    def _groups(self, recurse: bool) -> List[ShardGroup]:
        mods = self.modules() if recurse else [self]
        out = []
        for m in mods:
            g = getattr(m, "_mfsdp_group", None)
            if g is not None and g not in out:
                out.append(g)
        return out

    def _reconfigure(self, groups) -> None:
        for g in groups:
            if g.state is not None:
                g.state.configure(g)

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gathers this module's full parameters now (collective); they stay until reshard()."""
        g = group_of(self)
        state = state_of(self)
        buckets = list(g.unit.buckets)
        state.param_buffer.engine.unshard(buckets)
        handle = UnshardHandle(state, buckets)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Releases this module's full parameters (ZeRO-3 groups)."""
        g = group_of(self)
        if g.state is not None and g.unit.releasable:
            g.state.param_buffer.engine.reshard(list(g.unit.releasable))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: backwards accumulate unsharded local gradients and communicate nothing; the next
        backward with sync on reduces the sum (the memory of one full gradient copy per group
        meanwhile, as DDP holds; [Note: held gradients] in csrc/comm/backward.c)."""
        groups = self._groups(recurse)
        for g in groups:
            g.requires_gradient_sync = bool(requires_gradient_sync)
        self._reconfigure(groups)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP (2-D mesh): off, backwards still reduce within the shard dim but skip the
        all-reduce across replicas; the next backward with it on all-reduces the sum, once
        ([Note: hybrid sharding] in csrc/comm/replicas.c). No effect on a 1-D mesh."""
        groups = self._groups(recurse)
        for g in groups:
            g.requires_all_reduce = bool(requires_all_reduce)
        self._reconfigure(groups)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")
        groups = self._groups(recurse)
        for g in groups:
            g.reshard_after_forward = reshard_after_forward
        self._reconfigure(groups)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        groups = self._groups(recurse)
        for g in groups:
            g.reshard_after_backward = bool(reshard_after_backward)
        self._reconfigure(groups)

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Gather these modules' parameters when this one runs its forward (every group between
        them in the shared order is gathered too, see [Note: gather order] in hooks.py)."""
        for m in modules:
            group_of(m)
        g = group_of(self)
        g.forward_prefetch = list(modules)
        self._reconfigure([g])

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        for m in modules:
            group_of(m)
        g = group_of(self)
        g.backward_prefetch = list(modules)
        self._reconfigure([g])

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Gradients are divided by `factor` instead of the data-parallel size."""
        if not (isinstance(factor, (int, float)) and factor > 0):
            raise ValueError(f"the gradient divide factor must be a positive number, got {factor!r}")
        groups = self._groups(True)
        for g in groups:
            g.divide_factor = float(factor)
        self._reconfigure(groups)

    def comm_stats(self) -> dict:
        """megatron_fsdp_c's counters of the model's collectives so far (counts and bytes, by
        level: inner all-gathers and reductions, and the all-reduce across replicas of HSDP)."""
        return state_of(self).comm_stats()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility: every backward here finishes its reductions."""
        for g in self._groups(True):
            g.is_last_backward = bool(is_last_backward)

    def _apply(self, fn, *args, **kwargs):
        g = group_of(self)
        if g.state is not None:
            raise RuntimeError(f"{type(self).__name__}: .to()/.to_empty()/.float() after the first forward would move "
                               "the parameters out of the engine's buffers; call it before the first forward")
        out = super()._apply(fn, *args, **kwargs)
        for i, (mod, attr, _) in enumerate(g.places):  # to_empty() and friends may replace the parameters
            g.places[i] = (mod, attr, mod._parameters[attr])
        return out
