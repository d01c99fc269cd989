"""Tensor parallelism composed with FSDP (2-D parallelism): what a tensor-parallel (TP)
parameter looks like on each of its faces, and how its gradient reaches the engine.

[Note: tensor parallelism]
The engine never sees TP. To it a TP parameter is this rank's TP shard (its shape and dtype),
laid out, gathered, reduced and stepped over the data-parallel ranks like any other parameter;
each tp coordinate has its own data-parallel group and engine. TP shows in three places:

1. Placements, exactly what torch's FSDP2 makes (_fsdp_param.py, _init_sharding_spec_tp): the
   distributed parameter, its gradient and its optimizer states are DTensors on the data-parallel
   mesh (1-D, or (replicate, shard) for HSDP) concatenated with the TP mesh. The data-parallel
   placement is Shard(d) of the LOCAL TP shard (torch.chunk pieces of it along d, as for a plain
   parameter: d = 0, or shard_placement_fn's dim); when TP also shards dim d it is
   _StridedShard(d, split_factor=tp) instead (FSDP2's split factor, num_shards_map[d]), which
   tells torch that rank (i, t) holds chunk i of TP chunk t, not chunk t of chunk i. The TP
   placement follows unchanged (Replicate() or Shard(dim)). A replicated group (no_shard,
   fsdp_no_shard) has Replicate() on the data-parallel dims. So full_tensor(), redistribute, DCP across mesh shapes,
   get_model_state_dict and clip_grad_norm_ give the true answers with torch's own code.
2. The compute parameter. For a torch TP parameter (parallelize_module), a DTensor on the TP
   mesh with the parameter's TP placement, whose local tensor is the engine's view of the
   gathered TP shard: the TP modules compute with DTensors. For a Megatron-core style local shard
   (a plain parameter flagged tensor_model_parallel=True, partition_dim=d), the plain tensor: the
   module does its own TP communication.
3. Gradients. A torch TP parameter's gradient is a DTensor; when its placement differs from the
   parameter's (Partial() on tp for a Replicate() parameter fed sequence-sharded activations: the
   norms of torch's SequenceParallel), it is redistributed to the parameter's placement first (an
   all-reduce over tp), as FSDP2 does (_get_grad_inner_tensor); its local tensor then goes to the
   engine. A Megatron-style plain parameter flagged sequence_parallel=True has its gradient summed
   over tp first, as Megatron-LM's finalize_model_grads does for its layer norms.

TP-duplicated parameters (Replicate() on tp: row-parallel biases, norms) stay identical across
the tp group because their gradients are identical there: under plain TP every tp rank computes
them from the same replicated activations, under sequence parallelism item 3 sums them over tp.
Every tp rank then applies the same data-parallel reduction (the same values in the same order)
and the same optimizer update to the same values. As in torch, this is the TP plan's job: a plan
that feeds a TP-duplicated parameter different activations on different tp ranks without saying
so (a Replicate() DTensor whose gradient comes back Replicate(), or a plain parameter not flagged
sequence_parallel) diverges across tp, as it would under FSDP2 or Megatron-LM.
tests/test_tensor_parallel.py (torch TP) and tests/test_tensor_parallel_megatron.py (Megatron-core style)
check bit-identity across tp after training.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ._common import contiguous_stride

__all__ = ["TPSpec", "check_even_shards", "compose_meshes", "dtensor_tp_spec", "megatron_tp_spec", "other_dims",
           "spmd_layout", "tp_mesh_of", "tp_spec_of"]


@dataclasses.dataclass(eq=False)
class TPSpec:
    """A tensor-parallel parameter (see [Note: tensor parallelism])."""
    mesh: DeviceMesh            # the TP mesh (1-D)
    placement: object           # the parameter's placement on it: Shard(dim) or Replicate()
    shape: torch.Size           # the global shape
    local_shape: torch.Size     # this rank's TP shard: what the engine lays out
    dtensor_compute: bool       # torch TP: the module computes with a DTensor on `mesh`
    sum_grad: bool = False      # Megatron-style sequence_parallel: sum the gradient over tp first

    def split_factor(self, dim: int) -> int:
        """TP shards of `dim`: a data-parallel Shard(dim) interleaves with that many."""
        return self.mesh.size() if isinstance(self.placement, Shard) and self.placement.dim == dim else 1

    def compute_param(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """The compute parameter of a torch TP parameter: a DTensor on the TP mesh over `local`."""
        return nn.Parameter(DTensor.from_local(local, self.mesh, [self.placement], run_check=False,
                                               shape=self.shape, stride=contiguous_stride(self.shape)),
                            requires_grad=requires_grad)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient the engine reduces: this rank's TP shard of it (item 3 of the Note)."""
        if isinstance(grad, DTensor):
            if tuple(grad.placements) != (self.placement,):
                grad = grad.redistribute(self.mesh, [self.placement])
            grad = grad._local_tensor
            if isinstance(grad, AsyncCollectiveTensor):  # redistribute's functional collectives
                grad = grad.wait()
        elif self.sum_grad and self.mesh.size() > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=self.mesh.get_group())
        return grad

    def local_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP shard of a full (global) tensor: torch.chunk's piece, as DTensor's Shard."""
        if not isinstance(self.placement, Shard):
            return full
        size, dim = self.mesh.size(), self.placement.dim
        pieces = list(torch.chunk(full, size, dim=dim))
        mine = self.mesh.get_local_rank()
        if mine < len(pieces):
            return pieces[mine]
        return full.narrow(dim, 0, 0)


def compose_meshes(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, what: str) -> DeviceMesh:
    """The (data-parallel dims..., tp) mesh of a TP parameter's DTensors (FSDP2 concatenates the
    same way); a clear error when the two are not dims of one mesh."""
    key = (id(dp_mesh), id(tp_mesh))
    hit = _COMPOSED.get(key)
    if hit is not None:
        return hit[0]
    shared = set(tp_mesh.mesh_dim_names or ()) & set(dp_mesh.mesh_dim_names or ())
    if shared:
        raise ValueError(
            f"{what} is a DTensor on the tensor-parallel dim {sorted(shared)}, which the data-parallel mesh "
            f"{dp_mesh.mesh_dim_names} given to fully_shard includes: shard over the data-parallel dims only, "
            "e.g. fully_shard(..., mesh=mesh['dp']) (HSDP: mesh=mesh['dp_replicate', 'dp_shard'])")
    # the tp and data-parallel dims of one mesh meet in this rank only
    common = sorted(set(tp_mesh.mesh.flatten().tolist()) & set(dp_mesh.mesh.flatten().tolist()))
    if len(common) > 1:
        raise ValueError(
            f"{what} is already a DTensor on a mesh over the data-parallel ranks {common}: fully_shard shards plain "
            "parameters, or tensor-parallel DTensors on the tp dim of the mesh the data-parallel dims come from "
            "(parallelize_module(model, mesh['tp'], plan), then fully_shard(..., mesh=mesh['dp'])); for a "
            "replicated parameter pass the plain tensor (DTensor.full_tensor())")
    try:
        mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except (RuntimeError, ValueError, AssertionError, TypeError) as e:
        raise ValueError(
            f"{what} is a DTensor on the mesh {tp_mesh.mesh_dim_names} {tp_mesh.mesh.tolist()}, which is not a sub-mesh "
            f"of the same device mesh as the data-parallel mesh {dp_mesh.mesh_dim_names} {dp_mesh.mesh.tolist()} "
            f"({e}). Slice both from one init_device_mesh(..., mesh_dim_names=('dp', 'tp')): parallelize_module(model, "
            "mesh['tp'], plan), then fully_shard(..., mesh=mesh['dp'])") from None
    _COMPOSED[key] = (mesh, dp_mesh, tp_mesh)  # the meshes kept alive with their ids
    return mesh


_COMPOSED = {}


def spmd_layout(tp: TPSpec, dp_mesh: DeviceMesh, dp_placements: list, what: str) -> Tuple[DeviceMesh, list]:
    """(mesh, placements) of a TP parameter's DTensors: `dp_placements` are a plain parameter's on
    `dp_mesh` ([Shard(d)], [Replicate(), Shard(d)] for HSDP, Replicate() when replicated); Shard(d)
    becomes _StridedShard(d, split_factor) when TP shards dim d too (item 1 of the Note)."""
    mesh = compose_meshes(dp_mesh, tp.mesh, what)
    placements = [(_StridedShard(p.dim, split_factor=tp.split_factor(p.dim))
                   if type(p) is Shard and tp.split_factor(p.dim) > 1 else p) for p in dp_placements]
    return mesh, placements + [tp.placement]


def _check_placement(placement, what: str) -> None:
    if type(placement) is Shard or isinstance(placement, Replicate):
        return
    raise ValueError(
        f"{what} is a DTensor placed {placement!r} on its tensor-parallel mesh: megatron_fsdp_c composes FSDP with TP "
        "parameters placed Shard(dim) or Replicate() (what ColwiseParallel, RowwiseParallel and SequenceParallel "
        "make); a Partial() or strided parameter cannot be sharded further. Redistribute it to Shard or Replicate "
        "first")


def dtensor_tp_spec(p: DTensor, what: str, dp_mesh: DeviceMesh, tp_mesh: Optional[DeviceMesh] = None) -> TPSpec:
    """The TPSpec of a torch TP parameter (a DTensor from parallelize_module), checked: a 1-D mesh
    (tp_mesh's when given: the Megatron-style API's tp_dim) that composes with `dp_mesh`, a
    placement that composes with FSDP's."""
    mesh = p.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError(
            f"{what} is a DTensor on the {mesh.ndim}-D mesh {mesh.mesh_dim_names}: megatron_fsdp_c composes FSDP with "
            "1-D tensor parallelism (one tp dim); 2-D model parallelism (EP x TP) is not supported yet")
    if tp_mesh is not None and (mesh.mesh_dim_names != tp_mesh.mesh_dim_names
                                or mesh.mesh.tolist() != tp_mesh.mesh.tolist()):
        raise ValueError(
            f"{what} is a DTensor on the mesh {mesh.mesh_dim_names} over ranks {mesh.mesh.tolist()}, not on "
            f"device_mesh[tp_dim] = {tp_mesh.mesh_dim_names} over ranks {tp_mesh.mesh.tolist()}: parallelize the "
            "model on the tp dim of the device_mesh given to fully_shard (parallelize_module(model, "
            "device_mesh[tp_dim], plan))")
    if mesh.device_type != dp_mesh.device_type:
        raise ValueError(f"{what} is a DTensor on a '{mesh.device_type}' mesh, the data-parallel mesh is on "
                         f"'{dp_mesh.device_type}': build both from one init_device_mesh")
    _check_placement(p.placements[0], what)
    compose_meshes(dp_mesh, mesh, what)
    return TPSpec(mesh, p.placements[0], p.shape, p._local_tensor.shape, dtensor_compute=True)


def megatron_tp_spec(p: torch.Tensor, what: str, tp_mesh: DeviceMesh) -> TPSpec:
    """The TPSpec of a Megatron-core style parameter under tp_dim: a local shard (the attributes
    tensor_model_parallel=True and partition_dim=d, global shape = local x tp on d), or a
    TP-duplicated one (Replicate(); summed over tp in backward when flagged sequence_parallel)."""
    tp = tp_mesh.size()
    if getattr(p, "tensor_model_parallel", False):
        dim = getattr(p, "partition_dim", None)
        if not isinstance(dim, int) or not -p.dim() <= dim < p.dim():
            raise ValueError(f"{what} is flagged tensor_model_parallel=True but its partition_dim is {dim!r}: set "
                             "partition_dim to the dim the tensor-parallel ranks split (0: column-parallel, 1: "
                             "row-parallel), as Megatron-core's set_tensor_model_parallel_attributes does")
        dim %= p.dim()
        if getattr(p, "partition_stride", 1) != 1:
            raise NotImplementedError(
                f"{what} has partition_stride={p.partition_stride}: a strided tensor-parallel split (several "
                "interleaved pieces per rank) is not one Shard placement; megatron_fsdp_c composes FSDP with "
                "partition_stride=1 shards")
        shape = list(p.shape)
        shape[dim] *= tp
        return TPSpec(tp_mesh, Shard(dim), torch.Size(shape), p.shape, dtensor_compute=False)
    return TPSpec(tp_mesh, Replicate(), p.shape, p.shape, dtensor_compute=False,
                  sum_grad=bool(getattr(p, "sequence_parallel", False)))


def check_even_shards(records, tp_mesh: DeviceMesh) -> None:
    """Megatron-style local shards must be the same shape on every tp rank (a Shard placement
    with global = local x tp): one gather of the shapes over tp at set-up names any that are not."""
    if tp_mesh.size() == 1:
        return
    mine = [(r.name, tuple(r.shape)) for r in records if r.tp is not None and not r.tp.dtensor_compute]
    everyone = [None] * tp_mesh.size()
    dist.all_gather_object(everyone, mine, group=tp_mesh.get_group())
    for theirs in everyone:
        for (name, shape), (other_name, other) in zip(mine, theirs):
            if name != other_name or shape != other:
                raise ValueError(
                    f"parameter '{name}' has the local shape {shape} here and {other} ('{other_name}') on another "
                    "tensor-parallel rank: Megatron-style shards (tensor_model_parallel=True) must be even and every "
                    "tp rank must build the same model")
        if len(theirs) != len(mine):
            raise ValueError("the tensor-parallel ranks built models with different parameters: every tp rank must "
                             "build the same model")


def tp_mesh_of(device_mesh, tp_dim, dp_dims) -> Optional[DeviceMesh]:
    """device_mesh[tp_dim] of the Megatron-style API (None without tp_dim), with errors that
    name the fix."""
    if tp_dim is None:
        return None
    example = ("init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp')) with dp_shard_dim='dp', "
               "tp_dim='tp'")
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"tp_dim={tp_dim!r} needs device_mesh= the N-D DeviceMesh that holds it, got "
                         f"{type(device_mesh).__name__}: e.g. {example}")
    names = device_mesh.mesh_dim_names
    if not names:
        raise ValueError(f"tp_dim={tp_dim!r}, but the device mesh's dims have no names: build it with mesh_dim_names, "
                         f"e.g. {example}")
    if tp_dim not in names:
        raise ValueError(f"tp_dim={tp_dim!r} is not a dim of the device mesh {names}: pass the name of its "
                         f"tensor-parallel dim, e.g. {example}")
    if tp_dim in dp_dims:
        raise ValueError(f"tp_dim={tp_dim!r} is also a data-parallel dim (dp_shard_dim/dp_outer_dim): the tensor-parallel "
                         "dim must be another dim of the mesh")
    return device_mesh[tp_dim]


def other_dims(device_mesh, dp_dims) -> list:
    """The dims of size > 1 of an N-D device mesh that are not `dp_dims` (a tp dim not named)."""
    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim < 2 or not device_mesh.mesh_dim_names:
        return []
    return [n for i, n in enumerate(device_mesh.mesh_dim_names) if n not in dp_dims and device_mesh.size(i) > 1]


def tp_spec_of(p: nn.Parameter, what: str, tp_mesh: Optional[DeviceMesh], dp_mesh: DeviceMesh,
               unnamed_dims=()) -> Optional[TPSpec]:
    """The TPSpec of a Megatron-style API parameter under tp_dim (its record's `shape` is the
    local TP shard's), None without tp_dim. Without tp_dim, a DTensor parameter, or a
    Megatron-style shard while the mesh has `unnamed_dims` (dims of size > 1 no argument named),
    is refused with the fix. check_even_shards checks the records after."""
    if tp_mesh is None:
        if isinstance(p, DTensor):
            raise ValueError(
                f"{what} is a DTensor on the mesh {p.device_mesh.mesh_dim_names} (tensor parallel): pass "
                "device_mesh= the full mesh, dp_shard_dim= its data-parallel dim and tp_dim= its tensor-parallel "
                "dim, the one the parameter lives on")
        if getattr(p, "tensor_model_parallel", False) and unnamed_dims:
            raise ValueError(
                f"{what} is a Megatron-style tensor-parallel shard (tensor_model_parallel=True) and the device mesh "
                f"has the dims {list(unnamed_dims)} besides the data-parallel ones: pass tp_dim= its "
                "tensor-parallel dim")
        return None
    if isinstance(p, DTensor):
        return dtensor_tp_spec(p, what, dp_mesh, tp_mesh)
    spec = megatron_tp_spec(p, what, tp_mesh)
    compose_meshes(dp_mesh, tp_mesh, what)
    return spec
