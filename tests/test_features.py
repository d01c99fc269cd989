"""Core features against DDP (world 2, SGD, every strategy): tied weights, frozen parameters,
activation checkpointing, averaging modes, microbatch sync modes, process groups and meshes,
plus the collectives each strategy issues. Bit for bit in fp32 where the library reduces the same
sums as DDP, else in float64 to rtol 1e-9 (see [Note: reduction order] in test_parity.py)."""
import dataclasses

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.testing import GPT, Block, batch

from support import rank_grid
from support.checks import ATOL, RTOL
from support.train_both import CFG, assert_match, train_pair

FEATURES = {
    "tied_weights": dict(cfg=dataclasses.replace(CFG, tied=True)),
    "frozen_parameters": dict(freeze=("tok.", "blocks.0.", "blocks.2.ln")),
    "activation_checkpointing": dict(cfg=dataclasses.replace(CFG, checkpoint=True)),
    "average_in_collective": dict(average_in_collective=True),
    "sync_every_microbatch": dict(micro=3, use_no_sync=False),
    "auto_sync_off_no_last_microbatch": dict(micro=3, use_no_sync=False, sync_model_each_microbatch=False),
    "auto_sync_off_with_no_sync": dict(micro=3, sync_model_each_microbatch=False),
    "process_group_as_mesh": dict(mesh="group"),
    "device_mesh": dict(mesh="mesh"),
    "zero_grad_set_to_none_alternating": dict(alternate_set_to_none=True),
    "small_buckets": dict(bucket_size=500, reduce_queue_bytes=1),
}
STRATEGIES = [0, 1, 2, 3]
CELLS = rank_grid.Cells(__name__)
# Where the sums differ from DDP's with 3 microbatches: with every backward syncing, DDP
# all-reduces each microbatch's gradient added to the average so far, while ZeRO-1 reduces the
# local sum once per step and ZeRO-2/3 add each microbatch's average to theirs; with auto-sync
# off and no last-microbatch mark the library reduces the local sum once, DDP every microbatch;
# with no_sync, ZeRO-2/3 reduce each microbatch, DDP the sum once.
ORDER_DIFFERS = {"sync_every_microbatch": {1, 2, 3}, "auto_sync_off_no_last_microbatch": {0, 1, 2, 3},
                 "auto_sync_off_with_no_sync": {2, 3}}


def same_order(name, strategy):
    return strategy not in ORDER_DIFFERS.get(name, ())


def _feature_run(rank, world, strategy, name):
    kwargs = dict(FEATURES[name])
    dtype = torch.float32 if same_order(name, strategy) else torch.float64
    result = train_pair(rank, world, strategy, "sgd", dtype=dtype, **kwargs)
    model = result.pop("model")
    engine, buf = model.param_buffer.engine, model.param_buffer
    facts = {}
    if name == "tied_weights":
        facts["shared"] = model.module.head.weight is model.module.tok.weight
        facts["records"] = sum(1 for r in buf.records if r.name in ("tok.weight", "head.weight"))
    if name == "frozen_parameters":
        frozen = [r for r in buf.records if not r.requires_grad]
        facts["frozen_have_no_grad"] = all(r.dist_param.grad is None for r in frozen) and len(frozen) > 0
        facts["frozen_buckets_have_no_grad_memory"] = all(
            engine.tensor(r.bucket, _C.BUF_GRAD) is None for r in frozen)
        facts["requires_grad_kept"] = all(not r.dist_param.requires_grad for r in frozen)
    if name == "activation_checkpointing":
        facts["released"] = [engine.weight_state(b) for b in buf.weight_sharded_buckets()]
    return result, facts


for _strategy in STRATEGIES:
    for _name in FEATURES:
        CELLS.add((_strategy, _name), _feature_run, _strategy, _name, tests=["test_feature_matches_ddp"],
                  match=dict(name=_name, strategy=_strategy))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(FEATURES))
def test_feature_matches_ddp(name, strategy):
    for result, facts in CELLS.result((strategy, name), 2):
        if same_order(name, strategy):
            assert result["params"]["tok.weight"].dtype == torch.float32
            assert_match(result, exact=True)
        else:
            assert result["params"]["tok.weight"].dtype == torch.float64
            assert_match(result, rtol=RTOL, atol=ATOL)
        if name == "tied_weights":
            assert facts == {"shared": True, "records": 1}
        if name == "frozen_parameters":
            assert all(facts.values()), facts
        if name == "activation_checkpointing":
            assert all(s == "empty" for s in facts["released"]), facts


# -- one rank, every collective still issued (how the NCCL transport is tested on one GPU) ------

def single_rank_collectives(rank, world, strategy):
    result = train_pair(rank, world, strategy, "adamw", micro=2, single_rank_collectives=True)
    stats = result.pop("model").comm_stats()
    return result, stats


for _strategy in STRATEGIES:
    CELLS.add(("single rank collectives", _strategy), single_rank_collectives, _strategy, worlds=(1,),
              tests=["test_single_rank_collectives_match_ddp"], match=dict(strategy=_strategy))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_single_rank_collectives_match_ddp(strategy):
    result, stats = CELLS.result(("single rank collectives", strategy), 1)[0]
    assert stats["reduce_scatters"] + stats["all_reduces"] > 0
    if strategy == 3:
        assert stats["all_gathers"] > 0
    assert_match(result, exact=True)  # one rank: nothing to reorder


# -- per-token loss: gradients are summed over ranks, not averaged ------------------------------

def per_token_grads(rank, world, strategy):
    torch.manual_seed(0)
    model = GPT(CFG)
    ref = DDP(GPT(CFG))
    ref.module.load_state_dict(model.state_dict())
    fsdp, _ = mf.fully_shard(model, None, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                             calculate_per_token_loss=True)
    x, y = batch(CFG, 2, seed=rank)
    fsdp(x, y).backward()
    ref(x, y).backward()
    grads = fsdp.full_grads()
    return {n: (grads[n], p.grad * world) for n, p in ref.module.named_parameters()}


for _strategy in STRATEGIES:
    CELLS.add(("per-token loss", _strategy), per_token_grads, _strategy, tests=["test_per_token_loss_sums_gradients"],
              match=dict(strategy=_strategy))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_token_loss_sums_gradients(strategy):
    grads = CELLS.result(("per-token loss", strategy), 2)[0]
    for name, (ours, ddp_times_world) in grads.items():  # 2 ranks, one backward: DDP's sums
        assert torch.equal(ours, ddp_times_world), name


# -- collectives per step -----------------------------------------------------------------------

@CELLS.cell("collectives per step", tests=["test_collectives_per_strategy"])
def count_collectives(rank, world):
    out = {}
    for strategy in STRATEGIES + ["3 with a one-bucket queue"]:
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tight = dict(reduce_queue_bytes=1) if isinstance(strategy, str) else {}  # completes reductions early
        fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=int(str(strategy)[0]),
                                   **tight)
        buf = fsdp.param_buffer
        units = [b for b, bp in enumerate(buf.plan) if bp["unit"] >= 0]
        roots = [b for b, bp in enumerate(buf.plan) if bp["unit"] < 0]
        steps = []
        for step in range(2):
            before = fsdp.comm_stats()
            for m in range(3):
                x, y = batch(CFG, 2, seed=100 * step + 10 * m + rank)
                with fsdp.no_sync() if m < 2 else torch.enable_grad():
                    fsdp(x, y).backward()
            opt.step()
            opt.zero_grad()
            after = fsdp.comm_stats()
            steps.append({k: after[k] - before[k] for k in ("all_gathers", "reduce_scatters", "all_reduces")})
        out[strategy] = dict(steps=steps, units=len(units), roots=len(roots), buckets=len(buf.plan))
    return out


def test_collectives_per_strategy():
    counts = CELLS.result("collectives per step", 2)[0]
    # no_shard: one all-reduce per bucket per step, nothing gathered.
    c = counts[0]
    assert c["steps"][1] == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": c["buckets"]}
    # ZeRO-1: one reduce-scatter per bucket per step; weights re-gathered once after each step.
    c = counts[1]
    assert c["steps"][1] == {"all_gathers": c["buckets"], "reduce_scatters": c["buckets"], "all_reduces": 0}
    # ZeRO-2: a reduce-scatter per bucket per microbatch (3), one gather per bucket per step.
    c = counts[2]
    assert c["steps"][1] == {"all_gathers": c["buckets"], "reduce_scatters": 3 * c["buckets"], "all_reduces": 0}
    # ZeRO-3: per microbatch every unit bucket is gathered for forward and again for backward,
    # the buckets outside units once; prefetching never gathers anything twice.
    for key in (3, "3 with a one-bucket queue"):  # an early-completed reduction is not repeated
        c = counts[key]
        expected_ag = 3 * (2 * c["units"] + c["roots"])
        assert c["steps"][1] == {"all_gathers": expected_ag, "reduce_scatters": 3 * c["buckets"], "all_reduces": 0}
