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
outside the optimizer joins with add_param_group, DCP resume after unfreezing, mixed precision,
quantized communication; against FSDP2: SPMD compute parameters (dp_mesh_dims) and tensor
parallelism (dp 2 x tp 2). The cells run in the shared spawns ([Note: one spawn per world size]
in support/rank_grid.py).
"""
import contextlib
import functools
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.per_module import fully_shard as fully_shard_per_module
from megatron_fsdp_c.testing import GPT, TPGPT, Block, GPTConfig, batch, parallelize_tp

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


def dcp_resume(rank, world):
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

    ckdir = os.path.join(rank_grid.session_dir(), "requires_grad_changes")
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
    start training (a clear error). And the per-module API's case (per_module_mixed_precision)."""
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
    out["per-module"] = per_module_mixed_precision(rank)
    return out


def per_module_mixed_precision(rank):
    """float32 model, torch's MixedPrecisionPolicy(param_dtype=bfloat16): a parameter frozen at
    sharding keeps its float32 shard (as under FSDP2) and trains once unfrozen. Whether a step
    changed it, for steps 0 (frozen) and 1, 2 (unfrozen before step 1)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    model.blocks[0].requires_grad_(False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard_per_module(block, mp_policy=mp)
    fully_shard_per_module(model, mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = model.blocks[0].fc.weight
    changed = []
    for step in range(3):
        if step == 1:
            model.blocks[0].requires_grad_(True)
        before = w.full_tensor().clone()
        x, y = batch(CFG, 2, seed=step + rank)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        changed.append(bool((w.full_tensor() != before).any()))
    return str(w.dtype), changed


def quantized(rank, world):
    """Quantized gradients and weights (int8, float32 model, ZeRO-3): block 0, frozen at sharding,
    trains once unfrozen before step 1 (its gradient buffers and wires made then); its weights
    after step 2 against the same run without quantization (the int8 error is about 1e-2 of a
    step, so the difference stays well below the steps' size). (changed at each step, max
    difference from the unquantized run, max total change)."""
    def run(quant):
        torch.manual_seed(0)
        model = GPT(CFG)
        model.blocks[0].requires_grad_(False)
        fsdp, opt = mf.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[Block],
                                   zero_dp_strategy=3, quantized_comm_policy=quant)
        named = {n[len("module."):]: p for n, p in fsdp.named_parameters()}
        w = named["blocks.0.fc.weight"]
        start, changed = w.full_tensor().clone(), []
        for step in range(3):
            if step == 1:
                for n, p in named.items():
                    if n.startswith("blocks.0."):
                        p.requires_grad_(True)
            before = w.full_tensor().clone()
            x, y = batch(CFG, 2, seed=step + rank)
            fsdp(x, y).backward()
            opt.step()
            opt.zero_grad()
            changed.append(bool((w.full_tensor() != before).any()))
        return changed, start, w.full_tensor()
    changed, start, quantized_end = run(mf.QuantizedCommPolicy(weights="int8", grads="int8", block=32))
    _, _, plain_end = run(None)
    return changed, (quantized_end - plain_end).abs().max().item(), (plain_end - start).abs().max().item()


def spmd_compute_params(rank, world):
    """dp_mesh_dims, parameters DTensors replicated over the SPMD mesh (their compute parameters
    are DTensors too, [Note: SPMD compute parameters] in megatron_fsdp_c/per_module/_root.py):
    the first Linear frozen at sharding and unfrozen at step 2, when the second is frozen; ours
    and torch's FSDP2 on the same script, float64 (losses and final parameters). torch 2.11's
    fully_shard has no dp_mesh_dims: its side is then FSDP2 on that (1-D) mesh itself, plain."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from megatron_fsdp_c.per_module import DataParallelMeshDims
    torch_dims = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)
    # A dim name no other cell uses: torch hands a DTensor made on a mesh equal (same ranks and
    # names) to one an earlier cell of the spawn made that earlier mesh object (its dispatch
    # caches compare meshes by value), and FSDP2's SPMD path then refuses the parameter.
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("rg_dp_shard",))
    out = {}
    for impl, shard in (("ours", fully_shard_per_module), ("torch", torch_fully_shard)):
        spmd = impl == "ours" or torch_dims is not None
        dims = (DataParallelMeshDims if impl == "ours" else torch_dims)(shard="rg_dp_shard") if spmd else None
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 4)).double()
        if spmd:
            for mod in model.modules():
                for name, p in list(mod._parameters.items()):
                    mod._parameters[name] = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]))
        model[0].requires_grad_(False)
        for i in (0, 2, 4):
            shard(model[i], mesh=mesh, **({"dp_mesh_dims": dims} if spmd else {}))
        shard(model, mesh=mesh, **({"dp_mesh_dims": dims} if spmd else {}))
        opt = adamw(model.parameters())
        losses = []
        for step in range(STEPS):
            if step == 2:
                model[0].requires_grad_(True)
                model[2].requires_grad_(False)
            torch.manual_seed(100 * step + rank)
            x = torch.randn(4, 8, dtype=torch.float64)
            out_ = model(DTensor.from_local(x, mesh, [Shard(0)])).to_local() if spmd else model(x)
            loss = out_.square().mean()
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[impl] = dict(losses=losses, params={n: p.full_tensor() for n, p in model.named_parameters()})
    return out


def tensor_parallel(rank, world):
    """dp 2 x tp 2, TPGPT under torch's sequence-parallel plan (every parameter a DTensor on the
    TP mesh), per-module API: block 0 frozen at sharding and unfrozen at step 2, when block 1 is
    frozen; ours and torch's FSDP2 + TP on the same script, float64."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    mesh = rank_grid.device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    out = {}
    for impl, shard in (("ours", fully_shard_per_module), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        model = parallelize_tp(TPGPT(CFG).double(), mesh["tp"], sequence_parallel=True)
        model.blocks[0].requires_grad_(False)
        for block in model.blocks:
            shard(block, mesh=mesh["dp"])
        shard(model, mesh=mesh["dp"])
        opt = adamw(model.parameters())
        losses = []
        for step in range(STEPS):
            if step == 2:
                model.blocks[0].requires_grad_(True)
                model.blocks[1].requires_grad_(False)
            x, y = batch(CFG, 2, seed=100 * step + dp_rank)
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[impl] = dict(losses=losses, params={n: p.full_tensor() for n, p in model.named_parameters()})
    return out


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
CELLS.add("dcp resume", dcp_resume, tests=["test_dcp_resume_after_unfreezing"])
CELLS.add("mixed precision", mixed_precision, tests=["test_mixed_precision_unfreezing"])
CELLS.add("quantized", quantized, tests=["test_quantized_unfreezing"])
CELLS.add("spmd compute parameters", spmd_compute_params, tests=["test_against_fsdp2"],
          match=dict(name="spmd compute parameters"))
CELLS.add("tensor parallel", tensor_parallel, worlds=(4,), tests=["test_against_fsdp2"],
          match=dict(name="tensor parallel"))


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


def test_dcp_resume_after_unfreezing():
    for differing in CELLS.result("dcp resume", 2):
        assert differing == [], differing


def test_mixed_precision_unfreezing():
    for r in CELLS.result("mixed precision", 2):
        assert r[True] == ("no error", "torch.float32", True), r[True]
        kind, message, _ = r[False]
        assert kind == "ValueError" and "blocks.0.fc.weight" in message and "float32 main weights" in message, message
        assert r["per-module"] == ("torch.float32", [False, True, True]), r["per-module"]


def test_quantized_unfreezing():
    for changed, difference, moved in CELLS.result("quantized", 2):
        assert changed == [False, True, True], changed
        assert moved > 0 and difference < 0.1 * moved, (difference, moved)


@pytest.mark.parametrize("name,world", [("spmd compute parameters", 2), ("tensor parallel", 4)])
def test_against_fsdp2(name, world):
    for rank, r in enumerate(CELLS.result(name, world)):
        ours, ref = r["ours"], r["torch"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
        for n, p in ref["params"].items():
            torch.testing.assert_close(ours["params"][n], p, rtol=RTOL, atol=ATOL, msg=f"rank {rank}: {n}")
