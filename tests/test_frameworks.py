"""Frameworks' FSDP2 paths with torch's fully_shard swapped for megatron_fsdp_c.per_module.fully_shard
give torch's numbers on the same script (issue 24): accelerate 1.15.0 (FullyShardedDataParallelPlugin
(fsdp_version=2), gradient accumulation through its no_sync), Lightning 2.6.6 (Fabric's
no_backward_sync, the Trainer's accumulate_grad_batches). Each cell trains the same tiny model with
torch's FSDP2 and with ours in the same process and returns both: for Lightning, the scripts
examples/dropin_lightning_fabric.py and dropin_lightning_trainer.py themselves (their run(impl));
accelerate has no example, its script is here. The tests compare losses, gradient
norms and final parameters, and our reduce-scatter counts (a skipped gradient sync is skipped here
too). accelerate runs in float64 (rtol 1e-9); Lightning's ModelParallelStrategy refuses 64-true, so
it runs in float32, compared bit for bit: at world 2 each reduced gradient element is the sum of
two ranks' pieces (the same either way round) scaled by 1/2 (exact, before or after the sum), and
our per-module groups reduce the same parameters' rows as FSDP2's, so nothing may differ.
torchtitan is not here: it imports triton (a 285 MB wheel, ~1 GB installed, 46 s to install) and
costs ~25 s of imports per rank; examples/dropin_torchtitan.py runs it, with its figures.

The frameworks' cells share one spawn at world 2 of their own (group "frameworks"): they set
process-wide state (accelerate's singletons, the launcher environment Lightning reads), which no other
module's cells should see. A framework that is not installed skips its test with the import error.
"""
import contextlib
import importlib
import importlib.util
import os
import pathlib
import sys

import pytest
import torch
import torch.nn as nn

from support import rank_grid
from support.checks import RTOL

CELLS = rank_grid.Cells(__name__)
GROUP = "frameworks"
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
IMPLS = ("torch", "ours")


def missing(module: str):
    """Why `module` cannot be imported on this rank (None: it can). The cells check on the ranks,
    so that the pytest process does not pay the frameworks' imports (~5 s for Lightning)."""
    try:
        importlib.import_module(module)
        return None
    except ImportError as e:
        return f"{module} is not importable ({type(e).__name__}: {e}); `make setup` installs it"


def results(key):
    """Every rank's value of the cell, or the test skips when the framework is not installed."""
    values = CELLS.result(key, 2)
    if "missing" in values[0]:
        pytest.skip(values[0]["missing"])
    return values


@contextlib.contextmanager
def torchs_fully_shard_is(impl):
    """torch.distributed.fsdp.fully_shard is ours while inside (frameworks import it from there at
    call time), torch's again after."""
    import torch.distributed.fsdp as tfsdp
    orig = tfsdp.fully_shard
    if impl == "ours":
        from megatron_fsdp_c.per_module import fully_shard
        tfsdp.fully_shard = fully_shard
    try:
        yield
    finally:
        tfsdp.fully_shard = orig


@contextlib.contextmanager
def launcher_env(rank, world):
    """The variables torchrun sets, which accelerate and Lightning read to see that the processes
    exist already (the group is rank_grid's); removed after."""
    env = dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def batches(rank, n, dtype=torch.float64, dim=8, out=2):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, dim, generator=g, dtype=dtype), torch.randn(4, out, generator=g, dtype=dtype))
            for _ in range(n)]


def reduce_scatters(model, impl):
    return model.comm_stats()["reduce_scatters"] if impl == "ours" else None


# -- accelerate ------------------------------------------------------------------------------------

def accelerate_run(rank, world, impl, steps=2, accum=2):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=1)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=accum)
    # On CPU accelerate keeps MULTI_CPU (DDP) whatever the plugin says (its FSDP switch lists GPU-like
    # types only): tell it FSDP, as a CUDA run would have it.
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torchs_fully_shard_is(impl):
        model, opt = acc.prepare(model, opt)
    sharded = sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
    losses, norms = [], []
    for x, y in batches(rank, steps * accum):
        with acc.accumulate(model):
            loss = (model(x) - y).square().mean()
            acc.backward(loss)
            losses.append(loss.item())
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 1e9)))
            opt.step()
            opt.zero_grad()
    out = dict(losses=losses, norms=norms, sharded=sharded, params={n: p.full_tensor() for n, p in model.named_parameters()},
               reduce_scatters=reduce_scatters(model, impl), fsdp2=acc.is_fsdp2)
    AcceleratorState._reset_state(True)
    return out


@CELLS.cell("accelerate", group=GROUP, tests=["test_accelerate"])
def accelerate_cell(rank, world):
    if missing("accelerate"):
        return {"missing": missing("accelerate")}
    with launcher_env(rank, world):
        return {impl: accelerate_run(rank, world, impl) for impl in IMPLS}


# -- Lightning: the examples themselves ------------------------------------------------------------

def example(name: str):
    """examples/<name>.py as a module (once per process; its __main__ part does not run)."""
    module_name = f"example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        sys.modules[module_name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module_name])
    return sys.modules[module_name]


def example_run(name: str, impl: str):
    """The example's run(impl) on this rank, with what the tests compare beside its losses and
    gradient norms: the full parameters and our reduce-scatters."""
    out = example(name).run(impl)
    model = out["model"]
    return dict(losses=out["losses"], norms=out["norms"],
                params={n: p.full_tensor() for n, p in model.named_parameters()},
                reduce_scatters=reduce_scatters(model, impl))


@CELLS.cell("lightning", group=GROUP, tests=["test_lightning_fabric", "test_lightning_trainer"])
def lightning_cell(rank, world):
    if missing("lightning"):
        return {"missing": missing("lightning")}
    with launcher_env(rank, world):
        return {kind: {impl: example_run(f"dropin_lightning_{kind}", impl) for impl in IMPLS}
                for kind in ("fabric", "trainer")}


# -- the tests -------------------------------------------------------------------------------------

def same_run(torch_run, ours_run, rank, rtol=RTOL):
    """Losses, gradient norms and final parameters of ours against torch's, on one rank."""
    for what in ("losses", "norms"):
        assert ours_run[what] == pytest.approx(torch_run[what], rel=rtol, abs=0), f"rank {rank}: {what}"
    assert ours_run["params"].keys() == torch_run["params"].keys()
    for name, p in torch_run["params"].items():
        torch.testing.assert_close(ours_run["params"][name], p, rtol=rtol, atol=0, msg=f"rank {rank}: {name}")


def test_accelerate():
    """accelerate's FSDP2 path (fsdp2_prepare_model calls torch.distributed.fsdp.fully_shard on every
    module, then the root) with gradient_accumulation_steps=2: accumulate() turns gradient sync off
    for the first microbatch (set_requires_gradient_sync), clip_grad_norm_ reads the DTensor
    gradients. Ours: one reduce-scatter per group and step (no sync, no reduction)."""
    for rank, runs in enumerate(results("accelerate")):
        assert runs["torch"]["fsdp2"] and runs["ours"]["fsdp2"]
        assert runs["ours"]["sharded"] == runs["torch"]["sharded"]  # FSDPLinear x3, FSDPSequential
        same_run(runs["torch"], runs["ours"], rank)
        # 2 steps x 1 syncing backward x the 3 Linear groups (the root's group holds no parameter)
        assert runs["ours"]["reduce_scatters"] == 2 * 3


def test_lightning_fabric():
    """Fabric's no_backward_sync reaches our set_requires_gradient_sync (Fabric checks isinstance of
    torch's FSDPModule): one reduce-scatter per group and step."""
    for rank, runs in enumerate(results("lightning")):
        same_run(runs["fabric"]["torch"], runs["fabric"]["ours"], rank, rtol=0)
        assert runs["fabric"]["ours"]["reduce_scatters"] == 2 * 2  # 2 steps x 2 groups (model[0], the root)


def test_lightning_trainer():
    """The Trainer with accumulate_grad_batches=2: every microbatch's backward reduces (the Trainer
    skips sync for DDP only), in both."""
    for rank, runs in enumerate(results("lightning")):
        same_run(runs["trainer"]["torch"], runs["trainer"]["ours"], rank, rtol=0)
        assert runs["trainer"]["ours"]["reduce_scatters"] == 4 * 2  # 4 microbatches x 2 groups
