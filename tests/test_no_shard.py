"""fsdp_no_shard: a frozen vision tower of many small layers stays replicated (no all-gather,
no hooks, no temporary buckets) while the language model is sharded, and the model trains
exactly like DDP: bit for bit in fp32 where the library reduces the same sums as DDP (2 ranks,
no_shard and ZeRO-1), else in float64 to rtol 1e-9 (see [Note: reduction order] in
test_parity.py)."""

import pytest
import torch
import torch.nn as nn

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.testing import VLM, Block, GPTConfig, TowerBlock, batch, image_batch

from support import rank_grid
from support.checks import ATOL, RTOL
from support.train_both import TrainBoth

CELLS = rank_grid.Cells(__name__)

CFG = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=3)
STEPS = 4


def build(mark=True, dtype=torch.float32):
    torch.manual_seed(0)
    model = VLM(CFG).to(dtype)
    for p in model.tower.parameters():
        p.requires_grad_(False)
    if mark:
        mf.fsdp_no_shard([model.tower, model.proj.weight, model.proj.bias])  # a module and parameters
    return model


def same_order(world, strategy):
    """ZeRO-2/3 reduce each of the 2 microbatches (DDP their sum once); 4 ranks sum in another
    order than DDP's (see [Note: reduction order] in test_parity.py)."""
    return world <= 2 and strategy < 2


def optimizer(name, params):
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=0.05, momentum=0.9)


def vlm_data(rank, dtype):
    def data(step, mb):
        seed = 1000 * step + 10 * mb + rank
        return image_batch(2, seed=seed).to(dtype), *batch(CFG, 2, seed=seed)
    return data


def ddp_run(rank, world, optim, dtype):
    """DDP's side (the same for every strategy: each spawn trains it once per setting)."""
    ref = build(dtype=dtype)
    pair = TrainBoth(rank, world, None, ref, optimizers=(None, optimizer(optim, ref.parameters())))
    pair.run(STEPS, vlm_data(rank, dtype), micro=2, loss=lambda m, b: m(*b), quiet=lambda step, mb: mb == 0)
    return pair.ref_losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def vlm_run(rank, world, strategy, optim):
    dtype = torch.float32 if same_order(world, strategy) else torch.float64
    ref_losses, ref_params = rank_grid.once((__name__, optim, dtype), ddp_run, rank, world, optim, dtype)
    model = build(dtype=dtype)
    fsdp, opt = mf.fully_shard(model, optimizer(optim, model.parameters()), fsdp_unit_modules=[Block, TowerBlock],
                               zero_dp_strategy=strategy)
    pair = TrainBoth(rank, world, fsdp, None, optimizers=(opt, None))
    pair.run(STEPS, vlm_data(rank, dtype), micro=2, loss=lambda m, b: m(*b),
             quiet=lambda step, mb: fsdp.no_sync() if mb == 0 else None)
    losses = pair.losses
    buf = fsdp.param_buffer
    marked = [r for r in buf.records if r.replicated]
    marked_buckets = sorted({r.bucket for r in marked})
    stats = {b: fsdp.comm_stats(b) for b in marked_buckets}
    tower_hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
                      for m in model.tower.modules())
    param_hooks = sum(len(r.param._post_accumulate_grad_hooks or {}) for r in marked if not r.requires_grad)
    buckets = [dict(shards=buf.plan[b]["shards"], items=sum(buf.plan[b]["numels"]),
                    weight=buf.engine.tensor(b, _C.BUF_WEIGHT).untyped_storage().nbytes(),
                    elem=buf.engine.tensor(b, _C.BUF_WEIGHT).element_size(),
                    grad=buf.engine.tensor(b, _C.BUF_GRAD), trainable=buf.plan[b]["requires_grad"],
                    grad_mode=buf.specs[b]["grad_mode"])
               for b in marked_buckets]
    for b in buckets:
        b["grad"] = None if b["grad"] is None else b["grad"].untyped_storage().nbytes()
    full = fsdp.full_parameters()
    return dict(losses=losses, ref_losses=ref_losses, params=full, ref_params=ref_params, dtype=dtype, stats=stats, tower_hooks=tower_hooks,
                param_hooks=param_hooks, buckets=buckets, roots=fsdp.replicated_roots,
                marked=sorted(r.name for r in marked))


def optimizers(world, strategy):
    """AdamW where the sum order matches DDP's; SGD always."""
    return ["sgd", "adamw"] if same_order(world, strategy) else ["sgd"]


CASES = [(w, s, o) for w in (2, 4) for s in range(4) for o in optimizers(w, s)]
for _key in dict.fromkeys(c[1:] for c in CASES):
    CELLS.add(_key, vlm_run, *_key, worlds=[w for w, *key in CASES if tuple(key) == _key],
              tests=["test_frozen_replicated_tower_matches_ddp"], match=dict(strategy=_key[0], optim=_key[1]))


@pytest.mark.parametrize("world,strategy,optim", CASES)
def test_frozen_replicated_tower_matches_ddp(world, strategy, optim):
    for r in CELLS.result((strategy, optim), world):
        if same_order(world, strategy):
            assert r["dtype"] == torch.float32
            assert r["losses"] == r["ref_losses"]
            for n, ref in r["ref_params"].items():
                assert torch.equal(r["params"][n], ref), n
        else:
            assert r["dtype"] == torch.float64
            torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                                       torch.tensor(r["ref_losses"], dtype=torch.float64), rtol=RTOL, atol=ATOL)
            for n, ref in r["ref_params"].items():
                torch.testing.assert_close(r["params"][n], ref, rtol=RTOL, atol=ATOL, msg=n)
        # the marked parts: never gathered; trainable ones all-reduced once per step
        for b, s in r["stats"].items():
            assert s["all_gathers"] == 0 and s["reduce_scatters"] == 0, s
        assert r["tower_hooks"] == 0 and r["param_hooks"] == 0
        for b in r["buckets"]:
            assert b["shards"] == 1
            assert b["weight"] < (b["items"] + 64) * b["elem"]  # full size, alignment padding only
            if b["trainable"]:
                assert b["grad_mode"] == _C.GRAD_ALL_REDUCE and b["grad"] is not None
            else:
                assert b["grad"] is None, "frozen replicated parameters get no gradient memory"
        trainable_ar = [s["all_reduces"] for b, s in zip(r["buckets"], r["stats"].values()) if b["trainable"]]
        assert all(n == STEPS for n in trainable_ar), trainable_ar
        assert r["roots"] == ["tower", "proj"], r["roots"]
        assert "proj.weight" in r["marked"] and "tower.0.mix.weight" in r["marked"]


# -- the mark itself --------------------------------------------------------------------------

def test_marks_modules_parameters_and_lists():
    model = build(mark=False)
    assert mf.fsdp_no_shard(model.tower) is model.tower
    assert mf.fsdp_no_shard(model.proj.weight) is model.proj.weight
    out = mf.fsdp_no_shard([model.lm.ln, model.lm.head.weight])
    assert len(out) == 2
    from megatron_fsdp_c.no_shard import is_no_shard
    assert is_no_shard(model.tower[3].mix, "weight") and is_no_shard(model.proj, "weight")
    assert not is_no_shard(model.proj, "bias") and is_no_shard(model.lm.ln, "bias")
    assert is_no_shard(model.lm.head, "weight") and not is_no_shard(model.lm.tok, "weight")


@pytest.mark.parametrize("bad", [42, "tower", None, [nn.Linear(2, 2), 3.0], {"a": 1}])
def test_non_module_objects_are_a_type_error(bad):
    with pytest.raises(TypeError, match="nn.Module"):
        mf.fsdp_no_shard(bad)


def test_mark_survives_reset_parameters_and_to_empty():
    from megatron_fsdp_c.no_shard import is_no_shard, mark_by_name
    model = build(mark=False)
    mf.fsdp_no_shard(model.tower)
    mf.fsdp_no_shard(model.proj.weight)
    mark_by_name(model)  # what fully_shard does first
    model.tower[0].mix.reset_parameters()
    model.proj.reset_parameters()
    with torch.device("meta"):
        meta = VLM(CFG)
    mf.fsdp_no_shard(meta.tower)
    mf.fsdp_no_shard(meta.proj.weight)
    mark_by_name(meta)
    meta.to_empty(device="cpu")  # new Parameter objects
    for m in meta.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    for tree in (model, meta):
        assert is_no_shard(tree.tower[0].mix, "weight") and is_no_shard(tree.proj, "weight")
        assert not is_no_shard(tree.proj, "bias")


@CELLS.cell("marking after fully_shard", tests=["test_marking_after_fully_shard_is_refused"])
def after_fully_shard(rank, world):
    model = build(mark=False)
    fsdp, _ = mf.fully_shard(model, fsdp_unit_modules=[Block])
    try:
        mf.fsdp_no_shard(model.tower)
        return "no error"
    except RuntimeError as e:
        return str(e)


def test_marking_after_fully_shard_is_refused():
    message = CELLS.result("marking after fully_shard", 2)[0]
    assert "before fully_shard" in message
