"""Parameter records: one per distinct parameter of a model (its unit, places, aliases, sharding
and policies), how they are collected, and how their dtypes and shapes look to the engine."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from . import _C
from ._engine_dtypes import engine_dtype
from ._extensions import check_local_shard, is_extension
from .no_shard import is_no_shard
from ._tensor_parallel import TPSpec

__all__ = ["FoundParam", "ParamRecord", "as_dtype", "engine_dtype", "find_params", "into_engine", "local_shape", "make_records",
           "rows_of"]


def into_engine(t: torch.Tensor) -> torch.Tensor:
    """`t` as the engine takes it: contiguous, in the engine's element type."""
    t = t.contiguous()
    return t if t.dtype in _C.DTYPE_CODES else t.view(engine_dtype(t.dtype))


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.view(dtype)


@dataclasses.dataclass(eq=False)
class ParamRecord:
    index: int
    name: str                       # first registered name, relative to the wrapped module
    param: nn.Parameter             # the compute parameter (the module's own object)
    shape: torch.Size
    unit: int                       # FSDP unit index, -1 outside every unit (or shared across units)
    places: list                    # [(module, attribute)] where the parameter is registered
    replicated: bool = False        # fsdp_no_shard or 0-d: one full copy per rank
    bucket: int = -1
    item: int = -1
    local: tuple = (0, 0)           # (first element, count) of this rank's rows of the parameter
    dist_param: Optional[nn.Parameter] = None
    grad_dtensor: Optional[DTensor] = None
    origin: Optional[nn.Parameter] = None  # the Parameter object the user saw (meta init replaces it)
    aliases: list = dataclasses.field(default_factory=list)  # every qualified name it is registered under
    trains_later: bool = False      # frozen at sharding but expected to train: its main weights are planned wide
    shard_dim: int = 0              # torch's Shard(shard_dim) when sharded ([Note: chunked layout])
    tp: Optional[TPSpec] = None     # tensor parallel: `shape` is this rank's TP shard ([Note: tensor parallelism])
    extension: bool = False         # its local shard has FSDP2's all-gather extensions ([Note: extension parameters]
                                    # in _extensions.py): its bucket is never gathered

    def __post_init__(self):
        self.origin = self.param

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad


@dataclasses.dataclass(frozen=True)
class FoundParam:
    """A distinct parameter of a model, as the Megatron-style API's walk finds it: what its
    ParamRecord is made from (make_records)."""
    param: nn.Parameter
    name: str         # first registered name, relative to the wrapped module
    unit: int         # FSDP unit index, -1 outside every unit (or shared across units)
    places: tuple     # ((module, attribute), ...) where it is registered
    aliases: tuple    # every qualified name it is registered under
    replicated: bool  # fsdp_no_shard marked a place of it, or it is 0-d


def find_params(root: nn.Module, units: List[nn.Module]) -> List[FoundParam]:
    """Every distinct parameter of `root` in registration order, with its unit.

    A parameter registered under modules of two different units (or of a unit and the rest of
    the model), e.g. tied embeddings, belongs to no unit: it stays gathered for the whole pass.
    A parameter is replicated if fsdp_no_shard marked any place it is registered, or if it is
    0-d (a scalar has no rows to shard).
    """
    unit_of_module: Dict[int, int] = {}
    for u, module in enumerate(units):
        for sub in module.modules():
            unit_of_module.setdefault(id(sub), u)
    found: Dict[int, dict] = {}  # id(param) -> its facts so far, in registration order
    seen_places = set()
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None or (id(mod), attr) in seen_places:
                continue
            seen_places.add((id(mod), attr))
            unit = unit_of_module.get(id(mod), -1)
            qualified = f"{mod_name}.{attr}" if mod_name else attr
            f = found.get(id(p))
            if f is None:
                _check_plain(p, qualified)
                f = found[id(p)] = dict(param=p, name=qualified, unit=unit, places=[], aliases=[], replicated=False)
            elif f["unit"] != unit:
                f["unit"] = -1
            f["places"].append((mod, attr))
            f["aliases"].append(qualified)
            f["replicated"] = f["replicated"] or is_no_shard(mod, attr) or p.dim() == 0
    return [FoundParam(f["param"], f["name"], f["unit"], tuple(f["places"]), tuple(f["aliases"]), f["replicated"])
            for f in found.values()]


def make_records(found: List[FoundParam], trains_later=(), tp_of: Optional[Callable] = None,
                 replicate_extensions: bool = False) -> List[ParamRecord]:
    """The Megatron-style API's records of `found`, indexed from 0, each whole when made: those in
    `trains_later` (frozen parameters expected to train) marked so; `tp_of(param, what)` gives a
    parameter's TPSpec or None ([Note: tensor parallelism] in _tensor_parallel.py: `shape` is then
    the local TP shard's); extension parameters replicated under no_shard when
    `replicate_extensions` ([Note: extension parameters under MegatronFSDP] in
    _megatron_extensions.py)."""
    later = {id(p) for p in trains_later}
    records = []
    for f in found:
        p = f.param
        extension = not isinstance(p, DTensor) and is_extension(p.data)
        tp = tp_of(p, f"parameter '{f.name}'") if tp_of is not None else None
        records.append(ParamRecord(
            len(records), f.name, p, p.shape if tp is None else tp.local_shape, f.unit, list(f.places),
            replicated=f.replicated or (extension and replicate_extensions), aliases=list(f.aliases),
            trains_later=id(p) in later, tp=tp, extension=extension))
    return records


def _check_plain(p: nn.Parameter, name: str) -> None:
    """The Megatron-style API takes plain parameters and tensor subclasses with FSDP2's all-gather
    extensions ([Note: extension parameters] in _extensions.py); any other subclass is refused."""
    what = f"parameter '{name}'"
    data = p._local_tensor if isinstance(p, DTensor) else p.data  # a TP DTensor: its local shard
    check_local_shard(data, what)


def row_size(shape: torch.Size) -> int:
    if len(shape) < 2 or shape[0] == 0:
        return 1
    return max(1, math.prod(shape[1:]))


def rows_of(r: ParamRecord) -> tuple:
    """(row, outer) of `r` for the planner: a row is the elements of one index of the sharded dim,
    outer the blocks before it ([Note: chunked layout] in csrc/core/mfsdp_layout.h)."""
    d = r.shard_dim
    if d == 0 or r.replicated or math.prod(r.shape) == 0:
        return row_size(r.shape), 1
    return math.prod(r.shape[d + 1:]), math.prod(r.shape[:d])


def local_shape(shape: torch.Size, dim: int, world: int, rank: int) -> tuple:
    """The shape of rank `rank`'s Shard(dim) local tensor of a parameter of `shape` over `world`
    ranks: torch.chunk's piece, so the last ranks may hold fewer rows, or none."""
    if not shape:
        return ()
    rows = shape[dim]
    chunk = -(-rows // world)
    lo = min(rank * chunk, rows)
    return (*shape[:dim], min(lo + chunk, rows) - lo, *shape[dim + 1:])
