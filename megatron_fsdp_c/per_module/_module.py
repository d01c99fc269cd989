"""FSDPModule and UnshardHandle of the per-module API: subclasses of torch's own, so that code
which recognises FSDP2 modules by `isinstance(m, torch.distributed.fsdp.FSDPModule)` (torchtitan,
Lightning, accelerate, torch.distributed.pipelining) recognises ours.

[Note: torch's FSDPModule]
A sharded module's class is FSDP<Class>(FSDPModule, Class), where our FSDPModule subclasses
torch's: its MRO is FSDP<Class>, ours, torch's FSDPModule, Class, ... . Every public method of
torch's class (and the private ones torch's own code calls: _get_fsdp_state, _apply,
_set_unshard_async_op) is overridden here, so nothing falls through to torch's internals, which
would look for an FSDPState we do not have (tests/test_per_module_dropin.py fails when torch adds
a public method we do not override). Torch's __new__ is kept: it re-creates the original class when
a container is indexed (nn.Sequential[1:]), finding it at _orig_cls_mro_index, which is 3 here
(torch's own classes have it at 2). Our classes are not entered in torch's cls_to_fsdp_cls map:
Dynamo's package pickler reads the original class at __mro__[2] from that map.

Per method, what torch's does on our engine (the methods of every torch from 2.11 to 2.15; a torch
that lacks one, e.g. reset_iter_state before 2.13, still finds ours):
- unshard/reshard, set_requires_gradient_sync/_all_reduce, set_reshard_after_forward/_backward,
  set_modules_to_forward/backward_prefetch, set_gradient_divide_factor (and its deprecated name
  set_reduce_scatter_divide_factor), set_all_reduce_hook, reset_iter_state, set_post_optim_event,
  and torch 2.15's set_keep_unsharded_storage, set_manual_backward_finalization and
  finalize_backward: done (differences in their docstrings).
- set_is_last_backward, set_force_sum_reduction_for_comms, set_reduce_scatter_unused_params,
  set_reduce_scatter_max_input_buffers, set_separate_reduce_scatter_group,
  set_unshard_in_backward, _set_unshard_async_op: accepted, no effect (each docstring says why
  that is harmless).
- set_custom_all_gather, set_custom_reduce_scatter, set_symm_mem_for_comm,
  set_allocate_memory_from_process_group_for_comm(True): NotImplementedError (mechanisms the C
  engine does not have).
- _get_fsdp_state returns the adapter registered under torch's state key (_torch_state.py).
"""
from __future__ import annotations

import functools
import warnings
from typing import List, Optional

import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

from .._common import in_backward

from ._group import ShardGroup, group_of
from ._policy import compute_dtype
from ._root import RootState, state_of

__all__ = ["FSDPModule", "GradientReductionHandle", "UnshardHandle", "fsdp_class", "missing_overrides"]

# torch 2.15's handle class of finalize_backward(async_op=True); a plain base before it
_TorchReductionHandle = getattr(torch_fsdp, "GradientReductionHandle", object)


def missing_overrides() -> List[str]:
    """The public methods of the installed torch's FSDPModule that ours does not override: empty for
    every torch in the supported range (tests/test_per_module_dropin.py); fully_shard refuses a
    torch where it is not ([Note: supported torch versions] in ../_torch_compat.py)."""
    names = {n for k in TorchFSDPModule.__mro__ if k is not object for n in vars(k)
             if not n.startswith("__") and callable(getattr(TorchFSDPModule, n, None))}
    return sorted(n for n in names if n not in vars(FSDPModule) and not n.startswith("_orig"))


@functools.lru_cache(maxsize=None)
def fsdp_class(cls: type) -> type:
    """FSDP<cls>: the class a sharded `cls` module takes (see [Note: torch's FSDPModule])."""
    return type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})


class UnshardHandle(TorchUnshardHandle):
    """What unshard(async_op=True) returns: wait() makes the full parameters usable."""

    def __init__(self, state: RootState, group: ShardGroup):
        self._state, self._group = state, group

    def wait(self) -> None:
        """Waits for the gather and registers the group's unsharded parameters on its modules,
        until reshard() ([Note: per-group registration] in _registration.py)."""
        if self._group is not None:
            buckets = list(self._group.unit_state.buckets)
            if buckets:
                self._state.param_buffer.engine.wait_unshard(buckets)
            self._state.registration.register(self._group.unit_state.index, True)
            self._group = None


class GradientReductionHandle(_TorchReductionHandle):
    """What finalize_backward(async_op=True) returns (a subclass of torch 2.15's
    GradientReductionHandle where torch has one): wait() before using the gradients. The reduction
    itself completes inside finalize_backward ([Note: manual backward finalization] in _root.py),
    so wait() only ends the handle; after reset_iter_state it raises, as torch's does."""

    def __init__(self, root_group):
        self._group = root_group

    def wait(self) -> None:
        g, self._group = self._group, None
        if g is None:
            return
        if g.pending_reduction is not self:
            raise RuntimeError("this gradient reduction was invalidated by reset_iter_state(): its gradients were "
                               "discarded")
        g.pending_reduction = None


class FSDPModule(TorchFSDPModule):
    """The methods a module gains from megatron_fsdp_c.per_module.fully_shard: torch FSDP2's,
    on the C engine (see [Note: torch's FSDPModule] for what each does here). Settings with
    `recurse` apply to every sharded module under this one."""

    _orig_cls_mro_index = 3  # FSDP<Class>, this class, torch's FSDPModule, Class

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
            if g.owner is not None:
                g.owner.hooks.end_abandoned_backward()  # [Note: a backward that raised] in ../_hooks.py
                g.owner.configure(g)

    def _get_fsdp_state(self):
        """The adapter torch's own code reaches for (register_fsdp_forward_method,
        torch.distributed.pipelining): see [Note: torch's state key] in _torch_state.py."""
        return group_of(self).torch_state

    # -- gathers ------------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gathers this module's full parameters now (collective); they stay, registered on the
        module, until reshard(). Before the first forward, this initialises the model through
        its root (the outermost sharded module), as that forward would."""
        g = group_of(self)
        state = state_of(self)
        if g.unit_state.buckets:
            state.hooks.gather(g.unit_state)
        handle = UnshardHandle(state, g)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Releases this module's full parameters (ZeRO-3 groups) and registers its sharded ones."""
        g = group_of(self)
        if g.owner is not None:
            g.owner.reshard_group(g)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted, no effect: our pre-forward and pre-backward gathers are issued ahead
        (prefetch) and waited where used already."""

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Accepted, no effect: the group is still gathered in backward. Harmless: the backward
        computes the same gradients; it costs the one all-gather torch skips."""
        group_of(self).unshard_in_backward = bool(unshard_in_backward)

    def set_post_optim_event(self, event) -> None:
        """The root's next pre-forward makes the current stream wait on `event`, then drops it.
        Our gathers already follow the current stream, where the optimizer step ran, so this
        only adds the dependency torch's would (torch waits on the event instead)."""
        group_of(self).post_optim_event = event

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: releases the gathered parameters, puts the sharded
        parameters back and clears the per-pass state, so the next iteration runs. Call it on the
        root, on every rank. The gradients of the step so far are discarded (torch keeps those of
        completed backwards before the failed one); a backward that was interrupted is ended with
        its collectives (every rank must call this), torch's waits locally."""
        g = group_of(self)
        if g.owner is None:
            return
        if g.owner.root is not self:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        for state in g.owner.owners():  # every engine of the model ([Note: a mesh per group] in _root.py)
            state.reset_iter_state()
        g.pending_reduction = None  # an outstanding finalize_backward handle raises at wait()

    # -- gradient synchronisation ---------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Off: backwards accumulate unsharded local gradients and communicate nothing; the next
        backward with sync on reduces the sum (the memory of one full gradient copy per group
        meanwhile, as DDP holds; [Note: held gradients] in csrc/comm/backward.c)."""
        groups = self._groups(recurse)
        for g in groups:
            g.hold = not requires_gradient_sync
        self._reconfigure(groups)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP (2-D mesh): off, backwards still reduce within the shard dim but skip the
        all-reduce across replicas; the next backward with it on all-reduces the sum, once
        ([Note: hybrid sharding] in csrc/comm/replicas.c). No effect on a 1-D mesh."""
        groups = self._groups(recurse)
        for g in groups:
            g.outer_hold = not requires_all_reduce
        self._reconfigure(groups)

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """torch 2.15: on, the caller ends each logical backward with finalize_backward(). Ours
        finishes each backward at its end anyway, and finalize_backward reduces what the backwards
        held back and reshards ([Note: manual backward finalization] in _root.py). Checked as
        torch checks it: the root only (once known), and no change during a backward."""
        g = group_of(self)
        if g.owner is not None and g.owner.root is not self:
            raise RuntimeError(f"set_manual_backward_finalization must be called on the root FSDP module, not on "
                               f"this {type(self).__name__}")
        if bool(enabled) != g.manual_backward_finalization and in_backward():
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
        g.manual_backward_finalization = bool(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
        """torch 2.15: after the backward passes of a step (gradient sync off during them, then on
        again), reduces what they held back and reshards by the current settings, on every rank at
        the same point. Before the first forward, nothing to do. With async_op, returns a
        GradientReductionHandle to wait() on before using the gradients (the reduction is complete
        already: [Note: manual backward finalization] in _root.py)."""
        g = group_of(self)
        if g.pending_reduction is not None:
            raise RuntimeError("The previous gradient reduction must be waited on before finalizing backward again")
        if g.owner is not None:
            if g.owner.root is not self:
                raise RuntimeError(f"finalize_backward must be called on the root FSDP module, not on this "
                                   f"{type(self).__name__}")
            for state in g.owner.owners():  # every engine of the model ([Note: a mesh per group] in _root.py)
                state.finalize_backward()
        if not async_op:
            return None
        if g.owner is None:
            return GradientReductionHandle(None)  # nothing was reduced: wait() returns at once
        handle = g.pending_reduction = GradientReductionHandle(g)
        return handle

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted, no effect: every backward here finishes its reductions (torch defers some
        waits to the last one)."""
        for g in self._groups(True):
            g.is_last_backward = bool(is_last_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Gradients are divided by `factor` instead of the data-parallel size (on every group
        under this module; torch sets this module's group only)."""
        if not (isinstance(factor, (int, float)) and factor > 0):
            raise ValueError(f"the gradient divide factor must be a positive number, got {factor!r}")
        groups = self._groups(True)
        for g in groups:
            g.divide_factor = float(factor)
        self._reconfigure(groups)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: set_gradient_divide_factor."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted, no effect: our reductions always pre-scale and then sum (never AVG or
        PREMUL_SUM), which is what this asks torch's for."""
        group_of(self).force_sum_reduction = bool(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted, no effect: every rank always reduces every bucket, with zeros for parameters
        it did not use ([Note: collective order] in csrc/comm/reduce.c), which is what True asks."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """Accepted (checked as torch checks it), no effect: the engine bounds the reductions in
        flight by bytes (its reduce queue, 4x the largest gradient bucket), not by buffer count."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Accepted, no effect: the engine always reduces on a communicator of its own, apart from
        the all-gathers' (what True asks); False does not merge them."""

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """hook(grad_shard) runs after each syncing backward on the group's reduced gradient shard
        (per bucket, this rank's flat piece, in the main gradient dtype, padding included); an
        in-place change reaches the parameters' .grad. Torch passes one backward's reduce-scatter
        (or HSDP all-reduce) output before it is added to .grad; here the shard holds the sum of
        the step's syncing backwards so far (the same with one syncing backward per step). With
        `stream` (the device's, e.g. torch.cuda.Stream; torch.cpu.Stream on CPU), it runs there,
        ordered after the current stream and before its next work."""
        if not callable(hook):
            raise TypeError(f"the all-reduce hook must be callable, got {type(hook).__name__}")
        g = group_of(self)
        if stream is not None and g.ctx.outer_world > 1:
            raise ValueError("stream cannot be set when using native HSDP")
        g.all_reduce_hook = (hook, stream)

    # -- prefetching ----------------------------------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        groups = self._groups(recurse)
        for g in groups:
            g.reshard_after_forward = reshard_after_forward
        self._reconfigure(groups)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """torch 2.15: resharding keeps the gathered weights' memory (marked stale, gathered again
        into the same memory), so the compute parameters keep their data pointers across reshard
        and unshard (CUDA graph capture), at the memory of the full weights ([Note: kept full
        weights] in csrc/comm/weights.c). Off again, the kept memory of resharded groups is freed."""
        groups = self._groups(recurse)
        for g in groups:
            g.keep_unsharded_storage = bool(keep)
        self._reconfigure(groups)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        groups = self._groups(recurse)
        for g in groups:
            g.reshard_after_backward = bool(reshard_after_backward)
        self._reconfigure(groups)

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Gather these modules' parameters when this one runs its forward (every group between
        them in the shared order is gathered too, see [Note: gather order] in _hooks.py)."""
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

    # -- mechanisms the engine does not have -----------------------------------------------------
    def set_custom_all_gather(self, comm) -> None:
        raise NotImplementedError("set_custom_all_gather: megatron_fsdp_c's all-gathers run in its C engine over its "
                                  "own transport; a custom torch collective cannot replace them")

    def set_custom_reduce_scatter(self, comm) -> None:
        raise NotImplementedError("set_custom_reduce_scatter: megatron_fsdp_c's reductions run in its C engine over "
                                  "its own transport; a custom torch collective cannot replace them")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError("set_symm_mem_for_comm: megatron_fsdp_c does not allocate its collective buffers "
                                  "in symmetric memory")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """False (torch's default) is accepted; True raises: the engine allocates its own buffers."""
        if enable:
            raise NotImplementedError("set_allocate_memory_from_process_group_for_comm(True): megatron_fsdp_c's "
                                      "collective buffers are the engine's own, not the process group's")

    # -- megatron_fsdp_c's own ------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """megatron_fsdp_c's counters of the model's collectives so far (counts and bytes, by
        level: inner all-gathers and reductions, and the all-reduce across replicas of HSDP)."""
        return state_of(self).comm_stats()

    def _apply(self, fn, *args, **kwargs):
        g = group_of(self)
        if g.owner is not None:  # see [Note: re-initialisation] in _root.py; every engine of the model
            why = f"{type(self).__name__}: .to()/.to_empty()/.float() after the first forward"
            for state in list(g.owner.owners()):
                state.release_engine(why)
        out = super(TorchFSDPModule, self)._apply(fn, *args, **kwargs)  # the original class's, not torch's FSDP
        for i, (mod, attr, _) in enumerate(g.places):  # to_empty() and friends may replace the parameters
            p = g.places[i] = (mod, attr, mod._parameters[attr])
            # a dtype the group's policy cannot keep is refused at this call ([Note: main-weight parameters])
            compute_dtype(g.mp_policy, g.compute_dtypes.get((id(mod), attr)), p[2].dtype,
                          f"parameter '{attr}' of {type(mod).__name__}")
        return out
