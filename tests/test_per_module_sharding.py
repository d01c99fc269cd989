"""What megatron_fsdp_c.per_module.fully_shard shards: shard_placement_fn returning Shard(dim) for
any dim, as torch's FSDP2 allows (Muon/Dion-style optimizers shard along a chosen dim), tested
after torch's own suite (test_fully_shard_init.py's TestFullyShardShardPlacementFn,
test_fully_shard_training.py's shard_largest_dim tests) through public APIs only. The cells run
in the shared spawns (see [Note: one spawn per world size] in support/rank_grid.py).

The engine lays a Shard(d) parameter out in blocks ([Note: chunked layout] in
csrc/core/mfsdp_layout.h): each rank's piece is torch.chunk(w, world, dim=d)[rank] made
contiguous, the local tensor of torch's Shard(d) DTensor, and every bucket still moves with one
all-gather and one reduce-scatter. So the checks compare with torch's FSDP2 run side by side on
the same model, data and optimizer, in float64 to rtol 1e-9: local shards, placements, gradients,
state dicts (and DCP checkpoints written by one and read by the other), clip_grad_norm_.

Behaviours (cell names):
- Shard(largest dim), Shard(-1), Shard(1) for matrices: the same losses, local shards, placements
  and gradients as FSDP2's; parameters, local shards and gradients contiguous, in forward too:
  vs_fsdp2[largest|neg1|dim1_matrices]; sharded on the meta device, materialised, local shards
  filled by hand: vs_fsdp2[dim1_matrices-meta]
- state_dict()/get_model_state_dict full and sharded, a DCP checkpoint of ours loaded by FSDP2 and
  FSDP2's by ours, set_model_state_dict from a full state dict, clip_grad_norm_: state[...]
- Shard(1) under every zero_dp_strategy (Replicate where the strategy does not shard) against
  DDP, also with torch's foreach Adam (whose step bumps no DTensor version counter):
  strategies[...]; on an HSDP (replicate, shard) mesh: hsdp
- the refusals FSDP2 makes, with its exception types and messages (a dim past the last,
  uneven sharding on a dim other than 0), leaving the module as it was: refusals
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.tensor import DTensor, Shard

from megatron_fsdp_c.per_module import fully_shard

from support import rank_grid
from support.checks import full, raised_by, recorder_cells, reraise, verify
from support.tiny_models import gpt, gpt_data, gpt_loss, shard_blocks
from support.train_both import shard_against_ddp

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS, tests=["test_sharding_behaviour"])


def largest(p):
    return Shard(max(range(p.ndim), key=lambda d: p.shape[d]))


PLACEMENTS = {
    "largest": largest,                                   # torch's tests' choice (first largest dim)
    "neg1": lambda p: Shard(-1),                          # normalised to the last dim
    "dim1_matrices": lambda p: Shard(1) if p.ndim > 1 else Shard(0),
}


def torch_fully_shard():
    from torch.distributed.fsdp import fully_shard as torch_shard
    return torch_shard


def shard_gpt(impl, placement, meta=False, **kw):
    """The GPT of tiny_models (every dim even over 2 and 4 ranks) sharded per block and at the root
    by torch's FSDP2 or ours. meta: sharded on the meta device, materialised with to_empty, and
    each local shard filled with its torch.chunk piece of the eager model's weights (torchtitan's
    way; ours reads the local shards into the engine at the first forward)."""
    if meta:
        with torch.device("meta"):
            model = gpt()
    else:
        model = gpt()
    shard = torch_fully_shard() if impl == "torch" else fully_shard
    for b in model.blocks:
        shard(b, shard_placement_fn=placement, **kw)
    shard(model, shard_placement_fn=placement, **kw)
    if meta:
        model.to_empty(device="cpu")
        eager = dict(gpt().named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():
                dim, world = p.placements[-1].dim, p.device_mesh.size(p.device_mesh.ndim - 1)
                rank = p.device_mesh.get_local_rank(p.device_mesh.ndim - 1)
                p.to_local().copy_(torch.chunk(eager[name].detach(), world, dim=dim)[rank])
    return model


def train(model, rank, steps, first=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(first, first + steps):
        loss = gpt_loss(model, gpt_data(step, rank))
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return losses, opt


def reshard_all(model):
    from torch.distributed.fsdp import FSDPModule  # ours subclass it
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def compare_dtensors(ck, label, ours, theirs):
    """Placement, local shard (this rank's torch.chunk piece) and contiguity of one DTensor."""
    ck.equal(f"{label}: placements", ours.placements, theirs.placements)
    ck.close(f"{label}: local shard", ours.to_local(), theirs.to_local())
    ck.true(f"{label}: contiguous, local shard too", ours.is_contiguous() and ours.to_local().is_contiguous())


@cell("vs_fsdp2[largest]", worlds=(2, 4), which="largest")
@cell("vs_fsdp2[neg1]", which="neg1")
@cell("vs_fsdp2[dim1_matrices]", which="dim1_matrices")
@cell("vs_fsdp2[dim1_matrices-meta]", worlds=(2, 4), which="dim1_matrices", meta=True)
def vs_fsdp2(rank, world, ck, which, meta=False):
    placement = PLACEMENTS[which]
    ours, theirs = shard_gpt("ours", placement, meta), shard_gpt("torch", placement, meta)
    ck.true("some parameter is sharded on a dim other than 0",
            any(p.placements[-1].dim > 0 for p in ours.parameters()))
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        compare_dtensors(ck, f"after fully_shard: {name}", p, q)

    def contiguous_in_forward(mod, args):
        ck.true(f"{type(mod).__name__}: parameters contiguous in forward",
                all(p.is_contiguous() for p in mod.parameters(recurse=False)))
    for mod in ours.modules():
        mod.register_forward_pre_hook(contiguous_in_forward)
    opts = []
    for model in (ours, theirs):
        opts.append(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    for step in range(3):
        losses = []
        for model, opt in zip((ours, theirs), opts):
            loss = gpt_loss(model, gpt_data(step, rank))
            loss.backward()
            losses.append(loss.detach())
        ck.close(f"step {step}: loss", *losses)
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            ck.true(f"step {step}: {name}.grad a DTensor", isinstance(p.grad, DTensor))
            compare_dtensors(ck, f"step {step}: {name}.grad", p.grad, q.grad)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        compare_dtensors(ck, f"trained: {name}", p, q)
        ck.close(f"trained: {name} full", p, q)


def checkpoints(name: str) -> str:
    """A path for this session's checkpoints (spawns of every world size see it)."""
    return os.path.join(rank_grid.session_dir(), "per_module_sharding", name)


@cell("state[largest]", which="largest")
@cell("state[dim1_matrices]", which="dim1_matrices")
def state(rank, world, ck, which):
    placement = PLACEMENTS[which]
    ours, theirs = shard_gpt("ours", placement), shard_gpt("torch", placement)
    train(ours, rank, 2)
    train(theirs, rank, 2)
    sd, ref = ours.state_dict(), theirs.state_dict()
    ck.equal("state_dict keys", list(sd), list(ref))
    for k in ref:
        compare_dtensors(ck, f"state_dict {k}", sd[k], ref[k])
    full_opts = StateDictOptions(full_state_dict=True)
    fsd, fref = get_model_state_dict(ours, options=full_opts), get_model_state_dict(theirs, options=full_opts)
    for k in fref:
        ck.equal(f"get_model_state_dict(full) {k}: a plain tensor", type(fsd[k]), type(fref[k]))
        ck.close(f"get_model_state_dict(full) {k}", fsd[k], fref[k])
    ssd = get_model_state_dict(ours)
    for k, v in get_model_state_dict(theirs).items():
        compare_dtensors(ck, f"get_model_state_dict {k}", ssd[k], v)

    # DCP: ours written, FSDP2 reads it; FSDP2's written, ours reads it
    for writer, reader_impl in ((ours, "torch"), (theirs, "ours")):
        path = checkpoints(f"{which}-w{world}-by-{'ours' if writer is ours else 'torch'}")
        dcp.save(get_model_state_dict(writer), checkpoint_id=path)
        reader = shard_gpt(reader_impl, placement)
        msd = get_model_state_dict(reader)
        dcp.load(msd, checkpoint_id=path)
        set_model_state_dict(reader, msd)
        for (name, p), q in zip(reader.named_parameters(), writer.parameters()):
            compare_dtensors(ck, f"DCP to {reader_impl}: {name}", p, q)
        with torch.no_grad():
            ck.close(f"DCP to {reader_impl}: the next loss", gpt_loss(reader, gpt_data(7, rank)),
                     gpt_loss(writer, gpt_data(7, rank)))
        for model in (reader, writer):  # FSDP2 keeps a root's weights unsharded after forward
            reshard_all(model)
        dist.barrier()

    # a full state dict loaded into a fresh sharded model (rank 0's, broadcast)
    fresh = shard_gpt("ours", placement)
    set_model_state_dict(fresh, fref, options=StateDictOptions(full_state_dict=True))
    for (name, p), q in zip(fresh.named_parameters(), theirs.parameters()):
        compare_dtensors(ck, f"set_model_state_dict(full): {name}", p, q)

    # clip_grad_norm_ over Shard(d) gradients: FSDP2's total norm and clipped gradients
    for model in (ours, theirs):
        gpt_loss(model, gpt_data(9, rank)).backward()
    norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05) for m in (ours, theirs)]
    ck.close("clip_grad_norm_: total norm", full(norms[0]), full(norms[1]))
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        compare_dtensors(ck, f"clipped: {name}.grad", p.grad, q.grad)


@cell("strategies[no_shard]", strategy="no_shard")
@cell("strategies[optim]", worlds=(2, 4), strategy="optim")
@cell("strategies[optim_grads]", strategy="optim_grads")
@cell("strategies[optim_grads_params]", strategy="optim_grads_params")
@cell("strategies[no_shard, foreach]", strategy="no_shard", foreach=True)
@cell("strategies[optim, foreach]", strategy="optim", foreach=True)
@cell("strategies[optim_grads, foreach]", strategy="optim_grads", foreach=True)
def strategies(rank, world, ck, strategy, foreach=False):
    """`foreach`: torch's foreach Adam (its default on a GPU), whose step bumps no version counter of
    a DTensor: the kept full weights are refreshed all the same ([Note: stepped parameters])."""
    placement = PLACEMENTS["largest"]
    optimizer = (lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=foreach))
    model = shard_against_ddp(ck, rank, world, gpt(), lambda m: shard_blocks(
        m, shard_placement_fn=placement, zero_dp_strategy=strategy), gpt_data, loss=gpt_loss,
        optimizer=optimizer).model
    for name, p in model.named_parameters():
        want = "Replicate()" if strategy == "no_shard" else f"Shard(dim={placement(p).dim})"
        ck.equal(f"{name}: placement", repr(p.placements[-1]), want)
        if p.grad is not None:
            ck.equal(f"{name}.grad: placement", repr(p.grad.placements[-1]), want)


@cell("hsdp", worlds=(4,))
def hsdp(rank, world, ck):
    mesh = rank_grid.device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    placement = PLACEMENTS["dim1_matrices"]
    model = shard_against_ddp(ck, rank, world, gpt(), lambda m: shard_blocks(
        m, mesh=mesh, shard_placement_fn=placement), gpt_data, loss=gpt_loss).model
    for name, p in model.named_parameters():
        ck.equal(f"{name}: placements", [repr(x) for x in p.placements],
                 ["Replicate()", f"Shard(dim={1 if p.ndim > 1 else 0})"])


def _lin_model(shapes):
    torch.manual_seed(42)
    return nn.Sequential(*[nn.Linear(*s) for s in shapes])


REFUSALS = {  # label -> (model shapes, placement fn): each as torch's test makes it
    "a dim past the last (Shard(1) of a bias)": ([(16, 16), (16, 8)], lambda p: Shard(1)),
    "uneven sharding on dim 1": ([(16, 17), (17, 8)], largest),
}


@cell("refusals", tests=["test_refusals_as_fsdp2", "test_negative_dim_refused"])
def refusals(rank, world, ck):
    """Each refusal's exception type and message, ours and torch's, recorded under `label` and
    `label (torch)`; the module is left as it was (plain parameters, trainable)."""
    for label, (shapes, placement) in REFUSALS.items():
        model = _lin_model(shapes)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ck.raised(label, lambda: fully_shard(model, shard_placement_fn=placement))
        ck.raised(f"{label} (torch)", lambda: torch_fully_shard()(_lin_model(shapes), shard_placement_fn=placement))
        ck.true(f"{label}: the module is left as it was",
                all(type(p) is nn.Parameter and torch.equal(p, before[n]) for n, p in model.named_parameters()))
    # a dim still negative once normalised: FSDP2 lets it through to torch.chunk, ours refuses it
    ck.raised("Shard(-3) of a matrix", lambda: fully_shard(_lin_model([(16, 16)]), shard_placement_fn=lambda p: Shard(-3)))
    # afterwards the same module shards on dim 0 and trains
    model = _lin_model([(16, 16), (16, 8)]).double()
    shard_against_ddp(ck, rank, world, model, fully_shard, lambda s, r: torch.randn(4, 16, dtype=torch.float64,
                                                                                  generator=torch.Generator().manual_seed(10 * s + r)))


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, [k for k in CELLS.keys() if k != "refusals"]))
def test_sharding_behaviour(name, world):
    verify(CELLS, name, world)


@pytest.mark.parametrize("label", list(REFUSALS))
def test_refusals_as_fsdp2(label):
    verify(CELLS, "refusals", 2)
    ours, theirs = raised_by(CELLS.result("refusals", 2), label), raised_by(CELLS.result("refusals", 2), f"{label} (torch)")
    assert ours == theirs, f"{label}: ours raised {ours[0]}, torch's FSDP2 {theirs[0]}"
    kind, message = ours[0]
    with pytest.raises((AssertionError, NotImplementedError), match="Shard dim|uneven sharding"):
        reraise(kind, message)


def test_negative_dim_refused():
    verify(CELLS, "refusals", 2)
    for kind, message in raised_by(CELLS.result("refusals", 2), "Shard(-3) of a matrix"):
        with pytest.raises(AssertionError, match=r"Shard dim -1 is invalid for 2D tensor"):
            reraise(kind, message)
