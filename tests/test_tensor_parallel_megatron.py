"""2-D parallelism on the Megatron-style API (megatron_fsdp_c.fully_shard with tp_dim): torch
DTensor TP parameters, and Megatron-core style local shards (support/megatron_tp.py: a
sequence-parallel model doing its own collectives), float64 against test_tensor_parallel.py's
single-process reference, on (dp 2, tp 2) and HSDP / HFSDP + TP meshes; sequence-parallel norms
that are not flagged diverge across tp; the Megatron-style checkpoint of the DTensor model loaded
into the local-shard model at (dp 1, tp 4).
"""
import pytest
import torch

from megatron_fsdp_c.testing import TPBlock, parallelize_tp

from support import rank_grid
from support.megatron_tp import megatronize
from test_tensor_parallel import (STEPS, build, checkpoint_path, close_at_scale, dp_group, duplicated_identical, layout,
                                  matches_reference, mesh_of, reference_result, snapshot, tp_duplicated, train_steps)

CELLS = rank_grid.Cells(__name__)


def unprefixed(named):
    """named_parameters() without the wrapper's 'module.' prefix."""
    return lambda: ((n[len("module."):], p) for n, p in named())


def megatron_model(kind_of_tp, dtype, shape=(2, 2), flag_norms=True, **kw):
    """The Megatron-style API with tp_dim: torch DTensor TP parameters ("dtensor") or Megatron-core
    style local shards ("local")."""
    import megatron_fsdp_c as mf
    mesh = mesh_of(shape)
    model = build("gpt", dtype)
    if kind_of_tp == "dtensor":
        parallelize_tp(model, mesh["tp"], sequence_parallel=True)
    else:
        megatronize(model, mesh["tp"].get_group(), sp=True, flag_norms=flag_norms)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if mesh.ndim == 3:
        kw.update(dp_outer_dim="dp_replicate", hybrid_fsdp_group=dp_group(mesh))
    model, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[TPBlock], device_mesh=mesh, dp_shard_dim="dp",
                                tp_dim="tp", **kw)
    return model, opt, mesh


def megatron_cell(rank, world, kind_of_tp, dtype, shape=(2, 2), steps=STEPS, flag_norms=True, save=None, **kw):
    model, opt, mesh = megatron_model(kind_of_tp, dtype, shape, flag_norms, **kw)
    out = train_steps("gpt", model, unprefixed(model.named_parameters), opt, dp_group(mesh), steps)
    out["layout"] = layout(unprefixed(model.named_parameters)())
    out["duplicated"] = tp_duplicated(unprefixed(model.named_parameters)())
    if save:
        import megatron_fsdp_c as mf
        mf.save_checkpoint(checkpoint_path(save), model, opt)
    return out


def megatron_dcp_cell(rank, world, name):
    """The Megatron-style checkpoint of the DTensor TP model at (dp 2, tp 2) (saved by its cell after
    training), loaded into the Megatron-core style local-shard model at (dp 1, tp 4)."""
    path = checkpoint_path(name)
    import megatron_fsdp_c as mf
    model, opt, _ = megatron_model("local", torch.float64, (1, 4))
    mf.load_checkpoint(path, model, opt)
    return snapshot(unprefixed(model.named_parameters)(), opt)


def _register():
    add = lambda key, fn, *args, **kw: CELLS.add(key, fn, *args, worlds=(4,), **kw)  # noqa: E731
    add(("megatron", "dtensor"), megatron_cell, "dtensor", torch.float64, save="megatron")
    add(("megatron", "local"), megatron_cell, "local", torch.float64)
    add(("megatron", "local", "unflagged"), megatron_cell, "local", torch.float64, steps=2, flag_norms=False)
    add(("megatron", "local", "hsdp"), megatron_cell, "local", torch.float64, (1, 2, 2))
    add(("megatron", "dtensor", "hfsdp"), megatron_cell, "dtensor", torch.float64, (2, 1, 2),
        outer_dp_sharding_strategy="optim")
    # reads the checkpoint that ("megatron", "dtensor") saved
    add("megatron dcp", megatron_dcp_cell, "megatron", needs=[(__name__, ("megatron", "dtensor"), 4)])


_register()


def _cells(key):
    return CELLS.result(key, 4)


@pytest.mark.parametrize("kind_of_tp", ["dtensor", "local"])
def test_megatron_api_tp_dim_matches_reference(kind_of_tp):
    """tp_dim with torch DTensor TP parameters, and with Megatron-core style local shards: the
    state dict's DTensors gain Shard(partition_dim) on tp (Replicate() for TP-duplicated ones)."""
    runs = _cells(("megatron", kind_of_tp))
    for run in runs:
        matches_reference(run, reference_result("gpt"))
        assert run["layout"]["blocks.0.attn.q.weight"][0] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        assert run["layout"]["blocks.0.attn.proj.weight"][0] == "(Shard(dim=0), Shard(dim=1))"
        assert run["layout"]["blocks.0.ln1.weight"][0] == "(Shard(dim=0), Replicate())"
    duplicated_identical(runs)


def test_megatron_sequence_parallel_norms_need_their_flag():
    """The same Megatron-style model without sequence_parallel on its norms: their gradients are
    each tp rank's sequence shard's only, so the tp ranks' copies diverge (and the model is wrong)."""
    runs = _cells(("megatron", "local", "unflagged"))
    assert not torch.equal(runs[0]["duplicated"]["blocks.0.ln1.weight"], runs[1]["duplicated"]["blocks.0.ln1.weight"])
    with pytest.raises(AssertionError):
        matches_reference(runs[0], reference_result("gpt"), steps=2)


@pytest.mark.parametrize("variant", ["hsdp", "hfsdp"])
def test_megatron_api_hybrid_tp_matches_reference(variant):
    key = ("megatron", "local", "hsdp") if variant == "hsdp" else ("megatron", "dtensor", "hfsdp")
    runs = _cells(key)
    for run in runs:
        matches_reference(run, reference_result("gpt"))
    placement = run["layout"]["blocks.0.attn.q.weight"][0]
    assert placement == ("(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))" if variant == "hsdp" else
                         "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
    duplicated_identical(runs, (1, 2, 2))


def test_megatron_checkpoint_from_dtensor_tp_into_local_shards():
    ref = reference_result("gpt")["snaps"][STEPS - 1]
    for snap in _cells("megatron dcp"):
        close_at_scale(snap["params"], ref["params"], "params")
        close_at_scale(snap["states"], ref["states"], "Adam states")
