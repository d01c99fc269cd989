"""The Megatron-FSDP API surface: fully_shard_model + fully_shard_optimizer, dotted unit names,
param groups kept, sync()/set_model_auto_sync, what the modules hold between passes."""
import copy

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, batch

from support import rank_grid
from support.train_both import CFG, TrainBoth

CELLS = rank_grid.Cells(__name__)


def _two_groups(params_by_name):
    decay = [p for n, p in params_by_name if p.dim() >= 2]
    no_decay = [p for n, p in params_by_name if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1, "lr": 1e-2}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]


@CELLS.cell("separate_calls", tests=["test_fully_shard_model_then_optimizer_keeps_param_groups"])
def separate_calls(rank, world):
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    fsdp = mf.fully_shard_model(model, fsdp_unit_modules=["megatron_fsdp_c.testing.Block"],
                                zero_dp_strategy="optim_grads_params")
    opt = mf.fully_shard_optimizer(torch.optim.AdamW(_two_groups(fsdp.named_parameters())))
    ref_opt = torch.optim.AdamW(_two_groups(ref.named_parameters()))
    TrainBoth(rank, world, fsdp, ref, optimizers=(opt, ref_opt), ddp=ddp).run(
        3, lambda step, mb: batch(CFG, 2, seed=step * 10 + rank), loss=lambda m, xy: m(*xy))
    full = fsdp.full_parameters()
    worst = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    groups = [(g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
    return dict(worst=worst, groups=groups, units=len(fsdp.hooks.unit_states))


@CELLS.cell("between_passes", tests=["test_modules_hold_dtensor_shards_between_passes"])
def between_passes(rank, world):
    torch.manual_seed(0)
    model = GPT(CFG)
    fsdp, _ = mf.fully_shard(model, None, fsdp_unit_modules=[Block])
    w = fsdp.module.blocks[0].fc.weight
    names = [n for n, _ in fsdp.named_parameters()]
    return dict(is_dtensor=isinstance(w, DTensor), printable=float(w.to_local().sum()) == float(w.to_local().sum()),
                first_name=names[0], count=len(names), all_dtensor=all(isinstance(p, DTensor)
                                                                       for p in fsdp.parameters()))


@CELLS.cell("sync_contexts", tests=["test_sync_context_and_auto_sync"])
def sync_contexts(rank, world):
    torch.manual_seed(0)
    fsdp, _ = mf.fully_shard(GPT(CFG), None, fsdp_unit_modules=[Block], zero_dp_strategy=1,
                             sync_model_each_microbatch=False)
    seen = [fsdp.model_auto_sync]
    with fsdp.sync():
        seen.append(fsdp.model_auto_sync)
        x, y = batch(CFG, 2, seed=rank)
        fsdp(x, y).backward()
        synced = all(r.dist_param.grad is not None for r in fsdp.param_buffer.records)
    seen.append(fsdp.model_auto_sync)
    fsdp.set_model_auto_sync(True)
    seen.append(fsdp.model_auto_sync)
    return dict(seen=seen, synced=synced)


@CELLS.cell("step_kwargs", tests=["test_step_keyword_arguments"])
def step_without_sync_kwargs(rank, world):
    torch.manual_seed(0)
    model = GPT(CFG)
    fsdp, opt = mf.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[Block],
                               zero_dp_strategy=3)
    x, y = batch(CFG, 2, seed=rank)
    fsdp(x, y).backward()
    before = fsdp.full_parameters()["blocks.0.fc.weight"]
    opt.step(install_optimized_model_weights=False)
    after_main = fsdp.full_parameters()["blocks.0.fc.weight"]
    fsdp.install_optimized_model_weights()
    return dict(main_moved=not torch.equal(before, after_main))


@CELLS.cell("synchronize", tests=["test_synchronize_waits"])
def synchronize_waits(rank, world):
    """Megatron-FSDP's waits, synchronize_gradient_reduce() and synchronize_param_gather(): around
    a step they change no number; inside a backward (a gradient hook) they raise, saying when to
    call them, and the next call ends that backward, so training goes on."""
    def build():
        torch.manual_seed(0)
        model = GPT(CFG)
        return mf.fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block],
                              zero_dp_strategy=3)

    full = {}
    for waits in (False, True):
        fsdp, opt = build()
        for step in range(2):
            fsdp(*batch(CFG, 2, seed=step * 10 + rank)).backward()
            if waits:
                fsdp.synchronize_gradient_reduce()
            opt.step()
            opt.zero_grad()
            if waits:
                fsdp.synchronize_param_gather()
        full[waits] = fsdp.full_parameters()
    out = dict(worst=max((full[True][n] - full[False][n]).abs().max().item() for n in full[False]))

    fsdp, opt = build()
    def wait_in_backward(mod, args, y):
        y.register_hook(lambda g: fsdp.synchronize_gradient_reduce())

    hook = fsdp.module.blocks[0].register_forward_hook(wait_in_backward)
    try:  # the hook runs after the later blocks' backward: inside ours
        fsdp(*batch(CFG, 2, seed=rank)).backward()
        out["inside"] = "no error"
    except RuntimeError as e:
        out["inside"] = str(e)
    hook.remove()
    fsdp.synchronize_gradient_reduce()  # ends the backward that raised, as its final callback would have
    before = fsdp.full_parameters()
    loss = fsdp(*batch(CFG, 2, seed=rank + 5))
    loss.backward()
    opt.step()
    after = fsdp.full_parameters()
    out["trains_on"] = bool(torch.isfinite(loss)) and all(not torch.equal(before[n], after[n]) for n in before)
    return out


def _get(name):
    return CELLS.result(name, 2)[0]


def test_fully_shard_model_then_optimizer_keeps_param_groups():
    r = _get("separate_calls")
    assert r["units"] == CFG.layers  # units given as a dotted string
    assert r["groups"][0][:2] == (1e-2, 0.1) and r["groups"][1][:2] == (3e-3, 0.0)
    assert r["worst"] == 0.0, r  # 2 ranks, one backward a step: DDP's sums, bit for bit


def test_modules_hold_dtensor_shards_between_passes():
    r = _get("between_passes")
    assert r["is_dtensor"] and r["printable"] and r["all_dtensor"]
    assert r["first_name"] == "module.tok.weight"
    assert r["count"] == len(list(GPT(CFG).parameters()))


def test_sync_context_and_auto_sync():
    r = _get("sync_contexts")
    assert r["seen"] == [False, True, False, True]
    assert r["synced"], "a backward inside sync() attaches the reduced gradients"


def test_step_keyword_arguments():
    assert _get("step_kwargs")["main_moved"]


def test_synchronize_waits():
    r = _get("synchronize")
    assert r["worst"] == 0.0, r  # the same reductions in the same order: bit for bit
    assert "drain inside a backward pass" in r["inside"] and "after the backward" in r["inside"], r["inside"]
    assert r["trains_on"], r
