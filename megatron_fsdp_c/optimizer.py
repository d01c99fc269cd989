"""The optimizer side: fully_shard_optimizer, the local-shard step, and optimizer state dicts.

[Note: local-shard step]
Users see DTensor parameters (param_groups, clip_grad_norm_, state_dict). Stepping DTensors op by
op costs a DTensor dispatch per tensor op (about 20 ms a step on the CPU test GPT, a third of
it; FSDP2 users report the same, pytorch #134191). Every optimizer update is elementwise, so the
patched step runs the unmodified optimizer on plain "twin" parameters that alias each DTensor's
local shard (same storage), with the gradient shard as .grad, and moves the states back under
the DTensor keys afterwards. States are therefore plain local tensors in optimizer.state;
optimizer.state_dict() wraps them back into DTensors (with the uneven-shard metadata DCP needs)
and load_state_dict unwraps them.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Dict

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .checkpoint import attach_chunk, chunk_of

__all__ = ["fully_shard_optimizer", "remap_optimizer"]


def model_of(optimizer):
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = getattr(p, "_mfsdp_model_ref", None)
            model = ref() if ref is not None else None
            if model is not None:
                return model
    raise ValueError(
        "fully_shard_optimizer: the optimizer holds no megatron_fsdp_c parameters; build it on "
        "model.parameters() of the model fully_shard returned (or use fully_shard(module, optimizer))"
    )


def remap_optimizer(model, optimizer: torch.optim.Optimizer) -> None:
    """Points the optimizer's param groups at the distributed parameters, keeping each group's
    hyperparameters. Existing optimizer state refers to the old tensors and is dropped."""
    lookup = {}
    for r in model.param_buffer.records:
        for p in (r.origin, r.param, r.dist_param):
            lookup[id(p)] = r.dist_param
    for gi, group in enumerate(optimizer.param_groups):
        mapped = []
        for p in group["params"]:
            if id(p) not in lookup:
                raise ValueError(
                    f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} that is not part of the "
                    "sharded model; build the optimizer on the model's parameters"
                )
            mapped.append(lookup[id(p)])
        group["params"] = mapped
    if optimizer.state:
        optimizer.state.clear()


class LocalStep:
    """Runs an optimizer's own step() on plain twins of the DTensor parameters (see the note)."""

    def __init__(self, model, optimizer, base_step):
        self.optimizer = optimizer
        self.base_step = base_step
        self.twins: Dict[int, nn.Parameter] = {}
        for r in model.param_buffer.records:
            local = r.dist_param._local_tensor
            self.twins[id(r.dist_param)] = nn.Parameter(local, requires_grad=r.dist_param.requires_grad)

    def __call__(self, *args, **kwargs):
        opt = self.optimizer
        state = opt.state
        swapped = []  # (group, original params)
        pairs = []
        for group in opt.param_groups:
            originals = group["params"]
            local = []
            for p in originals:
                twin = self.twins.get(id(p))
                if twin is None:
                    local.append(p)
                    continue
                g = p.grad
                twin.grad = None if g is None else (g._local_tensor if isinstance(g, DTensor) else g)
                if p in state:
                    state[twin] = state.pop(p)
                pairs.append((p, twin))
                local.append(twin)
            swapped.append((group, originals))
            group["params"] = local
        try:
            return self.base_step(*args, **kwargs)
        finally:
            for group, originals in swapped:
                group["params"] = originals
            for p, twin in pairs:
                twin.grad = None
                if twin in state:
                    state[p] = state.pop(twin)


@torch.no_grad()
def init_optimizer_state(optimizer, step) -> None:
    """Creates every optimizer state now, numerically inert (Megatron-FSDP's trick), so that a
    fresh optimizer has tensors for a checkpoint to load into: zero gradients, lr and weight decay
    0, one step, step counters back to 0. Empty shards get (empty) states too, so every rank's
    state has the same structure."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params or all(optimizer.state.get(p) for p in params):
        return
    saved_grads = [p.grad for p in params]
    saved_groups = []
    for g in optimizer.param_groups:
        saved_groups.append({k: g[k] for k in ("lr", "weight_decay") if k in g})
        for k in ("lr", "weight_decay"):
            if k in g:
                g[k] = torch.zeros_like(g[k]) if isinstance(g[k], torch.Tensor) else 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        step()
    finally:
        for g, saved in zip(optimizer.param_groups, saved_groups):
            g.update(saved)
        for p, grad in zip(params, saved_grads):
            p.grad = grad
    for state in optimizer.state.values():
        if "step" in state:
            if isinstance(state["step"], torch.Tensor):
                state["step"].zero_()
            else:
                state["step"] = 0


def register_state_dict_hooks(model, optimizer) -> None:
    """state_dict() gives DTensor states with DCP metadata; load_state_dict() takes them back
    as local tensors."""
    record_of = {id(r.dist_param): r for r in model.param_buffer.records}

    def params_in_order(opt):
        return [p for group in opt.param_groups for p in group["params"]]

    def on_save(opt, state_dict):
        packed = state_dict["state"]
        for index, p in enumerate(params_in_order(opt)):
            r = record_of.get(id(p))
            if r is None or index not in packed:
                continue
            local_shape = r.dist_param._local_tensor.shape
            wrapped = {}
            for key, value in packed[index].items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local_shape \
                        and value.dim() > 0:
                    value = DTensor.from_local(value, r.dist_param.device_mesh, r.dist_param.placements,
                                               run_check=False, shape=r.shape, stride=r.dist_param.stride())
                    attach_chunk(value, chunk_of(r))
                wrapped[key] = value
            packed[index] = wrapped  # a new dict: the live state keeps its local tensors
        return state_dict

    def after_load(opt):
        for p in params_in_order(opt):
            if id(p) in record_of and p in opt.state:
                st = opt.state[p]
                for key, value in list(st.items()):
                    if isinstance(value, DTensor):
                        st[key] = value.to_local()

    optimizer.register_state_dict_post_hook(on_save)
    optimizer.register_load_state_dict_post_hook(after_load)


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, preproc_state_dict_for_dcp_ckpt: bool = True):
    """Patches `optimizer` in place: step() syncs gradients first, updates the local shards
    (see [Note: local-shard step]) and installs the updated weights after; zero_grad() also
    zeroes the gradient buffers. States are created now, numerically inert, so a checkpoint can
    be loaded into a fresh optimizer; state_dict() carries the uneven-shard metadata DCP needs."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fully_shard_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "_megatron_fsdp_patched", False):
        return optimizer
    model = model_of(optimizer)
    base_step, base_zero_grad = optimizer.step, optimizer.zero_grad
    local_step = LocalStep(model, optimizer, base_step)

    @functools.wraps(base_step)
    def step(*args, sync_grad_before_optimizer_step: bool = True, install_optimized_model_weights: bool = True,
             **kwargs):
        if sync_grad_before_optimizer_step and (not model.model_auto_sync or model._grads_pending):
            model.finish_grad_sync()
        result = local_step(*args, **kwargs)
        if install_optimized_model_weights:
            model.install_optimized_model_weights()
        return result

    @functools.wraps(base_zero_grad)
    def zero_grad(*args, zero_grad_buffer: bool = True, **kwargs):
        base_zero_grad(*args, **kwargs)
        if zero_grad_buffer:
            model.zero_grad_buffer()

    step.__signature__ = inspect.signature(step)
    init_optimizer_state(optimizer, local_step)
    if preproc_state_dict_for_dcp_ckpt:
        register_state_dict_hooks(model, optimizer)
    optimizer.step = step
    optimizer.zero_grad = zero_grad
    optimizer._megatron_fsdp_patched = True
    optimizer._megatron_fsdp_model = weakref.proxy(model)
    return optimizer
