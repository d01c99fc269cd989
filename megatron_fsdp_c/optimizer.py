"""The optimizer side: fully_shard_optimizer and the local-shard step.

[Note: optimizer protocols]
A sharded model changes three things about a step: gradients may still be in flight (finish the
sync first), the update must reach the compute weights (install them after), and zero_grad must
also clear the engine's gradient buffers. Everything else is the user's optimizer, untouched:
- `step` becomes a bound method of the instance (LR schedulers wrap it through `__func__`),
  doing sync -> torch's own hook wrapper (global and per-instance step pre/post hooks, as
  `Optimizer.profile_hook_step` runs them) around the optimizer's own update -> install. Pre
  hooks therefore see synced DTensor gradients; post hooks see updated DTensor parameters.
- `zero_grad` is bound too, and clears only this optimizer's parameters (several optimizers
  over disjoint parts of one model work in any call order).
- `optimizer.state` holds DTensor states placed like their parameters, so `state_dict()`,
  `get_optimizer_state_dict`, DCP and pickling see what they would under FSDP2.
- `add_param_group` and parameters of several wrapped models in one optimizer just work: the
  models are found from the parameters at each step.

[Note: local-shard step]
Stepping DTensors op by op costs a DTensor dispatch per tensor op (about 20 ms a step on the CPU
test GPT, a third of it; FSDP2 users report the same, pytorch #134191). Every optimizer update
is elementwise, so the update runs the unmodified optimizer on plain "twin" parameters that
alias each DTensor's local shard (same storage), with the local gradient as .grad, and with the
local tensors of the DTensor states; afterwards the states are rewrapped (a state updated in
place keeps its DTensor wrapper, so this costs a dict lookup per state).
"""
from __future__ import annotations

import types
import weakref
from typing import Dict, List

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._extensions import values_of

__all__ = ["fully_shard_optimizer", "remap_optimizer"]


def _model_of_param(p):
    ref = getattr(p, "_mfsdp_model_ref", None)
    return ref() if ref is not None else None


def models_of(optimizer) -> List:
    """The wrapped models whose parameters `optimizer` holds, in first-seen order."""
    seen: Dict[int, object] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            model = _model_of_param(p)
            if model is not None and id(model) not in seen:
                seen[id(model)] = model
    return list(seen.values())


def remap_optimizer(model, optimizer: torch.optim.Optimizer) -> None:
    """Points the optimizer's param groups at the distributed parameters, keeping each group's
    hyperparameters. Existing optimizer state refers to the old tensors and is dropped."""
    lookup = {}
    for r in model.all_records():
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


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


class ShardedStepState:
    """What fully_shard_optimizer keeps per optimizer (as `optimizer._mfsdp`)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        cls = type(optimizer)
        # The optimizer's own update, without torch's hook wrapper (we run that ourselves).
        self.raw_step = cls.step.__wrapped__ if getattr(cls.step, "hooked", False) else cls.step
        self.hooked_step = torch.optim.Optimizer.profile_hook_step(self._local_update)
        self.base_zero_grad = cls.zero_grad
        self.twins: Dict[int, nn.Parameter] = {}
        self.wrappers: Dict[tuple, DTensor] = {}  # (id(param), state key) -> DTensor state

    def twin(self, p: nn.Parameter) -> nn.Parameter:
        """A plain Parameter aliasing `p`'s local shard (see [Note: local-shard step])."""
        twin = self.twins.get(id(p))
        local = values_of(p._local_tensor)  # an extension parameter's values ([Note: extension parameters])
        if twin is None or twin.data.data_ptr() != local.data_ptr():
            twin = self.twins[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
        elif twin.requires_grad != p.requires_grad:  # [Note: changing requires_grad] in _trainable.py
            twin.requires_grad_(p.requires_grad)
        return twin

    def wrap(self, key, value, p: DTensor):
        """A state tensor of the local shard's shape, as a DTensor placed like `p` (cached)."""
        if key == "step" or not isinstance(value, torch.Tensor) or isinstance(value, DTensor) \
                or value.shape != p._local_tensor.shape:
            return value
        w = self.wrappers.get((id(p), key))
        if w is None or not _same_memory(w._local_tensor, value):  # a state updated in place keeps its wrapper
            w = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride())
            self.wrappers[(id(p), key)] = w
        return w

    def _local_update(self, optimizer, *args, **kwargs):
        """The optimizer's own update on plain twins of the DTensor parameters."""
        state = optimizer.state
        swapped, pairs = [], []
        for group in optimizer.param_groups:
            originals = group["params"]
            local = []
            for p in originals:
                if not isinstance(p, DTensor) or _model_of_param(p) is None:
                    local.append(p)
                    continue
                twin = self.twin(p)
                g = p.grad
                twin.grad = None if g is None else (g._local_tensor if isinstance(g, DTensor) else g)
                if p in state:
                    state[twin] = {k: (v._local_tensor if isinstance(v, DTensor) else v)
                                   for k, v in state.pop(p).items()}
                pairs.append((p, twin))
                local.append(twin)
            swapped.append((group, originals))
            group["params"] = local
        try:
            return self.raw_step(optimizer, *args, **kwargs)
        finally:
            for group, originals in swapped:
                group["params"] = originals
            for p, twin in pairs:
                twin.grad = None
                if twin in state:
                    state[p] = {k: self.wrap(k, v, p) for k, v in state.pop(twin).items()}


def _make_step():
    """A fresh `step` function per optimizer (a scheduler's mark on it stays with that optimizer)."""

    def step(self, *args, sync_grad_before_optimizer_step: bool = True, install_optimized_model_weights: bool = True,
             **kwargs):
        """Finishes gradient sync, runs the optimizer (and its step hooks) on the local shards,
        and installs the updated weights (see [Note: optimizer protocols] in
        megatron_fsdp_c/optimizer.py)."""
        models = models_of(self)
        if sync_grad_before_optimizer_step:
            for model in models:
                model._sync_grads_for_step()
        self._opt_called = True  # what an LR scheduler's step wrapper records
        result = self._mfsdp.hooked_step(self, *args, **kwargs)
        if install_optimized_model_weights:
            for model in models:
                model.install_optimized_model_weights()
        return result

    return step


def _sharded_zero_grad(self, set_to_none: bool = True, *, zero_grad_buffer: bool = True):
    """zero_grad of this optimizer's parameters only, engine gradient buffers included."""
    self._mfsdp.base_zero_grad(self, set_to_none)
    if zero_grad_buffer:
        params = [p for group in self.param_groups for p in group["params"]]
        for model in models_of(self):
            model._zero_grads_of(params, set_to_none)


@torch.no_grad()
def init_optimizer_state(optimizer) -> None:
    """Creates the state of every trainable parameter that has none yet, numerically inert
    (Megatron-FSDP's trick), so that a fresh optimizer has tensors for a checkpoint to load into:
    zero gradients, lr and weight decay 0, one step, step counters back to 0. Empty shards get
    (empty) states too, so every rank's state has the same structure. States that exist are left
    alone (the step runs over the missing ones only): load_checkpoint calls it again, for
    parameters unfrozen since ([Note: changing requires_grad] in _trainable.py)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and not optimizer.state.get(p)]
    if not params:
        return
    missing = {id(p) for p in params}
    saved_grads = [p.grad for p in params]
    saved_groups = []
    for g in optimizer.param_groups:
        saved_groups.append({k: g[k] for k in ("lr", "weight_decay", "params") if k in g})
        g["params"] = [p for p in g["params"] if id(p) in missing]
        for k in ("lr", "weight_decay"):
            if k in g:
                g[k] = torch.zeros_like(g[k]) if isinstance(g[k], torch.Tensor) else 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        optimizer._mfsdp._local_update(optimizer)
    finally:
        for g, saved in zip(optimizer.param_groups, saved_groups):
            g.update(saved)
        for p, grad in zip(params, saved_grads):
            p.grad = grad
    for p in params:
        state = optimizer.state.get(p, {})
        if "step" in state:
            if isinstance(state["step"], torch.Tensor):
                state["step"].zero_()
            else:
                state["step"] = 0


def fully_shard_optimizer(optimizer: torch.optim.Optimizer, preproc_state_dict_for_dcp_ckpt: bool = True):
    """Makes `optimizer` step sharded parameters (see [Note: optimizer protocols]): step() syncs
    gradients first, updates the local shards and installs the updated weights after;
    zero_grad() also clears the engine's gradient buffers of its own parameters. States are
    created now, numerically inert, so a checkpoint can be loaded into a fresh optimizer.
    `preproc_state_dict_for_dcp_ckpt` is accepted for Megatron-FSDP compatibility: the states
    are true DTensors, so DCP needs no preprocessing."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"fully_shard_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "_megatron_fsdp_patched", False):
        return optimizer
    models = models_of(optimizer)
    if not models:
        raise ValueError(
            "fully_shard_optimizer: the optimizer holds no megatron_fsdp_c parameters; build it on "
            "model.parameters() of the model fully_shard returned (or use fully_shard(module, optimizer))"
        )
    optimizer._mfsdp = ShardedStepState(optimizer)
    previous = optimizer.__dict__.get("step")
    step = _make_step()
    if previous is not None and getattr(previous, "_wrapped_by_lr_sched", False):
        step._wrapped_by_lr_sched = True  # a scheduler made before fully_shard keeps tracking steps
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.zero_grad = types.MethodType(_sharded_zero_grad, optimizer)
    init_optimizer_state(optimizer)
    optimizer._megatron_fsdp_patched = True
    optimizer._megatron_fsdp_model = weakref.proxy(models[0])
    return optimizer
