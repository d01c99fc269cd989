"""MegatronFSDP: the nn.Module wrapper users train (mirrors megatron_fsdp.MegatronFSDP).

Microbatch semantics (documented differences from Megatron-FSDP are marked *):
- A backward *syncs* when it is not inside `no_sync()` and either auto-sync is on
  (`sync_model_each_microbatch`, the fully_shard default) or `is_last_microbatch` is set.
  * Megatron-FSDP ignores `no_sync()` while auto-sync is on; here `no_sync()` always wins.
- ZeRO-2/3 reduce-scatter every backward and accumulate into the sharded main gradient.
  no_shard and ZeRO-1 accumulate locally and reduce exactly once per optimisation step: in a
  syncing backward (overlapped with it) or, at the latest, in `finish_grad_sync()`, which the
  patched `optimizer.step()` calls whenever gradients are pending.
  * Megatron-FSDP never reduces ZeRO-0/1 gradients when auto-sync is off and
  `is_last_microbatch` was not set; here the step's `finish_grad_sync()` always does.
- Gradients appear on the distributed parameters (`.grad` DTensors) after a syncing backward or
  `finish_grad_sync()`. A parameter that no rank used since its gradient was last set to None
  keeps `.grad is None`, as under DDP, so optimizers skip it (no weight decay): see
  [Note: unused parameters] in _owner.py.
- With expt_device_mesh, the expert parameters live in a second engine over the expert
  data-parallel mesh (`self.expert_owner`, an ExpertOwner); every method below acts on both
  ([Note: expert data-parallel mesh] in _megatron_experts.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import weakref
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

from ._common import ShardingStrategy, logger
from ._megatron_state_dict import register_model_hooks
from ._distributed import DistContext, check_same_model
from ._megatron_experts import ExpertOwner, expert_scaling, split_experts
from .mixed_precision import MixedPrecisionPolicy
from .no_shard import mark_by_name, replicated_roots
from ._owner import EngineOwner, clip_grad_norm
from ._param_buffer import ParamBuffer, model_wide
from ._param_record import find_params, make_records
from ._tensor_parallel import check_even_shards, tp_spec_of
from ._megatron_extensions import MegatronExtensions
from ._extensions import ROLE_PAYLOAD

__all__ = ["MegatronFSDP"]


class MegatronFSDP(EngineOwner, nn.Module):
    def __init__(self, module: nn.Module, *, dist_ctx: DistContext, zero_dp_strategy: ShardingStrategy,
                 fsdp_unit_modules: List[nn.Module], mixed_precision_policy: MixedPrecisionPolicy,
                 sync_model_each_microbatch: bool = False, overlap_grad_reduce: bool = True,
                 overlap_param_gather: bool = True, average_in_collective: bool = False,
                 calculate_per_token_loss: bool = False, report_nan_in_param_grad: bool = False,
                 bucket_size: Optional[int] = None, reduce_queue_bytes: Optional[int] = None,
                 init_model_with_meta_device: bool = False, single_rank_collectives: bool = False,
                 tp_mesh=None, unnamed_dims=(), quantized_comm_policy=None, expert_ctx: Optional[DistContext] = None,
                 trains_later=(), offload_fraction: float = 0.0):
        super().__init__()
        self.module = module
        self.dist_ctx = dist_ctx
        self.zero_dp_strategy = zero_dp_strategy
        self.mp_policy = mixed_precision_policy
        # Megatron-FSDP forces overlap on for ZeRO-2/3; here overlap is how the engine always works.
        self.overlap_grad_reduce = True if zero_dp_strategy >= ShardingStrategy.OPTIM_GRADS else overlap_grad_reduce
        self.overlap_param_gather = zero_dp_strategy == ShardingStrategy.OPTIM_GRADS_PARAMS or overlap_param_gather
        self.report_nan_in_param_grad = report_nan_in_param_grad
        self.model_auto_sync = sync_model_each_microbatch
        self.is_last_microbatch = False
        self.microbatch_count = 0
        self._no_sync_depth = 0
        self._grads_pending = False
        self._holds_dist_params = False
        self._record_of = {}  # id(distributed parameter) -> (its engine's owner, its record)
        self.expert_owner: Optional[ExpertOwner] = None  # the expert parameters' engine (expt_device_mesh)
        self._setup_host_heap(dist_ctx.device)

        mark_by_name(module)
        dense, experts = split_experts(find_params(module, fsdp_unit_modules), expert_ctx)
        tp_of = functools.partial(tp_spec_of, tp_mesh=tp_mesh, dp_mesh=dist_ctx.mesh, unnamed_dims=unnamed_dims)
        records = make_records(dense, trains_later, tp_of,  # [Note: tensor parallelism]
                               replicate_extensions=zero_dp_strategy == ShardingStrategy.NO_SHARD)
        if tp_mesh is not None:
            check_even_shards(records, tp_mesh)
        expert_records = make_records(experts, trains_later)
        if init_model_with_meta_device and any(r.tp is not None and r.tp.dtensor_compute for r in records):
            raise NotImplementedError("init_model_with_meta_device with torch tensor-parallel (DTensor) parameters is "
                                      "not supported yet: materialise the parallelized model first (to_empty + its "
                                      "initialisation), then shard it")
        check_same_model(records, dist_ctx)
        if any(r.extension for r in expert_records):
            raise NotImplementedError("tensor-subclass expert parameters (FSDP2's all-gather extensions) with "
                                      "expt_device_mesh are not supported yet: keep the experts' weights plain")
        # [Note: extension parameters under MegatronFSDP] in _megatron_extensions.py
        self.extensions = MegatronExtensions(records, dist_ctx, tp_mesh is not None, init_model_with_meta_device)
        self.replicated_roots = replicated_roots(module, [r.param for r in records if r.replicated])
        if self.replicated_roots and dist_ctx.rank == 0:
            logger.info("replicated (fsdp_no_shard) subtrees, never gathered: %s", ", ".join(self.replicated_roots))
        if calculate_per_token_loss:
            prescale, op = 1.0, "sum"
        elif average_in_collective:
            prescale, op = 1.0, "avg"
        else:
            prescale, op = 1.0 / dist_ctx.dp_world, "sum"
        cap = 0 if bucket_size is None else int(bucket_size)
        units, outside = model_wide(zero_dp_strategy, mixed_precision_policy, quantized_comm_policy,
                                    len(fsdp_unit_modules))
        buf = ParamBuffer(records, dist_ctx, units, outside, bucket_cap=cap,
                          reduce_queue_bytes=reduce_queue_bytes, grad_prescale=prescale, reduce_op=op,
                          single_rank_collectives=single_rank_collectives,
                          payloads=self.extensions.payloads(), offload_fraction=offload_fraction, pin_host=True)
        self.init_peak_bytes = None
        if init_model_with_meta_device:
            self.init_peak_bytes = buf.load_from_meta(module, dist_ctx.device)
        else:
            buf.load_params()
        buf.build_dist_params(self)
        self._start(buf, fsdp_unit_modules)  # [Note: owner start-up] in _owner.py
        self.extensions.start(buf, self.hooks)
        if expert_records:  # [Note: expert data-parallel mesh] in _megatron_experts.py
            scale, expert_op = expert_scaling(dist_ctx, expert_ctx, average_in_collective=average_in_collective,
                                              calculate_per_token_loss=calculate_per_token_loss)
            self.expert_owner = ExpertOwner(
                self, expert_records, expert_ctx, fsdp_unit_modules, strategy=zero_dp_strategy,
                policy=mixed_precision_policy, bucket_cap=cap, reduce_queue_bytes=reduce_queue_bytes,
                grad_prescale=scale, reduce_op=expert_op, single_rank_collectives=single_rank_collectives,
                quant_policy=quantized_comm_policy, offload_fraction=offload_fraction)
        self._record_of = {id(r.dist_param): (o, r) for o in self.owners() for r in o.param_buffer.records}
        register_model_hooks(self)
        self.register_forward_pre_hook(torch.compiler.disable(self._root_pre_forward, recursive=True), prepend=True)
        self.register_forward_hook(torch.compiler.disable(self._root_post_forward, recursive=True), prepend=True)
        for o in self.owners():
            o._swap_params(dist=True)
        module._megatron_fsdp_wrapper = weakref.ref(self)
        if logger.isEnabledFor(logging.INFO) and dist_ctx.rank == 0:
            self._log_summary(fsdp_unit_modules)

    # -- HookOwner: extension parameters' gathers ([Note: extension parameters under MegatronFSDP]) --
    def _unit_gathering(self, unit_state) -> None:
        self.extensions.gathering(unit_state)

    def _unit_unsharded(self, unit_state) -> None:
        self.extensions.unsharded(unit_state)

    def _unit_resharded(self, unit_state) -> None:
        self.extensions.resharded(unit_state)

    # -- engine owners --------------------------------------------------------------------
    def owners(self) -> tuple:
        """The owners of this model's engines, in the one order every rank drives them: this
        wrapper (the dense parameters), then the experts' ([Note: expert data-parallel mesh])."""
        return (self,) if self.expert_owner is None else (self, self.expert_owner)

    def all_records(self) -> list:
        """Every parameter record, the dense engine's first."""
        return [r for o in self.owners() for r in o.param_buffer.records]

    def _in_backward(self) -> bool:
        return any(o.hooks.pass_state.in_backward for o in self.owners())

    # -- parameters -----------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """The distributed (DTensor) parameters, named as in `state_dict` ('module.' + name):
        the dense ones, then the experts."""
        head = f"{prefix}." if prefix else ""
        for r in self.all_records():
            yield f"{head}module.{r.name}", r.dist_param

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def dist_param_of(self, param: nn.Parameter) -> nn.Parameter:
        """The distributed parameter standing for an original (compute) parameter."""
        for r in self.all_records():
            if r.param is param or r.dist_param is param:
                return r.dist_param
        raise KeyError("parameter does not belong to this model")

    # -- forward --------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # The root's work runs in this wrapper's own forward hooks, which Dynamo does not trace (see
    # [Note: compile] in _hooks.py).
    def _root_pre_forward(self, module, args):
        self._end_abandoned_backward()  # before the swap below: its end swaps the dist parameters in
        owners = self.owners()
        for o in owners:
            o._sync_requires_grad()
        for o in owners:
            o._swap_params(dist=False)
        self.extensions.root_pre_forward()  # [Note: extension parameters under MegatronFSDP]
        for o in owners:
            o.hooks.root_pre_forward()

    def _root_post_forward(self, module, args, output):
        for o in self.owners():  # the backward's final callbacks queued in this order too
            output = o._finish_root_forward(output)
        return output

    # -- gradient sync --------------------------------------------------------------------
    def _before_backward(self) -> None:
        """Nothing to prepare: this wrapper's gradients are cleared by zero_grad."""

    def _should_sync(self) -> bool:
        return self._no_sync_depth == 0 and (self.model_auto_sync or self.is_last_microbatch)

    def _after_backward(self, synced: bool) -> None:
        self._backward_ends(synced)

    def _backward_ends(self, synced: bool) -> None:
        """An engine's backward final callback ran (its HookManager is out of the backward); the
        last one ends the backward for the model: every engine's reductions are in ([Note: expert
        data-parallel mesh] in _megatron_experts.py). Read from the managers, not counted, so that nothing
        is left over from a backward an error interrupted."""
        if self._in_backward():
            return
        self.microbatch_count += 1
        self._grads_pending = True
        for o in self.owners():
            o._swap_params(dist=True)
        if synced:
            self.finish_grad_sync()
        self._trim_host_heap()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Finishes every gradient reduction (reducing no_shard/ZeRO-1 gradients exactly once)
        and attaches the `.grad` DTensors to the distributed parameters that have a gradient
        (see [Note: unused parameters] in _owner.py)."""
        self._end_abandoned_backward()
        if self._in_backward():
            raise RuntimeError("finish_grad_sync() called inside a backward pass; call it after backward()")
        for o in self.owners():
            o.param_buffer.engine.sync_grads()
            o._attach_grads(o.param_buffer.records)
        if self.report_nan_in_param_grad:
            self._check_nonfinite_grads()
        self.microbatch_count = 0
        self._grads_pending = False

    def _drop_grads(self) -> None:
        super()._drop_grads()
        self._grads_pending = False

    def _end_abandoned_backward(self) -> None:
        for o in self.owners():  # [Note: a backward that raised] in _hooks.py
            o.hooks.end_abandoned_backward()

    def _sync_grads_for_step(self) -> None:
        """What an optimizer step needs first: any gradient not yet reduced and attached."""
        if not self.model_auto_sync or self._grads_pending:
            self.finish_grad_sync()

    def _check_nonfinite_grads(self) -> None:
        bad = [r.name for o in self.owners() for r in o.param_buffer.records
               if r.grad_dtensor is not None and o.param_buffer.engine.count_nonfinite_grad(r.bucket, r.item)]
        flag = torch.tensor([len(bad)], dtype=torch.int64, device=self.dist_ctx.device)
        torch.distributed.all_reduce(flag, group=self.dist_ctx.all_dp_group)
        if flag.item():
            where = f"on rank {self.dist_ctx.rank}: {', '.join(bad)}" if bad else "on another rank"
            raise FloatingPointError(
                f"non-finite (NaN/Inf) gradient found after reduction {where}. Check the loss, the learning rate "
                "and the inputs of these parameters' modules")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the synced gradients of every parameter by their total norm, exactly, like
        torch.nn.utils.clip_grad_norm_ (which refuses a model with expt_device_mesh: its
        parameters are on two meshes). Collective: every rank calls it. Returns the total norm."""
        self._end_abandoned_backward()
        if self._in_backward():
            raise RuntimeError("clip_grad_norm_() called inside a backward pass; call it after backward()")
        return clip_grad_norm(list(self.parameters()), float(max_norm), float(norm_type))

    def zero_grad_buffer(self) -> None:
        """Zeroes the main gradient buffers and detaches `.grad` from the distributed parameters."""
        self._end_abandoned_backward()
        for o in self.owners():
            o._drop_grads()  # this wrapper's clears _grads_pending too

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_buffer()

    def _zero_grads_of(self, params, set_to_none: bool) -> None:
        """An optimizer's zero_grad: clears the gradients of `params` (those of this model) only."""
        self._end_abandoned_backward()
        found = [x for x in (self._record_of.get(id(p)) for p in params)
                 if x is not None and x[1].grad_dtensor is not None]
        whole = 0
        for o in self.owners():
            mine = [r for owner, r in found if owner is o]
            if not mine:
                continue
            engine = o.param_buffer.engine
            if len(mine) == sum(r.grad_dtensor is not None for r in o.param_buffer.records):
                engine.zero_grads()
                whole += 1
            else:
                by_bucket = {}
                for r in mine:
                    by_bucket.setdefault(r.bucket, []).append(r.item)
                for b, items in by_bucket.items():
                    engine.zero_item_grads(b, items)
            for r in mine:
                o._used[r.index] = 0
                if set_to_none:
                    o._has_grad[r.index] = 0
                    r.dist_param.grad = None
        if whole == len(self.owners()):
            self._grads_pending = False

    def install_optimized_model_weights(self) -> None:
        """Main weights -> compute weights after an optimizer step; the next forward's
        all-gathers spread them."""
        for o in self.owners():  # the payloads of extension parameters follow their main weights
            o.param_buffer.engine.install_main_weights(bool(getattr(o, "extensions", None) and o.extensions.exts))

    def start_param_sync(self, force_sync: bool = False) -> None:
        """Starts gathering every stale persistent bucket now (ZeRO-1/2) instead of at first use."""
        for o in self.owners():
            engine = o.param_buffer.engine
            stale = [b for b in o.param_buffer.gatherable_buckets() if engine.weight_state(b) == "stale"
                     and o.param_buffer.bucket_roles[b] != ROLE_PAYLOAD]  # those need their unit's inputs first
            if stale:
                engine.unshard(stale)
                if force_sync or not self.overlap_param_gather:
                    engine.wait_unshard(stale)

    def synchronize_param_gather(self) -> None:
        self._end_abandoned_backward()  # a drain inside a backward is refused (csrc/comm/pipeline.c)
        for o in self.owners():
            o.param_buffer.engine.drain()

    def synchronize_gradient_reduce(self) -> None:
        self._end_abandoned_backward()
        for o in self.owners():
            o.param_buffer.engine.drain()

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside do not reduce no_shard/ZeRO-1 gradients or attach `.grad`."""
        self._no_sync_depth += 1
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            if self._no_sync_depth == 0:
                self.is_last_microbatch = True

    @contextlib.contextmanager
    def sync(self):
        """Auto-sync on inside (restores the previous setting after; Megatron-FSDP resets to off)."""
        previous = self.model_auto_sync
        self.set_model_auto_sync(True)
        try:
            yield
        finally:
            self.model_auto_sync = previous

    def set_model_auto_sync(self, sync_model: bool = True) -> None:
        self.model_auto_sync = bool(sync_model)

    # -- mixed precision ------------------------------------------------------------------
    def reset_mixed_precision_policy(self, policy: MixedPrecisionPolicy) -> None:
        """Adopts `policy.grad_comm_dtype` (None: communicate in the main gradient dtype).
        Main parameter and gradient dtypes are fixed at fully_shard time and kept, as in
        Megatron-FSDP; only temporary communication buffers change, so this is always allowed
        (Megatron-FSDP's check for it is inverted)."""
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError(f"expected a MixedPrecisionPolicy, got {type(policy).__name__}")
        effective = dataclasses.replace(self.mp_policy, grad_comm_dtype=policy.grad_comm_dtype,
                                        allow_lossy_accumulation=policy.allow_lossy_accumulation)
        for dtype in {r.param.dtype for r in self.all_records()
                      if r.requires_grad and r.param.dtype.is_floating_point}:
            effective.resolve(dtype)  # raises when the new comm dtype would lose bits on accumulation
        if self._in_backward():
            raise RuntimeError("the mixed precision policy cannot change inside a backward pass")
        for o in self.owners():
            o.param_buffer.engine.set_comm_dtype(policy.grad_comm_dtype)
        self.mp_policy = effective

    @contextlib.contextmanager
    def mixed_precision_context(self, policy: MixedPrecisionPolicy):
        """Communicates gradients in `policy.grad_comm_dtype` inside the block."""
        previous = self.mp_policy
        self.reset_mixed_precision_policy(policy)
        try:
            yield self
        finally:
            self.reset_mixed_precision_policy(previous)

    def _log_summary(self, units) -> None:
        buf = self.param_buffer
        for b, (bp, spec) in enumerate(zip(buf.plan, buf.specs)):
            label = "outside units" if bp["unit"] < 0 else type(units[bp["unit"]]).__name__ + f"#{bp['unit']}"
            logger.info("bucket %d (%s): %d params, %d elements x %d shards, %s%s", b, label, bp["n_items"],
                        bp["shard_size"], bp["shards"], ShardingStrategy(self.zero_dp_strategy).label,
                        ", replicated" if bp["replicated"] else "")

    def extra_repr(self) -> str:
        hybrid = f" x {self.dist_ctx.outer_world} replicas" if self.dist_ctx.outer_world > 1 else ""
        ex = self.expert_owner
        experts = "" if ex is None else \
            f", experts over {ex.dist_ctx.dp_world} ranks in {len(ex.param_buffer.plan)} buckets"
        return (f"strategy={ShardingStrategy(self.zero_dp_strategy).label}, world={self.dist_ctx.world}{hybrid}, "
                f"buckets={len(self.param_buffer.plan)}{experts}")

    # -- introspection over both engines -------------------------------------------------------
    def full_parameters(self) -> dict:
        out = {}
        for o in self.owners():
            out.update(EngineOwner.full_parameters(o))
        return out

    def full_grads(self) -> dict:
        out = {}
        for o in self.owners():
            out.update(EngineOwner.full_grads(o))
        return out

    def memory_report(self, optimizer: Optional[torch.optim.Optimizer] = None, locations: bool = False) -> dict:
        """Bytes this rank holds now (both engines' buffers with expt_device_mesh; the optimizer's
        states counted once), every value a byte count; with `locations`, also "locations": on
        which devices each kind of state lives (compute and main weights, main gradients,
        optimizer state)."""
        report = self.param_buffer.memory_report(optimizer, locations)
        if self.expert_owner is not None:
            extra = self.expert_owner.param_buffer.memory_report(None, locations)
            for k in ("param_bytes", "grad_bytes", "temporary_bytes", "total_bytes"):
                report[k] += extra[k]
            if locations:
                for kind, devices in extra["locations"].items():
                    report["locations"][kind] = sorted(set(report["locations"][kind]) | set(devices))
        return report
