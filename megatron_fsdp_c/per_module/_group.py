"""A group of the per-module API: the parameters one fully_shard call takes over (see [Note:
per-module groups] in _fully_shard.py) and their conversion to DTensor parameters, on the
DistContext of their mesh (_mesh.py)."""
from __future__ import annotations

import dataclasses
import weakref
from typing import List, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._common import ShardingStrategy, contiguous_stride
from .._distributed import DistContext
from .._extensions import check_local_shard, is_extension
from .._param_buffer import local_shape
from ..no_shard import is_no_shard
from ._mesh import mesh_and_context
from ._policy import check_offload, check_param_dtype, param_policy, sharded_dtype
from .._tensor_parallel import TPSpec, dtensor_tp_spec, spmd_layout

__all__ = ["Origin", "ShardGroup", "check_extension_use", "check_origins", "form_group", "group_of", "refresh_places"]

@dataclasses.dataclass(eq=False)
class ShardGroup:
    """One fully_shard call (see [Note: per-module groups] in _fully_shard.py)."""
    modules: List[nn.Module]
    places: List[tuple]            # (module, attribute, original parameter) of the group's parameters
    ctx: DistContext
    strategy: ShardingStrategy
    mp_policy: object              # torch's MixedPrecisionPolicy or ours
    reshard_after_forward: Optional[bool]  # None: FSDP2's default, set at the lazy init (False for the root)
    reshard_after_backward: bool = True
    hold: bool = False             # gradients held, not reduced: set_requires_gradient_sync(False)
    outer_hold: bool = False       # HSDP: no all-reduce across replicas: set_requires_all_reduce(False)
    forward_prefetch: Optional[List[nn.Module]] = None
    backward_prefetch: Optional[List[nn.Module]] = None
    divide_factor: Optional[float] = None
    is_last_backward: bool = True
    owner: Optional[object] = None  # its RootState (_root.py, which imports this module), from the lazy init on
    unit_state: Optional[object] = None    # its UnitState in the engine's hooks (_hooks.py)
    all_reduce_hook: Optional[object] = None  # set_all_reduce_hook's (hook, stream)
    post_optim_event: Optional[object] = None  # set_post_optim_event's, waited on at the next root pre-forward
    keep_unsharded_storage: bool = False   # set_keep_unsharded_storage ([Note: kept full weights] in csrc/comm/weights.c)
    manual_backward_finalization: bool = False  # set_manual_backward_finalization, on the root's group
    pending_reduction: Optional[object] = None  # the root's finalize_backward(async_op=True) handle not waited on
    unshard_in_backward: bool = True       # accepted settings with no effect here ([Note: torch's FSDPModule])
    force_sum_reduction: bool = False
    torch_state: Optional[object] = None   # what torch's code finds under its state key (_torch_state.py)
    tp_specs: List[Optional[TPSpec]] = dataclasses.field(default_factory=list)  # per place: a TP parameter's
                                           # spec ([Note: tensor parallelism] in ../_tensor_parallel.py), or None
    quant_policy: Optional[object] = None  # its QuantizedCommPolicy (fully_shard's quantized_comm_policy)
    offload_policy: Optional[object] = None  # torch's OffloadPolicy or CPUOffloadPolicy ([Note: CPU offload] in _policy.py)
    # (id(module), attribute) -> (SPMD mesh, placements) of a parameter that came as a DTensor with
    # dp_mesh_dims ([Note: SPMD compute parameters] in _root.py)
    spmd_specs: dict = dataclasses.field(default_factory=dict)
    # (id(module), attribute) -> the dtype a parameter computes in, where its sharded DTensor has
    # another (the main weights' under megatron_fsdp_c's policy, [Note: main-weight parameters] in _policy.py)
    compute_dtypes: dict = dataclasses.field(default_factory=dict)
    # (id(module), attribute) -> the policy of a parameter where torch 2.15's param_dtype_override_fn
    # resolved one of its own (_policy.param_policy); the others take mp_policy
    param_policies: dict = dataclasses.field(default_factory=dict)
    parent: Optional["ShardGroup"] = None  # the group of the closest sharded module above (set by its fully_shard)


class Origin:
    """The plain parameter a group's DTensor parameter was made from, shared by every DTensor made
    of it; `owner` is a weak reference to the root state whose engine holds it."""
    __slots__ = ("owner",)

    def __init__(self):
        self.owner = None

    def __reduce__(self):
        # a copy (deepcopy, pickle) of a parameter is a parameter of its own: a fresh Origin
        return (Origin, ())


def check_origins(named: list, owner) -> None:
    """[(name, DTensor parameter)] of one root's groups at its lazy init: a parameter tied across
    two groups (two DTensors of one Origin, or one already held by another root's engine) is
    refused with FSDP2's error, which it raises at the same point; then claims the rest for
    `owner`."""
    seen = {}
    for name, dp in named:
        origin = getattr(dp, "_mfsdp_origin", None)
        if origin is None:
            continue
        first = seen.setdefault(origin, dp)
        other = origin.owner() if origin.owner is not None else None
        if first is not dp or (other is not None and other is not owner):
            raise ValueError(
                f"Parameter '{name}' is shared with a parameter already managed by another FSDP group. For "
                "shared/tied parameters, use fully_shard([module_a, module_b]) to place them in the same FSDP group "
                "(or shard a module containing every place it is registered, their common parent, and not the "
                "places themselves), or untie them")
    ref = weakref.ref(owner)
    for origin in seen:
        origin.owner = ref


def refresh_places(g: ShardGroup) -> None:
    """FSDP2's reset_sharded_param, at the lazy init: a parameter replaced on its module since
    fully_shard (load_state_dict(assign=True), an assignment, to_empty() or .to() on a part of
    the model) is the group's from now on. A DTensor must be placed as the one it replaces (same
    shape, mesh and placements); a plain tensor of the full shape is sharded as fully_shard does."""
    # A parameter tied across places stays one parameter: the first place's decides, as FSDP2
    # reads its primary place (load_state_dict(assign=True) assigns each key a parameter of its own).
    olds = [dp for _, _, dp in g.places]  # alive through the loop: the ids below stay theirs
    adopted = {}  # id(the group's parameter) -> what replaces it
    for i, (mod, attr, dp) in enumerate(g.places):
        new = adopted.get(id(dp))
        if new is None:
            cur = mod._parameters.get(attr)
            tp = g.tp_specs[i] if i < len(g.tp_specs) else None
            new = adopted[id(dp)] = dp if cur is dp else _adopt(cur, dp, g, mod, attr, tp)
        if mod._parameters.get(attr) is not new:
            mod._parameters[attr] = new
        g.places[i] = (mod, attr, new)
    del olds


def _adopt(cur, old: nn.Parameter, g: ShardGroup, mod: nn.Module, attr: str, tp) -> nn.Parameter:
    where = f"'{attr}' of {type(mod).__name__}"
    if not isinstance(cur, torch.Tensor):
        raise ValueError(f"parameter {where} was removed after fully_shard: a sharded module's parameters must stay "
                         "registered (assign a new nn.Parameter of the same shape instead)")
    if tuple(cur.shape) != tuple(old.shape):
        raise ValueError(f"parameter {where} was replaced after fully_shard by one of shape {tuple(cur.shape)}; "
                         f"the group sharded shape {tuple(old.shape)}: a replacement must have the same shape")
    if isinstance(cur, DTensor):
        if cur.device_mesh != old.device_mesh or tuple(cur.placements) != tuple(old.placements):
            raise ValueError(
                f"parameter {where} was replaced after fully_shard by a DTensor on mesh {cur.device_mesh} with "
                f"placements {tuple(cur.placements)}; the group shards it as {tuple(old.placements)} on "
                f"{old.device_mesh}: distribute it like the parameter it replaces (distribute_tensor(full, "
                "p.device_mesh, p.placements))")
        return cur if isinstance(cur, nn.Parameter) else nn.Parameter(cur, requires_grad=cur.requires_grad)
    if tp is not None:
        raise ValueError(f"the tensor-parallel parameter {where} was replaced after fully_shard by a plain tensor: "
                         "assign a DTensor distributed like the parameter it replaces (distribute_tensor(full, "
                         "p.device_mesh, p.placements))")
    placement = old.placements[g.ctx.mesh.ndim - 1]  # the data-parallel shard dim's
    dtype = sharded_dtype(g.mp_policy, cur.dtype)  # [Note: main-weight parameters] in _policy.py
    if dtype != cur.dtype:
        g.compute_dtypes[(id(mod), attr)] = cur.dtype
    return _to_dtensor(cur, g.ctx, None if isinstance(placement, Replicate) else placement.dim, g.ctx.device,
                       dtype=dtype)


def _plain(p: nn.Parameter, spmd_mesh: Optional[DeviceMesh]):
    """A DTensor parameter replicated over the SPMD mesh of dp_mesh_dims (all dims, or a size-1
    model-parallel one) as the plain tensor it holds, and its (mesh, placements) (its compute
    parameter is a DTensor again, see [Note: SPMD compute parameters] in _root.py); any other
    parameter as it is, with None."""
    if spmd_mesh is None or not isinstance(p, DTensor):
        return p, None
    sizes = p.device_mesh.mesh.shape
    if any(not isinstance(pl, Replicate) and sizes[i] > 1 for i, pl in enumerate(p.placements)):
        raise ValueError(f"a DTensor parameter with placements {p.placements} on mesh {p.device_mesh.mesh_dim_names}: "
                         "with dp_mesh_dims, parameters must be Replicate() on every dim of size > 1")
    return nn.Parameter(p.to_local(), requires_grad=p.requires_grad), (p.device_mesh, tuple(p.placements))


def _group_params(modules, ignored, children: list) -> List[tuple]:
    """(module, attr, param) of every parameter of `modules` not in a submodule's group; the
    groups of the sharded submodules met on the way are added to `children`."""
    places, seen_places = [], set()
    stack = list(modules)
    visited = set()
    while stack:
        mod = stack.pop(0)
        if id(mod) in visited:
            continue
        visited.add(id(mod))
        sub = getattr(mod, "_mfsdp_group", None)
        if sub is not None and mod not in modules:
            if sub not in children:
                children.append(sub)
            continue  # a sharded submodule: its parameters are its group's
        for attr, p in mod._parameters.items():
            if p is None or (id(mod), attr) in seen_places or p in ignored:
                continue
            seen_places.add((id(mod), attr))
            places.append((mod, attr, p))
        stack.extend(mod.children())
    return places


def _to_dtensor(p: nn.Parameter, ctx: DistContext, dim: Optional[int], device: torch.device,
                tp: Optional[TPSpec] = None, what: str = "", dtype: Optional[torch.dtype] = None) -> nn.Parameter:
    """This rank's torch.chunk piece of `p` along `dim` (None: all of it, replicated) as a DTensor
    Parameter, its local tensor contiguous as FSDP2's is; of its TP shard for a TP parameter, on the
    (data-parallel..., tp) mesh ([Note: tensor parallelism]); cast to `dtype` if given ([Note:
    main-weight parameters] in _policy.py)."""
    data = (p._local_tensor if tp is not None else p).detach()
    shape = data.shape
    if not data.is_meta and data.device != device:
        data = data.to(device)
    if dim is None:
        placement, local = Replicate(), data
    else:
        placement = Shard(dim)
        lshape = local_shape(shape, dim, ctx.world, ctx.rank)
        lo = min(ctx.rank * -(-shape[dim] // ctx.world), shape[dim])
        local = torch.empty(lshape, dtype=data.dtype, device="meta") if data.is_meta \
            else data.narrow(dim, lo, lshape[dim]).clone(memory_format=torch.contiguous_format)
    if dtype is not None and dtype != local.dtype:
        local = torch.empty(local.shape, dtype=dtype, device="meta") if local.is_meta else local.to(dtype)
    mesh, placements = ctx.mesh, ctx.placements(placement)
    if tp is not None:
        mesh, placements = spmd_layout(tp, mesh, placements, what)
        shape = tp.shape
    dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=contiguous_stride(shape))
    out = nn.Parameter(dt, requires_grad=p.requires_grad)
    # torch 2.15: a gradient dtype override kept, as FSDP2 keeps it ([Note: reduce dtype by torch version] in _policy.py)
    if getattr(p, "_has_grad_dtype_override", False):
        out.grad_dtype = p.grad_dtype
    return out


def _shard_dim(p: nn.Parameter, placement, what: str, world: int, sharded: bool) -> int:
    """The dim shard_placement_fn chose for `p` (None: 0), checked as FSDP2 checks it: Shard(-1) is
    the last dim, a dim past the last is an AssertionError, and a dim other than 0 must split
    evenly over the shard group (NotImplementedError), with torch's messages."""
    if placement is None:
        return 0
    if not isinstance(placement, Shard) or type(placement) is not Shard:
        raise ValueError(f"shard_placement_fn returned {placement!r} for {what}: megatron_fsdp_c takes None or "
                         "Shard(dim) (a per-parameter mesh, ShardPlacementResult, or a Shard subclass is not "
                         "supported)")
    dim = placement.dim + p.ndim if placement.dim < 0 else placement.dim
    if p.ndim == 0:
        return 0  # a 0-d parameter is replicated (no dim to shard)
    if not 0 <= dim < p.ndim:  # (FSDP2 lets a dim still negative once normalised through; we refuse it too)
        raise AssertionError(f"Shard dim {dim} is invalid for {p.ndim}D tensor: {p.shape}")
    if sharded and dim > 0 and p.shape[dim] % world != 0:
        raise NotImplementedError(f"FSDP does not support uneven sharding on dim {dim}: {p.shape} (world size: "
                                  f"{world})")
    return dim


def check_extension_use(what: str, ctx: DistContext, tp, spmd: bool, dim, quant) -> None:
    """The settings an extension parameter ([Note: extension parameters] in ../_extensions.py) is
    not supported with yet, refused at fully_shard (or at the lazy init, for extensions set on a
    local shard after fully_shard) with the way out."""
    why = ("tensor parallelism" if tp is not None else
           "dp_mesh_dims" if spmd else
           "a 2-D (HSDP) mesh without dim names" if ctx.mesh.ndim > 1 and not ctx.mesh.mesh_dim_names else
           "Shard(dim) with dim != 0 (shard_placement_fn)" if dim not in (0, None) else
           "quantized_comm_policy (the subclass decides what its gather carries)" if quant is not None else None)
    if why is not None:
        raise NotImplementedError(f"{what} defines FSDP2's all-gather extensions (fsdp_pre_all_gather / "
                                  f"fsdp_post_all_gather), which megatron_fsdp_c does not support with {why} yet: "
                                  "shard it with FSDP2's defaults on a 1-D mesh, or use plain parameters")


def form_group(modules: List[nn.Module], mesh: Optional[DeviceMesh], strategy: ShardingStrategy, mp_policy,
               reshard_after_forward: Optional[bool], ignored: set, shard_placement_fn,
               spmd_mesh: Optional[DeviceMesh] = None, quant_policy=None, offload_policy=None) -> ShardGroup:
    """One fully_shard call's group: its parameters become DTensor Parameters on the modules, and
    each module points at the group (`_mfsdp_group`). The arguments are checked already; `mesh` is
    the data-parallel mesh (dp_mesh_of's, when `spmd_mesh` carried dp_mesh_dims). Every parameter
    is checked before any is converted, so a refusal leaves the modules as they were."""
    plain = {}  # a DTensor parameter tied within the group stays tied as a plain one
    children = []
    places = [(mod, attr, plain.setdefault(id(p), _plain(p, spmd_mesh)))
              for mod, attr, p in _group_params(modules, ignored, children)]
    # by place, not on the parameter: .to_empty() before the first forward replaces it (_module.py's _apply)
    spmd_specs = {(id(mod), attr): spec for mod, attr, (_, spec) in places if spec is not None}
    places = [(mod, attr, p) for mod, attr, (p, _) in places]
    devices = {p.device.type for _, _, p in places if not p.is_meta}
    if len(devices) > 1:
        raise ValueError(f"the parameters of this {type(modules[0]).__name__} are on several device types "
                         f"{sorted(devices)}: move it to one device first")
    if devices:
        device_type = devices.pop()
    elif isinstance(mesh, DeviceMesh):
        device_type = mesh.device_type  # a meta-device module: it will live where the mesh is
    else:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_offload(offload_policy, torch.device(device_type), f"this {type(modules[0]).__name__}")
    ctx = mesh_and_context(mesh, device_type)

    # Each DTensor made here carries the Origin of the parameter it came from: a parameter registered
    # in two groups (tied weights split across fully_shard calls) becomes two DTensors with one
    # Origin, refused at the lazy init as FSDP2 refuses it (check_origins).
    dims = {}   # id(original) -> its shard dim, None when replicated (a parameter tied within the group once)
    policies = {}  # id(original) -> its policy (torch 2.15's param_dtype_override_fn, or mp_policy)
    tp_of = {}  # id(original) -> its TPSpec (a DTensor parameter from parallelize_module), or None
    for mod, attr, p in places:
        what = f"parameter '{attr}' of {type(mod).__name__}"
        if id(p) not in tp_of:
            tp_of[id(p)] = dtensor_tp_spec(p, what, ctx.mesh) if isinstance(p, DTensor) else None
        check_local_shard(p._local_tensor if tp_of[id(p)] is not None else p, what, extensions_later=True)
        if id(p) not in policies:
            policies[id(p)] = param_policy(mp_policy, p)
        check_param_dtype(p, what, policies[id(p)])
        if id(p) not in dims:
            replicated = strategy == ShardingStrategy.NO_SHARD or p.dim() == 0 or is_no_shard(mod, attr)
            placement = shard_placement_fn(p) if shard_placement_fn is not None else None
            # a TP parameter's local TP shard is what is sharded, on any dim (FSDP2 checks it so too)
            dim = _shard_dim(p._local_tensor if tp_of[id(p)] is not None else p, placement, what, ctx.world,
                             not replicated)
            dims[id(p)] = None if replicated else dim
            if is_extension(p.data if isinstance(p, nn.Parameter) else p):
                check_extension_use(what, ctx, tp_of[id(p)], (id(mod), attr) in spmd_specs, dims[id(p)],
                                    quant_policy)
    converted = {}  # id(original) -> DTensor Parameter
    compute_dtypes = {}  # [Note: main-weight parameters] in _policy.py
    for mod, attr, p in places:
        dtype = sharded_dtype(mp_policy, p.dtype)
        if dtype != p.dtype:
            compute_dtypes[(id(mod), attr)] = p.dtype
        if id(p) not in converted:
            dt = converted[id(p)] = _to_dtensor(p, ctx, dims[id(p)], ctx.device, tp_of[id(p)],
                                                f"parameter '{attr}' of {type(mod).__name__}", dtype)
            origin = getattr(p, "_mfsdp_origin", None)  # an attribute, not a dict: tensors compare by value
            if origin is None:
                origin = p._mfsdp_origin = Origin()
            dt._mfsdp_origin = origin
        mod._parameters[attr] = converted[id(p)]
    group = ShardGroup(modules, [(mod, attr, converted[id(p)]) for mod, attr, p in places], ctx, strategy,
                       mp_policy, reshard_after_forward, tp_specs=[tp_of[id(p)] for _, _, p in places],
                       spmd_specs=spmd_specs, compute_dtypes=compute_dtypes, quant_policy=quant_policy,
                       offload_policy=offload_policy, param_policies={(id(mod), attr): policies[id(p)] for mod, attr, p in places
                                       if policies[id(p)] is not mp_policy})
    for m in modules:
        m._mfsdp_group = group
    for child in children:
        if child.parent is None:
            child.parent = group
    return group


def group_of(module) -> ShardGroup:
    """The group `module` was sharded into (a clear error when it was not)."""
    g = getattr(module, "_mfsdp_group", None)
    if g is None:
        raise ValueError(f"{type(module).__name__} is not sharded by megatron_fsdp_c.per_module.fully_shard")
    return g

