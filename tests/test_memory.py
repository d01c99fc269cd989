"""Memory: under ZeRO-3 at world 4 a rank holds about a quarter of the parameter, gradient and
optimizer-state bytes of the unsharded model, and no more than two units of full weights at a
time. Run with -s to see the measured numbers."""
import torch

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid

CFG = GPTConfig(vocab=512, seq=32, d=96, heads=4, layers=6)
CELLS = rank_grid.Cells(__name__)


def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def memory_run(rank, world, strategy):
    # The unsharded baseline, measured the same way: one AdamW step on the plain model.
    torch.manual_seed(0)
    plain = GPT(CFG)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    x, y = batch(CFG, 2, seed=rank)
    plain(x, y).backward()
    plain_opt.step()
    unsharded = dict(
        param_bytes=storage_bytes(plain.parameters()),
        grad_bytes=storage_bytes(p.grad for p in plain.parameters()),
        optimizer_state_bytes=storage_bytes(v for s in plain_opt.state.values() for v in s.values()),
    )
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    buf = fsdp.param_buffer
    unit_bytes = max(bp["bucket_size"] * 4 for bp in buf.plan if bp["unit"] >= 0)
    root_bytes = sum(bp["bucket_size"] * 4 for bp in buf.plan if bp["unit"] < 0)
    during_forward = []
    for block in model.blocks:
        block.register_forward_hook(lambda *a: during_forward.append(fsdp.memory_report()["temporary_bytes"]))
    for step in range(2):
        x, y = batch(CFG, 2, seed=10 * step + rank)
        fsdp(x, y).backward()
        opt.step()
        opt.zero_grad()
    report = fsdp.memory_report(opt)
    return dict(unsharded=unsharded, sharded=report, peak_temporary_in_forward=max(during_forward),
                unit_bytes=unit_bytes, root_bytes=root_bytes)


CELLS.add(3, memory_run, 3, worlds=(4,), tests=["test_zero3_world4_holds_a_quarter"])
CELLS.add(1, memory_run, 1, worlds=(4,), tests=["test_zero1_shards_only_optimizer_state"])


def test_zero3_world4_holds_a_quarter():
    results = CELLS.result(3, 4)
    for rank, r in enumerate(results):
        unsharded = sum(r["unsharded"].values())
        ours = r["sharded"]["param_bytes"] + r["sharded"]["grad_bytes"] + r["sharded"]["optimizer_state_bytes"]
        ratio = ours / (unsharded / 4)
        print(f"\nrank {rank}: unsharded {r['unsharded']} = {unsharded} B; sharded {r['sharded']}; "
              f"param+grad+optimizer = {ours} B = {ratio:.4f} x (unsharded / 4)")
        assert 0.9 <= ratio <= 1.1, ratio
        assert r["sharded"]["temporary_bytes"] == 0, "full weights and gradient buckets are released after a step"
        # While a unit runs: the buckets outside units, the unit, and at most one prefetched unit.
        assert r["peak_temporary_in_forward"] <= r["root_bytes"] + 2 * r["unit_bytes"], r


def test_zero1_shards_only_optimizer_state():
    r = CELLS.result(1, 4)[0]
    unsharded, sharded = r["unsharded"], r["sharded"]
    assert sharded["param_bytes"] >= unsharded["param_bytes"]          # full compute weights kept
    assert sharded["grad_bytes"] >= unsharded["grad_bytes"]            # full gradient buffer kept
    assert sharded["optimizer_state_bytes"] <= 0.3 * unsharded["optimizer_state_bytes"]
