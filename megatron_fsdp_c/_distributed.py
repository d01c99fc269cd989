"""Process groups, device mesh and transport for one wrapped model."""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from . import _C

__all__ = ["DistContext", "check_rank_partition", "make_dist_context", "resolve_device"]


@dataclasses.dataclass
class DistContext:
    group: object          # the ProcessGroup the shards span (also used for reductions)
    gather_group: object   # a second group over the same ranks, for all-gathers
    mesh: DeviceMesh       # the DTensor mesh: 1-D over `group`; (outer, shard) for HSDP; the flattened
                           # (outer, shard) mesh for HFSDP
    rank: int
    world: int
    device: torch.device
    transport: object      # _C.TorchTransport (or _C.NcclTransport)
    # Hybrid sharding (HSDP): replicas of the shards, across which gradients are all-reduced.
    outer_group: object = None
    outer_world: int = 1
    outer_transport: object = None
    dp_group: object = None  # every data-parallel rank (shards x replicas); None: `group`
    # HFSDP: sharded parameters split over every data-parallel rank, rank (o, i) holding piece
    # o * world + i ([Note: optimizer sharded across replicas] in csrc/comm/replicas.c).
    outer_sharded: bool = False

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks in all: gradients are averaged over this many."""
        return self.world * self.outer_world

    @property
    def all_dp_group(self):
        return self.dp_group if self.dp_group is not None else self.group

    @property
    def pieces(self) -> int:
        """Ranks a sharded parameter's rows are split over (torch.chunk)."""
        return self.world * self.outer_world if self.outer_sharded else self.world

    @property
    def piece_rank(self) -> int:
        """Which of those pieces this rank holds."""
        return self.mesh.get_local_rank() if self.outer_sharded else self.rank

    def placements(self, inner):
        """DTensor placements of a parameter placed `inner` over the shards."""
        return [Replicate(), inner] if self.mesh.ndim == 2 else [inner]

    def close(self) -> None:
        """Collective (every rank, at the same point): ends the native NCCL transport's
        communicators. The torch transport borrows the process groups: nothing to end."""
        for t in (self.transport, self.outer_transport):
            close = getattr(t, "close", None)
            if close is not None:
                close()


def _require_initialized():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group(backend=...) "
            "first (launch with `torchrun --nproc_per_node N script.py`, backend 'gloo' on CPU, 'nccl' on GPU)"
        )


def resolve_device(device) -> Optional[torch.device]:
    """torch.device("cuda") without an index means whichever GPU is current when it is used:
    resolved once here, to the current one, so that each rank's buffers, streams and
    communicators stay on its own GPU (unresolved, every rank's NCCL set-up went to GPU 0)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def group_timeout(group, device: torch.device) -> datetime.timedelta:
    """The timeout the process group's own collectives have (init_process_group/new_group)."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))


def use_native_nccl(transport: str, device: torch.device) -> bool:
    """transport="auto" picks the torch transport (torch's NCCL backend on GPUs) until a GPU
    session has measured the native NCCL transport passing (benchmarks/gpu_check.sh); that
    session flips this and records the evidence in docs/setup.md."""
    return transport == "nccl"


def resolve_group(device_mesh, dp_shard_dim: Optional[str], device: torch.device):
    """(process_group, mesh) from None, a 1-D DeviceMesh, a named dim of an N-D mesh, or a ProcessGroup."""
    _require_initialized()
    if device_mesh is None:
        group = dist.group.WORLD
        return group, DeviceMesh.from_group(group, device.type)
    if isinstance(device_mesh, DeviceMesh):
        if device_mesh.ndim > 1:
            if dp_shard_dim is None:
                raise ValueError(
                    f"device_mesh has {device_mesh.ndim} dims {device_mesh.mesh_dim_names}: pass dp_shard_dim= the "
                    "name of the data-parallel dim"
                )
            device_mesh = device_mesh[dp_shard_dim]
        elif dp_shard_dim is not None and device_mesh.mesh_dim_names and dp_shard_dim not in device_mesh.mesh_dim_names:
            raise ValueError(f"dp_shard_dim={dp_shard_dim!r} is not a dim of the mesh {device_mesh.mesh_dim_names}")
        if device_mesh.device_type != device.type:
            raise ValueError(
                f"device_mesh is on '{device_mesh.device_type}' but the parameters are on '{device.type}'"
            )
        return device_mesh.get_group(), device_mesh
    if isinstance(device_mesh, dist.ProcessGroup):
        return device_mesh, DeviceMesh.from_group(device_mesh, device.type)
    raise TypeError(
        f"device_mesh must be None, a torch DeviceMesh or a ProcessGroup, got {type(device_mesh).__name__}"
    )


def _hybrid_groups(device_mesh, dp_shard_dim, dp_outer_dim, hybrid_fsdp_group, device: torch.device):
    """(shard group, outer group, 2-D (outer, shard) mesh, all-ranks group) of hybrid sharding,
    with Megatron-FSDP's checks. Dims are names, or indices of an unnamed 2-D mesh."""
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"hybrid sharding (dp_outer_dim={dp_outer_dim!r}) needs device_mesh to be a DeviceMesh, got "
                        f"{type(device_mesh).__name__}")
    names = device_mesh.mesh_dim_names or ()
    for role, dim in (("dp_shard_dim", dp_shard_dim), ("dp_outer_dim", dp_outer_dim)):
        if not (dim in names or (isinstance(dim, int) and 0 <= dim < device_mesh.ndim)):
            raise ValueError(f"{role}={dim!r} is not a dim of the device mesh (its dims: {names or device_mesh.ndim})")
    if dp_shard_dim == dp_outer_dim:
        raise ValueError(f"dp_shard_dim and dp_outer_dim are the same dim {dp_shard_dim!r}")
    if device_mesh.device_type != device.type:
        raise ValueError(f"device_mesh is on '{device_mesh.device_type}' but the parameters are on '{device.type}': "
                         "build the mesh for the parameters' device type (or move the model)")
    if isinstance(dp_shard_dim, int):
        if device_mesh.ndim != 2:
            raise ValueError("dims by index need a 2-D mesh (outer, shard); name the dims of a larger mesh")
        mesh2d = device_mesh
        shard_group, outer_group = device_mesh.get_group(dp_shard_dim), device_mesh.get_group(dp_outer_dim)
    else:
        mesh2d = device_mesh[(dp_outer_dim, dp_shard_dim)]
        shard_group, outer_group = device_mesh[dp_shard_dim].get_group(), device_mesh[dp_outer_dim].get_group()
    inner, outer = dist.get_world_size(shard_group), dist.get_world_size(outer_group)
    if hybrid_fsdp_group is None:  # the per-module API: a group over the mesh's ranks
        ranks = sorted(mesh2d.mesh.flatten().tolist())
        # made by its members only: under tensor parallelism each tp coordinate has its own
        # (replicate, shard) mesh, so the ranks differ between callers
        hybrid_fsdp_group = dist.group.WORLD if ranks == list(range(dist.get_world_size())) else \
            own_group("data-parallel", ranks)
    if hybrid_fsdp_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this rank is not a member of hybrid_fsdp_group: pass a group over all data-parallel "
                         "ranks of the mesh, this one included")
    if not isinstance(hybrid_fsdp_group, dist.ProcessGroup):
        raise TypeError(f"hybrid_fsdp_group must be a ProcessGroup, got {type(hybrid_fsdp_group).__name__}")
    total = dist.get_world_size(hybrid_fsdp_group)
    if inner * outer != total:
        raise ValueError(f"the mesh's dims do not multiply to the data-parallel size: {dp_outer_dim!r} ({outer}) x "
                         f"{dp_shard_dim!r} ({inner}) = {inner * outer}, but hybrid_fsdp_group has {total} ranks")
    return shard_group, outer_group, mesh2d, hybrid_fsdp_group


# [Note: the engine's own groups]
# The engine makes process groups of its own (a second communicator so that all-gathers never
# wait behind reductions, one across replicas, one over a sub-mesh's ranks). Each gloo group runs
# a TCP loop thread that wakes every 10 ms even when idle, and NCCL communicators hold device
# memory: a process that builds many models (a sweep, an evaluation that reloads, a test suite)
# must not pay one more per model. So they are made once per (role, ranks, backend, timeout)
# under the current default group and shared by every model over those ranks. Sharing is safe
# for the same reason sharing the default group is: every rank issues its collectives on a
# group in one program order ([Note: collective order] holds per group, not per model).
_OWN_GROUPS = {}  # (default group id, role, ranks, backend, timeout) -> (default group, group)


def own_group(role: str, ranks, backend=None, timeout=None):
    """The library's process group for `role` over `ranks` (see [Note: the engine's own groups])."""
    default = dist.distributed_c10d._get_default_group()
    key = (id(default), role, tuple(ranks), backend, timeout)
    hit = _OWN_GROUPS.get(key)
    if hit is None or hit[1] not in dist.distributed_c10d._world.pg_map:  # made, or destroyed since
        extra = {"timeout": timeout} if timeout is not None else {}
        group = dist.new_group(ranks=list(ranks), use_local_synchronization=True, backend=backend, **extra)
        hit = _OWN_GROUPS[key] = (default, group)  # the default group kept alive: its id stays unique
    return hit[1]


def _flat_mesh(mesh2d: DeviceMesh, dp_group) -> DeviceMesh:
    """HFSDP's DTensor mesh: the (outer, shard) mesh flattened outer-major, over dp_group, so that
    rank (o, i) is its rank o * shards + i. The engine's collectives assume that order."""
    order = mesh2d.mesh.flatten().tolist()
    if order != dist.get_process_group_ranks(dp_group) or order != sorted(order):
        raise ValueError(
            f"outer_dp_sharding_strategy='optim' needs the (dp_outer, dp_shard) mesh to number its ranks in order, "
            f"outer-major, as hybrid_fsdp_group does: the mesh holds {order}, the group "
            f"{dist.get_process_group_ranks(dp_group)}. Build the mesh with init_device_mesh(device_type, "
            "(outer, shard), mesh_dim_names=(...)) over the group's ranks")
    return DeviceMesh.from_group(dp_group, mesh2d.device_type)


def _reduces_in_place_wrongly(group) -> bool:
    """torch's threaded test group (FSDPTestMultiThread's backend "threaded") cannot reduce-scatter
    into an output inside its input (see alias_safe_reduce_scatter in csrc/python/torch_transport.c)."""
    return dist.get_backend(group) == "threaded"


def make_dist_context(device_mesh, dp_shard_dim, device: torch.device, transport: str = "auto",
                      collective_timeout: Optional[float] = None, *, dp_outer_dim=None,
                      hybrid_fsdp_group=None, outer_sharded: bool = False, with_tp: bool = False,
                      private: str = "") -> DistContext:
    """The groups and transports of one sharded model, complete. With dp_outer_dim, hybrid
    sharding: the shards span dp_shard_dim, their replicas dp_outer_dim ([Note: hybrid sharding]
    in csrc/comm/replicas.c); outer_sharded (HFSDP) splits sharded parameters over the replicas
    too. `with_tp`: device_mesh has a tensor-parallel dim, so HFSDP's flattened DTensor mesh is
    sliced from device_mesh (not made from the group) to compose with it ([Note: tensor
    parallelism] in _tensor_parallel.py).
    `private`: a name for an engine that must share no communicator with another engine of the
    same model, also over the same ranks: its reductions get an own group too, and its own groups
    are keyed by that name (the experts' engine, [Note: expert data-parallel mesh] in _megatron_experts.py)."""
    hybrid = dp_outer_dim is not None
    if hybrid:
        _require_initialized()
        group, outer_group, mesh, dp_group = _hybrid_groups(device_mesh, dp_shard_dim, dp_outer_dim,
                                                            hybrid_fsdp_group, device)
    else:
        group, mesh = resolve_group(device_mesh, dp_shard_dim, device)
        outer_group = dp_group = None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the data-parallel group passed as device_mesh")
    if transport not in ("auto", "torch", "nccl"):
        raise ValueError(f"transport must be 'auto', 'torch' or 'nccl', not {transport!r}")
    if transport == "nccl" and device.type != "cuda":
        raise ValueError("transport='nccl' needs CUDA parameters; CPU training uses transport='torch' (gloo)")
    if device.type == "cuda" and device.index is None:
        raise ValueError("make_dist_context: a CUDA device needs its index (see resolve_device)")
    use_nccl = use_native_nccl(transport, device)
    timeout = None if collective_timeout is None else datetime.timedelta(seconds=float(collective_timeout))
    # On CUDA the torch transport's Work.wait() takes no timeout (it would block the host until
    # each collective ends): a collective_timeout goes to the engine's own process groups.
    cuda_timeout = timeout if device.type == "cuda" and not use_nccl else None
    gather_group, reduce_group = group, group
    if world > 1 and not use_nccl:
        # A second communicator over the same ranks: all-gathers never wait behind reductions.
        ranks = dist.get_process_group_ranks(group)
        gather_group = own_group(private + "gather", ranks, dist.get_backend(group), cuda_timeout)
        if cuda_timeout is not None or private:
            reduce_group = own_group(private + "reduce", ranks, dist.get_backend(group), cuda_timeout)
    device_index = device.index if device.type == "cuda" else -1
    if use_nccl:
        from ._nccl import make_nccl_transport
        # None: the process group's timeout, as for the torch transport (docs/api.md)
        t = make_nccl_transport(group, rank, world, device, timeout or group_timeout(group, device))
    else:
        t = _C.TorchTransport(gather_group, reduce_group, device_index, timeout,
                              alias_safe_reduce=_reduces_in_place_wrongly(reduce_group))
    if not hybrid:
        return DistContext(group, gather_group, mesh, rank, world, device, t)
    outer_world, outer_transport = dist.get_world_size(outer_group), None
    if outer_world > 1 and use_nccl:
        # native: two communicators of its own across the replicas (gathers, reductions), next
        # to the two inside the replica: outer traffic never queues behind inner traffic
        from ._nccl import make_nccl_transport
        outer_transport = make_nccl_transport(outer_group, dist.get_rank(outer_group), outer_world, device,
                                              timeout or group_timeout(outer_group, device))
    elif outer_world > 1:
        # its own communicator: reductions across replicas never queue behind the shards' ones
        ranks = dist.get_process_group_ranks(outer_group)
        own = own_group(private + "outer", ranks, dist.get_backend(outer_group), cuda_timeout)
        outer_transport = _C.TorchTransport(own, own, device_index, timeout,
                                            alias_safe_reduce=_reduces_in_place_wrongly(own))
    outer_sharded = outer_sharded and outer_world > 1
    if outer_sharded:  # HFSDP's DTensor mesh: (dp_outer, dp_shard) flattened outer-major
        mesh = device_mesh[(dp_outer_dim, dp_shard_dim)]._flatten() if with_tp else _flat_mesh(mesh, dp_group)
    return DistContext(group, gather_group, mesh, rank, world, device, t, outer_group=outer_group,
                       outer_world=outer_world, outer_transport=outer_transport, dp_group=dp_group,
                       outer_sharded=outer_sharded)


def check_rank_partition(ranks: tuple, what: str, fix: str) -> None:
    """Collective over every rank: the rank sets `ranks` the ranks got for one mesh (a sub-mesh:
    expert parallelism's expert data-parallel mesh) must partition them: each contains its rank,
    all have one size, which divides the world, and every rank of a set got the same set. Checked
    by one all_gather_object before the mesh's process groups are made (new_group over rank sets
    the ranks disagree on would hang). Every rank raises the same ValueError: `what`, the problem,
    then `fix`."""
    world = dist.get_world_size()
    table = [None] * world
    dist.all_gather_object(table, tuple(ranks))
    problem = None
    for r, s in enumerate(table):
        if r not in s:
            problem = f"rank {r}'s mesh {s} does not include rank {r}"
        elif world % len(s) or len(s) != len(table[0]):
            problem = f"a mesh of {len(s)} ranks {s} does not divide the world of {world} ranks into equal meshes"
        else:
            odd = [q for q in s if table[q] != s]
            if odd:
                problem = (f"the mesh is ranks {s} on rank {r} but {table[odd[0]]} on rank {odd[0]}: overlapping "
                           "meshes with inconsistent rank sets")
        if problem:
            break
    if problem:
        raise ValueError(f"{what}: {problem}. {fix}")


def check_same_model(records, ctx: DistContext) -> None:
    """Every rank must shard the same model: one cheap all-reduce of a fingerprint; only on a
    mismatch are the descriptions gathered, to name the first differing parameter."""
    if ctx.dp_world == 1:
        return
    desc = [(r.name, tuple(r.shape), str(r.param.dtype), bool(r.requires_grad), bool(r.replicated), r.unit)
            for r in records]
    digest = int.from_bytes(hashlib.sha256(repr(desc).encode()).digest()[:7], "little")
    mine = torch.tensor([digest, -digest, len(desc), -len(desc)], dtype=torch.int64, device=ctx.device)
    seen = mine.clone()
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=ctx.all_dp_group)
    if torch.equal(seen, mine):
        return
    everyone = [None] * ctx.dp_world
    dist.all_gather_object(everyone, desc, group=ctx.all_dp_group)
    names = ("name", "shape", "dtype", "requires_grad", "replicated (fsdp_no_shard)", "unit")
    for i in range(max(len(d) for d in everyone)):
        entries = [d[i] if i < len(d) else None for d in everyone]
        for r in range(1, ctx.dp_world):
            if entries[r] != entries[0]:
                a, b = entries[0], entries[r]
                what = "is missing" if a is None or b is None else ", ".join(
                    f"{n} {x!r} vs {y!r}" for n, x, y in zip(names, a, b) if x != y)
                raise ValueError(
                    f"the model differs across ranks at parameter #{i} ('{(a or b)[0]}'): rank 0 vs rank {r}: {what}. "
                    "Every rank must build the same model (same code, config, frozen parameters and fsdp_no_shard "
                    "marks) before fully_shard")


# torch.distributed backends whose all_gather_into_tensor and all_to_all_single move uint8 tensors
# (gloo, checked on CPU; NCCL), the quantized wires' element type
QUANT_BACKENDS = ("gloo", "nccl")


def check_quant_transport(ctx: DistContext) -> None:
    """Quantized communication moves byte buffers: refused with the reason on a transport that
    may not carry them (the native NCCL transport does: ncclUint8 all-gathers and send/recv)."""
    if isinstance(ctx.transport, _C.TorchTransport):
        for group in (ctx.group, ctx.gather_group):
            backend = str(torch.distributed.get_backend(group))
            names = [part.split(":")[-1] for part in backend.split(",")]
            unknown = [n for n in names if n not in QUANT_BACKENDS]
            if unknown:
                raise ValueError(
                    f"QuantizedCommPolicy: the process group's backend {backend!r} is not known to carry the "
                    f"quantized wires (uint8 all-gathers and all-to-alls); supported: {', '.join(QUANT_BACKENDS)}")
