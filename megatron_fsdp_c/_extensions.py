"""FSDP2's all-gather extensions: parameters whose local shard is a tensor subclass defining
fsdp_pre_all_gather / fsdp_post_all_gather (torchao's float8 and int8 training weights). What
such a parameter is, how its values reach the engine, and the two calls around its gathers.

[Note: extension parameters]
A parameter whose local shard defines fsdp_pre_all_gather and fsdp_post_all_gather (torch's
FSDP2 protocol) is an extension parameter: its class decides what crosses the wire, the engine
still owns its numbers. The bucket plan gives each unit up to three kinds of buckets, by role
(the planner never mixes roles in a bucket, csrc/core/mfsdp_layout.h):
  ROLE_PARAMS     ordinary parameters, gathered as always;
  ROLE_EXTENSION  the extension parameters' own values (the subclass's one inner tensor of its
                  shape and dtype): main weights, gradients and optimizer state as for any
                  parameter -- the DTensor's local tensor is the subclass around this rank's
                  rows of the main shard, so the optimizer's in-place steps land in the engine --
                  but never gathered: nothing computes with them whole;
  ROLE_PAYLOAD    one item per all-gather input of each extension parameter, of the input's
                  dtype carried opaque ([Note: opaque parameter dtypes] in _engine_dtypes.py) and
                  its padded size per rank, frozen; gathered by the engine as any ZeRO-3 bucket,
                  so the inputs ride its prefetch and its one collective per bucket (one bucket
                  per unit and dtype: fp8 bytes in one, int8 data in one, fp32 scales in one).
Before a payload bucket is gathered (its weights empty or stale), the owner calls each of the
unit's fsdp_pre_all_gather on the current local shard, checks the inputs against the plan and
writes them into this rank's piece (zeros after them). After the wait, each input's gathered
rows are copied out of their item into a tensor of its own, as FSDP2's all-gather outputs are
(storage offset 0: TwoTensor requires it; a subclass may keep them as its inner tensors), and
fsdp_post_all_gather gets them, each shaped (world * rows, ...): the first time without `out`,
keeping the tensor it returns as the compute parameter (the gradient hook goes on it, and a
subclass gradient is copied into a plain one by its own copy_, as FSDP2 does), later with out=
that parameter. When the unit reshards, those outputs and the tensors the first call named are
freed (their storage; the objects stay for out=), and given their bytes back before the next
call, as FSDP2 frees them; torch 2.15's fsdp_should_release_all_gather_outputs_after_post_all_gather
frees the outputs right after the call instead. An input whose rows follow the shard's rows (on
uneven shards each rank's input has its own row count) is padded on the wire to the first
rank's rows and cut to the parameter's rows before post_all_gather, so the subclass never sees
padding (FSDP2 hands it the padded output and then as_strided's the subclass, which torchao's
float8 weight cannot take: torchao #3982); an input of one size on every rank passes as it is
(one the subclass padded itself: its tensor is cut to the parameter's size with as_strided, as
FSDP2 does). The sizes every rank gives are exchanged once, at the lazy init (one
all_gather_object); a later input of another size or dtype raises before any collective. An
optimizer step marks the payloads stale with every other weight (install_main_weights(True) at
the next forward), so the next gather calls pre_all_gather again; with one rank, where nothing
is gathered, each unshard of the unit writes the inputs in place and calls both hooks.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import _C
from ._engine_dtypes import opaque_dtype

__all__ = ["ROLE_PARAMS", "ROLE_EXTENSION", "ROLE_PAYLOAD", "ExtensionParam", "PayloadInput", "is_extension",
           "ExtensionGathers", "check_local_shard", "plain_grad", "value_names", "values_of", "repoint", "shard_mesh",
           "plan_inputs"]

ROLE_PARAMS, ROLE_EXTENSION, ROLE_PAYLOAD = 0, 1, 2


def is_extension(t) -> bool:
    """Does `t` (a local shard, or a parameter) define FSDP2's all-gather extensions? One of the
    two hooks without the other is FSDP2's AssertionError."""
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise AssertionError(f"Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using "
                             f"all-gather extensions: {type(t).__name__}")
    return pre


def value_names(t: torch.Tensor) -> list:
    """The inner tensors of subclass `t` (among __tensor_flatten__'s) of its shape and dtype: plain
    tensors that hold values (torchao's `_tensor`, `_data`; TwoTensor's `a` and `b`)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    names = flatten()[0] if flatten is not None else []
    return [n for n in names if type(getattr(t, n, None)) in (torch.Tensor, nn.Parameter)
            and getattr(t, n).shape == t.shape and getattr(t, n).dtype == t.dtype]


def _values_name(t: torch.Tensor, what: str) -> str:
    """The name of the inner tensor of subclass `t` that holds its values: the first of
    value_names (TwoTensor's `b` stays in the subclass's own memory, stepped with it by the
    optimizer, which steps the subclass under the per-module API)."""
    hits = value_names(t)
    if not hits:
        names = t.__tensor_flatten__()[0] if hasattr(t, "__tensor_flatten__") else []
        raise NotImplementedError(
            f"{what} is a {type(t).__name__} with FSDP2's all-gather extensions, but megatron_fsdp_c needs its values "
            f"in a plain inner tensor of its shape and dtype (none among __tensor_flatten__'s {names}): its engine "
            "keeps the main weights and gradients of that tensor")
    return hits[0]


def plain_grad(g: torch.Tensor) -> torch.Tensor:
    """An extension parameter's gradient as the engine takes it: a subclass gradient (TwoTensor's)
    copied into a plain tensor by its own copy_, as FSDP2 copies it into its reduce-scatter input."""
    if type(g) is torch.Tensor:
        return g
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    with torch.no_grad():
        out.copy_(g)
    return out


def _plain(t: torch.Tensor) -> bool:
    """A plain tensor (FSDP2 also takes the extensions as methods set on one, not a subclass)."""
    return type(t) in (torch.Tensor, nn.Parameter)


def check_local_shard(t: torch.Tensor, what: str, extensions_later: bool = False) -> None:
    """A plain tensor, or a subclass with FSDP2's all-gather extensions whose values are a plain
    inner tensor ([Note: extension parameters]); any other subclass is refused: the engine moves
    plain elements, it cannot gather a subclass's inner tensors. `extensions_later` (fully_shard):
    a subclass with such values may still get the extensions set on its local shard before the
    first forward (torch's FSDP2 tests do so), where this is called again without it."""
    data = t.data if isinstance(t, nn.Parameter) else t
    if is_extension(data):
        if not _plain(data):
            _values_name(data, what)
        return
    if type(data) is not torch.Tensor and extensions_later and value_names(data):
        return
    if type(data) is not torch.Tensor:
        raise NotImplementedError(
            f"{what} is a tensor subclass ({type(data).__name__}) without FSDP2's all-gather extensions (fsdp_pre_all_gather / "
            "fsdp_post_all_gather): megatron_fsdp_c's engine moves plain elements, not a subclass's inner tensors. Use "
            "torch.distributed.fsdp.fully_shard for this model, plain parameters, or give the subclass the extensions")


def values_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s values: itself, or an extension subclass's inner tensor."""
    if _plain(t) or not is_extension(t):
        return t
    return getattr(t, _values_name(t, type(t).__name__))


def repoint(t: torch.Tensor, values: torch.Tensor) -> None:
    """`t` (the same object: optimizers and state dicts hold it) computes with `values` from now
    on: its values' inner tensor is replaced (for a plain `t` with extension methods, its data)."""
    if _plain(t):
        t.data = values
    else:
        setattr(t, _values_name(t, type(t).__name__), values)


@dataclasses.dataclass(eq=False)
class PayloadInput:
    """One all-gather input of an extension parameter, as planned: its dtype, its size in every
    rank's piece (padded), and whether its rows follow the shard's (then cut to `rows` after the
    gather)."""
    dtype: torch.dtype
    shape: tuple            # this rank's input shape (checked at every gather)
    numel: int              # elements per rank in the payload bucket (the largest rank's)
    trailing: tuple         # the shape after dim 0 of every rank's input
    rows: Optional[int]     # the parameter's rows when the rows follow the shard's, else None
    replicated: bool = False  # its parameter is replicated (no_shard, fsdp_no_shard): nothing to gather
    slot: tuple = (-1, -1)  # (bucket, item) of its payload item, once planned
    output: Optional[torch.Tensor] = None  # what post_all_gather gets: a tensor of its own (see _post)

    @property
    def engine_dtype(self) -> torch.dtype:
        return opaque_dtype(self.dtype)  # [Note: opaque parameter dtypes] in _engine_dtypes.py


@dataclasses.dataclass(eq=False)
class ExtensionParam:
    """An extension parameter of one engine ([Note: extension parameters]): its record, the module
    and policy FSDP2 passes to pre_all_gather, its planned inputs, and what the last
    pre_all_gather returned."""
    record: object          # its ParamRecord
    module: nn.Module
    mp_policy: object
    param_dtype: torch.dtype  # post_all_gather's: the policy's param_dtype, else the parameter's
    inputs: List[PayloadInput]
    metadata: object = None
    compute: Optional[nn.Parameter] = None  # the first post_all_gather's tensor, as a Parameter
    inner: tuple = ()       # the tensors the first post_all_gather said to free at reshard, with their bytes
    release_outputs: bool = False  # torch 2.15's fsdp_should_release_all_gather_outputs_after_post_all_gather()

    @property
    def local(self) -> torch.Tensor:
        return self.record.dist_param._local_tensor

    def pre_all_gather(self, mesh, local=None) -> tuple:
        """fsdp_pre_all_gather of `local` (default: the current local shard) with the signature its
        class has: (mesh) or (mesh, outer_size, outer_stride, module, mp_policy), as FSDP2 calls
        it; anything else is FSDP2's error."""
        local = self.local if local is None else local
        n = len(inspect.signature(local.fsdp_pre_all_gather).parameters)
        if n == 1:
            inputs, metadata = local.fsdp_pre_all_gather(mesh)
        elif n == 5:
            shape = tuple(self.record.shape)
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            inputs, metadata = local.fsdp_pre_all_gather(mesh, torch.Size(shape), stride, self.module, self.mp_policy)
        else:
            raise AssertionError(f"Invalid fsdp_pre_all_gather: {inspect.signature(local.fsdp_pre_all_gather)}\n"
                                 "Expects fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, "
                                 "outer_stride: tuple[int, ...], module: nn.Module, mp_policy: MixedPrecisionPolicy)")
        return tuple(inputs), metadata


def shard_mesh(ctx):
    """The mesh FSDP2 hands fsdp_pre_all_gather: the shard mesh (HSDP: the last, named dim)."""
    return ctx.mesh if ctx.mesh.ndim == 1 else ctx.mesh[ctx.mesh.mesh_dim_names[-1]]


def plan_inputs(exts: List[ExtensionParam], mesh, group, world: int, rank: int, locals=None) -> None:
    """Each extension parameter's all-gather inputs planned ([Note: extension parameters]): one
    pre_all_gather per parameter, in the same order on every rank, and one all_gather_object of
    every rank's input shapes and dtypes over the shard group; inputs whose sizes or dtypes
    cannot share a payload item raise here, on every rank alike. `locals`: the local shards to
    ask (default: each parameter's current one; the Megatron-style API's are not DTensors yet)."""
    mine = []
    for k, ext in enumerate(exts):
        local = ext.local if locals is None else locals[k]
        release = getattr(local, "fsdp_should_release_all_gather_outputs_after_post_all_gather", None)
        if release is not None:  # the extension says whether its compute tensor aliases the outputs
            ext.release_outputs = release()
            if not isinstance(ext.release_outputs, bool):
                raise AssertionError("fsdp_should_release_all_gather_outputs_after_post_all_gather must return a bool, "
                                     f"got {type(ext.release_outputs)}")
        inputs, _ = ext.pre_all_gather(mesh, local)
        mine.append([(tuple(t.shape), str(t.dtype)) for t in inputs])
    every = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine, group=group)
    for k, ext in enumerate(exts):
        r = ext.record
        rows = r.shape[0] if len(r.shape) else 1
        pieces = 1 if r.replicated else world  # a replicated parameter's input is the whole on every rank
        chunk = -(-rows // pieces)
        rows_of = [max(0, min(chunk, rows - q * chunk)) for q in range(pieces)] * (world // pieces)
        counts = {len(e[k]) for e in every}
        if len(counts) != 1:
            raise ValueError(f"parameter '{r.name}': fsdp_pre_all_gather returned {sorted(counts)} inputs on different "
                             "ranks: every rank must return the same number")
        ext.inputs = []
        for j in range(counts.pop()):
            shapes = [tuple(e[k][j][0]) for e in every]
            dtypes = {e[k][j][1] for e in every}
            if len(dtypes) != 1:
                raise ValueError(f"parameter '{r.name}': all-gather input {j} has dtypes {sorted(dtypes)} on different "
                                 "ranks: every rank must give one dtype")
            dtype = getattr(torch, dtypes.pop().replace("torch.", ""))
            if len(set(shapes)) == 1:
                ext.inputs.append(PayloadInput(dtype, shapes[rank], math.prod(shapes[0]), shapes[0][1:], None,
                                               r.replicated))
            elif all(len(s) >= 1 and s[0] == n and s[1:] == shapes[0][1:] for s, n in zip(shapes, rows_of)):
                trailing = shapes[0][1:]
                ext.inputs.append(PayloadInput(dtype, shapes[rank], chunk * math.prod(trailing), trailing, rows))
            else:
                raise ValueError(
                    f"parameter '{r.name}': all-gather input {j} has shapes {shapes} on ranks 0..{world - 1}: "
                    "megatron_fsdp_c gathers inputs of one shape on every rank, or inputs whose rows are the rank's "
                    f"rows of the parameter ({rows_of}) with equal trailing dims")


class ExtensionGathers:
    """The owner's side of [Note: extension parameters] for one engine: writes a unit's
    all-gather inputs before its payload buckets are gathered (`gathering`, from the hooks'
    HookManager.gather), and makes or refreshes its compute parameters after the wait
    (`unsharded`, before the owner registers them). `hooks` is the engine's HookManager (a new
    compute parameter gets its gradient hook there)."""

    def __init__(self, buf, exts: List[ExtensionParam], mesh, hooks):
        self.buf, self.engine, self.mesh, self.hooks = buf, buf.engine, mesh, hooks
        self.by_unit = {}
        for e in exts:
            self.by_unit.setdefault(e.record.unit, []).append(e)
        gatherable = set(buf.gatherable_buckets())
        self.payload_buckets = {u: sorted({i.slot[0] for e in es for i in e.inputs}) for u, es in self.by_unit.items()}
        # one rank: the payload buckets are never gathered, the inputs are written in place
        self.in_place = {u for u, bs in self.payload_buckets.items() if not any(b in gatherable for b in bs)}
        self.fresh = set()  # units whose payloads were written since their last post_all_gather

    def gathering(self, u: int) -> None:
        """Unit `u` is about to be gathered: the inputs of the payload buckets that will gather
        (empty or stale ones; a bucket still gathered or in flight keeps its values)."""
        if u not in self.by_unit or u in self.in_place:
            return
        due = {b for b in self.payload_buckets[u] if self.engine.weight_state(b) in ("empty", "stale")}
        if due:
            for e in self.by_unit[u]:
                self._stage(e, due)
            self.fresh.add(u)

    def unsharded(self, u: int, registered: bool) -> None:
        """Unit `u`'s gathers are done: post_all_gather where new payloads landed. With one rank,
        each unshard of a unit not registered yet writes them in place first."""
        if u not in self.by_unit:
            return
        if u in self.in_place and not registered:
            for e in self.by_unit[u]:
                self._stage(e, None)
            self.fresh.add(u)
        if u in self.fresh:
            self.fresh.discard(u)
            for e in self.by_unit[u]:
                self._post(e)

    def _stage(self, e: ExtensionParam, due) -> None:
        inputs, e.metadata = e.pre_all_gather(self.mesh)
        if len(inputs) != len(e.inputs):
            raise ValueError(f"parameter '{e.record.name}': fsdp_pre_all_gather returned {len(inputs)} inputs, "
                             f"{len(e.inputs)} at the first forward: the number of inputs must not change")
        for t, plan in zip(inputs, e.inputs):
            if tuple(t.shape) != plan.shape or t.dtype != plan.dtype:
                raise ValueError(f"parameter '{e.record.name}': fsdp_pre_all_gather returned an input of shape "
                                 f"{tuple(t.shape)} and dtype {t.dtype}; it gave {plan.shape} and {plan.dtype} at the "
                                 "first forward, which its payload bucket was planned for")
            b, item = plan.slot
            if due is not None and b not in due:
                continue
            where, offset, n = self.engine.local_piece(b, item, _C.BUF_MAIN_SHARD)  # its rows in every strategy
            dst = self.engine.tensor(b, where).narrow(0, offset, n)
            src = t.detach().contiguous().view(-1).view(plan.engine_dtype)
            with torch.no_grad():
                dst[:src.numel()].copy_(src)
                dst[src.numel():].zero_()

    def resharded(self, u: int) -> None:
        """Unit `u` resharded: the outputs and the tensors post_all_gather named are freed (their
        storage, not the objects: the compute parameter keeps them), as FSDP2 frees them, where
        the payloads were released (ZeRO-3) or are written in place; payloads that persist
        (ZeRO-1/2: gathered again only after an optimizer step) keep their compute weights."""
        if u not in self.by_unit or u not in self.in_place and any(
                self.engine.weight_state(b) == "ready" for b in self.payload_buckets[u]):
            return
        for e in self.by_unit[u]:
            for t in [i.output for i in e.inputs] + [t for t, _ in e.inner]:
                if t is not None:
                    t.untyped_storage().resize_(0)

    def _post(self, e: ExtensionParam) -> None:
        """post_all_gather on this gather's outputs: each input's gathered rows copied out of its
        payload item into a tensor of its own (storage offset 0, as FSDP2's all-gather outputs:
        a subclass may require it, TwoTensor does), kept across gathers so that out= finds its
        inner tensors where they were."""
        outputs = []
        for plan in e.inputs:
            b, item = plan.slot
            bp = self.buf.plan[b]
            full = self.engine.tensor(b, _C.BUF_WEIGHT)
            src = full.narrow(0, bp["param_offsets"][item], plan.numel * bp["shards"]).view(plan.dtype)
            src = src.view(-1, *plan.trailing)
            if plan.rows is not None:
                src = src.narrow(0, 0, plan.rows)
            if plan.output is None:
                plan.output = torch.empty(src.shape, dtype=src.dtype, device=src.device)
            out = plan.output
            _alloc(out, out.numel() * out.element_size())
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(src)
            outputs.append(out)
        local, r = e.local, e.record
        if e.compute is None:
            made = local.fsdp_post_all_gather(tuple(outputs), e.metadata, e.param_dtype)
            tensor, inner = made if isinstance(made, tuple) else (made, ())
            if tuple(tensor.shape) != tuple(r.shape):  # padded rows (inputs padded by the subclass): cut as FSDP2 does
                if tensor.numel() < math.prod(r.shape):
                    raise ValueError(f"parameter '{r.name}': fsdp_post_all_gather made a tensor of shape "
                                     f"{tuple(tensor.shape)} from the gathered inputs, smaller than the parameter's "
                                     f"{tuple(r.shape)}")
                shape = tuple(r.shape)
                tensor = torch.as_strided(tensor, shape, tuple(math.prod(shape[i + 1:]) for i in range(len(shape))), 0)
            e.compute = nn.Parameter(tensor, requires_grad=r.dist_param.requires_grad)
            e.inner = tuple((t, t.untyped_storage().nbytes()) for t in inner if isinstance(t, torch.Tensor))
            r.param = e.compute
            self.hooks.rehook(r)
        else:
            for t, nbytes in e.inner:
                _alloc(t, nbytes)
            local.fsdp_post_all_gather(tuple(outputs), e.metadata, e.param_dtype, out=e.compute)
        e.metadata = None
        if e.release_outputs:  # nothing computes with them: freed now, not at reshard
            for out in outputs:
                out.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor, nbytes: int) -> None:
    """Gives a freed storage (resharded) its bytes back."""
    s = t.untyped_storage()
    if s.nbytes() == 0 and nbytes:
        s.resize_(nbytes)
