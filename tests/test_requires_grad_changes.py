"""requires_grad changed during training, in both APIs ([Note: changing requires_grad] in
megatron_fsdp_c/_trainable.py, [Note: requires_grad changes] in csrc/comm/trainable.c).

Gradual unfreezing and freezing mid-run against DDP(find_unused_parameters=True), float64, rtol
1e-9, every strategy, worlds 2 and 4, HSDP and HFSDP 2x2 at world 4. The schedule (STEPS steps of
MICRO microbatches, all but the last under no_sync / set_requires_gradient_sync(False), zero_grad
alternating set_to_none True and False): the embedding and block 0 start frozen, in the optimizer
(the gradual-unfreezing recipe), and are unfrozen at step 2, when block 1 and the final norm's
weight (one parameter of a bucket that goes on training) are frozen; the head is frozen after the
last backward, before its optimizer step (which still applies its gradient). The reference DDP
(trained once per spawn, rank_grid.once) is built with every parameter trainable and frozen
afterwards: DDP leaves a parameter frozen at its construction out of its reducer for good, so
unfreezing it later would give it local, unreduced gradients there. Also: gradient memory
follows, a replicated (fsdp_no_shard) embedding, a rank that disagrees is named, a parameter
outside the optimizer joins with add_param_group; with the other features:
test_requires_grad_features.py. The cells run in the shared spawns ([Note: one spawn per world
size] in support/rank_grid.py).
"""
import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.per_module import fully_shard as fully_shard_per_module
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid
from support.checks import ATOL, RTOL

CFG = GPTConfig(vocab=32, seq=8, d=16, heads=2, layers=3)
STEPS, MICRO = 4, 2
FROZEN_AT_START = ("tok.", "blocks.0.")
FROZEN_AT_2 = ("blocks.1.", "ln.weight")
FROZEN_BEFORE_LAST_STEP = ("head.",)


def matching(named, prefixes):
    return [p for n, p in named.items() if n.startswith(prefixes)]


def set_requires_grad(named, prefixes, flag):
    for p in matching(named, prefixes):
        p.requires_grad_(flag)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def gpt():
    """The model, frozen as at the start of the recipe."""
    torch.manual_seed(0)
    model = GPT(CFG).double()
    set_requires_grad(dict(model.named_parameters()), FROZEN_AT_START, False)
    return model


def train(rank, model, named, no_sync, opt, toggles=None):
    """The schedule above. `named()`: the parameters by the plain model's names; `no_sync(quiet)`:
    the context of a microbatch; `toggles(step, named)`: extra changes before a step's forward."""
    out = dict(losses=[], grad_none=[])
    for step in range(STEPS):
        if step == 2:
            set_requires_grad(named(), FROZEN_AT_START, True)
            set_requires_grad(named(), FROZEN_AT_2, False)
        if toggles is not None:
            toggles(step, named())
        for m in range(MICRO):
            quiet = m < MICRO - 1
            x, y = batch(CFG, 2, seed=1000 * step + 10 * m + rank)
            with no_sync(quiet):
                loss = model(x, y)
                loss.backward()
            out["losses"].append(loss.item())
        if step == STEPS - 1:
            set_requires_grad(named(), FROZEN_BEFORE_LAST_STEP, False)
        out["grad_none"].append(sorted(n for n, p in named().items() if p.grad is None))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    out["params"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach().clone())
                     for n, p in named().items()}
    return out


def _ddp_run(rank, joins_later):
    """DDP built while every parameter trains, then frozen: DDP leaves a parameter frozen at its
    construction out of its reducer for good, so unfreezing it later would give it local,
    unreduced gradients there. `joins_later`: the optimizer gets the frozen parameters at step 2
    (add_param_group)."""
    torch.manual_seed(0)
    ref = GPT(CFG).double()
    ddp = DDP(ref, find_unused_parameters=True)
    named = dict(ref.named_parameters())
    set_requires_grad(named, FROZEN_AT_START, False)
    opt = adamw([p for p in ref.parameters() if p.requires_grad] if joins_later else ref.parameters())

    def toggles(step, named):
        if joins_later and step == 2:
            opt.add_param_group({"params": matching(named, FROZEN_AT_START)})
    return train(rank, ddp, lambda: named, lambda quiet: ddp.no_sync() if quiet else contextlib.nullcontext(),
                 opt, toggles)


def ddp_run(rank, joins_later=False):
    """DDP's run, the same for every cell of a spawn: trained once there."""
    return rank_grid.once(("requires_grad_changes ddp", joins_later), _ddp_run, rank, joins_later)


def with_reference(rank, ours, joins_later=False):
    ref = ddp_run(rank, joins_later)
    return dict(ours, ref_losses=ref["losses"], ref_grad_none=ref["grad_none"], ref_params=ref["params"])


def megatron_model(model, optimizer, strategy, mesh=None, outer=None):
    kw = {}
    if mesh is not None:
        kw = dict(device_mesh=rank_grid.device_mesh("cpu", mesh, mesh_dim_names=("dp_outer", "dp_shard")),
                  dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", hybrid_fsdp_group=dist.group.WORLD,
                  outer_dp_sharding_strategy=outer or "no_shard")
    fsdp, opt = mf.fully_shard(model, optimizer, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, **kw)
    named = lambda: {n[len("module."):]: p for n, p in fsdp.named_parameters()}  # noqa: E731
    return fsdp, opt, named, lambda quiet: fsdp.no_sync() if quiet else contextlib.nullcontext()


def megatron_api(rank, world, strategy, mesh=None, outer=None, replicated_embedding=False):
    """megatron_fsdp_c.fully_shard, the optimizer holding every parameter (frozen ones too);
    `replicated_embedding`: the (frozen, then unfrozen) embedding under fsdp_no_shard."""
    model = gpt()
    if replicated_embedding:
        mf.fsdp_no_shard(model.tok)
    fsdp, opt, named, no_sync = megatron_model(model, adamw(model.parameters()), strategy, mesh, outer)
    return with_reference(rank, train(rank, fsdp, named, no_sync, opt))


@contextlib.contextmanager
def _gradient_sync(model, quiet):
    model.set_requires_gradient_sync(not quiet)
    yield


def per_module_api(rank, world, strategy, mesh=None):
    """megatron_fsdp_c.per_module.fully_shard per block and at the root; the optimizer made after."""
    model = gpt()
    device_mesh = None if mesh is None else rank_grid.device_mesh("cpu", mesh, mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard_per_module(block, mesh=device_mesh, zero_dp_strategy=strategy)
    fully_shard_per_module(model, mesh=device_mesh, zero_dp_strategy=strategy)
    opt = adamw(model.parameters())
    return with_reference(rank, train(rank, model, lambda: dict(model.named_parameters()),
                                      functools.partial(_gradient_sync, model), opt))


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
    """Block 0 and the embedding, frozen at sharding and left out of the optimizer, are unfrozen at
    step 2 and join it with add_param_group (on both sides)."""
    model = gpt()
    fsdp, opt, named, no_sync = megatron_model(model, adamw([p for p in model.parameters() if p.requires_grad]),
                                               strategy)

    def toggles(step, named):
        if step == 2:
            opt.add_param_group({"params": matching(named, FROZEN_AT_START)})
    return with_reference(rank, train(rank, fsdp, named, no_sync, opt, toggles), joins_later=True)


# ------------------------------------------------------------------------------------------
# the cells (one spawn per world size, shared with the other test files: [Note: one spawn per
# world size] in support/rank_grid.py)

CELLS = rank_grid.Cells(__name__)
PARITY = {f"megatron s{s}": (megatron_api, dict(strategy=s), (2, 4)) for s in range(4)}
PARITY.update({f"per-module s{s}": (per_module_api, dict(strategy=s), (2, 4)) for s in range(4)})
PARITY.update({
    "megatron HSDP 2x2 s3": (megatron_api, dict(strategy=3, mesh=(2, 2)), (4,)),
    "megatron HSDP 2x2 s1": (megatron_api, dict(strategy=1, mesh=(2, 2)), (4,)),
    "megatron HFSDP 2x2": (megatron_api, dict(strategy=3, mesh=(2, 2), outer="optim"), (4,)),
    "per-module HSDP 2x2 s3": (per_module_api, dict(strategy=3, mesh=(2, 2)), (4,)),
    "megatron s3 fsdp_no_shard": (megatron_api, dict(strategy=3, replicated_embedding=True), (2,)),
    "megatron s3 add_param_group": (joins_by_add_param_group, dict(strategy=3), (2,)),
    "megatron s1 add_param_group": (joins_by_add_param_group, dict(strategy=1), (2,)),
})
for _name, (_fn, _kw, _worlds) in PARITY.items():
    CELLS.add(_name, _fn, worlds=_worlds, tests=["test_requires_grad_changes_match_ddp"], match=dict(name=_name),
              **_kw)
for _strategy in (3, 1):
    CELLS.add(f"gradient memory s{_strategy}", gradient_memory, _strategy, tests=["test_gradient_memory_follows"],
              match=dict(strategy=_strategy))
CELLS.add("disagreement", disagreement, tests=["test_ranks_that_disagree_are_named"])


@pytest.mark.parametrize("name,world", [(n, w) for n, (_, _, worlds) in PARITY.items() for w in worlds])
def test_requires_grad_changes_match_ddp(name, world):
    for rank, r in enumerate(CELLS.result(name, world)):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=RTOL, atol=ATOL)
        assert r["grad_none"] == r["ref_grad_none"], f"rank {rank}: which .grad is None differs"
        assert set(r["params"]) == set(r["ref_params"])
        for n, p in r["ref_params"].items():
            torch.testing.assert_close(r["params"][n], p, rtol=RTOL, atol=ATOL, msg=f"rank {rank}: {n}")
        frozen_later = r["ref_grad_none"][3]
        assert "blocks.1.fc.weight" in frozen_later and "tok.weight" not in frozen_later, frozen_later


@pytest.mark.parametrize("strategy", [3, 1])
def test_gradient_memory_follows(strategy):
    for r in CELLS.result(f"gradient memory s{strategy}", 2):
        assert all(r["start_views"]), "no gradient buffers for buckets frozen at sharding"
        assert all(r["unfrozen_views"]) and r["start"] < r["unfrozen"], r
        assert r["refrozen"] == r["start"], r
        assert r["unfrozen_grads"]


def test_ranks_that_disagree_are_named():
    for status, message in CELLS.result("disagreement", 2):
        assert status == "RuntimeError", message
        assert "requires_grad differs across ranks" in message, message
        assert "'ln.weight' (trainable on ranks [1] only)" in message, message
