"""Forward and backward hooks: they say *when* to gather, release and reduce; the C engine
decides *how*. Every hook is a few dictionary lookups and one call into the engine.

[Note: pass lifecycle]
  root pre-forward   swap compute params in; gather the buckets outside every unit
  unit pre-forward   gather the unit (+ prefetch the next unit in last forward's order); wait
  unit post-forward  release the unit (ZeRO-3); hook the outputs for the pre-backward
  pre-backward       (first one also starts the backward: engine.begin_backward, final callback)
                     gather the unit again (+ prefetch the previous unit); wait
  param grad hook    hand the gradient to the engine (packs it; reduces when its bucket is full)
  post-backward      identity autograd.Function on the unit's inputs: release the unit
  final callback     engine.end_backward (leftovers, wait reductions), release everything,
                     sync gradients if this backward syncs, swap the distributed params back
Activation recomputation re-runs a unit's forward inside backward: then there is no prefetch
and no release in the post-forward (the backward that follows needs the weights).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Dict, List

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from .megatron_fsdp import MegatronFSDP

__all__ = ["HookManager"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _grad_tensors(tree) -> List[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, manager, unit, *inputs):
        ctx.manager, ctx.unit = manager, unit
        return inputs if len(inputs) > 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.manager.post_backward(ctx.unit)
        return (None, None) + grads


class _Unit:
    __slots__ = ("index", "module", "buckets", "releasable")

    def __init__(self, index, module, buckets, releasable):
        self.index = index
        self.module = module
        self.buckets = buckets          # bucket ids to gather before the unit runs
        self.releasable = releasable    # ZeRO-3 bucket ids to release after it ran


class HookManager:
    def __init__(self, owner: "MegatronFSDP", unit_modules: List[nn.Module]):
        self.owner = owner
        self.engine = owner.param_buffer.engine
        buf = owner.param_buffer
        sharded = set(buf.weight_sharded_buckets())
        gatherable = set(buf.gatherable_buckets())
        self.units: List[_Unit] = []
        for u, module in enumerate(unit_modules):
            ids = buf.buckets_of_unit(u)
            self.units.append(_Unit(u, module, tuple(b for b in ids if b in gatherable),
                                    tuple(b for b in ids if b in sharded)))
        root_ids = buf.buckets_of_unit(-1)
        self.root_buckets = tuple(b for b in root_ids if b in gatherable)
        self.all_sharded = tuple(sorted(sharded))
        self.last_order: List[int] = list(range(len(self.units)))  # forward order of the last pass
        self.order: List[int] = []
        self.prev_in_order: Dict[int, int] = {}
        self.in_backward = False
        self.sync_this_backward = False
        self.used = owner._used  # see [Note: unused parameters] in megatron_fsdp.py
        self.handles = []
        self._register()

    # -- registration ---------------------------------------------------------------------
    def _register(self) -> None:
        for unit in self.units:
            if not unit.buckets:
                continue  # nothing to gather: wholly replicated, or no_shard, or one rank
            self.handles.append(unit.module.register_forward_pre_hook(
                functools.partial(self.pre_forward, unit), prepend=True, with_kwargs=True))
            self.handles.append(unit.module.register_forward_hook(
                functools.partial(self.post_forward, unit), always_call=False))
        for rec in self.owner.param_buffer.records:
            if rec.requires_grad:
                self.handles.append(rec.param.register_post_accumulate_grad_hook(
                    functools.partial(self.grad_hook, rec.index, rec.bucket, rec.item)))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # -- forward --------------------------------------------------------------------------
    def root_pre_forward(self) -> None:
        if not _in_backward():
            self.order = []
        if self.root_buckets:
            self.engine.unshard(self.root_buckets)
            self.engine.wait_unshard(self.root_buckets)

    def root_post_forward(self, output):
        if torch.is_grad_enabled():
            tensors = _grad_tensors(output)
            if tensors:
                register_multi_grad_hook(tensors, self._root_pre_backward, mode="any")
        if self.order:
            self.last_order = list(self.order)
        return output

    def pre_forward(self, unit: _Unit, module, args, kwargs):
        recompute = _in_backward()
        self.engine.unshard(unit.buckets)
        if not recompute:
            self.order.append(unit.index)
            if self.owner.overlap_param_gather:
                nxt = self._next_in_last_order(len(self.order) - 1)
                if nxt is not None:
                    self.engine.unshard(self.units[nxt].buckets)
        self.engine.wait_unshard(unit.buckets)
        if unit.releasable and torch.is_grad_enabled():
            flat, spec = tree_flatten((args, kwargs))
            positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if positions:
                wrapped = _PostBackward.apply(self, unit, *(flat[i] for i in positions))
                if len(positions) == 1:
                    wrapped = (wrapped,)
                for i, t in zip(positions, wrapped):
                    flat[i] = t
                args, kwargs = tree_unflatten(flat, spec)
        return args, kwargs

    def post_forward(self, unit: _Unit, module, args, output):
        if not _in_backward() and unit.releasable:
            self.engine.reshard(unit.releasable)
        if torch.is_grad_enabled():
            tensors = _grad_tensors(output)
            if tensors:
                register_multi_grad_hook(tensors, functools.partial(self._pre_backward, unit), mode="any")
        return output

    def _next_in_last_order(self, position: int):
        order = self.last_order
        if position + 1 < len(order):
            nxt = order[position + 1]
            return nxt if self.units[nxt].buckets else None
        return None

    # -- backward -------------------------------------------------------------------------
    def start_backward(self) -> None:
        if self.in_backward:
            return
        owner = self.owner
        self.in_backward = True
        self.sync_this_backward = owner._should_sync()
        self.engine.begin_backward(self.sync_this_backward)
        self.prev_in_order = {}
        for a, b in zip(self.order, self.order[1:]):
            self.prev_in_order[b] = a
        torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def _root_pre_backward(self, grads):
        self.start_backward()

    def _pre_backward(self, unit: _Unit, grads):
        self.start_backward()
        self.engine.unshard(unit.buckets)
        if self.owner.overlap_param_gather:
            prev = self.prev_in_order.get(unit.index)
            if prev is not None and self.units[prev].buckets:
                self.engine.unshard(self.units[prev].buckets)
        self.engine.wait_unshard(unit.buckets)

    def post_backward(self, unit: _Unit) -> None:
        if unit.releasable:
            self.engine.reshard(unit.releasable)

    def grad_hook(self, index: int, bucket: int, item: int, param: torch.Tensor) -> None:
        self.start_backward()
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        self.used[index] = 1
        self.engine.grad_ready(bucket, item, grad if grad.is_contiguous() else grad.contiguous())

    def end_backward(self) -> None:
        try:
            self.engine.end_backward()
            if self.all_sharded:
                self.engine.reshard(self.all_sharded)
        finally:
            self.in_backward = False
        self.owner._after_backward(self.sync_this_backward)
