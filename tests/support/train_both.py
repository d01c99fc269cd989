"""The one train-both loop of the tests: a sharded model and an unsharded copy of it trained side
by side on the same per-rank data, with the same optimizer, compared as they go. Used by the
Megatron-FSDP API's parity tests (`train_pair`, against DDP, recording losses and counters) and by
the per-module API's behaviour cells (`TrainBoth` with a `Checks` recorder).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.device_mesh
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from .checks import ATOL, RTOL

CFG = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=3)
STEPS = 5


@torch.no_grad()
def average_grads(module: nn.Module, world: int) -> None:
    """What data parallelism does to a plain replica's gradients: the mean over ranks."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def adam(model: nn.Module):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def sum_loss(m, x):
    return m(x).sum()


def backward_of(loss: Callable) -> Callable:
    """A forward-backward from a loss function: the loss, after its backward."""
    def forward_backward(m, batch):
        out = loss(m, batch)
        out.backward()
        return out
    return forward_backward


class TrainBoth:
    """`model` (sharded) and `ref` (an unsharded copy) trained side by side, each with its own
    optimizer made by `optimizer` (or `optimizers`: the two, made already); `run` trains some
    steps and may be called again to go on. Either side may be None: the other trains alone, as
    it would beside it (a reference several cells share is trained once, see train_pair).

    reference -- how `ref` gets the gradients data parallelism gives:
      "ddp":    ref runs under DistributedDataParallel (quiet microbatches under its no_sync);
      "mean":   ref is a plain replica, its gradients averaged over the ranks after each step's
                microbatches;
      "global": ref is one process's model trained on the global batch (`ref_data`: every rank's
                data), its gradients divided by the world size; the ranks' losses summed must be
                its loss;
      reduce(ref): a function that gives ref's gradients after each step's microbatches.
    ck -- a checks.Checks recorder: losses, gradients (after each step's microbatches) and
    parameters are recorded against the reference's, to tol = (rtol, atol); without it only the
    losses are kept (self.losses, self.ref_losses).
    """

    def __init__(self, rank: int, world: int, model: Optional[nn.Module], ref: Optional[nn.Module], *,
                 reference="ddp", optimizer: Callable = adam, optimizers: Optional[tuple] = None, ck=None,
                 tol=(RTOL, ATOL), ddp_kwargs: Optional[dict] = None, ddp: Optional[DDP] = None):
        assert reference in ("ddp", "mean", "global") or callable(reference), reference
        assert ck is None or (model is not None and ref is not None), "checks compare both sides"
        self.rank, self.world, self.model, self.ref, self.reference, self.ck = rank, world, model, ref, reference, ck
        self.tol = tol
        self.ref_run = ref
        if ref is not None and reference == "ddp":
            self.ref_run = ddp or DDP(ref, **(ddp_kwargs or {}))
        self.opt, self.ref_opt = optimizers or (model and optimizer(model), ref and optimizer(ref))
        self.losses, self.ref_losses = [], []

    def run(self, steps: int, data: Callable, *, first: int = 0, micro: int = 1, loss: Callable = sum_loss,
            forward_backward: Optional[Callable] = None, ref_forward_backward: Optional[Callable] = None,
            ref_data: Optional[Callable] = None, quiet: Optional[Callable] = None,
            set_to_none: Callable = lambda step: True, zero_at_start: bool = False,
            before_step: Optional[Callable] = None, before_micro: Optional[Callable] = None,
            before_optimizer: Optional[Callable] = None, after_step: Optional[Callable] = None,
            check_loss: bool = True, check_grads: bool = True, params_every_step: bool = False) -> "TrainBoth":
        """Trains steps first .. first+steps-1, each of `micro` microbatches.

        data(step, mb): this rank's batch; loss(m, batch): the loss tensor, or forward_backward(m,
        batch): forward and backward (its own way), returning what is compared (a loss tensor, or
        None for nothing). quiet(step, mb) -> whether that microbatch must not sync: a context for
        `model` there (the reference is put under no_sync), or True when there is no model.
        set_to_none(step): zero_grad's argument after the step (before it with zero_at_start, as
        torch's FSDP2 tests do). before_step(step) and after_step(step) run around a step,
        before_micro(step, mb) before each microbatch (the per-module API's sync flags),
        before_optimizer(step) after the gradients are checked (gradient clipping)."""
        ck, model, ref = self.ck, self.model, self.ref
        fb = forward_backward or backward_of(loss)
        ref_fb = ref_forward_backward or fb
        ref_data = ref_data or data
        optimizers = [o for o in (self.opt, self.ref_opt) if o is not None]
        for step in range(first, first + steps):
            if before_step:
                before_step(step)
            if zero_at_start:
                for o in optimizers:
                    o.zero_grad(set_to_none=set_to_none(step))
            for mb in range(micro):
                if before_micro:
                    before_micro(step, mb)
                context = quiet(step, mb) if quiet else None
                out = ref_out = None
                if model is not None:
                    with context if context not in (None, True) else contextlib.nullcontext():
                        out = fb(model, data(step, mb))
                if ref is not None:
                    ref_quiet = context not in (None, False) and self.reference == "ddp"
                    with self.ref_run.no_sync() if ref_quiet else contextlib.nullcontext():
                        ref_out = ref_fb(self.ref_run, ref_data(step, mb))
                if isinstance(out, torch.Tensor):
                    self.losses.append(out.item())
                if isinstance(ref_out, torch.Tensor):
                    self.ref_losses.append(ref_out.item())
                if ck is not None and check_loss and out is not None:
                    label = f"step {step}{f' microbatch {mb}' if micro > 1 else ''}: loss"
                    if self.reference == "global":
                        total = out.detach().clone()
                        dist.all_reduce(total)
                        ck.close(f"{label} summed over ranks", total, ref_out, *self.tol)
                    else:
                        ck.close(label, out, ref_out, *self.tol)
            if ref is None:
                pass
            elif self.reference == "mean":
                average_grads(ref, self.world)
            elif self.reference == "global":
                with torch.no_grad():
                    for p in ref.parameters():
                        if p.grad is not None:
                            p.grad.div_(self.world)
            elif callable(self.reference):
                self.reference(ref)
            if ck is not None and check_grads:
                ck.grads(f"step {step}", model, ref, *self.tol)
            if before_optimizer:
                before_optimizer(step)
            for o in optimizers:
                o.step()
            if not zero_at_start:
                for o in optimizers:
                    o.zero_grad(set_to_none=set_to_none(step))
            if ck is not None and params_every_step:
                ck.params(f"step {step}", model, ref, *self.tol)
            if after_step:
                after_step(step)
        return self

    def check_params(self, label: str = "after training") -> None:
        self.ck.params(label, self.model, self.ref, *self.tol)


# ------------------------------------------------------------------------------------------
# the per-module API (megatron_fsdp_c.per_module.fully_shard) against DDP


def against_ddp(ck, rank, world, model, ref, data, *, steps=3, loss=sum_loss, optimizer=adam, optimizers=None,
                grads=True, ddp_kwargs=None) -> TrainBoth:
    """`model` (sharded already) and `ref` (its plain copy, put under DDP) train on data(step,
    rank) with zero_grad's set_to_none alternating, as torch's tests do; losses, gradients and
    parameters must match, and the parameters stay DTensors."""
    from torch.distributed.tensor import DTensor
    pair = TrainBoth(rank, world, model, ref, optimizer=optimizer, optimizers=optimizers, ck=ck, ddp_kwargs=ddp_kwargs)
    pair.run(steps, lambda step, mb: data(step, rank), loss=loss, zero_at_start=True,
             set_to_none=lambda step: step % 2 == 0, check_grads=grads)
    pair.check_params()
    ck.true("parameters are DTensors after training", all(isinstance(p, DTensor) for p in model.parameters()),
            str([type(p).__name__ for p in model.parameters()]))
    return pair


def shard_against_ddp(ck, rank, world, model, shard, data, **kwargs) -> TrainBoth:
    """against_ddp of `model` sharded by shard(model), against a copy taken before."""
    ref = copy.deepcopy(model)
    shard(model)
    return against_ddp(ck, rank, world, model, ref, data, **kwargs)


# ------------------------------------------------------------------------------------------
# the Megatron-FSDP API (megatron_fsdp_c.fully_shard) against DDP


REFERENCE_OPTIMIZER = {"fused_adamw": "adamw"}  # what the DDP side of train_pair steps with instead


def make_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "fused_adamw":  # its reference side is torch's AdamW (REFERENCE_OPTIMIZER)
        import megatron_fsdp_c as mf
        return mf.FusedAdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def device_mesh_arg(kind, world):
    if isinstance(kind, torch.distributed.device_mesh.DeviceMesh):
        return kind  # a mesh of the caller's own (hybrid sharding)
    if kind == "group":
        return dist.group.WORLD
    if kind == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return None


def train_pair(rank, world, strategy, optim="adamw", micro=1, *, cfg=CFG, steps=STEPS, dtype=torch.float32,
               use_no_sync=True, freeze=(), alternate_set_to_none=False, mesh=None, **shard_kwargs):
    """Trains the test GPT with megatron_fsdp_c.fully_shard and compares with DDP on the same
    per-rank data. DDP's run does not depend on the strategy or the sharding options, so each spawn
    trains it once per setting (rank_grid.once) for every cell that compares with it.

    use_no_sync: microbatches before the last run inside no_sync() on both sides (else every
    backward syncs on both). freeze: parameter-name prefixes frozen in both models."""
    import megatron_fsdp_c as mf
    from . import rank_grid
    setting = (dataclasses.astuple(cfg), dtype, optim, micro, steps, use_no_sync, tuple(freeze), alternate_set_to_none)
    ref_setting = setting[:2] + (REFERENCE_OPTIMIZER.get(optim, optim),) + setting[3:]
    ref = rank_grid.once(("train_pair DDP",) + ref_setting, _pair_side, rank, world, None, ref_setting)
    return dict(_pair_side(rank, world, lambda model, opt: mf.fully_shard(
        model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, device_mesh=device_mesh_arg(mesh, world),
        **shard_kwargs), setting), ref_losses=ref["losses"], ref_params=ref["params"])


def _pair_side(rank, world, shard, setting):
    """One side of train_pair: DDP (shard None) or the model shard(model, optimizer) returns."""
    cfg, dtype, optim, micro, steps, use_no_sync, freeze, alternate_set_to_none = setting
    torch.manual_seed(0)
    model = GPT(GPTConfig(*cfg)).to(dtype)
    for name, p in model.named_parameters():
        if any(name.startswith(f) for f in freeze):
            p.requires_grad_(False)
    opt = make_optimizer(optim, [p for p in model.parameters() if p.requires_grad])
    ours = shard is not None
    fsdp, opt = shard(model, opt) if ours else (None, opt)
    pair = TrainBoth(rank, world, fsdp, None if ours else model, optimizers=(opt, None) if ours else (None, opt))

    def quiet(step, mb):
        if not use_no_sync or mb == micro - 1:
            return None
        return fsdp.no_sync() if ours else True
    per_step, before = [], {}
    pair.run(steps, lambda step, mb: batch(GPTConfig(*cfg), 2, seed=10_000 * step + 100 * mb + rank), micro=micro,
             loss=lambda m, xy: m(*xy), quiet=quiet,
             set_to_none=(lambda step: step % 2 == 0) if alternate_set_to_none else (lambda step: True),
             before_step=lambda step: ours and before.update(fsdp.comm_stats()),
             after_step=lambda step: ours and per_step.append({k: v - before[k]
                                                               for k, v in fsdp.comm_stats().items()}))
    if not ours:
        return dict(losses=pair.ref_losses, params={n: p.detach().clone() for n, p in model.named_parameters()})
    return dict(losses=pair.losses, params=fsdp.full_parameters(), per_step=per_step, memory=fsdp.memory_report(opt, locations=True),
                model=fsdp)


def assert_match(result, exact=False, rtol=1e-5, atol=1e-6):
    # python floats: a float64 tensor holds fp32 and float64 losses exactly
    losses = torch.tensor(result["losses"], dtype=torch.float64)
    ref_losses = torch.tensor(result["ref_losses"], dtype=torch.float64)
    params, ref_params = result["params"], result["ref_params"]
    assert set(params) == set(ref_params)
    if exact:
        assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
        for name in ref_params:
            assert torch.equal(params[name], ref_params[name]), name
        return
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=atol)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=rtol, atol=atol, msg=name)
