"""Sharded checkpoints through torch.distributed.checkpoint: bit-identical round trips, resharding
across world sizes, interop with plain models, meta-device initialisation, broken checkpoints."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid
from support.checks import RTOL
from support.data import rank_share

CFG = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=3)
GLOBAL_BATCH = 4
CELLS = rank_grid.Cells(__name__)


def checkpoints(name: str) -> str:
    """A directory of this session's checkpoints (spawns of every world size see it)."""
    path = os.path.join(rank_grid.session_dir(), "checkpoints", name)
    os.makedirs(path, exist_ok=True)
    return path


def build(strategy, seed=0, meta=False, cfg=CFG, dtype=torch.float32):
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = GPT(cfg).to(dtype)
    else:
        model = GPT(cfg).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                          init_model_with_meta_device=meta)


def train(model, opt, rank, world, steps, first_step=0):
    """Global batch of GLOBAL_BATCH sequences per step, split over the ranks; returns the
    global mean loss per step (the same numbers at any world size, up to rounding)."""
    losses = []
    for step in range(first_step, first_step + steps):
        loss = model(*rank_share(batch(CFG, GLOBAL_BATCH, seed=step), rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total / world).item())
    return losses


# -- round trip -------------------------------------------------------------------------------

def round_trip(rank, world, strategy):
    model, opt = build(strategy)
    straight = train(model, opt, rank, world, 6)
    model, opt = build(strategy)
    first = train(model, opt, rank, world, 3)
    path = os.path.join(checkpoints("round_trip"), f"{world}-{strategy}")
    mf.save_checkpoint(path, model, opt)
    fresh, fresh_opt = build(strategy, seed=123)  # different weights until the load
    mf.load_checkpoint(path, fresh, fresh_opt)
    resumed = train(fresh, fresh_opt, rank, world, 3, first_step=3)
    # the Megatron-FSDP flow: plain dcp.save / dcp.load / load_state_dict
    again, again_opt = build(strategy, seed=7)
    state = {"model": again.state_dict(), "optimizer": again_opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    again.load_state_dict(state["model"])
    again_opt.load_state_dict(state["optimizer"])
    resumed_plain = train(again, again_opt, rank, world, 3, first_step=3)
    return dict(straight=straight, resumed=first + resumed, plain=first + resumed_plain)


for _strategy in range(4):
    CELLS.add(("round trip", _strategy), round_trip, _strategy, worlds=(2, 4),
              tests=["test_save_load_continue_is_bit_identical"], match=dict(strategy=_strategy))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", range(4))
def test_save_load_continue_is_bit_identical(world, strategy):
    for r in CELLS.result(("round trip", strategy), world):
        assert r["resumed"] == r["straight"], (r["resumed"], r["straight"])
        assert r["plain"] == r["straight"]


# -- resharding 4 -> 2 -> 1 -> 4 ------------------------------------------------------------------

STRATEGIES = range(4)


def reshard_leg(rank, world, load_from, save_to, first_step, steps):
    """One leg for every strategy: (load) + train + (save); returns the global losses. float64:
    each world size sums the gradients in its own order (see [Note: reduction order] in
    tests/test_parity.py)."""
    root = checkpoints("reshard")
    out = {}
    for strategy in STRATEGIES:
        model, opt = build(strategy, seed=0 if load_from is None else 99, dtype=torch.float64)
        if load_from:
            mf.load_checkpoint(os.path.join(root, f"{load_from}-{strategy}"), model, opt)
        out[strategy] = train(model, opt, rank, world, steps, first_step=first_step)
        if save_to:
            mf.save_checkpoint(os.path.join(root, f"{save_to}-{strategy}"), model, opt)
    return out


# Steps 0-2 at world 4, 3-4 at 2, 5 at 1, 6 back at 4. The first leg has a spawn of its own (group
# "reshard"), the others run in the shared spawns, which then run in the order 2, 1, 4 (see
# [Note: one spawn per world size] in support/rank_grid.py).
RESHARD_LEGS = [(4, "reshard", None, "a", 0, 3), (2, "shared", "a", "b", 3, 2), (1, "shared", "b", "c", 5, 1),
                (4, "shared", "c", None, 6, 1)]
for _i, (_world, _group, _load, _save, _first, _steps) in enumerate(RESHARD_LEGS):
    CELLS.add(("reshard leg", _i), reshard_leg, _load, _save, _first, _steps, worlds=(_world,), group=_group,
              tests=["test_reshard_4_2_1_4"], needs=[(__name__, ("reshard leg", _i - 1), RESHARD_LEGS[_i - 1][0])]
              if _i else ())
CELLS.add("straight", reshard_leg, None, None, 0, 7, worlds=(1,), tests=["test_reshard_4_2_1_4"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reshard_4_2_1_4(strategy):
    legs = [CELLS.result(("reshard leg", i), leg[0])[0] for i, leg in enumerate(RESHARD_LEGS)]
    straight = CELLS.result("straight", 1)[0]
    continued = [loss for leg in legs for loss in leg[strategy]]
    print(f"\nstrategy {strategy}: resharded {continued}\n            straight  {straight[strategy]}")
    # The global batch is the same at every world size; only the order of the sums differs.
    torch.testing.assert_close(torch.tensor(continued, dtype=torch.float64),
                               torch.tensor(straight[strategy], dtype=torch.float64), rtol=RTOL, atol=0)


# -- interop with plain models -------------------------------------------------------------------

@CELLS.cell("interop", tests=["test_plain_checkpoints_load_and_export"])
def interop(rank, world):
    root = checkpoints("interop")
    out = {}
    torch.manual_seed(5)
    plain = GPT(CFG)
    plain_dir = os.path.join(root, "plain")
    dcp.save(plain.state_dict(), checkpoint_id=plain_dir)  # a checkpoint of an unsharded model
    model, opt = build(3, seed=0)
    state = model.module.state_dict()
    dcp.load(state, checkpoint_id=plain_dir)
    model.module.load_state_dict(state)
    full = model.full_parameters()
    out["dcp_plain_into_sharded"] = max((full[n] - p).abs().max().item() for n, p in plain.named_parameters())
    # the loaded weights are live at once: the sharded model computes what the plain one does
    x, y = batch(CFG, 2, seed=1)
    out["loss_gap"] = abs(model(x, y).item() - plain(x, y).item())
    model.zero_grad_buffer()
    # a full torch state dict (torch.save style) into a sharded model of another layout
    model2, _ = build(1, seed=1)
    model2.module.load_state_dict(plain.state_dict())
    full2 = model2.full_parameters()
    out["full_dict_into_sharded"] = max((full2[n] - p).abs().max().item() for n, p in plain.named_parameters())
    # export: gather the sharded model into a plain state dict on rank 0
    train(model, opt, rank, world, 2)
    exported = mf.full_state_dict(model)
    x, y = batch(CFG, 2, seed=3)
    sharded_loss = model(x, y).item()  # a collective: every rank runs it
    if rank == 0:
        fresh = GPT(CFG)
        fresh.load_state_dict(exported)  # strict: same keys, same shapes
        out["export_loss_gap"] = abs(fresh(x, y).item() - sharded_loss)
    else:
        out["export_empty"] = exported == {}
    return out


def test_plain_checkpoints_load_and_export():
    for rank, r in enumerate(CELLS.result("interop", 2)):
        assert r["dcp_plain_into_sharded"] == 0.0
        assert r["full_dict_into_sharded"] == 0.0
        assert r["loss_gap"] < 1e-6
        if rank == 0:
            assert r["export_loss_gap"] < 1e-6
        else:
            assert r["export_empty"]


# -- meta-device initialisation ------------------------------------------------------------------

BIG = GPTConfig(vocab=256, seq=16, d=64, heads=4, layers=8)


@CELLS.cell("meta init", worlds=(4,), tests=["test_meta_init_holds_a_quarter_plus_one_module_and_trains_the_same"])
def meta_init(rank, world):
    torch.manual_seed(0)
    model = GPT(BIG)
    full_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest_module = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                         for m in model.modules())
    eager, eager_opt = mf.fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      fsdp_unit_modules=[Block])
    torch.manual_seed(0)
    with torch.device("meta"):
        meta_model = GPT(BIG)
    lazy, lazy_opt = mf.fully_shard(meta_model, torch.optim.AdamW(meta_model.parameters(), lr=1e-2),
                                    fsdp_unit_modules=[Block], init_model_with_meta_device=True)
    largest_bucket = max(bp["bucket_size"] * 4 for bp in lazy.param_buffer.plan)
    losses = []
    for m, o in ((eager, eager_opt), (lazy, lazy_opt)):
        run = []
        for step in range(3):
            x, y = batch(BIG, 2, seed=10 * step + rank)
            loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            run.append(loss.item())
        losses.append(run)
    return dict(peak=lazy.init_peak_bytes, full=full_param_bytes, module=largest_module, bucket=largest_bucket,
                eager=losses[0], lazy=losses[1])


def test_meta_init_holds_a_quarter_plus_one_module_and_trains_the_same():
    for rank, r in enumerate(CELLS.result("meta init", 4)):
        quarter = r["full"] / 4
        print(f"\nrank {rank}: full parameters {r['full']} B, quarter {quarter:.0f} B, largest module {r['module']} B; "
              f"peak while materialising {r['peak']['materialise']} B "
              f"({r['peak']['materialise'] / (quarter + r['module']):.3f} x (quarter + module)), "
              f"while pointing views {r['peak']['point']} B")
        assert r["peak"]["materialise"] <= 1.1 * quarter + r["module"]
        assert r["peak"]["point"] <= 1.1 * quarter + r["bucket"]
        assert r["lazy"] == r["eager"], "meta initialisation trains exactly like eager initialisation"


class NoReset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


@CELLS.cell("no reset_parameters", tests=["test_module_without_reset_parameters_is_named"])
def no_reset(rank, world):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), NoReset())
    try:
        mf.fully_shard(model, zero_dp_strategy=2, init_model_with_meta_device=True)
        return "no error"
    except ValueError as e:
        return str(e)


def test_module_without_reset_parameters_is_named():
    message = CELLS.result("no reset_parameters", 2)[0]
    assert "'1'" in message and "NoReset" in message and "reset_parameters" in message


# -- broken checkpoints --------------------------------------------------------------------------

@CELLS.cell("broken", tests=["test_missing_or_truncated_checkpoint_is_a_clear_error"])
def broken(rank, world):
    root = checkpoints("broken")
    out = {}
    model, opt = build(3)
    train(model, opt, rank, world, 1)
    before = model.full_parameters()
    try:
        mf.load_checkpoint(os.path.join(root, "does-not-exist"), model, opt)
        out["missing"] = ("no error", "")
    except FileNotFoundError as e:
        out["missing"] = ("FileNotFoundError", str(e))
    path = os.path.join(root, "truncated")
    mf.save_checkpoint(path, model, opt)
    dist.barrier()
    if rank == 0:
        for name in sorted(os.listdir(path)):
            if name.endswith(".distcp"):
                with open(os.path.join(path, name), "r+b") as f:
                    f.truncate(max(0, os.path.getsize(os.path.join(path, name)) // 3))
    dist.barrier()
    other, other_opt = build(3, seed=42)
    snapshot = other.full_parameters()
    try:
        mf.load_checkpoint(path, other, other_opt)
        out["truncated"] = ("no error", "")
    except RuntimeError as e:
        out["truncated"] = ("RuntimeError", str(e))
    after = other.full_parameters()
    out["unchanged"] = all(torch.equal(snapshot[n], after[n]) for n in snapshot)
    out["still_trains"] = len(train(other, other_opt, rank, world, 1)) == 1
    out["before_untouched"] = all(torch.equal(before[n], model.full_parameters()[n]) for n in before)
    return out


def test_missing_or_truncated_checkpoint_is_a_clear_error():
    for rank, r in enumerate(CELLS.result("broken", 2)):
        kind, text = r["missing"]
        assert kind == "FileNotFoundError" and "does-not-exist" in text
        kind, text = r["truncated"]
        assert kind == "RuntimeError" and "left unchanged" in text, text
        assert r["unchanged"] and r["still_trains"] and r["before_untouched"]
