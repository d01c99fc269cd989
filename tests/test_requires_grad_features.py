"""requires_grad changed during training (test_requires_grad_changes.py's schedule and models)
with the other features: DCP resume after unfreezing, mixed precision, quantized communication;
against FSDP2: SPMD compute parameters (dp_mesh_dims) and tensor parallelism (dp 2 x tp 2).
The cells run in the shared spawns ([Note: one spawn per world size] in support/rank_grid.py).
"""
import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import megatron_fsdp_c as mf
from megatron_fsdp_c.per_module import fully_shard as fully_shard_per_module
from megatron_fsdp_c.testing import GPT, TPGPT, Block, batch, parallelize_tp

from support import rank_grid
from support.checks import ATOL, RTOL
from test_requires_grad_changes import CFG, FROZEN_AT_START, STEPS, adamw, set_requires_grad

CELLS = rank_grid.Cells(__name__)


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


CELLS.add("dcp resume", dcp_resume, tests=["test_dcp_resume_after_unfreezing"])
CELLS.add("mixed precision", mixed_precision, tests=["test_mixed_precision_unfreezing"])
CELLS.add("quantized", quantized, tests=["test_quantized_unfreezing"])
CELLS.add("spmd compute parameters", spmd_compute_params, tests=["test_against_fsdp2"],
          match=dict(name="spmd compute parameters"))
CELLS.add("tensor parallel", tensor_parallel, worlds=(4,), tests=["test_against_fsdp2"],
          match=dict(name="tensor parallel"))


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
