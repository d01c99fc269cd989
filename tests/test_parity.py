"""Training parity with DistributedDataParallel: every strategy, world sizes 1, 2, 4, AdamW
and SGD, 1 and 3 microbatches, 5 steps on different per-rank data (fp32).

[Note: reduction order at world 4]
With two ranks a sum a+b is the same in any order, so no_shard is bit-identical to DDP. With
four, gloo's all-reduce/reduce-scatter sums each element in an order set by its position in the
buffer; DDP's buckets and ours place parameters differently, so about a third of the reduced
gradient elements differ in the last bit (measured: 12-15k of 42k elements between DDP and the
same gradients reduced in another layout). SGD keeps that at 1e-7. Adam divides by sqrt(v):
for elements whose rank contributions nearly cancel, last-bit noise of the *terms* is a large
part of the *sum*, and Adam turns it into up to ~1e-4 of parameter difference after 5 steps.
ZeRO-2/3 with several microbatches meet the same effect at any world size: they reduce every
microbatch and sum the averages, DDP averages the sum once (measured at world 2: 2.9e-6 on one
bias after 5 AdamW steps). So in these order-sensitive cases (AdamW, and world 4 or ZeRO-2/3
with microbatches) the losses must still match to rtol 1e-5, the fp32 parameters to atol 1e-3
(a wrong gradient would be off by lr-sized steps), and the same run in float64 -- where the
order noise is 1e-16 -- must match DDP to rtol 1e-7.
"""
import contextlib
import copy
import itertools
import traceback

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from conftest import get_run

STRATEGIES = [0, 1, 2, 3]
OPTIMIZERS = ["adamw", "sgd"]
MICROBATCHES = [1, 3]
STEPS = 5
CFG = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=3)
COMBOS = tuple(itertools.product(STRATEGIES, OPTIMIZERS, MICROBATCHES))


def make_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_pair(rank, world, strategy, optim, micro, cfg=CFG, steps=STEPS, dtype=torch.float32, **shard_kwargs):
    """Trains the same model with fully_shard and with DDP; returns losses and final params."""
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    ref_opt = make_optimizer(optim, ref.parameters())
    opt = make_optimizer(optim, model.parameters())
    fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, **shard_kwargs)
    losses, ref_losses = [], []
    for step in range(steps):
        for m in range(micro):
            x, y = batch(cfg, 2, seed=10_000 * step + 100 * m + rank)
            last = m == micro - 1
            with contextlib.nullcontext() if last else fsdp.no_sync():
                loss = fsdp(x, y)
                loss.backward()
            with contextlib.nullcontext() if last else ddp.no_sync():
                ref_loss = ddp(x, y)
                ref_loss.backward()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    full = fsdp.full_parameters()
    return dict(losses=losses, ref_losses=ref_losses, params=full,
                ref_params={n: p.detach().clone() for n, p in ref.named_parameters()})


def order_sensitive(world, strategy, optim, micro):
    """See [Note: reduction order at world 4]."""
    return optim == "adamw" and (world > 2 or (world > 1 and strategy >= 2 and micro > 1))


def parity_grid(rank, world):
    out = {}
    for combo in COMBOS:
        try:
            out[combo] = ("ok", train_pair(rank, world, *combo))
            if order_sensitive(world, *combo):
                out[combo + ("float64",)] = ("ok", train_pair(rank, world, *combo, dtype=torch.float64))
        except Exception:  # noqa: BLE001 - reported by the test of this combo
            out[combo] = ("error", traceback.format_exc())
    return out


def assert_match(result, exact=False, rtol=1e-5, atol=1e-6, param_atol=None):
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(result["ref_losses"])
    params, ref_params = result["params"], result["ref_params"]
    assert set(params) == set(ref_params)
    if exact:
        assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
        for name in ref_params:
            assert torch.equal(params[name], ref_params[name]), name
        return
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=atol)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=rtol,
                                   atol=atol if param_atol is None else param_atol, msg=name)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy,optim,micro", COMBOS)
def test_parity_with_ddp(world, strategy, optim, micro):
    per_rank = get_run(parity_grid, world)
    for rank, grid in enumerate(per_rank):
        status, result = grid[(strategy, optim, micro)]
        assert status == "ok", f"rank {rank}:\n{result}"
        if order_sensitive(world, strategy, optim, micro):
            assert_match(result, param_atol=1e-3)
            assert_match(grid[(strategy, optim, micro, "float64")][1], rtol=1e-7, atol=1e-9)
        else:
            # no_shard reduces like DDP: bit-identical where the sum order cannot differ (2 ranks).
            assert_match(result, exact=(strategy == 0 and world <= 2))
