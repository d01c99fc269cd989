"""FusedAdamW(step_in_backward=True) ([Note: stepping in backward] in
megatron_fsdp_c/_backward_step.py): each ZeRO-2/3 bucket steps inside the backward as its
gradients land, on the optimizer's worker thread, and training is the same as stepping after the
backward: bit for bit against step_in_backward=False, and against DDP with torch's AdamW in
float64, with two parameter groups, an LR schedule and gradient accumulation, in both APIs, with
CPU offload and without. Strategies whose gradients are final only at the sync (ZeRO-1, no_shard,
HSDP) step at optimizer.step() instead, and what would make a step taken in the backward wrong
(clipping, hyperparameters changed, a second syncing backward) raises."""
import copy

import time

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import Block

from support import rank_grid
from support.checks import full, recorder_cells, verify
from support.tiny_models import Named, gpt, gpt_data, gpt_loss, shard_blocks
from support.train_both import TrainBoth

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)
MICRO = 2
STEPS = 3
LAYERS = 5  # enough units that the backward gathers more while the first steps run


def groups(model: nn.Module) -> list:
    """Two parameter groups: matrices with weight decay, the rest without (and another LR)."""
    named = list(model.named_parameters())
    return [dict(params=[p for _, p in named if p.ndim >= 2], weight_decay=0.1),
            dict(params=[p for _, p in named if p.ndim < 2], weight_decay=0.0, lr=5e-3)]


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def sharded(api: str, strategy, offload: bool, step_in_backward: bool, mesh=None):
    """The test GPT sharded by `api`, its FusedAdamW and the model to train (the wrapper)."""
    model = gpt(layers=LAYERS)
    if api == "per_module":  # the optimizer on the sharded parameters, as with FSDP2
        kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if offload else {}
        shard_blocks(model, zero_dp_strategy=strategy, **kw, **(dict(mesh=mesh) if mesh is not None else {}))
        return model, mf.FusedAdamW(groups(model), lr=1e-2, step_in_backward=step_in_backward)
    opt = mf.FusedAdamW(groups(model), lr=1e-2, step_in_backward=step_in_backward)
    return mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                          optimizer_cpu_offload=offload)


def quiet_of(api, model):
    """The non-last microbatches accumulate with sync off (each API's own way)."""
    if api == "per_module":
        return (lambda step, mb: True if mb < MICRO - 1 else None,
                lambda step, mb: model.set_requires_gradient_sync(mb == MICRO - 1))
    return lambda step, mb: model.no_sync() if mb < MICRO - 1 else None, None


def steppers(model):
    """The BackwardSteps of every engine of `model` ([Note: stepping in backward])."""
    if hasattr(model, "owners"):
        return [o.hooks.backward_steps for o in model.owners()]
    return [model._mfsdp_group.owner.hooks.backward_steps]


@cell("per_module[zero3, offload]", worlds=(2, 4), api="per_module", strategy="optim_grads_params", offload=True)
@cell("per_module[zero2]", worlds=(2,), api="per_module", strategy="optim_grads", offload=False)
@cell("per_module[zero1, after]", worlds=(2,), api="per_module", strategy="optim", offload=True, in_backward=False)
@cell("per_module[hsdp, after]", worlds=(4,), api="per_module", strategy="optim_grads_params", offload=True,
      in_backward=False, hsdp=True)
@cell("megatron[3, offload]", worlds=(2, 4), api="megatron", strategy=3, offload=True)
@cell("megatron[2, offload]", worlds=(2,), api="megatron", strategy=2, offload=True)
@cell("megatron[1, after]", worlds=(2,), api="megatron", strategy=1, offload=True, in_backward=False)
def against_ddp(rank, world, ck, api, strategy, offload, in_backward=True, hsdp=False):
    """float64 against DDP + torch.optim.AdamW (same groups and schedule); bit for bit against the
    same script stepping after the backward; `in_backward`: buckets stepped while the backward ran and
    the weights updated before optimizer.step(), else (gradients final at the sync only) none."""
    mesh = rank_grid.device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard")) if hsdp else None
    finals = {}
    for step_in_backward in (True, False):
        model, opt = sharded(api, strategy, offload, step_in_backward, mesh)
        ref = ref_opt = None  # the second run: the same script alone
        if step_in_backward:
            ref = gpt(layers=LAYERS) if api == "per_module" else Named(gpt(layers=LAYERS))
            ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2)
        scheds = [schedule(o) for o in (opt, ref_opt) if o is not None]
        quiet, before_micro = quiet_of(api, model)
        seen = {"during": 0, "at_end": 0, "waits": 0, "passed": 0, "moved": True, "still": True}

        def snapshot(step, mb):
            if before_micro:
                before_micro(step, mb)
            if mb == MICRO - 1:
                seen["before"] = [p._local_tensor.clone() for p in model.parameters()]

        def after_backward(step):  # gradients checked; the optimizers not stepped yet
            opt._join()
            moved = [not torch.equal(p._local_tensor, b) for p, b in zip(model.parameters(), seen["before"])
                     if b.numel()]
            seen["moved"] &= all(moved)
            seen["still"] &= not any(moved)
            for s in steppers(model):
                seen["during"] += s.counts["during"]
                seen["at_end"] += s.counts["at_end"]
                seen["waits"] += s.counts["waits"]
                seen["passed"] += s.counts["passed"]

        pair = TrainBoth(rank, world, model, ref, optimizers=(opt, ref_opt), ck=ck if step_in_backward else None)
        pair.run(STEPS, lambda step, mb: gpt_data(10 * step + mb, rank), micro=MICRO, loss=gpt_loss, quiet=quiet,
                 before_micro=snapshot, before_optimizer=after_backward,
                 after_step=lambda step: [s.step() for s in scheds])
        if step_in_backward:
            pair.check_params()
            if in_backward:  # ZeRO-2's units stay gathered: their backward has no gathers to go on
                ck.true("buckets stepped while the backward ran, the rest at its end",
                        seen["during"] > 0 and seen["at_end"] > 0, f"{seen['during']} {seen['at_end']}")
                ck.true("every weight stepped before optimizer.step()", seen["moved"])
                ck.true("gathers of the backward went on while steps ran, none waited for one",
                        seen["waits"] == 0 and (seen["passed"] > 0 or strategy in (2, "optim_grads")),
                        f"{seen['waits']} waited, {seen['passed']} went on while steps ran")
            else:
                ck.true("no bucket stepped in the backward", seen["during"] == seen["at_end"] == 0,
                        f"{seen['during']} {seen['at_end']}")
                ck.true("no weight changed before optimizer.step()", seen["still"])
        finals[step_in_backward] = [full(p) for p in model.parameters()]
    ck.true("bit for bit as stepping after the backward",
            all(torch.equal(a, b) for a, b in zip(finals[True], finals[False])))


class _LandingLate:
    """An engine whose buckets' gradients land 50 ms after finish_grads (wait_grads sleeps first)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def wait_grads(self, bucket):
        time.sleep(0.05)
        self.engine.wait_grads(bucket)


def _one_step(model, opt, rank, backwards=1):
    for k in range(backwards):
        gpt_loss(model, gpt_data(k, rank)).backward()


@cell("refusals", worlds=(2,))
def refusals(rank, world, ck):
    """What would make a step taken in the backward differ from optimizer.step()'s raises there,
    naming the fix: a gradient changed since (clipping), a hyperparameter changed since, a second
    syncing backward before the step (which raises in that backward, before it steps again)."""
    def expect(label, fn, match):
        try:
            fn()
        except RuntimeError as e:
            ck.true(label, match in str(e), str(e))
        else:
            ck.true(label, False, "no error")

    model, opt = sharded("per_module", "optim_grads_params", True, True)
    _one_step(model, opt, rank)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    expect("clipping after the backward", opt.step, "step_in_backward=False to change gradients")
    opt.zero_grad()
    # gradients that land late (a busy GPU): the backward's end still waits for every fingerprint,
    # so clipping right after it is caught, not stepped unseen
    owner = model._mfsdp_group.owner
    owner.param_buffer.engine = _LandingLate(owner.param_buffer.engine)
    _one_step(model, opt, rank)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    expect("clipping after a backward whose gradients landed late", opt.step,
           "step_in_backward=False to change gradients")
    opt.zero_grad()
    owner.param_buffer.engine = owner.param_buffer.engine.engine

    _one_step(model, opt, rank)
    opt.param_groups[0]["lr"] = 0.5
    expect("an LR set between backward and step", opt.step, "LR schedulers step after optimizer.step()")
    opt.zero_grad()

    model, opt = sharded("megatron", 3, False, True)
    _one_step(model, opt, rank)
    opt.step()
    opt.zero_grad()
    before = [full(p) for p in model.parameters()]
    loss = gpt_loss(model, gpt_data(1, rank))
    loss.backward()
    opt._join()  # the stepped weights are the worker's until joined
    after_first = [full(p) for p in model.parameters()]
    ck.true("the first backward stepped", not any(torch.equal(a, b) for a, b in zip(before, after_first)))
    expect("a second syncing backward before optimizer.step()",
           lambda: gpt_loss(model, gpt_data(2, rank)).backward(), "a second backward that syncs gradients")

    # .to()/.double() hands the engine's buffers back: not while the worker may still write them, and
    # not between the backward that stepped and optimizer.step() (which skips what was stepped)
    model, opt = sharded("per_module", "optim_grads_params", False, True)
    _one_step(model, opt, rank)
    expect(".double() between a stepping backward and optimizer.step()", model.double,
           "and optimizer.step(): call optimizer.step() first")
    ck.true("the refused conversion waited for the steps", not opt._pending, f"{len(opt._pending)} steps in flight")
    # a forward or unshard() in between joins the steps, and optimizer.step() still has to skip them
    with torch.no_grad():
        gpt_loss(model, gpt_data(3, rank))
    expect(".double() after a forward between the stepping backward and optimizer.step()", model.double,
           "and optimizer.step(): call optimizer.step() first")
    model.unshard()
    model.reshard()
    expect(".double() after unshard() between the stepping backward and optimizer.step()", model.double,
           "and optimizer.step(): call optimizer.step() first")
    opt.step()
    opt.zero_grad()
    model.double()  # after the step: converted as usual (the same dtype: a new engine), and training goes on
    _one_step(model, opt, rank)
    opt.step()
    ck.true("training goes on after the conversion", all(bool(torch.isfinite(full(p)).all()) for p in model.parameters()))


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys(), {}))
def test_backward_step(name, world):
    verify(CELLS, name, world)


def test_step_in_backward_must_be_a_bool():
    with pytest.raises(TypeError, match="step_in_backward must be True or False, got 1"):
        mf.FusedAdamW([torch.zeros(2, requires_grad=True)], step_in_backward=1)


def test_plain_tensors_step_as_torch_adamw():
    """Outside a megatron_fsdp_c model nothing steps in a backward: step() is torch's AdamW."""
    torch.manual_seed(0)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    v = w.detach().clone().requires_grad_(True)
    ours, theirs = mf.FusedAdamW([w], lr=0.1, step_in_backward=True), torch.optim.AdamW([v], lr=0.1)
    for _ in range(3):
        for p, o in ((w, ours), (v, theirs)):
            (p * p).sum().backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(w, v, rtol=1e-12, atol=0)
