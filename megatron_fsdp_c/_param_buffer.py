"""ParamBuffer: a model's parameters laid out in engine buckets, and their three faces.

1. The compute parameter: the module's own nn.Parameter object, whose .data is a view into the
   bucket's full-weight buffer (WEIGHT). Under ZeRO-3 that buffer's storage exists only while
   the unit runs; the view stays valid (see [Note: storage resize] in csrc/comm/buffers.c).
2. The distributed parameter: an nn.Parameter holding a DTensor whose local tensor is a view
   of this rank's rows of the main weights: torch's own Shard(0) (rank r holds the torch.chunk
   rows [r*ceil(R/W), ...), see [Note: chunked layout] in csrc/core/mfsdp_layout.h) or Shard(d)
   of the per-module API's shard_placement_fn (torch.chunk along d, made contiguous), or
   Replicate() for no_shard and replicated parameters. The optimizer steps it in place.
3. The gradient DTensor: same placement, a view of the optimizer-gradient buffer (OPT_GRAD).

Outside forward/backward the module holds the distributed parameters (so printing, state_dict
and optimizers see valid tensors); the wrapper swaps the compute parameters in for each pass.

The bucket math itself (grouping, both layouts, every rank's rows) lives in C:
csrc/core/mfsdp_layout.h, reached through _C.plan.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _C
from ._common import ShardingStrategy, contiguous_stride, move_storage, transformers_initialiser
from ._distributed import DistContext, check_quant_transport
from ._extensions import ROLE_EXTENSION, ROLE_PARAMS, ROLE_PAYLOAD, values_of, repoint
from ._memory_report import StorageTally, memory_report
from ._bucket_dtypes import bucket_dtypes
from .mixed_precision import MixedPrecisionPolicy, QuantizedCommPolicy
from ._param_record import ParamRecord, as_dtype, into_engine, rows_of, engine_dtype, local_shape
from ._tensor_parallel import spmd_layout

__all__ = ["ParamBuffer", "ParamRecord", "UnitConfig", "model_wide"]  # ParamRecord re-exported from _param_record.py

ALIGN_BYTES = 16  # shard boundaries on 16-byte multiples: aligned vector access on every rank

def wire_fields(quant: Optional[QuantizedCommPolicy]) -> dict:
    """A bucket's quantized-wire fields of the engine's spec (mfsdp_wire_spec): 0 for a plain
    wire, else 1 + the mode's code; none without a policy."""
    if quant is None:
        return {}
    code = lambda m: 0 if m is None else 1 + _C.QUANT_MODES[m]  # noqa: E731
    return {"wire_weights": code(quant.weights), "wire_grads": code(quant.grads),
            "wire_outer_weights": code(quant.outer_weights), "wire_block": quant.block}


def offload_buckets(plan: List[dict], units: List["UnitConfig"], fraction: float) -> set:
    """The buckets whose optimizer-side buffers live in host memory: a unit's when its UnitConfig
    says offload (FSDP2's CPUOffloadPolicy, per group), and the first buckets in plan order until
    `fraction` of the parameters' elements is offloaded (Megatron's optimizer_offload_fraction, of
    the model, not of a unit: honoured to a bucket, the last one may pass it). Payload buckets
    (extension parameters' gather inputs) are no optimizer's: they stay."""
    params = [b for b, bp in enumerate(plan) if bp["role"] != ROLE_PAYLOAD]
    chosen = {b for b in params if plan[b]["unit"] >= 0 and units[plan[b]["unit"]].offload}
    total, done = sum(plan[b]["weight_size"] for b in params), 0
    for b in params:
        if done >= fraction * total:  # (fraction 0: none)
            break
        chosen.add(b)
        done += plan[b]["weight_size"]
    return chosen


@dataclasses.dataclass(frozen=True)
class UnitConfig:
    """How one unit's buckets are built: its strategy, its quantized wire, its engine policy by
    bucket dtype (`policies`: the per-module API's, by compute dtype, a group's parameters sharing
    their storage dtype as FSDP2 requires; `policy` for every dtype not named: the Megatron-style
    API's one policy, extension payloads') and whether it is offloaded. The per-module API makes
    one per group (RootState), the Megatron-style API one for every unit (model_wide)."""
    strategy: ShardingStrategy
    quant: Optional[QuantizedCommPolicy]
    policy: Optional[MixedPrecisionPolicy]
    policies: Dict[torch.dtype, MixedPrecisionPolicy] = dataclasses.field(default_factory=dict)
    offload: bool = False  # CPUOffloadPolicy ([Note: offloaded buckets] in csrc/comm/buffers.c)

    def policy_of(self, dtype: torch.dtype) -> MixedPrecisionPolicy:
        """The policy of a bucket of `dtype`; never a stand-in for a group's missing one (a bucket
        reduced under another policy than its group's would be a silent wrong number)."""
        policy = self.policies.get(dtype, self.policy)
        if policy is None:
            raise RuntimeError(f"internal: no engine policy for a bucket of {dtype} (the group's policies name "
                               f"{sorted(map(str, self.policies))})")
        return policy


def model_wide(strategy: ShardingStrategy, policy: MixedPrecisionPolicy, quant: Optional[QuantizedCommPolicy],
               n_units: int) -> tuple:
    """(units, outside) of the Megatron-style API: its one configuration for each of its `n_units`
    units and outside them."""
    config = UnitConfig(strategy, quant, policy)
    return [config] * n_units, config


class ParamBuffer:
    """Builds the plan and the engine for one model and keeps the parameter records. Each unit's
    buckets are built by its UnitConfig (`units`, by unit index), the buckets outside every unit
    (parameters shared across units) by `outside`, whose strategy is also the model's: no_shard
    plans one shard per bucket. Payload buckets (`payloads`: (unit, PayloadInput) of the
    extension parameters' all-gather inputs, [Note: extension parameters] in _extensions.py;
    their (bucket, item) is set here) take their unit's strategy and wire and `outside`'s policy:
    they have no gradients. Each UnitConfig's `offload` and `offload_fraction` (the Megatron-style
    API's) say which buckets keep their main weights, main gradients and optimizer gradients in
    host memory, pinned on a GPU when `pin_host` ([Note: offloaded buckets] in
    csrc/comm/buffers.c; offload_buckets)."""

    def __init__(self, records: List[ParamRecord], ctx: DistContext, units: List[UnitConfig], outside: UnitConfig,
                 *, bucket_cap: int, reduce_queue_bytes: Optional[int], grad_prescale: float, reduce_op: str,
                 single_rank_collectives: bool = False, payloads=(), offload_fraction: float = 0.0,
                 pin_host: bool = False):
        self.single_rank_collectives = single_rank_collectives
        self.records = records
        self.units = units
        self.outside = outside
        self.ctx = ctx
        codes = _C.DTYPE_CODES
        plan_input = []
        for r in records:  # the compute parameter's dtype; r.shape (it may be an empty placeholder until pointed)
            row, outer = rows_of(r)
            plan_input.append((math.prod(r.shape), row, codes[engine_dtype(r.param.dtype)], r.unit,
                               int(r.param.requires_grad), int(r.replicated), outer,
                               ROLE_EXTENSION if r.extension else ROLE_PARAMS))
        shard_world = 1 if outside.strategy == ShardingStrategy.NO_SHARD else ctx.pieces
        for unit, inp in payloads:  # one piece of inp.numel elements per rank (replicated: the whole input)
            pieces = 1 if inp.replicated else shard_world
            plan_input.append((inp.numel * pieces, 1, codes[inp.engine_dtype], unit, 0, int(inp.replicated), 1,
                               ROLE_PAYLOAD))
        # quantized gradients: the flag tail on their blocks' boundaries ([Note: used-flag tail])
        quants = [c.quant for c in units] + [outside.quant]
        blocks = {q.block for q in quants if q is not None and q.grads}
        # _C.FLAG_TAIL elements per item at the end of every shard: the used-parameter flags and the
        # trainable check, laid out and read by the engine ([Note: used-flag tail] in csrc/comm/reduce.c)
        self.plan = _C.plan(plan_input, shard_world, ctx.piece_rank if shard_world > 1 else 0, bucket_cap,
                            ALIGN_BYTES, _C.FLAG_TAIL, math.lcm(*blocks) if blocks else 0)
        dtype_of = {code: dt for dt, code in codes.items()}
        specs = []
        max_grad_bytes = 0
        self.train_error: Dict[int, str] = {}  # bucket -> why its parameters cannot start training
        n_records = len(records)
        named = lambda bp: [records[pi] for pi in bp["params"] if pi < n_records]  # noqa: E731 (payloads have no record)
        offloaded = offload_buckets(self.plan, units, offload_fraction)
        for b, bp in enumerate(self.plan):
            first = named(bp)[0] if named(bp) else None
            dtype = dtype_of[bp["dtype"]]
            config = self.config_of_unit(bp["unit"])
            policy = self.outside.policy if bp["role"] == ROLE_PAYLOAD else config.policy_of(dtype)
            spec = self._bucket_spec(b, bp, dtype, config.strategy, policy, config.quant,
                                     first.name if first is not None else "",
                                     any(r.trains_later for r in named(bp)), b in offloaded)
            specs.append(spec)
            for i, (pi, local) in enumerate(zip(bp["params"], bp["local"])):
                if pi >= n_records:
                    payloads[pi - n_records][1].slot = (b, i)
                    continue
                rec = records[pi]
                rec.bucket, rec.item, rec.local = b, i, local
            if spec["trainable_mode"] != _C.GRAD_NONE:
                width = torch.empty((), dtype=dtype_of[spec["comm_dtype"]]).element_size()
                max_grad_bytes = max(max_grad_bytes, bp["bucket_size"] * width)
        if reduce_queue_bytes is None:
            reduce_queue_bytes = 4 * max_grad_bytes  # a few reductions in flight, never the whole model
        self.specs = specs  # "grad_mode" follows the engine: GRAD_NONE while the bucket has no gradient buffers
        self.trainable_items = [int(bp["requires_grad"]) * bp["n_items"] if s["trainable_mode"] else 0
                                for bp, s in zip(self.plan, specs)]
        if any(s.get("wire_weights") or s.get("wire_grads") or s.get("wire_outer_weights") for s in specs):
            check_quant_transport(ctx)
        engine_specs = [dict(s, grad_mode=s["trainable_mode"]) for s in specs]
        self.engine = _C.Engine(engine_specs, ctx.world, ctx.rank, grad_prescale, reduce_op, int(reduce_queue_bytes),
                                ctx.device, ctx.transport, single_rank_collectives,
                                outer_transport=ctx.outer_transport, outer_world=ctx.outer_world,
                                outer_sharded=ctx.outer_sharded, pin_host=pin_host)
        self.bucket_units = [bp["unit"] for bp in self.plan]
        self.bucket_roles = [bp["role"] for bp in self.plan]

    def config_of_unit(self, unit: int) -> UnitConfig:
        return self.outside if unit < 0 else self.units[unit]

    def _bucket_spec(self, b: int, bp: dict, dtype: torch.dtype, strategy: ShardingStrategy,
                     policy: MixedPrecisionPolicy, quant: Optional[QuantizedCommPolicy], name: str,
                     trains_later: bool, offload: bool) -> dict:
        """The engine's spec of bucket `b`: every floating bucket gets the gradient mode it trains
        with, a frozen one marked `frozen` (no gradient memory until a parameter of it starts
        training, [Note: changing requires_grad] in _trainable.py); train_error[b] says why one cannot."""
        main, grad, comm, wire, why_not = bucket_dtypes(dtype, bool(bp["requires_grad"]), trains_later, policy,
                                                        quant, name)
        can_train = dtype.is_floating_point and not (why_not and why_not[0])
        if why_not:
            self.train_error[b] = why_not[1]
        codes = _C.DTYPE_CODES
        sharded = bp["shards"] > 1
        if not can_train:
            grad_mode = _C.GRAD_NONE
        elif bp["replicated"] or strategy == ShardingStrategy.NO_SHARD:
            grad_mode = _C.GRAD_ALL_REDUCE
        elif strategy == ShardingStrategy.OPTIM:
            grad_mode = _C.GRAD_SCATTER_IN_PLACE
        else:
            grad_mode = _C.GRAD_SCATTER_ACCUMULATE
        return dict(
            shards=bp["shards"], shard_rank=bp["shard_rank"], shard_size=bp["shard_size"],
            weight_size=bp["weight_size"], numels=bp["numels"], pieces=bp["pieces"],
            param_offsets=bp["param_offsets"], shard_offsets=bp["shard_offsets"], outers=bp["outers"],
            tail_offset=bp["tail_offset"], tail=bp["tail"],
            param_dtype=codes[dtype], main_dtype=codes[main], grad_dtype=codes[grad], comm_dtype=codes[comm],
            weights_sharded=int((sharded or self.single_rank_collectives) and not bp["replicated"]
                                and strategy == ShardingStrategy.OPTIM_GRADS_PARAMS),
            weights_regather=int(sharded and strategy in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS)),
            trainable_mode=grad_mode, frozen=int(not bp["requires_grad"]),
            sum_in_comm_dtype=int(policy.sum_in_comm_dtype), offload=int(offload),
            grad_mode=grad_mode if bp["requires_grad"] else _C.GRAD_NONE,
            **wire_fields(wire),
        )

    # -- initialisation -------------------------------------------------------------------
    def load_params(self, bucket_ids=None) -> None:
        """Copies the parameters' current values into their buckets and points each compute
        parameter at its place in the full-weight buffer."""
        by_bucket: Dict[int, List[ParamRecord]] = {}
        for r in self.records:
            by_bucket.setdefault(r.bucket, []).append(r)
        for b in (range(len(self.plan)) if bucket_ids is None else bucket_ids):
            self.engine.init_begin(b)
            for r in by_bucket.get(b, []):
                data = r.param._local_tensor if r.tp is not None and r.tp.dtensor_compute else values_of(r.param)
                self.engine.set_item(b, r.item, into_engine(data.detach()))
            # while the full weights exist (an extension parameter computes with what its gathers make)
            self.point_compute_params([r for r in by_bucket.get(b, []) if not r.extension])
            self.engine.init_end(b)

    def load_locals(self) -> None:
        """Initialises every bucket from this rank's rows alone: each record's dist_param is a
        DTensor whose local tensor holds them (the per-module API's parameters before its lazy
        init). Full weights are gathered where they persist."""
        by_bucket = self.records_by_bucket()
        for b in range(len(self.plan)):
            self.engine.init_begin(b, True)
            for r in by_bucket.get(b, []):
                local = values_of(r.dist_param._local_tensor).detach()
                if local.is_meta:
                    raise RuntimeError(
                        f"parameter '{r.name}' is still on the meta device at the first forward: materialise the "
                        "model after fully_shard (model.to_empty(device=...) and reset_parameters() / init_weights())")
                self.engine.set_local(b, r.item, into_engine(local.to(self.ctx.device)))
            self.engine.init_end(b)
        self.engine.install_main_weights(True)  # persistent full weights: this rank's rows in, a gather brings the rest
        self.point_all_compute_params()

    def records_by_bucket(self) -> Dict[int, List[ParamRecord]]:
        by_bucket: Dict[int, List[ParamRecord]] = {}
        for r in self.records:
            by_bucket.setdefault(r.bucket, []).append(r)
        return by_bucket

    def point_all_compute_params(self) -> None:
        """Points every compute parameter at its full weights. A ZeRO-3 bucket's full-weight
        buffer is not gathered for it: the views only need its storage object, which keeps them
        across release and gather ([Note: storage resize] in csrc/comm/buffers.c), so its
        storage is given its size while they are made (torch checks a view against the storage's
        size) and released again, no collective issued: FSDP2's lazy init gathers nothing either
        (torch's test_gradient_accumulation counts the first forward's all-gathers). Full weights
        that persist (ZeRO-1/2) are gathered now."""
        for b, recs in self.records_by_bucket().items():
            if self.bucket_roles[b] == ROLE_EXTENSION:
                continue  # they compute with what fsdp_post_all_gather makes ([Note: extension parameters])
            if self.specs[b]["weights_sharded"]:
                full = self.engine.tensor(b, _C.BUF_WEIGHT)
                storage = full.untyped_storage()
                released = storage.nbytes() == 0
                if released:
                    storage.resize_(full.numel() * full.element_size())
                try:
                    self.point_compute_params(recs)
                finally:
                    if released:
                        storage.resize_(0)
                continue
            if self.specs[b]["weights_regather"]:
                self.engine.unshard([b])
                self.engine.wait_unshard([b])
            self.point_compute_params(recs)

    def point_compute_params(self, records: List[ParamRecord]) -> None:
        for r in records:
            full = self.engine.tensor(r.bucket, _C.BUF_WEIGHT)
            offset = self.plan[r.bucket]["param_offsets"][r.item]
            view = as_dtype(full.narrow(0, offset, math.prod(r.shape)), r.param.dtype).view(r.shape)
            if r.tp is not None and r.tp.dtensor_compute:
                r.param._local_tensor = view  # a DTensor on the TP mesh over the TP shard
            else:
                r.param.data = view

    def load_from_meta(self, root: nn.Module, device: torch.device) -> dict:
        """Materialises a meta-device model one module at a time, in module (construction) order
        so the random initialisation matches a model built directly on `device`: to_empty +
        reset_parameters (a transformers model: its _init_weights on each module, the initialiser
        from_config and from_pretrained run, which also makes the rotary embeddings' buffers),
        the module's rows go straight into this rank's shards, the module's full tensors are
        dropped. No rank ever holds more than its shards plus one module (and,
        while compute parameters are pointed at their buckets, one gathered bucket).
        Returns the peak parameter bytes (weights, main weights, the module being materialised)
        measured in each phase."""
        record_of = {id(r.param): r for r in self.records}
        for b in range(len(self.plan)):
            self.engine.init_begin(b, True)
        peak = {"materialise": 0, "point": 0}
        done = set()
        hf_init = transformers_initialiser(root)
        for name, mod in root.named_modules():
            metas = [attr for attr, p in mod._parameters.items() if p is not None and p.is_meta]
            if not metas and not any(b is not None and b.is_meta for b in mod._buffers.values()):
                continue
            reset = getattr(mod, "reset_parameters", None) or getattr(mod, "_reset_parameters", None)
            if hf_init is not None:  # its norms and rotary embeddings have no reset_parameters
                reset = functools.partial(hf_init, mod)
            if reset is None:
                raise ValueError(
                    f"init_model_with_meta_device: module '{name or '<root>'}' ({type(mod).__name__}) holds meta "
                    "tensors but has no reset_parameters(); add one that initialises its own parameters, or build "
                    "the model on a real device")
            old = {attr: mod._parameters[attr] for attr in metas}
            mod.to_empty(device=device, recurse=False)
            with torch.no_grad():
                reset()
            module_bytes = sum(t.numel() * t.element_size() for t in mod._parameters.values() if t is not None)
            peak["materialise"] = max(peak["materialise"], self.materialized_bytes() + module_bytes)
            for attr, meta_param in old.items():
                rec = record_of.get(id(meta_param))
                fresh = mod._parameters[attr]
                if rec is None:
                    continue
                if id(rec) in done:  # tied: the first module's initialisation wins, as when built eagerly
                    mod._parameters[attr] = rec.param
                    continue
                self.engine.set_item(rec.bucket, rec.item, into_engine(fresh.detach()))
                fresh.requires_grad_(meta_param.requires_grad)
                fresh.data = torch.empty(0, dtype=fresh.dtype, device=device)  # drop the full copy
                rec.param = fresh
                for m, a in rec.places:
                    m._parameters[a] = fresh
                done.add(id(rec))
        for b in range(len(self.plan)):
            self.engine.init_end(b)
        by_bucket: Dict[int, List[ParamRecord]] = {}
        for r in self.records:
            by_bucket.setdefault(r.bucket, []).append(r)
        for b, recs in by_bucket.items():
            sharded = self.specs[b]["weights_sharded"]
            if sharded:  # the full weights exist only while gathered
                self.engine.unshard([b])
                self.engine.wait_unshard([b])
                peak["point"] = max(peak["point"], self.materialized_bytes())
            self.point_compute_params(recs)
            if sharded:
                self.engine.reshard([b])
        return peak

    WEIGHT_KINDS = (_C.BUF_WEIGHT, _C.BUF_WEIGHT_SHARD, _C.BUF_MAIN_SHARD)

    def materialized_bytes(self, kinds=WEIGHT_KINDS) -> int:
        """Bytes of the engine buffers of `kinds` (default: parameters) whose storage exists now."""
        tally = StorageTally()
        return sum(tally(self.engine.tensor(b, kind)) for b in range(len(self.plan)) for kind in kinds)

    def memory_report(self, optimizer: Optional[torch.optim.Optimizer] = None, locations: bool = False) -> dict:
        """What this rank holds now, and with `locations` where (see _memory_report.memory_report)."""
        return memory_report(self.engine, self.specs, optimizer, locations)

    def placement(self, r: ParamRecord):
        sharded = self.config_of_unit(r.unit).strategy != ShardingStrategy.NO_SHARD
        return Shard(r.shard_dim) if sharded and not r.replicated else Replicate()

    def layout(self, r: ParamRecord) -> tuple:
        """(mesh, placements, global shape) of `r`'s DTensors: the data-parallel mesh, or with TP
        the (data-parallel..., tp) mesh (see [Note: tensor parallelism] in _tensor_parallel.py)."""
        placements = self.ctx.placements(self.placement(r))
        if r.tp is None:
            return self.ctx.mesh, placements, r.shape
        mesh, placements = spmd_layout(r.tp, self.ctx.mesh, placements, f"parameter '{r.name}'")
        return mesh, placements, r.tp.shape

    def dtensor(self, r: ParamRecord, kind: int) -> DTensor:
        """This rank's rows of `r` in buffer `kind` (MAIN_SHARD, OPT_GRAD) as a DTensor."""
        mesh, placements, shape = self.layout(r)
        return DTensor.from_local(self.local_view(r, kind), mesh, placements, run_check=False,
                                  shape=shape, stride=contiguous_stride(shape))

    def build_dist_params(self, owner, existing: bool = False) -> None:
        """The distributed parameters (and gradient DTensors) over the engine's buffers. With
        `existing`, each record's dist_param is already a DTensor Parameter of the right shape and
        placement (the per-module API made it): its local tensor is re-pointed at the engine's
        rows: its local tensor's storage moves there ([Note: local shards keep their storage] in
        _common.py), so optimizers built on it and state dicts taken of it keep working, as FSDP2's
        sharded parameters never change storage."""
        moved = set()
        for r in self.records:
            if existing and r.extension:  # the subclass keeps its object, its values move ([Note: extension parameters])
                dp = r.dist_param
                view = self.local_view(r, _C.BUF_MAIN_SHARD)
                if not move_storage(values_of(dp._local_tensor), view, moved):
                    repoint(dp._local_tensor, view)
            elif existing:
                dp = r.dist_param
                view = self.local_view(r, _C.BUF_MAIN_SHARD)
                if not move_storage(dp._local_tensor, view, moved):
                    dp._local_tensor = view
            else:
                dp = r.dist_param = nn.Parameter(self.dtensor(r, _C.BUF_MAIN_SHARD), requires_grad=r.param.requires_grad)
            dp._megatron_fsdp_model = weakref.proxy(owner)  # Megatron-FSDP's attribute
            dp._mfsdp_model_ref = weakref.ref(owner)  # how the optimizer finds the model
            if self.specs[r.bucket]["grad_mode"] != _C.GRAD_NONE:
                r.grad_dtensor = self.dtensor(r, _C.BUF_OPT_GRAD)

    def local_view(self, r: ParamRecord, kind: int) -> torch.Tensor:
        """This rank's rows of `r` in buffer `kind` (MAIN_SHARD or OPT_GRAD): a view shaped as
        torch's Shard(d) local tensor (the whole parameter when the bucket is not sharded)."""
        where, offset, n = self.engine.local_piece(r.bucket, r.item, kind)
        # A tensor of its own over the same memory (storage offset 0, keeping the buffer alive):
        # torch pickles a DTensor whose local tensor sits at a storage offset through the
        # wrapper's own (empty) storage and fails, so torch.save(model.state_dict()) would.
        flat = torch.from_dlpack(self.engine.tensor(r.bucket, where).narrow(0, offset, n))
        if r.param.dtype not in _C.DTYPE_CODES:  # frozen, carried opaque: [Note: opaque parameter dtypes]
            flat = flat.view(r.param.dtype)
        if self.plan[r.bucket]["shards"] == 1 or r.replicated:
            return flat.view(r.shape)
        bp = self.plan[r.bucket]  # rank-major: torch.chunk's piece, contiguous
        return flat.view(local_shape(r.shape, r.shard_dim, bp["shards"], bp["shard_rank"]))

    # -- views used by the wrapper --------------------------------------------------------
    def buckets_of_unit(self, unit: int) -> tuple:
        return tuple(b for b, u in enumerate(self.bucket_units) if u == unit)

    def reduce_order(self) -> list:
        """Buckets in the order a backward completes them, the order every rank reduces in ([Note:
        collective order] in csrc/comm/reduce.c): the unit whose forward started last first (units
        are in forward order), then the buckets outside every unit. A unit containing others (the
        per-module API's root group) completes after them, as its earliest-used parameter does."""
        units = self.bucket_units
        return sorted(range(len(self.plan)), key=lambda b: (units[b] < 0, -units[b], -b))

    def weight_sharded_buckets(self) -> tuple:
        return tuple(b for b, s in enumerate(self.specs) if s["weights_sharded"])

    def grad_buckets(self) -> tuple:
        """Buckets with trainable parameters now (they reduce gradients)."""
        return tuple(b for b, n in enumerate(self.trainable_items) if n > 0)

    def gatherable_buckets(self) -> tuple:
        """Buckets whose full weights ever need an all-gather (ZeRO-1/2/3 with several ranks; never
        the extension parameters' own, [Note: extension parameters] in _extensions.py)."""
        return tuple(b for b, s in enumerate(self.specs) if (s["weights_sharded"] or s["weights_regather"])
                     and self.bucket_roles[b] != ROLE_EXTENSION)
