"""requires_grad changed during training, in both APIs ([Note: changing requires_grad] in
megatron_fsdp_c/_trainable.py, [Note: requires_grad changes] in csrc/comm/trainable.c).

Gradual unfreezing and freezing mid-run against DDP(find_unused_parameters=True), float64, rtol
1e-9, every strategy, worlds 2 and 4, HSDP and HFSDP 2x2 at world 4. The schedule (STEPS steps of
MICRO microbatches, all but the last under no_sync / set_requires_gradient_sync(False), zero_grad
alternating set_to_none True and False): the embedding and block 0 start frozen, in the optimizer
(the gradual-unfreezing recipe), and are unfrozen at step 2, when block 1 and the final norm's
weight (one parameter of a bucket that goes on training) are frozen; the head is frozen after the
last backward, before its optimizer step (which still applies its gradient). The reference DDP is
built with every parameter trainable and frozen afterwards: DDP leaves a parameter frozen at its
construction out of its reducer for good, so unfreezing it later would give it local, unreduced
gradients there. Also: gradient memory follows, a rank that disagrees is named, a parameter
outside the optimizer joins with add_param_group, DCP resume after unfreezing, mixed precision.
One spawn per world size, every cell in it (conftest.get_run).
"""
import contextlib
import copy
import functools
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.experimental import fully_shard as fully_shard_per_module
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch
from conftest import get_run

CFG = GPTConfig(vocab=32, seq=8, d=16, heads=2, layers=3)
STEPS, MICRO = 4, 2
FROZEN_AT_START = ("tok.", "blocks.0.")
FROZEN_AT_2 = ("blocks.1.", "ln.weight")
FROZEN_BEFORE_LAST_STEP = ("head.",)
RTOL, ATOL = 1e-9, 1e-12


def matching(named, prefixes):
    return [p for n, p in named.items() if n.startswith(prefixes)]


def set_requires_grad(named, prefixes, flag):
    for p in matching(named, prefixes):
        p.requires_grad_(flag)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def model_and_reference():
    """The model, and DDP over a copy built while every parameter trains; both then frozen."""
    torch.manual_seed(0)
    model = GPT(CFG).double()
    ref = copy.deepcopy(model)
    ddp = DDP(ref, find_unused_parameters=True)
    for m in (model, ref):
        set_requires_grad(dict(m.named_parameters()), FROZEN_AT_START, False)
    return model, ref, ddp


def parity_loop(rank, ours, named, no_sync, opt, ref, ddp, ref_opt, toggles=None):
    """Trains our model and DDP on the same data with the schedule above. `named()`: our
    distributed parameters by the plain model's names; `no_sync(quiet)`: our context for a
    microbatch. `toggles(step, named, ref_named)`: extra changes before a step's forward."""
    out = dict(losses=[], ref_losses=[], grad_none=[], ref_grad_none=[])
    ref_named = dict(ref.named_parameters())
    for step in range(STEPS):
        if step == 2:
            for n in (named(), ref_named):
                set_requires_grad(n, FROZEN_AT_START, True)
                set_requires_grad(n, FROZEN_AT_2, False)
        if toggles is not None:
            toggles(step, named(), ref_named)
        for m in range(MICRO):
            quiet = m < MICRO - 1
            x, y = batch(CFG, 2, seed=1000 * step + 10 * m + rank)
            with no_sync(quiet):
                loss = ours(x, y)
                loss.backward()
            with ddp.no_sync() if quiet else contextlib.nullcontext():
                ref_loss = ddp(x, y)
                ref_loss.backward()
            out["losses"].append(loss.item())
            out["ref_losses"].append(ref_loss.item())
        if step == STEPS - 1:
            for n in (named(), ref_named):
                set_requires_grad(n, FROZEN_BEFORE_LAST_STEP, False)
        out["grad_none"].append(sorted(n for n, p in named().items() if p.grad is None))
        out["ref_grad_none"].append(sorted(n for n, p in ref_named.items() if p.grad is None))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        ref_opt.zero_grad(set_to_none=step % 2 == 0)
    out["params"] = {n: p.full_tensor() for n, p in named().items()}
    out["ref_params"] = {n: p.detach().clone() for n, p in ref_named.items()}
    return out


def megatron_api(rank, world, strategy, mesh=None, outer=None):
    """megatron_fsdp_c.fully_shard, the optimizer holding every parameter (frozen ones too)."""
    model, ref, ddp = model_and_reference()
    kw = {}
    if mesh is not None:
        kw = dict(device_mesh=init_device_mesh("cpu", mesh, mesh_dim_names=("dp_outer", "dp_shard")),
                  dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", hybrid_fsdp_group=dist.group.WORLD,
                  outer_dp_sharding_strategy=outer or "no_shard")
    fsdp, opt = mf.fully_shard(model, adamw(model.parameters()), fsdp_unit_modules=[Block],
                               zero_dp_strategy=strategy, **kw)
    named = lambda: {n[len("module."):]: p for n, p in fsdp.named_parameters()}  # noqa: E731
    return parity_loop(rank, fsdp, named, lambda quiet: fsdp.no_sync() if quiet else contextlib.nullcontext(),
                       opt, ref, ddp, adamw(ref.parameters()))


@contextlib.contextmanager
def _gradient_sync(model, quiet):
    model.set_requires_gradient_sync(not quiet)
    yield


def per_module_api(rank, world, strategy, mesh=None):
    """megatron_fsdp_c.experimental.fully_shard per block and at the root; the optimizer made after."""
    model, ref, ddp = model_and_reference()
    device_mesh = None if mesh is None else init_device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard_per_module(block, mesh=device_mesh, zero_dp_strategy=strategy)
    fully_shard_per_module(model, mesh=device_mesh, zero_dp_strategy=strategy)
    opt = adamw(model.parameters())
    return parity_loop(rank, model, lambda: dict(model.named_parameters()), functools.partial(_gradient_sync, model),
                       opt, ref, ddp, adamw(ref.parameters()))


# ------------------------------------------------------------------------------------------
# the other behaviours (world 2)

def gradient_memory(rank, world, strategy):
    """No gradient memory for what is frozen at sharding; it appears at unfreezing, and goes again
    once the parameters are frozen and their .grad dropped (at the next forward)."""
    torch.manual_seed(0)
    model = GPT(CFG).double()
    set_requires_grad(dict(model.named_parameters()), FROZEN_AT_START, False)
    fsdp, opt = mf.fully_shard(model, adamw(model.parameters()), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    named = {n[len("module."):]: p for n, p in fsdp.named_parameters()}
    frozen_buckets = sorted({r.bucket for r in fsdp.param_buffer.records if r.name.startswith(FROZEN_AT_START)})

    def step(seed):
        x, y = batch(CFG, 2, seed=seed + rank)
        fsdp(x, y).backward()
        opt.step()
        opt.zero_grad()
        return fsdp.memory_report()["grad_bytes"]

    engine = fsdp.param_buffer.engine
    out = dict(start=step(0), start_views=[engine.tensor(b, _C.BUF_OPT_GRAD) is None for b in frozen_buckets])
    set_requires_grad(named, FROZEN_AT_START, True)
    out["unfrozen"] = step(1)
    out["unfrozen_views"] = [engine.tensor(b, _C.BUF_OPT_GRAD) is not None for b in range(engine.num_buckets)]
    out["unfrozen_grads"] = all(p.grad is None for p in named.values())  # zero_grad() dropped them
    set_requires_grad(named, FROZEN_AT_START, False)
    out["refrozen"] = step(2)
    return out


def disagreement(rank, world):
    """Rank 0 freezes one parameter of a bucket that goes on training, rank 1 does not: the
    collectives still match, and the next gradient sync names the parameter on every rank."""
    torch.manual_seed(0)
    fsdp, opt = mf.fully_shard(GPT(CFG).double(), None, fsdp_unit_modules=[Block], zero_dp_strategy=3)
    if rank == 0:
        dict(fsdp.named_parameters())["module.ln.weight"].requires_grad_(False)
    x, y = batch(CFG, 2, seed=rank)
    try:
        fsdp(x, y).backward()
        return ("no error", "")
    except RuntimeError as e:
        return ("RuntimeError", str(e))


def joins_by_add_param_group(rank, world, strategy):
    """Block 0, frozen at sharding and left out of the optimizer, is unfrozen at step 2 and joins
    it with add_param_group (on both sides)."""
    model, ref, ddp = model_and_reference()
    trainable = [p for p in model.parameters() if p.requires_grad]
    fsdp, opt = mf.fully_shard(model, adamw(trainable), fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    ref_opt = adamw([p for p in ref.parameters() if p.requires_grad])
    named = lambda: {n[len("module."):]: p for n, p in fsdp.named_parameters()}  # noqa: E731

    def toggles(step, ours, refs):
        if step == 2:
            opt.add_param_group({"params": matching(ours, FROZEN_AT_START)})
            ref_opt.add_param_group({"params": matching(refs, FROZEN_AT_START)})
    return parity_loop(rank, fsdp, named, lambda quiet: fsdp.no_sync() if quiet else contextlib.nullcontext(),
                       opt, ref, ddp, ref_opt, toggles)


def dcp_resume(rank, world, ckdir):
    """Unfrozen at step 1 and saved after step 2; a fresh model (frozen as at the start, unfrozen as
    the script knows by then) loads it and runs step 3 bit for bit as the model that went on."""
    def build():
        torch.manual_seed(0)
        model = GPT(CFG).double()
        set_requires_grad(dict(model.named_parameters()), FROZEN_AT_START, False)
        fsdp, opt = mf.fully_shard(model, adamw(model.parameters()), fsdp_unit_modules=[Block], zero_dp_strategy=3)
        return fsdp, opt, {n[len("module."):]: p for n, p in fsdp.named_parameters()}

    def step(fsdp, opt, s):
        x, y = batch(CFG, 2, seed=100 * s + rank)
        fsdp(x, y).backward()
        opt.step()
        opt.zero_grad()

    fsdp, opt, named = build()
    for s in range(3):
        if s == 1:
            set_requires_grad(named, FROZEN_AT_START, True)
        step(fsdp, opt, s)
        if s == 2:
            mf.save_checkpoint(f"{ckdir}/resume", fsdp, opt)
    step(fsdp, opt, 3)
    went_on = fsdp.full_parameters()
    fresh, fresh_opt, fresh_named = build()
    set_requires_grad(fresh_named, FROZEN_AT_START, True)
    mf.load_checkpoint(f"{ckdir}/resume", fresh, fresh_opt)
    step(fresh, fresh_opt, 3)
    resumed = fresh.full_parameters()
    return sorted(n for n in went_on if not torch.equal(went_on[n], resumed[n]))


def mixed_precision(rank, world):
    """bf16 model, float32 main weights: a frozen parameter the optimizer given to fully_shard holds
    is planned with float32 main weights and trains once unfrozen; one it does not hold cannot
    start training (a clear error)."""
    out = {}
    for in_optimizer in (True, False):
        torch.manual_seed(0)
        model = GPT(CFG).to(torch.bfloat16)
        set_requires_grad(dict(model.named_parameters()), ("blocks.0.",), False)
        params = model.parameters() if in_optimizer else [p for p in model.parameters() if p.requires_grad]
        fsdp, opt = mf.fully_shard(model, torch.optim.SGD(params, lr=0.1), fsdp_unit_modules=[Block],
                                   mixed_precision_policy=mf.MixedPrecisionPolicy(main_params_dtype=torch.float32))
        named = {n[len("module."):]: p for n, p in fsdp.named_parameters()}
        w = named["blocks.0.fc.weight"]
        before = w.full_tensor().clone()
        w.requires_grad_(True)
        x, y = batch(CFG, 2, seed=rank)
        try:
            fsdp(x, y).backward()
            opt.step()
            out[in_optimizer] = ("no error", str(w.dtype), bool((w.full_tensor() != before).any()))
        except ValueError as e:
            out[in_optimizer] = ("ValueError", str(e), False)
    return out


# ------------------------------------------------------------------------------------------
# the grid: every cell of a world size in one spawn

PARITY = {f"megatron s{s}": (megatron_api, dict(strategy=s), (2, 4)) for s in range(4)}
PARITY.update({f"per-module s{s}": (per_module_api, dict(strategy=s), (2, 4)) for s in range(4)})
PARITY.update({
    "megatron HSDP 2x2 s3": (megatron_api, dict(strategy=3, mesh=(2, 2)), (4,)),
    "megatron HSDP 2x2 s1": (megatron_api, dict(strategy=1, mesh=(2, 2)), (4,)),
    "megatron HFSDP 2x2": (megatron_api, dict(strategy=3, mesh=(2, 2), outer="optim"), (4,)),
    "per-module HSDP 2x2 s3": (per_module_api, dict(strategy=3, mesh=(2, 2)), (4,)),
    "megatron s3 add_param_group": (joins_by_add_param_group, dict(strategy=3), (2,)),
    "megatron s1 add_param_group": (joins_by_add_param_group, dict(strategy=1), (2,)),
})
OTHER = {
    "gradient memory s3": (gradient_memory, dict(strategy=3), (2,)),
    "gradient memory s1": (gradient_memory, dict(strategy=1), (2,)),
    "disagreement": (disagreement, {}, (2,)),
    "dcp resume": (dcp_resume, {}, (2,)),
    "mixed precision": (mixed_precision, {}, (2,)),
}
CELLS = {**PARITY, **OTHER}


def grid(rank, world, ckdir):
    torch.set_num_threads(1)
    out = {}
    for name, (fn, kw, worlds) in CELLS.items():
        if world not in worlds:
            continue
        if fn is dcp_resume:
            kw = dict(kw, ckdir=ckdir)
        try:
            out[name] = ("ok", fn(rank, world, **kw))
        except Exception:  # noqa: BLE001 - reported by the cell's test
            out[name] = ("error", traceback.format_exc())
        dist.barrier()
    return out


@functools.lru_cache(maxsize=None)
def checkpoint_dir() -> str:
    """Made once in the pytest process and handed to the spawn: every rank writes one checkpoint."""
    return tempfile.mkdtemp(prefix="mfsdp_requires_grad_")


def results(name, world):
    cells = []
    for rank, grid_out in enumerate(get_run(grid, world, checkpoint_dir())):
        status, value = grid_out[name]
        assert status == "ok", f"rank {rank}:\n{value}"
        cells.append(value)
    return cells


@pytest.mark.parametrize("name,world", [(n, w) for n, (_, _, worlds) in PARITY.items() for w in worlds])
def test_requires_grad_changes_match_ddp(name, world):
    for rank, r in enumerate(results(name, world)):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=RTOL, atol=ATOL)
        assert r["grad_none"] == r["ref_grad_none"], f"rank {rank}: which .grad is None differs"
        assert set(r["params"]) == set(r["ref_params"])
        for n, p in r["ref_params"].items():
            torch.testing.assert_close(r["params"][n], p, rtol=RTOL, atol=ATOL, msg=f"rank {rank}: {n}")
        frozen_later = r["ref_grad_none"][3]
        assert "blocks.1.fc.weight" in frozen_later and "tok.weight" not in frozen_later, frozen_later


@pytest.mark.parametrize("strategy", [3, 1])
def test_gradient_memory_follows(strategy):
    for r in results(f"gradient memory s{strategy}", 2):
        assert all(r["start_views"]), "no gradient buffers for buckets frozen at sharding"
        assert all(r["unfrozen_views"]) and r["start"] < r["unfrozen"], r
        assert r["refrozen"] == r["start"], r
        assert r["unfrozen_grads"]


def test_ranks_that_disagree_are_named():
    for status, message in results("disagreement", 2):
        assert status == "RuntimeError", message
        assert "requires_grad differs across ranks" in message and "'ln.weight' (trainable on ranks [1] only)" in message


def test_dcp_resume_after_unfreezing():
    for differing in results("dcp resume", 2):
        assert differing == [], differing


def test_mixed_precision_unfreezing():
    for r in results("mixed precision", 2):
        assert r[True] == ("no error", "torch.float32", True), r[True]
        kind, message, _ = r[False]
        assert kind == "ValueError" and "blocks.0.fc.weight" in message and "float32 main weights" in message, message
