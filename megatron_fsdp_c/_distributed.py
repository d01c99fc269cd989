"""Process groups, device mesh and transport for one wrapped model."""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _C

__all__ = ["DistContext", "make_dist_context"]


@dataclasses.dataclass
class DistContext:
    group: object          # the data-parallel ProcessGroup (also used for reductions)
    gather_group: object   # a second group over the same ranks, for all-gathers
    mesh: DeviceMesh       # 1-D mesh over `group`, for DTensor parameters
    rank: int
    world: int
    device: torch.device
    transport: object      # _C.TorchTransport (or _C.NcclTransport)


def _require_initialized():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group(backend=...) "
            "first (launch with `torchrun --nproc_per_node N script.py`, backend 'gloo' on CPU, 'nccl' on GPU)"
        )


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


def make_dist_context(device_mesh, dp_shard_dim, device: torch.device, transport: str = "auto",
                      collective_timeout: Optional[float] = None) -> DistContext:
    group, mesh = resolve_group(device_mesh, dp_shard_dim, device)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the data-parallel group passed as device_mesh")
    if transport not in ("auto", "torch", "nccl"):
        raise ValueError(f"transport must be 'auto', 'torch' or 'nccl', not {transport!r}")
    if transport == "nccl" and device.type != "cuda":
        raise ValueError("transport='nccl' needs CUDA parameters; CPU training uses transport='torch' (gloo)")
    gather_group = group
    if world > 1:
        # A second communicator over the same ranks: all-gathers never wait behind reductions.
        ranks = dist.get_process_group_ranks(group)
        gather_group = dist.new_group(ranks=ranks, use_local_synchronization=True,
                                      backend=dist.get_backend(group))
    use_nccl = transport == "nccl" or (transport == "auto" and device.type == "cuda"
                                       and getattr(_C, "NcclTransport", None) is not None)
    timeout = None if collective_timeout is None else datetime.timedelta(seconds=float(collective_timeout))
    if use_nccl:
        from ._nccl import make_nccl_transport
        t = make_nccl_transport(group, rank, world, device, timeout)
    else:
        t = _C.TorchTransport(gather_group, group, device.index if device.type == "cuda" else -1, timeout)
    return DistContext(group, gather_group, mesh, rank, world, device, t)


def check_same_model(records, ctx: DistContext) -> None:
    """Every rank must shard the same model: one cheap all-reduce of a fingerprint; only on a
    mismatch are the descriptions gathered, to name the first differing parameter."""
    if ctx.world == 1:
        return
    desc = [(r.name, tuple(r.shape), str(r.param.dtype), bool(r.requires_grad), bool(r.replicated), r.unit)
            for r in records]
    digest = int.from_bytes(hashlib.sha256(repr(desc).encode()).digest()[:7], "little")
    mine = torch.tensor([digest, -digest, len(desc), -len(desc)], dtype=torch.int64, device=ctx.device)
    seen = mine.clone()
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=ctx.group)
    if torch.equal(seen, mine):
        return
    everyone = [None] * ctx.world
    dist.all_gather_object(everyone, desc, group=ctx.group)
    names = ("name", "shape", "dtype", "requires_grad", "replicated (fsdp_no_shard)", "unit")
    for i in range(max(len(d) for d in everyone)):
        entries = [d[i] if i < len(d) else None for d in everyone]
        for r in range(1, ctx.world):
            if entries[r] != entries[0]:
                a, b = entries[0], entries[r]
                what = "is missing" if a is None or b is None else ", ".join(
                    f"{n} {x!r} vs {y!r}" for n, x, y in zip(names, a, b) if x != y)
                raise ValueError(
                    f"the model differs across ranks at parameter #{i} ('{(a or b)[0]}'): rank 0 vs rank {r}: {what}. "
                    "Every rank must build the same model (same code, config, frozen parameters and fsdp_no_shard "
                    "marks) before fully_shard")
