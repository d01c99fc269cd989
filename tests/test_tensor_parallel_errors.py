"""2-D parallelism's bad input, on both APIs: each a clear error naming the fix (cells at world 4,
(dp 2, tp 2), on test_tensor_parallel.py's models)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megatron_fsdp_c.testing import TPBlock, parallelize_tp

from support import rank_grid
from support.checks import outcome
from support.megatron_tp import megatronize
from test_tensor_parallel import build, mesh_of

CELLS = rank_grid.Cells(__name__)


def errors_cell(rank, world):
    """Bad input, each a clear error naming the fix."""
    import megatron_fsdp_c as mf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.placement_types import _StridedShard
    from megatron_fsdp_c.per_module import fully_shard
    mesh = mesh_of((2, 2))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))

    def gpt(plan_mesh=None):
        model = build("gpt", torch.float32)
        if plan_mesh is not None:
            parallelize_tp(model, plan_mesh, sequence_parallel=True)
        return model

    def mf_shard(model, **kw):
        kw.setdefault("device_mesh", mesh)
        kw.setdefault("dp_shard_dim", "dp")
        return mf.fully_shard(model, fsdp_unit_modules=[TPBlock], **kw)

    def placed(placement):
        model = build("gpt", torch.float32)
        lin = model.blocks[0].mlp.fc
        lin.weight = nn.Parameter(DTensor.from_local(lin.weight.detach()[:64].clone(), mesh["tp"], [placement],
                                                     run_check=False))
        return model

    def strided_megatron():
        model = megatronize(gpt(), mesh["tp"].get_group())
        model.blocks[0].attn.q.weight.partition_stride = 2
        return model

    cases = {
        "tp_dim not on the mesh": lambda: mf_shard(gpt(mesh["tp"]), tp_dim="model"),
        "tp_dim on an unnamed mesh": lambda: mf_shard(gpt(), device_mesh=init_device_mesh("cpu", (2, 2)),
                                                      dp_shard_dim=0, tp_dim="tp"),
        "tp_dim without a mesh": lambda: mf_shard(gpt(), device_mesh=dist.group.WORLD, dp_shard_dim=None, tp_dim="tp"),
        "tp_dim is the dp dim": lambda: mf_shard(gpt(mesh["tp"]), tp_dim="dp"),
        "DTensor without tp_dim": lambda: mf_shard(gpt(mesh["tp"])),
        "Megatron shard without tp_dim": lambda: mf_shard(megatronize(gpt(), mesh["tp"].get_group())),
        "DTensor on another mesh (Megatron-style API)": lambda: mf_shard(gpt(other["b"]), tp_dim="tp"),
        "DTensor on another mesh (per-module)": lambda: fully_shard(gpt(other["a"]).blocks[0], mesh=mesh["dp"]),
        "per-module mesh includes tp": lambda: fully_shard(gpt(mesh["tp"]).blocks[0], mesh=mesh),
        "Partial placement": lambda: fully_shard(placed(Partial()).blocks[0], mesh=mesh["dp"]),
        "strided placement": lambda: mf_shard(placed(_StridedShard(0, split_factor=2)), tp_dim="tp"),
        "2-D TP mesh": lambda: fully_shard(_on_2d_mesh(mesh), mesh=mesh["dp"]),
        "partition_stride": lambda: mf_shard(strided_megatron(), tp_dim="tp"),
    }
    return {label: outcome(fn) for label, fn in cases.items()}


def _on_2d_mesh(mesh):
    from torch.distributed.tensor import Replicate, distribute_tensor
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Replicate(), Replicate()]))
    return lin


CELLS.add("errors", errors_cell, worlds=(4,))


EXPECTED_ERRORS = {
    "tp_dim not on the mesh": ("ValueError", "tp_dim='model' is not a dim of the device mesh"),
    "tp_dim on an unnamed mesh": ("ValueError", "mesh_dim_names"),
    "tp_dim without a mesh": ("ValueError", "needs device_mesh= the N-D DeviceMesh"),
    "tp_dim is the dp dim": ("ValueError", "also a data-parallel dim"),
    "DTensor without tp_dim": ("ValueError", "pass device_mesh= the full mesh, dp_shard_dim="),
    "Megatron shard without tp_dim": ("ValueError", "pass tp_dim="),
    "DTensor on another mesh (Megatron-style API)": ("ValueError", "not on device_mesh[tp_dim]"),
    "DTensor on another mesh (per-module)": ("ValueError", "already a DTensor on a mesh over the data-parallel ranks"),
    "per-module mesh includes tp": ("ValueError", "mesh=mesh['dp']"),
    "Partial placement": ("ValueError", "Partial()"),
    "strided placement": ("ValueError", "placed _StridedShard"),
    "2-D TP mesh": ("NotImplementedError", "1-D tensor parallelism"),
    "partition_stride": ("NotImplementedError", "partition_stride=2"),
}


@pytest.mark.parametrize("label", list(EXPECTED_ERRORS))
def test_bad_input_is_a_clear_error(label):
    kind, text = EXPECTED_ERRORS[label]
    for r in CELLS.result("errors", 4):
        assert r[label].startswith(kind) and text in r[label], r[label]
