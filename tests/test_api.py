"""The Megatron-FSDP API surface: fully_shard_model + fully_shard_optimizer, dotted unit names,
param groups kept, sync()/set_model_auto_sync, what the modules hold between passes."""
import copy
import traceback

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, batch

from common import CFG
from conftest import get_run


def _two_groups(params_by_name):
    decay = [p for n, p in params_by_name if p.dim() >= 2]
    no_decay = [p for n, p in params_by_name if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1, "lr": 1e-2}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]


def api_checks(rank, world):
    out = {}

    def check(name, fn):
        try:
            out[name] = ("ok", fn())
        except Exception:  # noqa: BLE001
            out[name] = ("error", traceback.format_exc())

    def separate_calls():
        torch.manual_seed(0)
        model = GPT(CFG)
        ref = DDP(copy.deepcopy(model))
        fsdp = mf.fully_shard_model(model, fsdp_unit_modules=["megatron_fsdp_c.testing.Block"],
                                    zero_dp_strategy="optim_grads_params")
        opt = mf.fully_shard_optimizer(torch.optim.AdamW(_two_groups(fsdp.named_parameters())))
        ref_opt = torch.optim.AdamW(_two_groups(ref.module.named_parameters()))
        for step in range(3):
            x, y = batch(CFG, 2, seed=step * 10 + rank)
            fsdp(x, y).backward()
            ref(x, y).backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        full = fsdp.full_parameters()
        worst = max((full[n] - p).abs().max().item() for n, p in ref.module.named_parameters())
        groups = [(g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
        return dict(worst=worst, groups=groups, units=len(fsdp.hooks.units))

    def between_passes():
        torch.manual_seed(0)
        model = GPT(CFG)
        fsdp, _ = mf.fully_shard(model, None, fsdp_unit_modules=[Block])
        w = fsdp.module.blocks[0].fc.weight
        names = [n for n, _ in fsdp.named_parameters()]
        return dict(is_dtensor=isinstance(w, DTensor), printable=float(w.to_local().sum()) == float(w.to_local().sum()),
                    first_name=names[0], count=len(names), all_dtensor=all(isinstance(p, DTensor)
                                                                           for p in fsdp.parameters()))

    def sync_contexts():
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

    def step_without_sync_kwargs():
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

    check("separate_calls", separate_calls)
    check("between_passes", between_passes)
    check("sync_contexts", sync_contexts)
    check("step_kwargs", step_without_sync_kwargs)
    return out


def _get(name):
    results = get_run(api_checks, 2)
    for rank, res in enumerate(results):
        status, value = res[name]
        assert status == "ok", f"rank {rank}:\n{value}"
    return results[0][name][1]


def test_fully_shard_model_then_optimizer_keeps_param_groups():
    r = _get("separate_calls")
    assert r["units"] == CFG.layers  # units given as a dotted string
    assert r["groups"][0][:2] == (1e-2, 0.1) and r["groups"][1][:2] == (3e-3, 0.0)
    assert r["worst"] < 1e-5, r


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
