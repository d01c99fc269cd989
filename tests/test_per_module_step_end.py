"""torch 2.15's FSDPModule surface on the per-module API, on every torch of the range (ours implements
it where torch's does not have it yet): manual backward finalization (set_manual_backward_finalization,
finalize_backward and its GradientReductionHandle; [Note: manual backward finalization] in
megatron_fsdp_c/per_module/_root.py) and set_keep_unsharded_storage ([Note: kept full weights]
in csrc/comm/weights.c).

Cells at worlds 2 and 4, float64: against DDP on the same per-rank data (rtol 1e-9), and where the
installed torch's FSDP2 has the methods, against FSDP2 on the same script too.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

from support import rank_grid
from support.checks import RTOL, outcome

CELLS = rank_grid.Cells(__name__)
D, STEPS, MICRO = 8, 3, 3
TORCH_HAS_FINALIZE = hasattr(TorchFSDPModule, "finalize_backward")  # torch 2.15+
TORCH_HAS_KEEP = hasattr(TorchFSDPModule, "set_keep_unsharded_storage")


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)], nn.Linear(D, 2)).double()


def data(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, D, generator=g, dtype=torch.float64)


def shard(model, impl):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from megatron_fsdp_c.per_module import fully_shard
    for block in model[:-1]:
        fully_shard(block)
    fully_shard(model)
    return model


def full_state(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone() for n, p in model.named_parameters()}


def ddp_reference(rank, world):
    """DDP on the same microbatches: no_sync for all but each step's last."""
    model = DDP(mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for step in range(STEPS):
        for micro in range(MICRO):
            if micro < MICRO - 1:
                with model.no_sync():
                    model(data(step, micro, rank)).square().mean().backward()
            else:
                model(data(step, micro, rank)).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
        opt.step()
        opt.zero_grad()
    return dict(grads=grads, params={n: p.detach().clone() for n, p in model.module.named_parameters()})


def manual_finalization(rank, world, impl, async_op):
    """torch 2.15's pipelining recipe by hand: manual finalization on the root, every microbatch's
    backward with gradient sync off and no reshard after it, then sync and resharding on again and
    finalize_backward (async: wait on its handle) before reading the gradients."""
    model = shard(mlp(), impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model.set_manual_backward_finalization(True)
    grads = []
    for step in range(STEPS):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(False)
            model(data(step, micro, rank)).square().mean().backward()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        handle = model.finalize_backward(async_op=async_op)
        if async_op:
            handle.wait()
        else:
            assert handle is None
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    model.set_manual_backward_finalization(False)
    out = dict(grads=grads, params=full_state(model))
    if impl == "ours":
        from megatron_fsdp_c.per_module import GradientReductionHandle
        state = model._mfsdp_group.owner
        out["handle_is_torchs"] = not async_op or not TORCH_HAS_FINALIZE or isinstance(
            handle, torch.distributed.fsdp.GradientReductionHandle)
        out["ours_handle"] = not async_op or isinstance(handle, GradientReductionHandle)
        out["weights_released"] = [state.param_buffer.engine.weight_state(b)
                                   for b in state.param_buffer.weight_sharded_buckets()]
    return out


def finalization_errors(rank, world):
    """What torch 2.15 refuses, refused the same way (every torch)."""
    model = shard(mlp(), "ours")
    early = model.finalize_backward(async_op=True)
    out = {"before_first_forward": outcome(lambda: model.finalize_backward()),
           "handle_before_first_forward": type(early).__name__, "wait_before_first_forward": outcome(early.wait)}
    model(data(0, 0, rank)).sum().backward()
    out["child_manual"] = outcome(lambda: model[0].set_manual_backward_finalization(True))
    out["child_finalize"] = outcome(lambda: model[0].finalize_backward())
    model.set_manual_backward_finalization(True)
    handle = model.finalize_backward(async_op=True)
    out["again_before_wait"] = outcome(lambda: model.finalize_backward())
    handle.wait()
    out["after_wait"] = outcome(lambda: model.finalize_backward())
    model.set_requires_gradient_sync(False)
    model(data(0, 1, rank)).sum().backward()
    model.set_requires_gradient_sync(True)
    stale = model.finalize_backward(async_op=True)
    model.reset_iter_state()
    out["wait_after_reset"] = outcome(stale.wait)

    def change_in_backward(grad):
        out["change_in_backward"] = outcome(lambda: model.set_manual_backward_finalization(False))
        return grad
    x = data(0, 2, rank).requires_grad_(True)
    x.register_hook(change_in_backward)
    model(x).sum().backward()
    model.set_manual_backward_finalization(False)
    return out


def keep_storage(rank, world, impl):
    """set_keep_unsharded_storage(True): the compute parameters keep their data pointers from step
    to step (read inside each forward), the numbers are DDP's (and FSDP2's where torch has it);
    off again, the kept weights are released."""
    model = shard(mlp(), impl)
    model.set_keep_unsharded_storage(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    seen = []
    hooks = [model[k][0].register_forward_hook(lambda m, i, o: seen.append(m.weight.data_ptr())) for k in range(3)]
    grads = []
    for step in range(STEPS):
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            model(data(step, micro, rank)).square().mean().backward()
        grads.append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    for h in hooks:
        h.remove()
    per_block = [seen[k::3] for k in range(3)]
    out = dict(grads=grads, params=full_state(model), pointers_kept=all(len(set(p)) == 1 for p in per_block),
               forwards=len(seen))
    if impl == "ours":
        buf = model._mfsdp_group.owner.param_buffer
        sharded = buf.weight_sharded_buckets()
        out["kept_states"] = sorted({buf.engine.weight_state(b) for b in sharded})
        model.set_keep_unsharded_storage(False)
        out["released_states"] = sorted({buf.engine.weight_state(b) for b in sharded})
    return out


USES_DDP = ["test_manual_finalization", "test_keep_unsharded_storage"]
CELLS.add("ddp", ddp_reference, worlds=(2, 4), tests=USES_DDP)
for _impl in ("ours", "torch") if TORCH_HAS_FINALIZE else ("ours",):
    for _async in (False, True):
        CELLS.add(("manual", _impl, _async), manual_finalization, _impl, _async, worlds=(2, 4),
                  match={"async_op": _async}, tests=["test_manual_finalization"])
for _impl in ("ours", "torch") if TORCH_HAS_KEEP else ("ours",):
    CELLS.add(("keep", _impl), keep_storage, _impl, worlds=(2, 4), tests=["test_keep_unsharded_storage"])
CELLS.add("errors", finalization_errors, worlds=(2,), tests=["test_finalization_errors"])


def _same(ours, ref, what):
    assert set(ours) == set(ref), what
    for k in ref:
        torch.testing.assert_close(ours[k], ref[k], rtol=RTOL, atol=0, msg=lambda m: f"{what} {k}: {m}")


def _against_references(key, world, ours_rank):
    """ours against DDP on every torch, and against torch's FSDP2 where it has the methods."""
    ref = CELLS.result("ddp", world)
    has = TORCH_HAS_FINALIZE if key[0] == "manual" else TORCH_HAS_KEEP
    theirs = CELLS.result((key[0], "torch") + key[2:], world) if has else None
    for rank, ours in enumerate(ours_rank):
        for step, (g, r) in enumerate(zip(ours["grads"], ref[rank]["grads"])):
            _same(g, r, f"rank {rank} step {step} grads vs DDP")
        _same(ours["params"], ref[rank]["params"], f"rank {rank} params vs DDP")
        if theirs is not None:
            for step, (g, t) in enumerate(zip(ours["grads"], theirs[rank]["grads"])):
                _same(g, t, f"rank {rank} step {step} grads vs FSDP2")
            _same(ours["params"], theirs[rank]["params"], f"rank {rank} params vs FSDP2")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("async_op", [False, True])
def test_manual_finalization(world, async_op):
    ours = CELLS.result(("manual", "ours", async_op), world)
    _against_references(("manual", "ours", async_op), world, ours)
    for r in ours:
        assert r["ours_handle"] and r["handle_is_torchs"], r
        assert set(r["weights_released"]) == {"empty"}, r["weights_released"]  # resharded by finalize_backward


@pytest.mark.parametrize("world", [2, 4])
def test_keep_unsharded_storage(world):
    ours = CELLS.result(("keep", "ours"), world)
    _against_references(("keep", "ours"), world, ours)
    for r in ours:
        assert r["forwards"] == 3 * STEPS * MICRO and r["pointers_kept"], r
        assert r["kept_states"] == ["stale"] and r["released_states"] == ["empty"], r
    if TORCH_HAS_KEEP:
        assert all(r["pointers_kept"] for r in CELLS.result(("keep", "torch"), world))


def test_finalization_errors():
    for r in CELLS.result("errors", 2):
        assert r["before_first_forward"] == "accepted" and r["handle_before_first_forward"] == "GradientReductionHandle"
        assert r["wait_before_first_forward"] == "accepted", r
        for key in ("child_manual", "child_finalize"):
            assert r[key].startswith("RuntimeError") and "root FSDP module" in r[key], (key, r[key])
        assert r["again_before_wait"].startswith("RuntimeError") and "must be waited on" in r["again_before_wait"], r
        assert r["after_wait"] == "accepted", r
        assert r["wait_after_reset"].startswith("RuntimeError") and "reset_iter_state" in r["wait_after_reset"], r
        assert r["change_in_backward"] == "RuntimeError: set_manual_backward_finalization cannot change mode during " \
                                          "backward", r
