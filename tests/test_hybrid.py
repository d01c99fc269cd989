"""Hybrid sharding. HSDP: shards inside a replica, replicas across dp_outer, gradients all-reduced
across the replicas once per optimisation step ([Note: hybrid sharding] in csrc/comm/replicas.c).
HFSDP (outer_dp_sharding_strategy="optim"): main weights, gradients and optimizer state sharded
over every rank, a reduce-scatter and an all-gather across the replicas once per step ([Note:
optimizer sharded across replicas]).

4 gloo ranks as 2x2, 1x4 and 4x1 (dp_outer x dp_shard) meshes, every inner strategy (HFSDP: 3),
1 and 3 microbatches (no_sync on all but the last), AdamW: parity with DDP in float64 to rtol 1e-9
(an exact check of the algorithm: at 4 ranks the sums run in another order than DDP's, see
[Note: reduction order] in tests/test_parity.py). fp32 is checked where the order is DDP's: 2
ranks as 2 replicas of one shard (2x1), every inner strategy and HFSDP, bit for bit. The
engine's counters split by level match the theoretical volume; memory; DCP across mesh shapes
and between HSDP, HFSDP and 1-D FSDP; errors.
"""
import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid
from support.checks import ATOL, RTOL
from support.train_both import train_pair
from test_mixed_precision import LOSS_RTOL, _reference_losses, _sharded_losses

CFG = GPTConfig(vocab=67, seq=8, d=36, heads=4, layers=2)
MESHES = [(2, 2), (1, 4), (4, 1)]  # (dp_outer, dp_shard)
FP32_MESH = (2, 1)  # at 2 ranks: a reduction across replicas whose sums are DDP's
STEPS = 3
CELLS = rank_grid.Cells(__name__)


def hybrid_mesh(outer, shard):
    return rank_grid.device_mesh("cpu", (outer, shard), mesh_dim_names=("dp_outer", "dp_shard"))


def shard_hybrid(model, opt, mesh, strategy, **kw):
    return mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy, device_mesh=mesh,
                          dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", hybrid_fsdp_group=dist.group.WORLD, **kw)


def train_vs_ddp(rank, world, mesh_shape, strategy, micro, dtype, **kw):
    """tests/support/train_both.py's train_pair on a hybrid mesh (no_sync on all but the last microbatch),
    with what the hybrid checks need: counters per step, placements, memory."""
    r = train_pair(rank, world, strategy, "adamw", micro, cfg=CFG, steps=STEPS, dtype=dtype,
                   mesh=hybrid_mesh(*mesh_shape), dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                   hybrid_fsdp_group=dist.group.WORLD, **kw)
    fsdp = r.pop("model")
    buf = fsdp.param_buffer
    grad_buckets = [b for b, s in enumerate(buf.specs) if s["grad_mode"] != mf._C.GRAD_NONE]
    # what the reduction across replicas moves per bucket: the bucket's part one inner rank holds
    # (HFSDP: shard_size is a piece of it, one of the replicas' dp_outer pieces)
    outer = mesh_shape[0] if kw.get("outer_dp_sharding_strategy") == "optim" else 1
    shard_grad_bytes = sum(buf.plan[b]["shard_size"] * outer * 8 if buf.plan[b]["shards"] > 1 else
                           buf.plan[b]["bucket_size"] * 8 for b in grad_buckets)
    r.update(grad_buckets=len(grad_buckets), shard_grad_bytes=shard_grad_bytes,
             placements={str(p.placements) for p in fsdp.parameters()},
             model_bytes=sum(p.numel() * p.element_size() for p in r["ref_params"].values()))
    return r


# HFSDP variants, float64 at 2x2: every backward syncing (a reduced sub-shard receives more
# gradients), the collectives averaging, a frozen layer (a bucket the replicas never gather).
HF_VARIANTS = {"sync each": dict(use_no_sync=False), "average": dict(average_in_collective=True),
               "average, sync each": dict(average_in_collective=True, use_no_sync=False),
               "frozen": dict(freeze=("blocks.0.attn",))}


F32, F64 = "torch.float32", "torch.float64"
for _strategy in (0, 1, 2, 3):
    for _micro in (1, 3):  # fp32 where the sums are DDP's (see the module docstring)
        CELLS.add((FP32_MESH, _strategy, _micro, F32), train_vs_ddp, FP32_MESH, _strategy, _micro, torch.float32,
                  tests=["test_hsdp_matches_ddp_fp32"], match=dict(strategy=_strategy, micro=_micro))
        if _strategy == 3:
            CELLS.add(("hfsdp", FP32_MESH, _micro, F32), train_vs_ddp, FP32_MESH, 3, _micro, torch.float32,
                      outer_dp_sharding_strategy="optim", tests=["test_hfsdp_matches_ddp_fp32"], match=dict(micro=_micro))
for _mesh in MESHES:
    for _strategy in (0, 1, 2, 3):
        for _micro in (1, 3):
            _key = (_mesh, _strategy, _micro, F64)
            CELLS.add(_key, train_vs_ddp, _mesh, _strategy, _micro, torch.float64, worlds=(4,),
                      tests=["test_hsdp_matches_ddp_float64"]
                      + (["test_outer_reduction_once_per_step_at_the_theoretical_volume"] if _micro == 3 else [])
                      + (["test_placements_and_memory_at_2x2", "test_hfsdp_memory_at_2x2"]
                         if _key[:3] == ((2, 2), 3, 1) else []),
                      match=dict(mesh_shape=_mesh, strategy=_strategy, micro=_micro))
    for _micro in (1, 3):
        _key = ("hfsdp", _mesh, _micro, F64)
        CELLS.add(_key, train_vs_ddp, _mesh, 3, _micro, torch.float64, outer_dp_sharding_strategy="optim",
                  worlds=(4,), tests=["test_hfsdp_matches_ddp_float64"]
                  + (["test_hfsdp_collectives_per_level_at_the_theoretical_volume"] if _micro == 3 else [])
                  + (["test_hfsdp_memory_at_2x2"] if _key[1:3] == ((2, 2), 1) else []),
                  match=dict(mesh_shape=_mesh, micro=_micro))
for _name, _kw in HF_VARIANTS.items():
    CELLS.add(("hfsdp", _name), train_vs_ddp, (2, 2), 3, 3, torch.float64, outer_dp_sharding_strategy="optim", **_kw,
              worlds=(4,), tests=["test_hfsdp_variants_match_ddp_float64"], match=dict(variant=_name))


def hfsdp_bf16_losses(rank, world, comm):
    """A bf16 model with fp32 main weights and gradients under HFSDP 2x2 (the replicas gather a
    bf16 shard cast from the fp32 pieces), trained as tests/test_mixed_precision.py trains it."""
    return _sharded_losses(rank, world, 3, comm, STEPS, device_mesh=hybrid_mesh(2, 2), dp_shard_dim="dp_shard",
                           dp_outer_dim="dp_outer", hybrid_fsdp_group=dist.group.WORLD,
                           outer_dp_sharding_strategy="optim")


for _comm in (None, torch.bfloat16):
    _tests = ["test_hfsdp_bf16_compute_fp32_main_matches_reference"]
    CELLS.add(("hfsdp bf16", str(_comm)), hfsdp_bf16_losses, _comm, worlds=(4,), tests=_tests, match=dict(comm=_comm))
    CELLS.add(("bf16 reference", str(_comm)), _reference_losses, _comm, STEPS, worlds=(4,), tests=_tests,
              match=dict(comm=_comm))


def _cell(key, world=4):
    return CELLS.result(key, world)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.parametrize("micro", [1, 3])
def test_hsdp_matches_ddp_float64(mesh_shape, strategy, micro):
    for r in _cell((mesh_shape, strategy, micro, "torch.float64")):
        torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                                   torch.tensor(r["ref_losses"], dtype=torch.float64), rtol=RTOL, atol=ATOL)
        for name, ref in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], ref, rtol=RTOL, atol=ATOL, msg=name)


def _assert_bit_identical(r):
    assert r["params"]["tok.weight"].dtype == torch.float32
    assert r["losses"] == r["ref_losses"], (r["losses"], r["ref_losses"])
    for name, ref in r["ref_params"].items():
        assert torch.equal(r["params"][name], ref), name


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.parametrize("micro", [1, 3])
def test_hsdp_matches_ddp_fp32(strategy, micro):
    """2 replicas of one shard at 2 ranks: bit for bit (the module docstring says why not 2x2)."""
    for r in _cell((FP32_MESH, strategy, micro, "torch.float32"), world=2):
        _assert_bit_identical(r)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_outer_reduction_once_per_step_at_the_theoretical_volume(mesh_shape, strategy):
    """With no_sync on all but the last of 3 microbatches, each gradient bucket is all-reduced
    across the replicas once per step, and the bytes are each bucket's reduced part (ZeRO-1/2/3:
    this rank's shard; no_shard: the whole bucket) -- the model's gradients / dp_shard, up to
    padding. One replica (1x4) sends nothing across replicas."""
    outer = mesh_shape[0]
    for r in _cell((mesh_shape, strategy, 3, "torch.float64")):
        for step in r["per_step"]:
            if outer == 1:
                assert step["outer_all_reduces"] == 0 and step["outer_all_reduce_bytes"] == 0
                continue
            assert step["outer_all_reduces"] == r["grad_buckets"], step
            assert step["outer_all_reduce_bytes"] == r["shard_grad_bytes"], step
            model_grad_bytes = r["model_bytes"]
            inner = mesh_shape[1] if strategy > 0 else 1
            assert model_grad_bytes / inner <= step["outer_all_reduce_bytes"] <= 1.05 * model_grad_bytes / inner + 4096


def test_placements_and_memory_at_2x2():
    for r in _cell(((2, 2), 3, 1, "torch.float64")):
        assert r["placements"] <= {"(Replicate(), Shard(dim=0))", "(Replicate(), Replicate())"}, r["placements"]
        # HSDP holds the optimizer state of half the model at 2x2 (sharded over dp_shard = 2)
        optim = r["memory"]["optimizer_state_bytes"]  # AdamW: two states, each of half the model
        assert abs(optim - r["model_bytes"]) <= 0.05 * r["model_bytes"], (optim, r["model_bytes"])


# -- HFSDP ---------------------------------------------------------------------------------------

def _assert_float64_parity(r):
    torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                                   torch.tensor(r["ref_losses"], dtype=torch.float64), rtol=RTOL, atol=ATOL)
    for name, ref in r["ref_params"].items():
        torch.testing.assert_close(r["params"][name], ref, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("micro", [1, 3])
def test_hfsdp_matches_ddp_float64(mesh_shape, micro):
    for r in _cell(("hfsdp", mesh_shape, micro, "torch.float64")):
        _assert_float64_parity(r)
        # one replica (1x4) is plain FSDP on the 2-D mesh; else Shard(0) over every rank
        want = {"(Replicate(), Shard(dim=0))"} if mesh_shape[0] == 1 else {"(Shard(dim=0),)"}
        assert r["placements"] == want, r["placements"]


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_hfsdp_variants_match_ddp_float64(variant):
    for r in _cell(("hfsdp", variant)):
        _assert_float64_parity(r)


@pytest.mark.parametrize("micro", [1, 3])
def test_hfsdp_matches_ddp_fp32(micro):
    for r in _cell(("hfsdp", FP32_MESH, micro, "torch.float32"), world=2):
        _assert_bit_identical(r)


@pytest.mark.parametrize("comm", [None, torch.bfloat16], ids=["comm=fp32", "comm=bf16"])
def test_hfsdp_bf16_compute_fp32_main_matches_reference(comm):
    for value, ref in zip(_cell(("hfsdp bf16", str(comm))), _cell(("bf16 reference", str(comm)))):
        losses, main_dtypes, compute_dtypes = value
        assert main_dtypes == {torch.float32} and compute_dtypes == {torch.bfloat16}
        diff = ((torch.tensor(losses) - torch.tensor(ref)).abs() / torch.tensor(ref).abs()).max().item()
        assert diff <= LOSS_RTOL, diff


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_hfsdp_collectives_per_level_at_the_theoretical_volume(mesh_shape):
    """With no_sync on all but the last of 3 microbatches, per step and per gradient bucket: one
    reduce-scatter across the replicas (on the syncing backward) and one all-gather across them
    (after the step), each moving the bucket's collective shard S = O * Sv -- the model / dp_shard,
    up to padding; inside the replica, one reduce-scatter per backward, as in FSDP."""
    outer, inner = mesh_shape
    for r in _cell(("hfsdp", mesh_shape, 3, "torch.float64")):
        for step in r["per_step"]:
            assert step["outer_all_reduces"] == 0, step
            if outer == 1:
                assert step["outer_reduce_scatters"] == step["outer_all_gathers"] == 0, step
                continue
            assert step["outer_reduce_scatters"] == step["outer_all_gathers"] == r["grad_buckets"], step
            assert step["outer_reduce_scatter_bytes"] == step["outer_all_gather_bytes"] == r["shard_grad_bytes"], step
            assert r["model_bytes"] / inner <= step["outer_reduce_scatter_bytes"] <= \
                1.05 * r["model_bytes"] / inner + 4096, step
            inner_reductions = 3 * r["grad_buckets"] if inner > 1 else 0
            assert step["reduce_scatters"] == inner_reductions, step


def test_hfsdp_memory_at_2x2():
    """AdamW's two states: HFSDP holds them for a quarter of the model per rank, HSDP for half."""
    for hf, hs in zip(_cell(("hfsdp", (2, 2), 1, "torch.float64")), _cell(((2, 2), 3, 1, "torch.float64"))):
        model = hf["model_bytes"]
        for r, share in ((hf, 1 / 4), (hs, 1 / 2)):
            want = 2 * share * model
            assert abs(r["memory"]["optimizer_state_bytes"] - want) <= 0.05 * want, (share, r["memory"], model)


# -- checkpoints across mesh shapes ------------------------------------------------------------

@CELLS.cell("dcp chain", worlds=(4,), tests=["test_dcp_across_mesh_shapes"])
def dcp_chain(rank, world):
    """Save at 2x2, load at 1x4, save; load at 4x1, save; load at 2x2; then into a plain 1-D model;
    the HFSDP links (outer "optim") hold Shard(0) over all ranks, the HSDP ones over dp_shard."""
    import torch.distributed.checkpoint as dcp
    path = os.path.join(rank_grid.session_dir(), "hybrid_dcp")
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(0)
    reference = GPT(CFG).double()
    want = {n: p.detach().clone() for n, p in reference.named_parameters()}
    out = {}
    chain = [(2, 2), (2, 2, "optim"), (1, 4), (4, 1, "optim"), (4, 1), (2, 2, "optim"), (2, 2), None]
    for k, shape in enumerate(chain):
        torch.manual_seed(k + 11)  # a different init: the load must overwrite it
        model = GPT(CFG).double()
        if shape is None:
            fsdp, _ = mf.fully_shard(model, None, fsdp_unit_modules=[Block], zero_dp_strategy=3)
        else:
            fsdp, _ = shard_hybrid(model, None, hybrid_mesh(*shape[:2]), 3,
                                   outer_dp_sharding_strategy=shape[2] if len(shape) > 2 else "no_shard")
        if k == 0:
            fsdp.load_state_dict({"module." + n: v for n, v in want.items()})
        else:
            sd = fsdp.state_dict()
            dcp.load(sd, checkpoint_id=os.path.join(path, f"ckpt{k - 1}"))
            fsdp.load_state_dict(sd)
        got = fsdp.full_parameters()
        out[str(shape)] = max((got[n] - want[n]).abs().max().item() for n in want)
        x, y = batch(CFG, 2, seed=rank)
        with torch.no_grad():
            out[f"loss {shape}"] = fsdp(x, y).item()
        dcp.save(fsdp.state_dict(), checkpoint_id=os.path.join(path, f"ckpt{k}"))
        dist.barrier()
    # meta-device initialisation under HFSDP (each rank writes its whole collective shard directly)
    # initialises exactly what 1-D FSDP's does from the same seed
    def from_meta(**hybrid):
        torch.manual_seed(5)
        with torch.device("meta"):
            model = GPT(CFG).double()
        kw = dict(init_model_with_meta_device=True, device=torch.device("cpu"))
        if hybrid:
            return shard_hybrid(model, None, hybrid_mesh(2, 2), 3, **hybrid, **kw)[0]
        return mf.fully_shard(model, None, fsdp_unit_modules=[Block], zero_dp_strategy=3, **kw)[0]

    plain, meta = from_meta(), from_meta(outer_dp_sharding_strategy="optim")
    a, b = plain.full_parameters(), meta.full_parameters()
    out["meta init"] = max((a[n] - b[n]).abs().max().item() for n in a)
    x, y = batch(CFG, 2, seed=rank)
    with torch.no_grad():
        out["meta init loss diff"] = abs(plain(x, y).item() - meta(x, y).item())
    return out


def test_dcp_across_mesh_shapes():
    for r in _cell("dcp chain"):
        for key, value in r.items():
            if not key.startswith("loss"):
                assert value == 0.0, (key, value)
        assert set(r) >= {"(2, 2, 'optim')", "(4, 1, 'optim')", "meta init", "meta init loss diff"}
        losses = {v for k, v in r.items() if k.startswith("loss")}
        assert len(losses) == 1, r


# -- bad input ---------------------------------------------------------------------------------

@CELLS.cell("bad input", worlds=(4,), tests=["test_hybrid_bad_input"])
def bad_inputs(rank, world):
    msgs = {}

    def attempt(name, fn):
        try:
            fn()
            msgs[name] = "no error"
        except Exception as e:  # noqa: BLE001
            msgs[name] = f"{type(e).__name__}: {e}"

    mesh = hybrid_mesh(2, 2)
    attempt("no hybrid group", lambda: mf.fully_shard(GPT(CFG), None, fsdp_unit_modules=[Block], device_mesh=mesh,
                                                      dp_shard_dim="dp_shard", dp_outer_dim="dp_outer"))
    attempt("group without outer dim", lambda: mf.fully_shard(GPT(CFG), None, fsdp_unit_modules=[Block],
                                                              device_mesh=mesh, dp_shard_dim="dp_shard",
                                                              hybrid_fsdp_group=dist.group.WORLD))
    attempt("unknown dim", lambda: mf.fully_shard(GPT(CFG), None, fsdp_unit_modules=[Block], device_mesh=mesh,
                                                  dp_shard_dim="dp_shard", dp_outer_dim="nodes",
                                                  hybrid_fsdp_group=dist.group.WORLD))
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    half = halves[rank // 2]  # a group of 2 that holds this rank: too small for the 2x2 mesh
    attempt("dims do not multiply", lambda: mf.fully_shard(GPT(CFG), None, fsdp_unit_modules=[Block],
                                                           device_mesh=mesh, dp_shard_dim="dp_shard",
                                                           dp_outer_dim="dp_outer", hybrid_fsdp_group=half))
    attempt("optim outer with ZeRO-2", lambda: mf.fully_shard(GPT(CFG), None, zero_dp_strategy=2, device_mesh=mesh,
                                                              dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                                                              hybrid_fsdp_group=dist.group.WORLD,
                                                              outer_dp_sharding_strategy="optim"))
    from torch.distributed.device_mesh import DeviceMesh
    permuted = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp_outer", "dp_shard"))
    attempt("HFSDP on a permuted mesh", lambda: mf.fully_shard(GPT(CFG), None, fsdp_unit_modules=[Block],
                                                               device_mesh=permuted, dp_shard_dim="dp_shard",
                                                               dp_outer_dim="dp_outer", hybrid_fsdp_group=dist.group.WORLD,
                                                               outer_dp_sharding_strategy="optim"))
    meta = GPT(CFG).to("meta")
    attempt("wrong device type", lambda: mf.fully_shard(
        GPT(CFG), None, fsdp_unit_modules=[Block], dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
        device_mesh=init_device_mesh("meta", (2, 2), mesh_dim_names=("dp_outer", "dp_shard")),
        hybrid_fsdp_group=dist.group.WORLD))
    del meta
    return msgs


@pytest.mark.parametrize("case,match", [
    ("no hybrid group", "required exactly when dp_outer_dim"),
    ("group without outer dim", "required exactly when dp_outer_dim"),
    ("unknown dim", "dp_outer_dim='nodes' is not a dim of the device mesh"),
    ("dims do not multiply", "do not multiply to the data-parallel size"),
    ("optim outer with ZeRO-2", "needs zero_dp_strategy='optim_grads_params'"),
    ("HFSDP on a permuted mesh", "needs the (dp_outer, dp_shard) mesh to number its ranks in order"),
    ("wrong device type", "parameters are on 'cpu'"),
])
def test_hybrid_bad_input(case, match):
    for msgs in _cell("bad input"):
        assert match in msgs[case], msgs[case]


# -- the per-module API: a 2-D mesh is HSDP, as in torch -------------------------------------------

def per_module_vs_ddp(rank, world, mesh_shape, strategy, micro, skip):
    """per_module.fully_shard on a (replicate, shard) mesh against DDP and torch's own FSDP2 HSDP,
    float64. The quiet microbatches turn off `skip`: set_requires_all_reduce (reduce within the
    shard dim, no all-reduce across replicas) or set_requires_gradient_sync (no reduction)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from megatron_fsdp_c.per_module import fully_shard
    torch.manual_seed(0)
    model = GPT(CFG).double()
    ref, peer = copy.deepcopy(model), copy.deepcopy(model)
    ddp = DDP(ref)
    mesh = rank_grid.device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, zero_dp_strategy=strategy)
    fully_shard(model, mesh=mesh, zero_dp_strategy=strategy)
    for blk in peer.blocks:
        torch_fully_shard(blk, mesh=mesh)
    torch_fully_shard(peer, mesh=mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, ref, peer)]
    outer_counts = []
    for step in range(STEPS):
        before = model.comm_stats()["outer_all_reduces"]
        for m in range(micro):
            x, y = batch(CFG, 2, seed=1000 * step + 10 * m + rank)
            last = m == micro - 1
            getattr(model, skip)(last)
            getattr(peer, skip)(last)
            with ddp.no_sync() if not last else torch.enable_grad():
                ddp(x, y).backward()
            model(x, y).backward()
            peer(x, y).backward()
        for o in opts:
            o.step()
            o.zero_grad()
        outer_counts.append(model.comm_stats()["outer_all_reduces"] - before)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    return dict(params=full, ref={n: p.detach().clone() for n, p in ref.named_parameters()},
                peer={n: p.full_tensor() for n, p in peer.named_parameters()}, outer_counts=outer_counts,
                placements={str(p.placements) for p in model.parameters()},
                grad_buckets=sum(s["grad_mode"] != mf._C.GRAD_NONE
                                 for s in model._mfsdp_group.owner.param_buffer.specs))


PM_CASES = [((2, 2), s, 1, "set_requires_all_reduce") for s in (0, 1, 2, 3)] + \
           [((2, 2), s, 3, skip) for s in (0, 1, 2, 3) for skip in ("set_requires_all_reduce",
                                                                      "set_requires_gradient_sync")] + \
           [((4, 1), 3, 3, "set_requires_all_reduce"), ((1, 4), 3, 3, "set_requires_all_reduce")]


for _case in PM_CASES:
    CELLS.add(("per-module",) + _case, per_module_vs_ddp, *_case, worlds=(4,),
              tests=["test_per_module_hsdp_matches_ddp_and_fsdp2_float64"], match=dict(case=_case))


@pytest.mark.parametrize("case", PM_CASES, ids=[f"{m[0]}x{m[1]}-s{s}-micro{n}-{k[4:]}" for m, s, n, k in PM_CASES])
def test_per_module_hsdp_matches_ddp_and_fsdp2_float64(case):
    mesh_shape, strategy, micro, skip = case
    for r in _cell(("per-module",) + case):
        for name, ref in r["ref"].items():
            torch.testing.assert_close(r["params"][name], ref, rtol=RTOL, atol=ATOL, msg=f"vs DDP: {name}")
            torch.testing.assert_close(r["params"][name], r["peer"][name], rtol=RTOL, atol=ATOL,
                                       msg=f"vs FSDP2: {name}")
        assert r["placements"] <= {"(Replicate(), Shard(dim=0))", "(Replicate(), Replicate())"}, r["placements"]
        # the all-reduce across replicas: once per step per gradient bucket, whatever the microbatches
        expect = r["grad_buckets"] if mesh_shape[0] > 1 else 0
        assert r["outer_counts"] == [expect] * STEPS, (r["outer_counts"], expect)
