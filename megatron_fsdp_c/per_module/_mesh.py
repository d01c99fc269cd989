"""The meshes of the per-module API: the DistContext of each mesh, made once and shared by the
groups on it (one engine per mesh, [Note: a mesh per group] in _root.py); torch's dp_mesh_dims (a
full SPMD mesh whose data-parallel dims are named); and what reshard_after_forward=n means here."""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._distributed import DistContext, make_dist_context
from ._lazy_init import check_sub_mesh

__all__ = ["dp_mesh_of", "mesh_and_context", "post_forward_world"]

# [Note: per-world caches]
# Both caches are keyed by the caller's default process group as well: torch's threaded test group
# (FSDPTestMultiThread) runs every rank as a thread of one process, each thread with its own
# default group and group map, so a mesh or context made by one rank's thread is unusable on
# another's; and a process that re-initialises torch.distributed gets new ones too. Each value
# holds its default group, so the group's id in the key cannot be reused while it is cached.
# (default group, mesh's ranks and names, device) -> (DistContext, the mesh, the default group): one communicator
# per mesh; the mesh and the group kept alive with it, so the key's id() is never reused
_CONTEXTS = {}
_DEFAULT_MESH = {}  # (default group, device type) -> (default group, the 1-D mesh over all ranks)
_DP_MESHES = {}     # (SPMD mesh, shard dims, replicate dims) -> (data-parallel mesh, no_shard, SPMD mesh)


def _submesh(mesh: DeviceMesh, names: tuple) -> DeviceMesh:
    """The dims `names` of `mesh` as one dim (flattened when several, as torch's fully_shard does)."""
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


def dp_mesh_of(mesh: DeviceMesh, dp_mesh_dims) -> tuple:
    """(the data-parallel mesh, whether it only replicates) of torch 2.13's `dp_mesh_dims` on a full
    SPMD `mesh`: its shard dims flattened into one, its replicate dims into another; both make the
    2-D (replicate, shard) HSDP mesh, replicate dims alone a replicated (no_shard) group, as in
    torch. A dim of size > 1 that is neither is tensor (or expert, context) parallelism: not
    supported by the per-module API yet. Made once per mesh and dims: every group of a model must
    get the same mesh object (one engine per mesh, see [Note: per-module groups] in _fully_shard.py)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"dp_mesh_dims needs mesh= the full SPMD DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    shard, replicate = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
    if not shard and not replicate:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    for name in shard + replicate:
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")
    model_parallel = [n for n in names if n not in shard + replicate and mesh.size(names.index(n)) > 1]
    if model_parallel:
        # torch computes with DTensors on the whole SPMD mesh here (the batch a DTensor too); ours
        # composes TP through the data-parallel sub-mesh instead ([Note: tensor parallelism])
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims=...) on a mesh with the model-parallel dims {model_parallel} (tensor, "
            "context or expert parallelism) is not supported by megatron_fsdp_c's per-module API (a later issue "
            "for tensor parallelism in this form). For tensor parallelism use torchtitan's recipe: "
            "parallelize_module(model, mesh['tp'], plan), then fully_shard(module, mesh=mesh['dp'])")
    key = (id(mesh), shard, replicate)
    if key not in _DP_MESHES:
        if shard and replicate:
            dp = DeviceMesh._concatenate([_submesh(mesh, replicate), _submesh(mesh, shard)])
        else:
            dp = _submesh(mesh, shard or replicate)
        _DP_MESHES[key] = (dp, not shard, mesh)  # the SPMD mesh kept alive with its key
    dp, no_shard, _ = _DP_MESHES[key]
    return dp, no_shard


def post_forward_world(n: int, mesh: Optional[DeviceMesh]) -> bool:
    """[Note: reshard to a smaller world]
    FSDP2's reshard_after_forward=n (an int) keeps, after forward, the weights sharded over groups
    of n ranks (e.g. a node) and gathers them over those groups in backward: less memory than
    False, less traffic across nodes than True. It is checked as torch checks it (n must divide
    the shard group's size); n == 1 is False and n == that size is True, as in torch. Any other n
    behaves as True: the weights go back to 1/world after forward and backward gathers over the
    whole shard group. The numbers are the same (a gather moves values, it does not change them),
    the collectives are the same ones FSDP2 issues (one all-gather per group in backward; torch's
    CommDebugMode counts the same), and the memory between forward and backward is never more than
    FSDP2's (1/world of the weights instead of 1/n); what differs is that the backward gather spans
    every rank of the shard group instead of n of them. Resharding to sub-groups needs a second
    gather buffer and communicator per sub-group in the engine, which it does not have yet."""
    if isinstance(mesh, DeviceMesh):
        size = mesh.size(mesh.ndim - 1)
    elif mesh is None and dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
    else:
        return True  # form_group raises the mesh's (or torch.distributed's) error
    if n < 1 or n > size or size % n != 0:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {size}, but got {n}")
    if n == 1:
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world size 1, instead of "
                      "reshard_after_forward=True (bool)", stacklevel=3)
        return False
    if n < size:
        warnings.warn(f"reshard_after_forward={n}: megatron_fsdp_c reshards to all {size} ranks of the shard group "
                      f"after forward (as reshard_after_forward=True), not to groups of {n}: the same gradients and "
                      f"collectives, 1/{size} of the weights held between forward and backward instead of 1/{n}, and "
                      f"the backward's all-gather spans all {size} ranks ([Note: reshard to a smaller world] in "
                      "megatron_fsdp_c/per_module/_mesh.py)", stacklevel=3)
    return True


def mesh_and_context(mesh, device_type: str) -> DistContext:
    """The DistContext of `mesh` (None: every rank), made once per mesh and device."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group first "
                           "(launch with torchrun; backend 'gloo' on CPU, 'nccl' on GPU)")
    world = dist.distributed_c10d._get_default_group()  # see [Note: per-world caches]
    if mesh is None:
        key = (id(world), device_type)
        if key not in _DEFAULT_MESH:
            _DEFAULT_MESH[key] = (world, init_device_mesh(device_type, (dist.get_world_size(),)))
        mesh = _DEFAULT_MESH[key][1]
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: mesh has {mesh.ndim} dims "
                         f"{mesh.mesh_dim_names}: the per-module fully_shard takes a 1-D "
                         "mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), as torch's does; slice a larger mesh "
                         "first, e.g. mesh['dp_outer', 'dp_shard']")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:  # torch's check and words (an AssertionError there too)
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified: e.g. "
                             "init_device_mesh(device_type, (replicas, shards), mesh_dim_names=('dp_replicate', "
                             "'dp_shard'))")
    if mesh.device_type != device_type:
        raise ValueError(f"mesh is on '{mesh.device_type}' but the parameters are on '{device_type}': build the mesh "
                         f"with init_device_mesh('{device_type}', ...) or move the module first")
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)
    # By the ranks and dim names, not the object: mesh["dp"] makes a new DeviceMesh each time, and
    # the calls on one mesh must get one context (one engine per mesh, [Note: a mesh per group] in _root.py).
    key = (id(world), tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names, str(device))
    hit = _CONTEXTS.get(key)
    if hit is None:
        ranks = tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))
        if len(ranks) < dist.get_world_size():
            check_sub_mesh(ranks)
        # A 2-D mesh is HSDP, as in torch: dim 0 replicates, dim 1 shards ([Note: hybrid sharding])
        ctx = make_dist_context(mesh, None, device) if mesh.ndim == 1 else \
            make_dist_context(mesh, 1, device, dp_outer_dim=0)
        hit = _CONTEXTS[key] = (ctx, mesh, world)
    return hit[0]
