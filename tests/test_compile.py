"""torch.compile of a sharded model: it trains like DDP, and Dynamo breaks its graph at most once
per step (the unit hooks, which run eagerly as FSDP2's do; see [Note: compile] in _hooks.py).

The Dynamo "eager" backend traces exactly as inductor would (graph breaks are Dynamo's) without
generating code, which keeps this test fast.
"""
import collections
import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid
from support.checks import ATOL, RTOL
from support.train_both import TrainBoth

CFG = GPTConfig(vocab=64, seq=8, d=32, heads=4, layers=3)
MAX_BREAKS = {0: 0, 1: 1, 2: 1, 3: 1}  # measured: FSDP2 has 0 on the same model
CELLS = rank_grid.Cells(__name__)


def compiled_vs_ddp(rank, world, strategy):
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = GPT(CFG).double()
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    compiled = torch.compile(fsdp, backend="eager")
    dynamo.reset()
    counters.clear()
    breaks = []

    def count_breaks(step):
        if step == 0:
            breaks.append(sum(collections.Counter(counters["graph_break"]).values()))
    pair = TrainBoth(rank, world, compiled, ref, optimizers=(opt, ref_opt), ddp=ddp)
    pair.run(3, lambda step, mb: batch(CFG, 2, seed=10 * step + rank), loss=lambda m, xy: m(*xy),
             before_optimizer=count_breaks)
    losses, ref_losses, breaks = pair.losses, pair.ref_losses, breaks[0]
    params = fsdp.full_parameters()
    diff = max((params[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    return dict(losses=losses, ref_losses=ref_losses, breaks=breaks,
                later_breaks=sum(counters["graph_break"].values()) - breaks, param_diff=diff)


for _strategy in (0, 1, 2, 3):
    CELLS.add(_strategy, compiled_vs_ddp, _strategy, match=dict(strategy=_strategy))


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_compiled_model_trains_like_ddp(strategy):
    for r in CELLS.result(strategy, 2):
        torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                                   torch.tensor(r["ref_losses"], dtype=torch.float64), rtol=RTOL, atol=ATOL)
        assert r["param_diff"] < 1e-9, r["param_diff"]
        assert r["breaks"] <= MAX_BREAKS[strategy], f"{r['breaks']} graph breaks (at most {MAX_BREAKS[strategy]})"
        assert r["later_breaks"] == 0, "later steps recompiled with new graph breaks"


def inductor_both_apis(rank, world, api):
    """The default backend (inductor: generated code, AOTAutograd's functionalized graphs around
    the unit hooks) on a float32 GPT, both APIs, against the same model eager under DDP: the same
    losses and parameters to float32 rounding (inductor fuses, so the last bits differ; float64
    models are checked with the eager backend above, as torch 2.11's inductor cannot compile a
    float64 causal attention backward on the CPU, pytorch/pytorch#185539)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    if api == "megatron":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block])
    else:
        from megatron_fsdp_c.per_module import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model)
    losses, ref_losses = [], []
    for step in range(2):
        x, y = batch(CFG, 2, seed=10 * step + rank)
        for m, o, out in ((compiled, opt, losses), (ref, ref_opt, ref_losses)):
            loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    params = model.full_parameters() if api == "megatron" else {n: p.full_tensor() for n, p in model.named_parameters()}
    diff = max((params[n] - p.detach()).abs().max().item() for n, p in ref.module.named_parameters())
    return dict(losses=losses, ref_losses=ref_losses, param_diff=diff)


for _api in ("megatron", "per_module"):
    CELLS.add(("inductor", _api), inductor_both_apis, _api, match=dict(api=_api))


@pytest.mark.parametrize("api", ["megatron", "per_module"])
def test_inductor_compiled_model_trains_like_ddp(api):
    for r in CELLS.result(("inductor", api), 2):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=1e-6)
        assert r["param_diff"] < 1e-5, r["param_diff"]
