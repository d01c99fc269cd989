"""Sharded checkpoints through torch.distributed.checkpoint (DCP).

[Note: uneven DTensor chunks]
DTensor assumes Shard(0) splits like torch.chunk; ours are whole-row slices of a flat bucket, so
rank r's rows of a parameter start wherever the layout put them. DTensor defers checkpoint
metadata to its local tensor when that tensor has `__create_write_items__` /
`__create_chunk_list__`, so every Shard(0) tensor handed to DCP (parameters in the model state
dict, optimizer states) gets those two attributes with its true global row offset and size. DCP
then writes each rank's real rows and, on load, reads whatever overlapping rows another world
size wrote: resharding falls out of DCP's offset arithmetic. Ranks whose slice is empty write
and read nothing.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

__all__ = ["save_checkpoint", "load_checkpoint", "full_state_dict"]


def chunk_of(record):
    """(offsets, sizes) of this rank's rows of `record`'s parameter, or None when replicated."""
    placement = record.dist_param.placements[0]
    if not isinstance(placement, Shard):
        return None
    shape = record.shape
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    lo, hi, _ = record.local_slice
    first, count = (lo // row, (hi - lo) // row) if row else (0, 0)
    return torch.Size([first] + [0] * (len(shape) - 1)), torch.Size([count] + list(shape[1:]))


def attach_chunk(tensor: DTensor, chunk) -> None:
    """Gives DCP the true global position of `tensor`'s local rows (see the note)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    if chunk is None or not isinstance(tensor, DTensor):
        return
    offsets, sizes = chunk
    empty = math.prod(sizes) == 0

    def create_write_items(fqn, obj):
        if empty:
            return []
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                      properties=TensorProperties.create_from_tensor(obj.to_local()),
                                                      size=obj.size()))]

    def create_chunk_list():
        return [] if empty else [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]

    local = tensor._local_tensor
    local.__create_write_items__ = create_write_items
    local.__create_chunk_list__ = create_chunk_list


def register_model_hooks(model) -> None:
    """State-dict hooks on the wrapped module (they run for model.state_dict() and for
    model.module.state_dict() alike)."""
    records = model.param_buffer.records
    chunks = {name: chunk_of(r) for r in records for name in r.aliases}

    def on_save(module, state_dict, prefix, local_metadata):
        for name, chunk in chunks.items():
            value = state_dict.get(prefix + name)
            if isinstance(value, DTensor):
                attach_chunk(value, chunk)
        return state_dict

    def before_load(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # A full (unsharded) tensor, e.g. from a plain model's checkpoint: keep this rank's rows.
        for r in records:
            for name in r.aliases:
                key = prefix + name
                value = state_dict.get(key)
                if value is None or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                    continue
                if tuple(value.shape) != tuple(r.shape):
                    continue  # load_state_dict reports the size mismatch
                local = r.dist_param.to_local()
                lo, hi, _ = r.local_slice
                flat = value.detach().reshape(-1)
                rows = flat[lo:hi] if r.dist_param.placements[0].is_shard() else flat
                state_dict[key] = DTensor.from_local(rows.reshape(local.shape).to(local.dtype),
                                                     r.dist_param.device_mesh, r.dist_param.placements,
                                                     run_check=False, shape=r.shape, stride=r.dist_param.stride())

    def after_load(module, incompatible_keys):
        model.param_buffer.engine.install_main_weights(True)  # compute weights follow at once

    model.module._register_state_dict_hook(on_save)
    model.module._register_load_state_dict_pre_hook(before_load, with_module=True)
    model.module.register_load_state_dict_post_hook(after_load)


def _staged_copy(tree):
    """A clone of a state-dict tree: DCP reads into it, so a failed read leaves the model alone."""
    if isinstance(tree, dict):
        return {k: _staged_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_staged_copy(v) for v in tree]
    if isinstance(tree, DTensor):
        local = tree._local_tensor
        copy = DTensor.from_local(local.clone(), tree.device_mesh, tree.placements, run_check=False,
                                  shape=tree.shape, stride=tree.stride())
        for attr in ("__create_write_items__", "__create_chunk_list__"):
            if attr in local.__dict__:
                setattr(copy._local_tensor, attr, local.__dict__[attr])
        return copy
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return tree


def save_checkpoint(path: str, model, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Writes this rank's shards of the model (and optimizer) to the DCP directory `path`."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(path: str, model, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Loads a DCP checkpoint written at any world size (or from a plain model) into the
    sharded model (and optimizer). Reads into a staged copy first: a missing or unreadable
    checkpoint raises and leaves the live model and optimizer unchanged."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"no checkpoint at '{path}' (no {os.path.join(path, '.metadata')}); nothing was loaded")
    live = {"model": model.state_dict()}
    if optimizer is not None:
        live["optimizer"] = optimizer.state_dict()
    staged = _staged_copy(live)
    try:
        dcp.load(staged, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised with what the user needs to know
        raise RuntimeError(f"checkpoint '{path}' could not be read ({type(e).__name__}: {str(e)[:500]}); the model "
                           "and optimizer were left unchanged") from e
    model.load_state_dict(staged["model"])
    if optimizer is not None:
        optimizer.load_state_dict(staged["optimizer"])


def full_state_dict(model, rank0_only: bool = True) -> dict:
    """The unsharded state dict (main weights and buffers, a plain model's keys): gathered by
    every rank, returned on rank 0 only (or everywhere with rank0_only=False). For export."""
    gathered = model.full_parameters()
    params = {alias: gathered[r.name] for r in model.param_buffer.records for alias in r.aliases}
    if rank0_only and dist.get_rank(model.dist_ctx.group) != 0:
        return {}
    out = {}
    for name, value in model.module.state_dict().items():
        out[name] = params[name].cpu() if name in params else value.detach().cpu()
    return out
