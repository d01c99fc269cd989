"""Sharded checkpoints through torch.distributed.checkpoint (DCP).

Parameters and optimizer states are torch's own Shard(0) DTensors (see [Note: chunked layout]
in csrc/core/mfsdp_layout.h), so DCP writes each rank's rows and reshards on load with its own
offset arithmetic: nothing here patches chunk metadata.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .optimizer import init_optimizer_state

__all__ = ["save_checkpoint", "load_checkpoint", "full_state_dict"]


def _staged_copy(tree):
    """A clone of a state-dict tree: DCP reads into it, so a failed read leaves the model alone."""
    if isinstance(tree, dict):
        return {k: _staged_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_staged_copy(v) for v in tree]
    if isinstance(tree, DTensor):
        return DTensor.from_local(tree._local_tensor.clone(), tree.device_mesh, tree.placements, run_check=False,
                                  shape=tree.shape, stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    return tree


def _named_optimizer_state(model) -> bool:
    """With expert parallelism the checkpoint keys the optimizer state by parameter name, not by
    torch's index in the param groups: the same index is a different expert on ranks of different
    expert groups, and DCP would merge their states under one key ([Note: expert data-parallel
    mesh] in _megatron_experts.py). The param groups' hyperparameters are saved as they are; their
    parameter lists differ across ranks, so a load keeps the live optimizer's."""
    return getattr(model, "expert_owner", None) is not None


def _index_names(model, optimizer) -> list:
    """The name of each parameter by its index in optimizer.state_dict() (torch numbers the
    parameters of the param groups in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [names.get(id(p), f"param.{i}") for i, p in enumerate(params)]


def _optimizer_state(model, optimizer) -> dict:
    sd = optimizer.state_dict()
    if not _named_optimizer_state(model):
        return sd
    names = _index_names(model, optimizer)
    return {"state": {names[i]: v for i, v in sd["state"].items()}, "param_groups": sd["param_groups"]}


def _load_optimizer_state(model, optimizer, sd: dict) -> None:
    if not _named_optimizer_state(model):
        optimizer.load_state_dict(sd)
        return
    live = optimizer.state_dict()
    index = {n: i for i, n in enumerate(_index_names(model, optimizer))}
    groups = [dict(saved, params=mine["params"]) for saved, mine in zip(sd["param_groups"], live["param_groups"])]
    optimizer.load_state_dict({"state": {index[n]: v for n, v in sd["state"].items() if n in index},
                               "param_groups": groups})


def save_checkpoint(path: str, model, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Writes this rank's shards of the model (and optimizer) to the DCP directory `path`."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(model, optimizer)
    dcp.save(state, checkpoint_id=path)


def load_checkpoint(path: str, model, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Loads a DCP checkpoint written at any world size (or from a plain model) into the
    sharded model (and optimizer). Reads into a staged copy first: a missing or unreadable
    checkpoint raises and leaves the live model and optimizer unchanged."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"no checkpoint at '{path}' (no {os.path.join(path, '.metadata')}); nothing was loaded")
    if optimizer is not None and getattr(optimizer, "_mfsdp", None) is not None:
        # parameters unfrozen since fully_shard need states for the checkpoint's to load into
        init_optimizer_state(optimizer)
    live = {"model": model.state_dict()}
    if optimizer is not None:
        live["optimizer"] = _optimizer_state(model, optimizer)
    staged = _staged_copy(live)
    try:
        dcp.load(staged, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised with what the user needs to know
        raise RuntimeError(f"checkpoint '{path}' could not be read ({type(e).__name__}: {str(e)[:500]}); the model "
                           "and optimizer were left unchanged") from e
    model.load_state_dict(staged["model"])
    if optimizer is not None:
        _load_optimizer_state(model, optimizer, staged["optimizer"])


def full_state_dict(model, rank0_only: bool = True) -> dict:
    """The unsharded state dict (main weights and buffers, a plain model's keys): gathered by
    every rank, returned on rank 0 only (or everywhere with rank0_only=False). For export."""
    gathered = model.full_parameters()
    params = {alias: gathered[r.name] for r in model.all_records() for alias in r.aliases}
    if rank0_only and dist.get_rank(model.dist_ctx.group) != 0:
        return {}
    out = {}
    for name, value in model.module.state_dict().items():
        out[name] = params[name].cpu() if name in params else value.detach().cpu()
    return out
