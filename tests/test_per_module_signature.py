"""torch 2.13's fully_shard signature on the per-module API: reshard_after_forward=None (FSDP2's
default) and dp_mesh_dims (a named SPMD mesh whose dims are all data-parallel), on the models and
script of test_per_module_dropin.py.

Cells at world 2 (rank_grid), float64 against torch's FSDP2 on the same script (rtol 1e-9).
"""
import pytest
import torch
import torch.nn as nn

from support import rank_grid
from support.checks import RTOL, outcome
from test_per_module_dropin import close_dicts, data, full_params, mlp, shard

CELLS = rank_grid.Cells(__name__)


def reshard_default(rank, world):
    """reshard_after_forward=None is FSDP2's default: the root keeps its parameters gathered from
    forward to backward (one all-gather fewer a step than True), the blocks reshard."""
    counts = {}
    for label, kw in (("none", {}), ("true", {"reshard_after_forward": True})):
        model = shard(mlp(), "ours", **kw)
        model(data(0, rank)).sum().backward()  # lazy init and a first step
        before = model.comm_stats()["all_gathers"]
        model(data(1, rank)).sum().backward()
        counts[label] = model.comm_stats()["all_gathers"] - before
    return counts


def dp_mesh_dims(rank, world, impl, dims):
    """torch's dp_mesh_dims (2.12+; ours on every torch): a named SPMD mesh whose dims are all
    data-parallel, parameters DTensors replicated over it (as torch requires); float64 against
    torch's FSDP2 on the same script: both compute with DTensors on the SPMD mesh, the batch
    sharded over it ([Note: SPMD compute parameters] in megatron_fsdp_c/per_module/_root.py).
    Two microbatches a step, the first with gradient sync off (their DTensor gradients' local
    tensors are held, then summed). On torch 2.11, whose fully_shard has no dp_mesh_dims, torch's
    side is what the argument stands for: FSDP2 on the data-parallel mesh itself (the 1-D shard
    dim, or the 2-D (replicate, shard) HSDP mesh), plain parameters and batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    if impl == "ours":
        from megatron_fsdp_c.per_module import DataParallelMeshDims
    else:
        DataParallelMeshDims = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)
    if dims == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        spec = DataParallelMeshDims and DataParallelMeshDims(shard="dp_shard")
    else:  # hsdp: 1 x world
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_replicate", "dp_shard"))
        spec = DataParallelMeshDims and DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    model = mlp()
    if spec is not None:
        for mod in model.modules():
            for name, p in list(mod._parameters.items()):
                mod._parameters[name] = nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()] * mesh.ndim))
        shard(model, impl, mesh=mesh, dp_mesh_dims=spec)
    else:
        shard(model, impl, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x = data(10 * step + micro, rank)
            if spec is not None:
                x = DTensor.from_local(x, mesh, [Shard(0)] * mesh.ndim)
            out = model(x)
            if spec is not None:
                assert isinstance(out, DTensor) and all(isinstance(p, DTensor) for p in model.parameters())
                out = out.to_local()
            loss = out.square().mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return dict(losses=losses, params=full_params(model))


def dp_mesh_dims_errors(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from megatron_fsdp_c.per_module import DataParallelMeshDims, fully_shard
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp"))
    return {label: outcome(fn) for label, fn in {
        "tensor parallel dim": lambda: fully_shard(mlp(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")),
        "unknown dim": lambda: fully_shard(mlp(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp")),
    }.items()}

CELLS.add("reshard_default", reshard_default, tests=["test_reshard_after_forward_none_keeps_the_root_gathered"])
CELLS.add("dims_errors", dp_mesh_dims_errors, tests=["test_dp_mesh_dims_with_tensor_parallel_dims_is_a_clear_error"])
for _impl in ("torch", "ours"):
    for _dims in ("fsdp", "hsdp"):
        CELLS.add(("dims", _dims, _impl), dp_mesh_dims, _impl, _dims, tests=["test_dp_mesh_dims_matches_fsdp2"],
                  match={"dims": _dims})


def _cell(key):
    return CELLS.result(key, 2)


def test_reshard_after_forward_none_keeps_the_root_gathered():
    for r in _cell("reshard_default"):
        assert r["true"] == r["none"] + 1, r  # the root's one bucket, gathered again in backward with True


@pytest.mark.parametrize("dims", ["fsdp", "hsdp"])
def test_dp_mesh_dims_matches_fsdp2(dims):
    for theirs, ours in zip(_cell(("dims", dims, "torch")), _cell(("dims", dims, "ours"))):
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=RTOL, atol=0)
        close_dicts(ours["params"], theirs["params"], "params")


def test_dp_mesh_dims_with_tensor_parallel_dims_is_a_clear_error():
    for r in _cell("dims_errors"):
        assert r["tensor parallel dim"].startswith("NotImplementedError") and "['tp']" in r["tensor parallel dim"] \
            and "fully_shard(module, mesh=mesh['dp'])" in r["tensor parallel dim"], r
        assert r["unknown dim"].startswith("ValueError") and "'fsdp' not found" in r["unknown dim"], r
