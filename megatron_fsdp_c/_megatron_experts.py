"""Megatron-FSDP's expert data-parallel mesh on the Megatron-style API: which parameters are
experts, the expert mesh's process groups and checks, their gradient scaling, and the engine
that shards them (ExpertOwner, owned by the MegatronFSDP wrapper next to its own).

[Note: expert data-parallel mesh]
`fully_shard(..., expt_device_mesh=mesh, hybrid_fsdp_expt_group=group)` means what it means in
Megatron-FSDP (megatron_fsdp/fully_shard.py, utils.py's FSDPDistributedIndex,
param_and_grad_buffer.py):
- Expert parameters are the ones Megatron-core marks for expert parallelism: `allreduce=False`
  (set on the experts' weights when expert_model_parallel_size > 1; Megatron-FSDP groups its
  buckets by `not getattr(p, "allreduce", True)`), or `is_expert=True`, accepted as the same
  mark. Names are not looked at.
- They are sharded, with the model's zero_dp_strategy, over the expert data-parallel ranks:
  `mesh[dp_shard_dim]` (the ranks holding the same experts: torchtitan's dp_mod_ep), read by the
  same dim names as device_mesh; with HSDP (dp_outer_dim), shards over `mesh[dp_shard_dim]`,
  replicas over `mesh[dp_outer_dim]`, and hybrid_fsdp_expt_group the group over both (required
  then, refused otherwise, as Megatron-FSDP requires it for HSDP). Dense parameters are sharded
  over device_mesh's dims as before.
- Gradient scaling is Megatron-LM's (distributed_data_parallel.py): an expert's gradient on a
  rank already holds every ep peer's tokens (the all-to-all's backward brings them), so summing it
  over the expert data-parallel ranks sums over all data-parallel ranks, and the average needs
  the dense data-parallel size: expert gradients are pre-scaled by 1/dp (dp the dense mesh's
  data-parallel size, not the expert one's) and summed; with average_in_collective, pre-scaled by
  expert_dp/dp and averaged over the expert ranks (the same 1/dp); with
  calculate_per_token_loss, summed unscaled. Megatron-FSDP itself scales experts by 1/dp too and
  refuses average_in_collective; we follow Megatron-LM there.
- An expert mesh without expert parameters, or expert parameters without an expert mesh, is an
  error naming the fix: Megatron-FSDP would silently shard unmarked experts over the dense ranks
  (wrong gradients, not an error) or fail on a missing group.
- One engine per mesh, as the per-module API ([Note: a mesh per group] in
  per_module/_root.py): the wrapper's own engine holds the dense parameters, an ExpertOwner
  the experts, each with its buckets, communicators, HookManager and collective orders ([Note:
  gather order] in _hooks.py, [Note: collective order] in csrc/comm/reduce.c) over the same
  fsdp_unit_modules: a unit gathers its dense buckets on the dense communicators and its experts
  on the expert ones. The experts' engine shares no communicator with the dense one, also where
  their rank sets coincide (Megatron-LM's HSDP layout: the experts' replicas {0,2} are the dense
  mesh's dp_outer {0,2}; ep 1): its gathers, reductions and reductions across replicas run on
  groups of its own ("expert " groups, [Note: the engine's own groups] in _distributed.py),
  because each engine launches a reduction across replicas when its inner one completes, a
  moment that differs across ranks, so two engines on one group could pair different tensors.
  The wrapper drives both in one order on every rank: root pre- and post-forward (dense first,
  so the backward's final callbacks are queued in that order too); the backward ends for the
  model when no engine's HookManager is in it any more, then gradient sync, flags and attach per
  engine in that order. So every rank issues each communicator's collectives in one order, also
  for graphs that differ across ranks (an expert no rank fed keeps `.grad is None`: the used
  flags are reduced per engine, over its own mesh).
"""
from __future__ import annotations

import weakref
from typing import List, Optional

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ._distributed import DistContext, check_rank_partition, check_same_model, make_dist_context
from ._owner import EngineOwner
from ._param_buffer import ParamBuffer, ParamRecord, model_wide
from ._param_record import FoundParam

__all__ = ["ExpertOwner", "expert_context", "expert_scaling", "is_expert_param", "split_experts"]


def is_expert_param(p: nn.Parameter) -> bool:
    """Megatron-core's mark of an expert-parallel parameter ([Note: expert data-parallel mesh])."""
    return not getattr(p, "allreduce", True) or bool(getattr(p, "is_expert", False))


def _mesh_ranks(mesh: DeviceMesh) -> tuple:
    return tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))


def expert_context(expt_device_mesh, hybrid_fsdp_expt_group, *, dp_shard_dim, dp_outer_dim, tp_dim, device,
                   transport, collective_timeout, outer_sharded: bool, meta_init: bool) -> Optional[DistContext]:
    """The expert data-parallel mesh's groups (None without one), after Megatron-FSDP's argument
    checks and a check across ranks that its rank sets partition the world."""
    if expt_device_mesh is None and hybrid_fsdp_expt_group is None:
        return None
    if expt_device_mesh is None:
        raise ValueError("hybrid_fsdp_expt_group is the data-parallel group of the expert mesh: pass expt_device_mesh "
                         "(the expert parallel DeviceMesh) with it, or drop it")
    if not isinstance(expt_device_mesh, DeviceMesh):
        raise TypeError(f"expt_device_mesh must be a torch DeviceMesh (named like device_mesh: dp_shard_dim, and "
                        f"dp_outer_dim with HSDP), got {type(expt_device_mesh).__name__}")
    if dp_outer_dim is None and hybrid_fsdp_expt_group is not None:
        raise ValueError("hybrid_fsdp_expt_group is only for hybrid sharding (HSDP: dp_outer_dim and "
                         "hybrid_fsdp_group); without it the experts are sharded over expt_device_mesh[dp_shard_dim]: drop "
                         "hybrid_fsdp_expt_group, or pass dp_outer_dim and hybrid_fsdp_group for HSDP")
    if dp_outer_dim is not None and hybrid_fsdp_expt_group is None:
        raise ValueError("hybrid sharding (dp_outer_dim) with expt_device_mesh needs hybrid_fsdp_expt_group: the "
                         "ProcessGroup over the expert mesh's (dp_outer_dim, dp_shard_dim) ranks, as Megatron-FSDP "
                         "requires")
    if tp_dim is not None:
        raise NotImplementedError("expt_device_mesh with tp_dim (expert tensor parallelism) is not supported yet: "
                                  "shard the experts without tensor parallelism")
    if meta_init:
        raise NotImplementedError("init_model_with_meta_device with expt_device_mesh is not supported yet: "
                                  "materialise the model first, then shard it")
    names = expt_device_mesh.mesh_dim_names or ()
    for role, dim in (("dp_shard_dim", dp_shard_dim), ("dp_outer_dim", dp_outer_dim)):
        if dim is not None and dim not in names:
            raise ValueError(f"expt_device_mesh has no dim {dim!r} ({role}): Megatron-FSDP reads the expert mesh by "
                             f"the same dim names as device_mesh; its dims are {names}")
    if dp_shard_dim is None and expt_device_mesh.ndim > 1:
        raise ValueError(f"expt_device_mesh has {expt_device_mesh.ndim} dims {names}: pass dp_shard_dim= the name of "
                         "the data-parallel dim, which both meshes share")
    dp_mesh = expt_device_mesh if dp_shard_dim is None else expt_device_mesh[dp_shard_dim]
    if dp_outer_dim is not None:
        dp_mesh = expt_device_mesh[(dp_outer_dim, dp_shard_dim)]
    check_rank_partition(
        _mesh_ranks(dp_mesh), "expt_device_mesh's data-parallel ranks do not partition the ranks",
        "Build the expert mesh over all ranks with init_device_mesh(device, (dp // ep, ep), "
        "mesh_dim_names=(dp_shard_dim, 'ep')) (with HSDP: (outer, dp // ep // outer, ep) and dp_outer_dim first), so "
        "that the ranks holding the same experts agree on their set ([Note: expert data-parallel mesh] in "
        "megatron_fsdp_c/_megatron_experts.py)")
    try:
        return make_dist_context(expt_device_mesh, dp_shard_dim, device, transport, collective_timeout,
                                 dp_outer_dim=dp_outer_dim, hybrid_fsdp_group=hybrid_fsdp_expt_group,
                                 outer_sharded=outer_sharded, private="expert ")
    except (ValueError, TypeError) as e:
        raise type(e)(f"expt_device_mesh / hybrid_fsdp_expt_group: {e}") from e


def split_experts(found: List[FoundParam], expert_ctx) -> tuple:
    """(dense, experts) of the found parameters; a missing mesh or missing experts refused with
    the fix ([Note: expert data-parallel mesh])."""
    experts = [f for f in found if is_expert_param(f.param)]
    if expert_ctx is None:
        if experts:
            raise ValueError(
                f"{len(experts)} parameters are marked as expert-parallel (allreduce=False or is_expert=True, e.g. "
                f"'{experts[0].name}') but fully_shard got no expt_device_mesh: pass expt_device_mesh (the expert "
                "parallel DeviceMesh whose dp_shard_dim holds the ranks with the same experts), or clear the mark "
                "(ep size 1: the experts are dense parameters)")
        return found, []
    if not experts:
        raise ValueError(
            "fully_shard got expt_device_mesh but no parameter is marked as an expert (Megatron-core sets "
            "param.allreduce = False on expert-parallel weights; is_expert = True is accepted too): mark the experts' "
            "parameters before fully_shard, or drop expt_device_mesh")
    dense = [f for f in found if not is_expert_param(f.param)]
    if not dense:
        raise ValueError("every parameter is an expert parameter: shard the model with device_mesh= the expert mesh "
                         "and no expt_device_mesh")
    return dense, experts


def expert_scaling(dense_ctx: DistContext, expert_ctx: DistContext, *, average_in_collective: bool,
                   calculate_per_token_loss: bool) -> tuple:
    """(pre-scale, reduce op) of expert gradients: Megatron-LM's expert_gradient_scaling_factor
    ([Note: expert data-parallel mesh])."""
    if calculate_per_token_loss:
        return 1.0, "sum"
    if average_in_collective:
        return expert_ctx.dp_world / dense_ctx.dp_world, "avg"
    return 1.0 / dense_ctx.dp_world, "sum"


class ExpertOwner(EngineOwner):
    """The engine of the expert parameters over the expert data-parallel mesh: its buckets,
    distributed parameters and HookManager over the wrapper's units. The HookOwner whose backward
    bookkeeping is the wrapper's ([Note: expert data-parallel mesh])."""

    def __init__(self, wrapper, records: List[ParamRecord], ctx: DistContext, units: List[nn.Module], *,
                 strategy: int, policy, bucket_cap: int, reduce_queue_bytes, grad_prescale: float, reduce_op: str,
                 single_rank_collectives: bool, quant_policy, offload_fraction: float = 0.0):
        self._wrapper = weakref.proxy(wrapper)  # the wrapper owns this engine
        self.dist_ctx = ctx
        self._holds_dist_params = False
        check_same_model(records, ctx)  # the ranks of one expert mesh hold the same experts
        unit_configs, outside = model_wide(strategy, policy, quant_policy, len(units))
        buf = ParamBuffer(records, ctx, unit_configs, outside, bucket_cap=bucket_cap,
                          reduce_queue_bytes=reduce_queue_bytes, grad_prescale=grad_prescale, reduce_op=reduce_op,
                          single_rank_collectives=single_rank_collectives, offload_fraction=offload_fraction,
                          pin_host=True)
        buf.load_params()
        buf.build_dist_params(wrapper)  # the optimizer finds the wrapper from them
        for r in records:  # the mark stays visible on model.parameters() (Megatron's optimizers read it)
            for attr in ("allreduce", "is_expert"):
                if hasattr(r.origin, attr):
                    setattr(r.dist_param, attr, getattr(r.origin, attr))
        self._start(buf, units)  # [Note: owner start-up] in _owner.py

    @property
    def overlap_param_gather(self) -> bool:
        return self._wrapper.overlap_param_gather

    def _before_backward(self) -> None:
        """Nothing to prepare: the wrapper's zero_grad clears the gradients."""

    def _should_sync(self) -> bool:
        return self._wrapper._should_sync()

    def _after_backward(self, synced: bool) -> None:
        self._wrapper._backward_ends(synced)
