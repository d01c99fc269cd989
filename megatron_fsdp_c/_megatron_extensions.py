"""Extension parameters ([Note: extension parameters] in _extensions.py) under the Megatron-style
API: the checks, the planning shards, and the per-unit registration of their compute parameters.

[Note: extension parameters under MegatronFSDP]
MegatronFSDP swaps every parameter at once (the compute ones at the root pre-forward, the
distributed ones after the backward). An extension parameter has no compute parameter until its
unit's first gather (fsdp_post_all_gather makes it), so its record computes with a placeholder
until then, and each unshard of its unit registers the compute parameter the gather made (or
refreshed) on its modules, after the swap. Its distributed parameter is a DTensor whose local
tensor is the subclass (this rank's torch.chunk piece, cloned, its values then pointed at the
main shard), as under the per-module API; the optimizer steps those values directly (a plain
twin of them, optimizer.py). Its main weights change only in the optimizer's step, after which
install_main_weights(True) marks the payloads stale with every gathered weight.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn

from ._extensions import ExtensionGathers, ExtensionParam, plan_inputs, repoint, shard_mesh, value_names, values_of

__all__ = ["MegatronExtensions"]


class MegatronExtensions:
    """The extension parameters of one MegatronFSDP engine: made before its ParamBuffer (their
    payloads are planned from every rank's inputs), `start`ed once the buffer and hooks exist."""

    def __init__(self, records, ctx, tp_used: bool, meta: bool):
        self.records = [r for r in records if r.extension]
        self.exts: List[ExtensionParam] = []
        self.shards: List[torch.Tensor] = []  # each record's local shard: the subclass its dist param holds
        self.gathers = None  # ExtensionGathers, from start() on
        self.registered = set()  # units whose compute parameters are registered
        if not self.records:
            return
        outside = [r.name for r in self.records if r.unit < 0]
        # the optimizer steps one values tensor (optimizer.py's twin): a second would silently stay behind
        several = [r.name for r in self.records if len(value_names(r.param.data)) > 1]
        why = ("tensor parallelism" if tp_used or any(r.tp is not None for r in self.records) else
               f"parameters outside every unit or shared by several ({', '.join(outside[:3])})" if outside else
               f"subclasses with several value tensors ({', '.join(several[:3])}: TwoTensor-like)" if several else
               "init_model_with_meta_device" if meta else
               "HFSDP (dp_outer sharded)" if ctx.outer_sharded else
               "a 2-D mesh without dim names" if ctx.mesh.ndim > 1 and not ctx.mesh.mesh_dim_names else None)
        if why is not None:
            raise NotImplementedError(f"parameter '{self.records[0].name}' is a tensor subclass with FSDP2's all-gather "
                                      f"extensions, which megatron_fsdp_c's Megatron-style API does not take with {why} "
                                      "yet: shard it with megatron_fsdp_c.per_module.fully_shard, or use plain parameters")
        from torch.distributed.fsdp import MixedPrecisionPolicy  # what FSDP2 passes: the module computes in its dtype
        self.mesh = shard_mesh(ctx)
        for r in self.records:  # (replicated under no_shard: make_records)
            full = r.param.detach()
            self.shards.append(full if r.replicated else torch.chunk(full, ctx.world, dim=0)[ctx.rank].clone())
            self.exts.append(ExtensionParam(r, r.places[0][0], MixedPrecisionPolicy(), r.param.dtype, []))
        plan_inputs(self.exts, self.mesh, ctx.group, ctx.world, ctx.rank, locals=self.shards)

    def payloads(self) -> list:
        return [(e.record.unit, i) for e in self.exts for i in e.inputs]

    def start(self, buf, hooks) -> None:
        """After the buffer's load and dist params: each record computes with a placeholder until
        its first gather; the gathers' owner side is made."""
        if not self.exts:
            return
        self.gathers = ExtensionGathers(buf, self.exts, self.mesh, hooks)
        for r, shard in zip(self.records, self.shards):  # the dist param's local tensor: the subclass
            repoint(shard, r.dist_param._local_tensor)
            r.dist_param._local_tensor = shard
        for r in self.records:
            r.param = nn.Parameter(torch.empty(0, dtype=r.param.dtype, device=values_of(r.param).device),
                                   requires_grad=r.param.requires_grad)
        buf.engine.install_main_weights(True)  # payloads start stale: the full load left persistent ones ready

    def gathering(self, unit_state) -> None:
        if self.gathers is not None:
            self.gathers.gathering(unit_state.index)

    def unsharded(self, unit_state) -> None:
        """The unit's compute parameters made or refreshed, and registered after the swap."""
        if self.gathers is not None and unit_state.index in self.gathers.by_unit:
            self._register(unit_state.index)

    def root_pre_forward(self) -> None:
        """Units whose payloads are never gathered (one rank, no_shard): no hook of theirs runs,
        so their hooks run in place here, after the swap, every forward."""
        for u in sorted(self.gathers.in_place) if self.gathers is not None else ():
            self.registered.discard(u)
            self._register(u)

    def _register(self, u: int) -> None:
        self.gathers.unsharded(u, u in self.registered)
        self.registered.add(u)
        for e in self.gathers.by_unit[u]:
            for mod, attr in e.record.places:
                mod._parameters[attr] = e.record.param

    def resharded(self, unit_state) -> None:
        if self.gathers is not None and unit_state.index in self.gathers.by_unit:
            self.gathers.resharded(unit_state.index)
            self.registered.discard(unit_state.index)
