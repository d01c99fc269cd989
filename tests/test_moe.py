"""Mixture-of-experts with expert parallelism: a mesh per group ([Note: a mesh per group] in
megatron_fsdp_c/per_module/_root.py) on the MoE of tests/support/moe_model.py (top-2 router, all-to-all
dispatch over the ep group, local experts). The cells run in the shared spawns ([Note: one spawn
per world size] in support/rank_grid.py).

World 4, ep 2: the ep groups are {0,1} and {2,3}; the experts are sharded over the ranks that hold
the same experts (dp_mod_ep: {0,2} and {1,3}), the dense part over all four (or HSDP 2 x 2). The
experts' gradients are divided by the full data-parallel degree with set_gradient_divide_factor,
as torchtitan does ([Note: expert gradient scaling]). At worlds 1 and 2, ep 1: the experts' mesh spans
the same ranks as the dense one under other dim names, so two engines still run side by side.

Behaviours (cell names):
- the per-module API against the single-process reference on the global batch, AdamW, float64,
  rtol 1e-9 (losses, parameters after 3 steps): plain (dense FSDP over 4; and worlds 1 and 2, ep 1),
  hsdp (the dense part on a 2 x 2 (dp_replicate, dp_shard) mesh), skew_dead (a rank-dependent
  router, so ranks send different token counts, and an expert that gets no token on any rank:
  its parameters keep `.grad is None` after every backward, as the reference's)
- vs_fsdp2: torch's FSDP2 with the same two meshes and script, fp32 losses within 1e-6 relative
- dcp: a DCP checkpoint saved at ep 2 with the dense part over 4 ranks, loaded at ep 2 with the
  dense part on HSDP 2 x 2 (another data-parallel layout), equal to what was saved, then trained
  on against the reference; get_model_state_dict(full_state_dict=True) against the reference's
  state dict. dcp_world2: the same checkpoint loaded at world 2, ep 2 (each rank holds its
  experts whole, the dense part over 2), against the reference, then trained on
- bad_input: an expert mesh that does not divide the world, overlapping meshes with inconsistent
  rank sets, a parameter registered in groups on two meshes: each a ValueError naming the fix
- megatron_<strategy>, megatron_hsdp_<strategy>: the Megatron-style API (megatron_fsdp_c.fully_shard)
  with Megatron-FSDP's expt_device_mesh: experts marked allreduce=False (Megatron-core's mark),
  sharded over the expert mesh's dp_shard dim {0,2} / {1,3}, the dense part over 4 (or HSDP
  2 x 2 with hybrid_fsdp_expt_group over the experts' (dp_outer 1, dp_shard 2)), against the
  reference as above (float64, AdamW, rtol 1e-9, the rank-dependent router, a dead expert keeps
  `.grad is None`); megatron_hsdp_expert_replicas: the experts' mesh (dp_outer 2, dp_shard 1), each
  expert whole on a rank, all-reduced across the 2 replicas; megatron_average_in_collective: AVG
  collectives, experts pre-scaled by expert_dp / dp; Megatron-LM's
  expert gradient scaling, 1/dp ([Note: expert data-parallel mesh] in megatron_fsdp_c/_megatron_experts.py)
- megatron_clip: MegatronFSDP.clip_grad_norm_ over both meshes (torch's refuses two meshes) against
  torch's on the reference, norms and parameters after 2 clipped steps
- megatron_dcp: the Megatron-style model and optimizer saved (save_checkpoint) with dense ZeRO-3 over 4,
  loaded into one with dense HSDP 2 x 2 and no_shard, equal to what was saved, trained on against the
  reference with its optimizer state; get_model_state_dict(full_state_dict=True) against the reference
- bad_input also holds the Megatron-style API's errors (MBAD): expert meshes that do not partition
  the world, an expert mesh without marked experts and the reverse, hybrid_fsdp_expt_group without
  HSDP and HSDP without it, an expert mesh without the dp_shard dim
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh

import megatron_fsdp_c as mfsdp
from megatron_fsdp_c.per_module import fully_shard

from support import rank_grid
from support.checks import raised_by, recorder_cells, reraise, strip, verify
from support.data import global_batch
from support.moe_model import MoEBlock, moe_batch, moe_model

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS, tests=["test_moe"])
STEPS, LR = 3, 1e-2


def meshes(world: int, hsdp: bool = False, ep=None):
    """(ep, the expert-parallel mesh, the experts' dp_mod_ep mesh, the dense mesh); ep 2 at world 4,
    else 1 unless given."""
    ep = ep or (2 if world >= 4 else 1)
    mesh = rank_grid.device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp_mod_ep", "ep"))
    dense = rank_grid.device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard")) if hsdp \
        else rank_grid.device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return ep, mesh["ep"], mesh["dp_mod_ep"], dense


def sharded_moe(world: int, impl=fully_shard, hsdp: bool = False, dtype=torch.float64, ep=None, **config):
    """The MoE at ep 2 (1 below world 4), experts sharded over dp_mod_ep, blocks and root over the dense mesh."""
    ep, ep_mesh, expert_mesh, dense = meshes(world, hsdp, ep)
    model = moe_model(dtype=dtype, **config).expert_parallel(ep_mesh.get_group(), ep_mesh.get_local_rank(), ep)
    for block in model.blocks:
        impl(block.moe.experts, mesh=expert_mesh)
        # torchtitan's apply_fsdp: the experts' gradients averaged over every data-parallel rank
        block.moe.experts.set_gradient_divide_factor(float(world))
        impl(block, mesh=dense)
    impl(model, mesh=dense)
    return model


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)


def mean_over_ranks(loss) -> float:
    t = loss.detach().to(torch.float64).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def check_against_reference(ck, label, model, ref):
    """Every parameter of ours (this rank's experts and the dense part) against the reference's."""
    refs = dict(ref.named_parameters())
    names = [strip(n) for n, _ in model.named_parameters()]
    ck.true(f"{label}: our parameter names are the reference's", set(names) <= set(refs),
            f"only ours: {sorted(set(names) - set(refs))[:4]}")
    for name, p in model.named_parameters():
        ck.close(f"{label}: {name}", p, refs[strip(name)])


def train_both(ck, rank, world, model, ref, steps=STEPS, first=0, dead=None, opt=None, ropt=None):
    opt, ropt = opt or adamw(model), ropt or adamw(ref)
    for step in range(first, first + steps):
        loss = model(*moe_batch(step, rank))
        loss.backward()
        rloss = ref(*global_batch(moe_batch, step, world))
        rloss.backward()
        if dead is not None:
            for (name, p), (_, r) in zip(_expert_params(model, dead), _expert_params(ref, dead)):
                ck.true(f"step {step}: {name}.grad is None (no token on any rank)", p.grad is None and r.grad is None,
                        f"ours {p.grad is not None}, reference {r.grad is not None}")
        ck.close(f"step {step}: loss", [mean_over_ranks(loss)], [rloss.item()])
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    return opt, ropt


def _expert_params(model, expert: int):
    return [(n, p) for n, p in model.named_parameters() if f"experts.e.{expert}." in n]


@cell("plain", worlds=(1, 2, 4))
def plain(rank, world, ck):
    model, ref = sharded_moe(world), moe_model()
    train_both(ck, rank, world, model, ref)
    check_against_reference(ck, "after training", model, ref)
    ck.true("two engines", len(model._mfsdp_group.owner.owners()) == 2)


@cell("hsdp", worlds=(4,))
def hsdp(rank, world, ck):
    model, ref = sharded_moe(world, hsdp=True), moe_model()
    train_both(ck, rank, world, model, ref)
    check_against_reference(ck, "after training", model, ref)


@cell("skew_dead", worlds=(4,))
def skew_dead(rank, world, ck):
    dead = 1
    model, ref = sharded_moe(world, skew=True, dead_expert=dead), moe_model(skew=True, dead_expert=dead)
    holds_dead = bool(_expert_params(model, dead))
    train_both(ck, rank, world, model, ref, dead=dead if holds_dead else None)
    check_against_reference(ck, "after training", model, ref)
    # the ranks sent different token counts to the experts (the router leans towards expert
    # rank % 4), and none to the dead one
    with torch.no_grad():
        model(*moe_batch(0, rank))
    counts = [torch.empty(4, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, model.blocks[0].moe.last_counts)
    ck.true("rank-dependent token counts", len({tuple(c.tolist()) for c in counts}) == world,
            str([c.tolist() for c in counts]))
    ck.true("no token for the dead expert", all(int(c[dead]) == 0 for c in counts))


@cell("vs_fsdp2", worlds=(4,))
def vs_fsdp2(rank, world, ck):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    theirs = sharded_moe(world, impl=torch_fully_shard, dtype=torch.float32)
    for m in theirs.modules():
        if hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    ours = sharded_moe(world, dtype=torch.float32)
    opts = [adamw(ours), adamw(theirs)]
    for step in range(STEPS):
        losses = []
        for m, opt in zip((ours, theirs), opts):
            loss = m(*moe_batch(step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss))
        ck.close(f"step {step}: fp32 loss against FSDP2's", [losses[0]], [losses[1]], rtol=1e-6, atol=0.0)


@cell("dcp", worlds=(4,))
def dcp_cell(rank, world, ck):
    path = os.path.join(rank_grid.session_dir(), "moe_dcp")
    model, ref = sharded_moe(world), moe_model()
    train_both(ck, rank, world, model, ref, steps=2)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    rsd = ref.state_dict()
    ck.true("full state dict: our keys are the reference's", set(full) <= set(rsd))
    for k, v in full.items():
        ck.close(f"full state dict: {k}", v, rsd[k])
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    saved = {n: p.full_tensor() for n, p in model.named_parameters()}

    again = sharded_moe(world, hsdp=True)  # ep 2 again, the dense part on another data-parallel layout
    state = {"model": again.state_dict()}
    dcp.load(state, checkpoint_id=path)
    again.load_state_dict(state["model"])
    for n, p in again.named_parameters():
        ck.close(f"loaded: {n}", p, saved[n], rtol=0.0, atol=0.0)
    # one more step from the loaded weights (the model only: both sides start a fresh AdamW)
    fresh_ref = moe_model()
    fresh_ref.load_state_dict(ref.state_dict())
    train_both(ck, rank, world, again, fresh_ref, steps=1, first=2)
    check_against_reference(ck, "trained on after loading", again, fresh_ref)


# The reload at another expert dp saves at world 2 and loads at world 4, the direction the other
# cross-world checkpoints of the suite take (tests/test_per_module_state.py): the world-2 spawn then
# runs before the world-4 one, and no cell waits for a spawn that needs it back ([Note: one spawn
# per world size]).
RELOAD_STEPS = 2


@cell("dcp_save_world2", worlds=(2,))
def dcp_save_world2(rank, world, ck):
    """ep 2 at world 2: each rank holds its experts whole (expert dp 1), the dense part over 2;
    trained, then saved for dcp_load_world4."""
    model, ref = sharded_moe(world, ep=2), moe_model()
    train_both(ck, rank, world, model, ref, steps=RELOAD_STEPS)
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(rank_grid.session_dir(), "moe_dcp_world2"))


@cell("dcp_load_world4", worlds=(4,), needs=[(__name__, "dcp_save_world2", 2)])
def dcp_load_world4(rank, world, ck):
    """The world-2 checkpoint loaded at world 4 with ep 2 (experts over 2 ranks: expert dp 2, dense
    over 4), against the reference trained on world 2's global batches; then one more step."""
    ref = moe_model()
    ropt = adamw(ref)
    for step in range(RELOAD_STEPS):
        ref(*global_batch(moe_batch, step, 2)).backward()
        ropt.step()
        ropt.zero_grad()
    model = sharded_moe(world)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(rank_grid.session_dir(), "moe_dcp_world2"))
    model.load_state_dict(state["model"])
    check_against_reference(ck, "loaded at world 4", model, ref)
    fresh_ref = moe_model()
    fresh_ref.load_state_dict(ref.state_dict())
    train_both(ck, rank, world, model, fresh_ref, steps=1, first=RELOAD_STEPS)
    check_against_reference(ck, "trained on after loading", model, fresh_ref)


# -- the Megatron-style API: expt_device_mesh ---------------------------------------------------
MEGATRON_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def megatron_moe(world: int, strategy: str, hsdp: bool = False, expert_outer: int = 1, options=None, **config):
    """The MoE at ep 2 under megatron_fsdp_c.fully_shard with expt_device_mesh (Megatron-FSDP's
    names): experts marked allreduce=False over the expert mesh's dp_shard dim, the dense part over
    the device mesh's (HSDP: dp_outer 2 x dp_shard 2, the experts' mesh (expert_outer, 2 //
    expert_outer) over the same names). Returns (model, optimizer)."""
    ep = 2
    if hsdp:
        dense = rank_grid.device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_outer", "dp_shard"))
        expt = rank_grid.device_mesh("cpu", (expert_outer, world // ep // expert_outer, ep),
                                     mesh_dim_names=("dp_outer", "dp_shard", "ep"))
        hybrid = {"dp_outer_dim": "dp_outer", "hybrid_fsdp_group": dist.group.WORLD,
                  "hybrid_fsdp_expt_group": expt[("dp_outer", "dp_shard")]._flatten().get_group()}
    else:
        dense = rank_grid.device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        expt = rank_grid.device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp_shard", "ep"))
        hybrid = {}
    module = moe_model(**config).expert_parallel(expt["ep"].get_group(), expt["ep"].get_local_rank(), ep)
    for block in module.blocks:
        for p in block.moe.experts.parameters():
            p.allreduce = False  # Megatron-core's mark of expert-parallel parameters
    return mfsdp.fully_shard(module, adamw(module), device_mesh=dense, dp_shard_dim="dp_shard",
                             expt_device_mesh=expt, fsdp_unit_modules=[MoEBlock], zero_dp_strategy=strategy,
                             **hybrid, **(options or {}))


def _megatron_cell(hsdp: bool, strategy: str, expert_outer: int = 1, options=None):
    def run(rank, world, ck):
        dead = 1
        model, opt = megatron_moe(world, strategy, hsdp=hsdp, expert_outer=expert_outer, options=options, skew=True,
                                  dead_expert=dead)
        ref = moe_model(skew=True, dead_expert=dead)
        ck.true("two engines", model.expert_owner is not None and model.expert_owner.dist_ctx.dp_world == 2)
        holds_dead = bool(_expert_params(model, dead))
        train_both(ck, rank, world, model, ref, dead=dead if holds_dead else None, opt=opt)
        check_against_reference(ck, "after training", model, ref)
    return run


for _strategy in MEGATRON_STRATEGIES:
    cell(f"megatron_{_strategy}", worlds=(4,))(_megatron_cell(False, _strategy))
for _strategy in ("no_shard", "optim_grads_params"):
    cell(f"megatron_hsdp_{_strategy}", worlds=(4,))(_megatron_cell(True, _strategy))
# Megatron-LM's own layout: the experts' data-parallel ranks split into the dense part's 2 replicas
cell("megatron_hsdp_expert_replicas", worlds=(4,))(_megatron_cell(True, "optim_grads_params", expert_outer=2))
# experts pre-scaled by expert_dp / dp and averaged over the expert ranks (Megatron-LM's average_in_collective)
cell("megatron_average_in_collective", worlds=(4,))(
    _megatron_cell(False, "optim_grads_params", options={"average_in_collective": True}))


@cell("megatron_clip", worlds=(4,))
def megatron_clip(rank, world, ck):
    """model.clip_grad_norm_ over the dense and the expert meshes (HSDP dense, no_shard: replicated
    pieces counted once) against torch's clip_grad_norm_ on the reference, clipping every step."""
    model, opt = megatron_moe(world, "optim_grads_params", hsdp=True)
    ref = moe_model()
    ropt = adamw(ref)
    for step in range(2):
        loss = model(*moe_batch(step, rank))
        loss.backward()
        ref(*global_batch(moe_batch, step, world)).backward()
        ours, theirs = model.clip_grad_norm_(0.05), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ck.close(f"step {step}: total gradient norm", [ours.item()], [theirs.item()])
        ck.true(f"step {step}: the norm is above the bound (clipping happens)", theirs.item() > 0.05)
        for r_opt in (opt, ropt):
            r_opt.step()
            r_opt.zero_grad()
    check_against_reference(ck, "after clipped training", model, ref)


@cell("megatron_dcp", worlds=(4,))
def megatron_dcp(rank, world, ck):
    """The Megatron-style model's checkpoint (mfsdp.save_checkpoint: model and optimizer, experts on
    their mesh) loaded into a model on another data-parallel layout (HSDP, no_shard); full state
    dict against the reference."""
    path = os.path.join(rank_grid.session_dir(), "moe_megatron_dcp")
    model, opt = megatron_moe(world, "optim_grads_params")
    ref = moe_model()
    _, ropt = train_both(ck, rank, world, model, ref, steps=2, opt=opt)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    rsd = ref.state_dict()
    ck.true("full state dict: our keys are the reference's", {strip(k) for k in full} <= set(rsd))
    for k, v in full.items():
        ck.close(f"full state dict: {k}", v, rsd[strip(k)])
    mfsdp.save_checkpoint(path, model, opt)
    saved = {n: p.full_tensor() for n, p in model.named_parameters()}
    again, again_opt = megatron_moe(world, "no_shard", hsdp=True)
    mfsdp.load_checkpoint(path, again, again_opt)
    for n, p in again.named_parameters():
        ck.close(f"loaded: {n}", p, saved[n], rtol=0.0, atol=0.0)
    # one more step on both, the optimizer states loaded on ours, the reference's kept
    train_both(ck, rank, world, again, ref, steps=1, first=2, opt=again_opt, ropt=ropt)
    check_against_reference(ck, "trained on after loading", again, ref)


BAD = ("expert mesh not dividing the world", "inconsistent overlapping meshes", "a parameter on two meshes")
MBAD = ("megatron: expert mesh not dividing the world", "megatron: inconsistent expert mesh",
        "megatron: expert mesh without experts", "megatron: experts without an expert mesh",
        "megatron: hybrid_fsdp_expt_group without HSDP", "megatron: HSDP without hybrid_fsdp_expt_group",
        "megatron: expert mesh without the dp_shard dim")


def _pair(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(dtype)


def _first_forward(model):
    model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()


# late: after every other cell of the spawn, as the meshes it makes disagree across ranks on purpose and
# a mesh made after them in that process can hang in new_group
@cell("bad_input", worlds=(4,), tests=["test_bad_input"], late=True)
def bad_input(rank, world, ck):
    _, _, expert_mesh, dense = meshes(world)

    def mesh_of(rank_sets):
        """Every rank makes every group (new_group is collective); this rank's mesh is its own set's."""
        groups = [dist.new_group(list(s)) for s in rank_sets]
        mine = next(i for i, s in enumerate(rank_sets) if rank in s)
        return DeviceMesh.from_group(groups[mine], "cpu", mesh_dim_names=("experts",))

    def on_mesh(expert_mesh):
        model = _pair()
        fully_shard(model[0], mesh=expert_mesh)
        fully_shard(model, mesh=dense)
        _first_forward(model)

    def tied():
        model = _pair()
        model[2].weight = model[0].weight
        fully_shard(model[0], mesh=expert_mesh)
        fully_shard(model[2], mesh=dense)
        fully_shard(model, mesh=dense)
        _first_forward(model)
    def megatron(expt, marked=True, **kwargs):
        model = _pair()
        if marked:
            model[0].weight.allreduce = model[0].bias.allreduce = False
        args = dict(device_mesh=dense, dp_shard_dim="dp", expt_device_mesh=expt, zero_dp_strategy="optim_grads")
        mfsdp.fully_shard(model, **dict(args, **kwargs))

    ck.raised(BAD[2], tied)  # first: the meshes of the cases below are made on purpose to break new groups
    hsdp = rank_grid.device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp"))
    expt = DeviceMesh.from_group(expert_mesh.get_group(), "cpu", mesh_dim_names=("dp",))  # named as the dense mesh
    ck.raised(MBAD[2], lambda: megatron(expt, marked=False))
    ck.raised(MBAD[3], lambda: megatron(None))
    ck.raised(MBAD[4], lambda: megatron(expt, hybrid_fsdp_expt_group=dist.group.WORLD))
    ck.raised(MBAD[5], lambda: megatron(hsdp, device_mesh=hsdp, dp_outer_dim="dp_outer",
                                        hybrid_fsdp_group=dist.group.WORLD))
    ck.raised(MBAD[6], lambda: megatron(expert_mesh))  # its dim is dp_mod_ep, not the dense mesh's 'dp'
    not_dividing = mesh_of([(0, 1, 2), (3,)])
    ck.raised(BAD[0], lambda: on_mesh(not_dividing))
    ck.raised(MBAD[0], lambda: megatron(DeviceMesh.from_group(not_dividing.get_group(), "cpu", mesh_dim_names=("dp",))))
    # rank 2 thinks its mesh is {1, 2}; ranks 0 and 1 think theirs is {0, 1}
    sets = [(0, 1), (1, 2), (3,)]
    groups = [dist.new_group(list(s)) for s in sets]
    mine = {0: 0, 1: 0, 2: 1, 3: 2}[rank]
    ck.raised(BAD[1], lambda: on_mesh(DeviceMesh.from_group(groups[mine], "cpu", mesh_dim_names=("experts",))))
    ck.raised(MBAD[1], lambda: megatron(DeviceMesh.from_group(groups[mine], "cpu", mesh_dim_names=("dp",))))


MOE_CELLS = [k for k in CELLS.keys() if k != "bad_input"]


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, MOE_CELLS))
def test_moe(name, world):
    verify(CELLS, name, world)


@pytest.mark.parametrize("label,match", [
    (BAD[0], r"does not divide the world of 4 ranks.*Slice every mesh from one DeviceMesh"),
    (BAD[1], r"inconsistent rank sets.*Slice every mesh from one DeviceMesh"),
    (BAD[2], r"in groups on two different meshes.*one fully_shard call"),
    (MBAD[0], r"expt_device_mesh's data-parallel ranks do not partition.*does not divide the world of 4 ranks"
              r".*Build the expert mesh"),
    (MBAD[1], r"expt_device_mesh's data-parallel ranks do not partition.*inconsistent rank sets"
              r".*Build the expert mesh"),
    (MBAD[2], r"got expt_device_mesh but no parameter is marked as an expert.*allreduce = False.*or drop "
              r"expt_device_mesh"),
    (MBAD[3], r"2 parameters are marked as expert-parallel.*'0.weight'.*no expt_device_mesh: pass expt_device_mesh"),
    (MBAD[4], r"hybrid_fsdp_expt_group is only for hybrid sharding.*drop hybrid_fsdp_expt_group"),
    (MBAD[5], r"needs hybrid_fsdp_expt_group"),
    (MBAD[6], r"expt_device_mesh has no dim 'dp' \(dp_shard_dim\).*same dim names as device_mesh"),
])
def test_bad_input(label, match):
    for kind, message in raised_by(CELLS.result("bad_input", 4), label):
        with pytest.raises(ValueError, match=match):
            reraise(kind, message)
