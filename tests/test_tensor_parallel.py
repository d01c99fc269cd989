"""2-D parallelism: FSDP composed with tensor parallelism ([Note: tensor parallelism] in
megatron_fsdp_c/_tensor_parallel.py), on both APIs.

Cells at world 4 (rank_grid): (dp 2, tp 2) unless a cell says otherwise. Models: megatron_fsdp_c's
TPGPT under torch's sequence-parallel plan (every parameter a DTensor; vocab 67 splits unevenly
over tp and again over dp), and a transformers Llama under its own base TP plan (the decoder
layers' linears and lm_head split, norms and embeddings plain). The reference trains the
unparallelised model in one process on the global batch (the dp ranks' batches concatenated).

- Per-module API, torchtitan's recipe (parallelize_module on mesh["tp"], fully_shard per block and
  on the root on mesh["dp"]): float64 against the reference at rtol 1e-9 (losses, parameters, the
  last step's gradients and Adam states, clip_grad_norm_'s norm); fp32 against torch's FSDP2 + TP
  running the same script: bit-identical (both reduce-scatter the same rank-major layout of each
  TP shard in the same order with gloo; the gradients of sequence-parallel norms are all-reduced
  over tp by the same DTensor redistribute); the DTensors' placements and local shapes equal
  FSDP2's.
- Megatron-style API with tp_dim (test_tensor_parallel_megatron.py): torch DTensor TP parameters,
  and Megatron-core style local shards (tensor_model_parallel/partition_dim, a sequence-parallel
  model doing its own collectives), float64 against the same reference.
- 3-D meshes: HSDP + TP (2, 1, 2) and (1, 2, 2) on the per-module API, HSDP and HFSDP + TP on the
  Megatron-style one, float64 against the same reference.
- shard_placement_fn returning Shard(1) for TP DTensors: FSDP2's placements (_StridedShard(1) where
  TP shards dim 1 too), float64 against the reference and against FSDP2 + TP at rtol 1e-9.
- TP-duplicated parameters are bit-identical across the tp group after training, under plain TP
  (Llama's norms) and sequence parallelism (SequenceParallel norms, Megatron's flagged norms); a
  Megatron-style model whose sequence-parallel norms are not flagged diverges across tp.
- DCP: saved at (dp 2, tp 2) after two steps, loaded at (dp 4, tp 1) and (dp 1, tp 4): full tensors
  of parameters and Adam states, get_model_state_dict(full_state_dict=True), then a third step's
  parameters, gradients and states, against the reference; a Megatron-style checkpoint of the
  DTensor model loaded into the local-shard model at (dp 1, tp 4).
- Bad input: clear errors naming the fix (test_tensor_parallel_errors.py).
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_fsdp_c.testing import GPTConfig, TPGPT, batch, parallelize_tp

from support import rank_grid
from support.checks import RTOL, to_full
from support.data import global_batch, rank_share

CFG = GPTConfig(vocab=67, seq=8, d=32, heads=4, layers=2)
LLAMA_VOCAB = 61
STEPS = 3
CLIP = 0.5      # small enough that clip_grad_norm_ scales every step
DATA_RANKS = 2  # the global batch: 2 x token_batch, 4 sequences


# -- models and data ----------------------------------------------------------------------------

def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      attn_implementation="eager", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def build(kind, dtype, meta=False):
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        model = TPGPT(CFG) if kind == "gpt" else llama()
    return model.to(dtype)


def parallelize_llama(model, tp_mesh):
    """transformers' own TP plan of Llama (config.base_model_tp_plan, and the model's lm_head
    entry), in torch's styles."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model.model, tp_mesh, {k: styles[v]() for k, v in model.config.base_model_tp_plan.items()})
    parallelize_module(model, tp_mesh, {k: styles[v]() for k, v in type(model)._tp_plan.items()})
    return model


def blocks_of(kind, model):
    return list(model.blocks) if kind == "gpt" else list(model.model.layers)


def loss_of(kind, model, x, y):
    if kind == "gpt":
        return model(x, y)
    # not labels=: transformers computes that loss from float32 logits even in a float64 model
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def token_batch(step, dp_rank, kind):
    """One of the DATA_RANKS batches of 2 sequences whose concatenation is every run's global
    batch; a run at another dp size takes its rank_share of it."""
    cfg = CFG if kind == "gpt" else GPTConfig(vocab=LLAMA_VOCAB, seq=8)
    return batch(cfg, 2, seed=1000 * step + dp_rank)


def snapshot(named, opt):
    """Full tensors of the parameters, their gradients and Adam states (collective)."""
    params, grads, states = {}, {}, {}
    for n, p in named:
        params[n] = to_full(p)
        if p.grad is not None:
            grads[n] = to_full(p.grad)
        st = opt.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in st:
                states[f"{n}.{k}"] = to_full(st[k])
        if "step" in st:
            states[f"{n}.step"] = torch.as_tensor(st["step"]).detach().clone().double()
    return dict(params=params, grads=grads, states=states)


def train_steps(kind, model, named, opt, dp_group, steps, first_step=0, clip=True):
    """The training loop every cell runs: the global-batch loss (averaged over dp), clip_grad_norm_'s
    total norm, and a snapshot after the last step (before zero_grad, so gradients are there)."""
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    out = dict(losses=[], norms=[], snaps={})
    for step in range(first_step, first_step + steps):
        x, y = rank_share(global_batch(token_batch, step, DATA_RANKS, kind), dp_rank, dp_size)
        loss = loss_of(kind, model, x, y)
        loss.backward()
        if clip:
            out["norms"].append(to_full(torch.nn.utils.clip_grad_norm_([p for _, p in named()], CLIP)).item())
        opt.step()
        if step == first_step + steps - 1:
            out["snaps"][step] = snapshot(named(), opt)
        opt.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g, group=dp_group)
        out["losses"].append(g.item() / dp_size)
    return out


def reference(kind, steps=STEPS):
    """The unparallelised model in one process on the global batch, float64."""
    model = build(kind, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = dict(losses=[], norms=[], snaps={})
    for step in range(steps):
        x, y = global_batch(token_batch, step, DATA_RANKS, kind)
        loss = loss_of(kind, model, x, y)
        loss.backward()
        if kind == "gpt":
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        out["snaps"][step] = snapshot(model.named_parameters(), opt)
        opt.zero_grad()
        out["losses"].append(loss.item())
    return out


# -- the cells ----------------------------------------------------------------------------------

def mesh_of(shape):
    names = ("dp", "tp") if len(shape) == 2 else ("dp_replicate", "dp", "tp")
    return rank_grid.device_mesh("cpu", shape, mesh_dim_names=names)


def dp_mesh(mesh):
    return mesh["dp"] if mesh.ndim == 2 else mesh["dp_replicate", "dp"]


def dp_group(mesh):
    return mesh["dp"].get_group() if mesh.ndim == 2 else mesh["dp_replicate", "dp"]._flatten().get_group()


def shard_dim1(p):
    """shard_placement_fn: matrices on dim 1 of their TP shard (TP's Shard(1) too: _StridedShard
    then), vectors on dim 0."""
    from torch.distributed.tensor import Shard
    return Shard(1) if p.ndim == 2 else None


def per_module(kind, impl, dtype, shape=(2, 2), meta=False, placement_fn=None):
    """torchtitan's recipe on the per-module API (ours or torch's FSDP2): the model and optimizer.
    meta: built on the meta device, parallelized and sharded there, then materialised (to_empty)
    and initialised (reset_parameters, on the DTensors; on CPU each rank draws its own shard).
    placement_fn: fully_shard's shard_placement_fn."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from megatron_fsdp_c.per_module import fully_shard
    mesh = mesh_of(shape)
    model = build(kind, dtype, meta)
    if kind == "gpt":
        parallelize_tp(model, mesh["tp"], sequence_parallel=True)
    else:
        parallelize_llama(model, mesh["tp"])
    for block in blocks_of(kind, model):
        fully_shard(block, mesh=dp_mesh(mesh), shard_placement_fn=placement_fn)
    fully_shard(model, mesh=dp_mesh(mesh), shard_placement_fn=placement_fn)
    if meta:
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt, mesh


def layout(named):
    return {n: (str(p.placements), tuple(p.to_local().shape), p.device_mesh.mesh_dim_names) for n, p in named}


def tp_duplicated(named):
    """Local tensors of the parameters replicated over tp (no TP placement, or Replicate() on tp)."""
    out = {}
    for n, p in named:
        names = p.device_mesh.mesh_dim_names
        if "tp" not in names or p.placements[names.index("tp")].is_replicate():
            out[n] = p.to_local().detach().clone()
    return out


def per_module_cell(rank, world, kind, impl, dtype, shape=(2, 2), meta=False, placement_fn=None):
    model, opt, mesh = per_module(kind, impl, dtype, shape, meta, placement_fn)
    out = train_steps(kind, model, model.named_parameters, opt, dp_group(mesh), STEPS, clip=kind == "gpt")
    out["layout"] = layout(model.named_parameters())
    out["duplicated"] = tp_duplicated(model.named_parameters())
    return out


def dcp_cell(rank, world, name):
    """Save at (dp 2, tp 2) after two steps; load at (dp 4, tp 1) and (dp 1, tp 4); a third step."""
    path = checkpoint_path(name)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    model, opt, mesh = per_module("gpt", "ours", torch.float64)
    out = {"saved": train_steps("gpt", model, model.named_parameters, opt, dp_group(mesh), 2)}
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    out["full_state_dict"] = {k: v.detach().clone() for k, v in get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True)).items()}
    for shape in ((4, 1), (1, 4)):
        torch.manual_seed(123)  # a different initialisation: what we compare comes from the checkpoint
        fresh, fresh_opt, fresh_mesh = per_module("gpt", "ours", torch.float64, shape)
        with torch.no_grad():
            for p in fresh.parameters():
                p._local_tensor.normal_()
        sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(fresh, sd["model"])
        set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
        loaded = snapshot(fresh.named_parameters(), fresh_opt)
        after = train_steps("gpt", fresh, fresh.named_parameters, fresh_opt, dp_group(fresh_mesh), 1, first_step=2)
        out[shape] = dict(loaded=loaded, after=after, layout=layout(fresh.named_parameters()))
    return out


def checkpoint_path(name):
    return os.path.join(rank_grid.session_dir(), "tensor_parallel", name)


def reference_cell(rank, world):
    """The single-process reference on the global batch: rank 0 trains it, the others wait."""
    return {kind: reference(kind) for kind in ("gpt", "llama")} if rank == 0 else None


def _register():
    add = lambda key, fn, *args, **kw: CELLS.add(key, fn, *args, worlds=(4,), **kw)  # noqa: E731
    for kind in ("gpt", "llama"):
        add(("per-module", kind, "ours", "float64"), per_module_cell, kind, "ours", torch.float64)
        for impl in ("ours", "torch"):
            add(("per-module", kind, impl, "float32"), per_module_cell, kind, impl, torch.float32)
    for impl in ("ours", "torch"):
        add(("per-module", "gpt", impl, "float32", "meta"), per_module_cell, "gpt", impl, torch.float32, meta=True)
    for impl in ("ours", "torch"):  # shard_placement_fn's Shard(1) on TP shards
        add(("per-module", "gpt", impl, "float64", "shard1"), per_module_cell, "gpt", impl, torch.float64,
            placement_fn=shard_dim1)
    for shape in ((2, 1, 2), (1, 2, 2)):
        add(("per-module", "gpt", "ours", "float64", shape), per_module_cell, "gpt", "ours", torch.float64, shape)
    add("dcp", dcp_cell, "per_module")
    add("reference", reference_cell)


CELLS = rank_grid.Cells(__name__)
_register()


# -- the tests ----------------------------------------------------------------------------------

def _cells(key):
    return CELLS.result(key, 4)


def reference_result(kind):
    return CELLS.result("reference", 4)[0][kind]


def close_at_scale(ours, ref, what, rtol=RTOL):
    assert set(ours) == set(ref), f"{what}: names differ: {sorted(set(ours) ^ set(ref))}"
    for name in ref:
        a, b = ours[name].double(), ref[name].double()
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max().clamp_min(1e-30)),
                                   msg=lambda m: f"{what} {name}: {m}")


def matches_reference(run, ref, steps=STEPS, first=0):
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"][first:first + steps]),
                               rtol=RTOL, atol=0)
    if run["norms"]:
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"][first:first + steps]),
                                   rtol=RTOL, atol=0)
    assert run["snaps"]
    for step, snap in run["snaps"].items():
        for part in ("params", "grads", "states"):
            close_at_scale(snap[part], ref["snaps"][step][part], f"step {step} {part}")


def duplicated_identical(runs, shape=(2, 2)):
    """Ranks that differ only in their tp coordinate hold bit-identical TP-duplicated tensors."""
    tp = shape[-1]
    for r in range(0, 4, tp):
        for other in range(r + 1, r + tp):
            a, b = runs[r]["duplicated"], runs[other]["duplicated"]
            assert a and set(a) == set(b)
            for name in a:
                assert torch.equal(a[name], b[name]), f"{name} differs between ranks {r} and {other}"


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_per_module_float64_matches_single_process_reference(kind):
    """Losses, parameters, the gradients and Adam states of every step, and (gpt) clip_grad_norm_'s
    norm over the 2-D DTensors, at rtol 1e-9."""
    for run in _cells(("per-module", kind, "ours", "float64")):
        matches_reference(run, reference_result(kind))


@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt meta-init"])
def test_per_module_fp32_is_fsdp2_tp_bit_for_bit(kind):
    """The same script on torch's FSDP2 + TP: identical losses, norms, parameters, gradients, Adam
    states, and the same placements and local shapes. 'gpt meta-init': torchtitan's meta-device
    flow (parallelize and shard on meta, to_empty, initialise the DTensors)."""
    key = ("gpt", "float32", "meta") if kind == "gpt meta-init" else (kind, "float32")
    ours, theirs = _cells(("per-module", key[0], "ours") + key[1:]), _cells(("per-module", key[0], "torch") + key[1:])
    for a, b in zip(ours, theirs):
        assert a["layout"] == b["layout"]
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert a["snaps"].keys() == b["snaps"].keys()
        for sa, sb in zip(a["snaps"].values(), b["snaps"].values()):
            for part in ("params", "grads", "states"):
                assert set(sa[part]) == set(sb[part])
                for name in sa[part]:
                    assert torch.equal(sa[part][name], sb[part][name]), (part, name)


def test_shard_placement_fn_dim1_on_tp_parameters():
    """shard_placement_fn returning Shard(1) for TP DTensors (torch's
    test_init_2d_transformer_shard_diff_dim): FSDP2's placements and local shapes (_StridedShard(1,
    sf=2) where TP shards dim 1 too, Shard(1) where TP shards dim 0), float64 at rtol 1e-9 against
    the single-process reference and against FSDP2 + TP running the same script."""
    ours, theirs = _cells(("per-module", "gpt", "ours", "float64", "shard1")), \
        _cells(("per-module", "gpt", "torch", "float64", "shard1"))
    layout = ours[0]["layout"]
    assert layout["blocks.0.attn.proj.weight"] == ("(_StridedShard(dim=1, sf=2), Shard(dim=1))", (32, 8), ("dp", "tp"))
    assert layout["embed.tok.weight"] == ("(Shard(dim=1), Shard(dim=0))", (34, 16), ("dp", "tp"))
    for a, b in zip(ours, theirs):
        assert a["layout"] == b["layout"]
        matches_reference(a, reference_result("gpt"))
        matches_reference(a, b)


def test_placements_are_fsdp2s():
    """Dim-0 TP shards get _StridedShard(0, sf=2) on dp, the rest Shard(0); the TP placement follows;
    plain parameters (Llama's norms) stay on the dp mesh. Vocab 67 splits 34/33 over tp, then 17/17
    and 17/16 over dp."""
    layouts = [r["layout"] for r in _cells(("per-module", "gpt", "ours", "float32"))]
    assert layouts[0]["embed.tok.weight"] == ("(_StridedShard(dim=0, sf=2), Shard(dim=0))", (17, 32), ("dp", "tp"))
    assert layouts[3]["embed.tok.weight"][1] == (16, 32)
    assert layouts[0]["blocks.0.attn.proj.weight"] == ("(Shard(dim=0), Shard(dim=1))", (16, 16), ("dp", "tp"))
    assert layouts[0]["blocks.0.ln1.weight"] == ("(Shard(dim=0), Replicate())", (16,), ("dp", "tp"))
    llama_layout = _cells(("per-module", "llama", "ours", "float32"))[0]["layout"]
    assert llama_layout["model.norm.weight"] == ("(Shard(dim=0),)", (12,), ("dp",))
    assert llama_layout["model.layers.0.self_attn.o_proj.weight"][0] == "(Shard(dim=0), Shard(dim=1))"


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_tp_duplicated_parameters_stay_identical_across_tp(kind):
    """gpt: SequenceParallel norms (gradients Partial() over tp, summed by the redistribute);
    llama: plain TP (norms and embeddings computed from replicated activations)."""
    duplicated_identical(_cells(("per-module", kind, "ours", "float64")))


@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 2, 2)])
def test_hsdp_tp_3d_mesh_matches_reference(shape):
    runs = _cells(("per-module", "gpt", "ours", "float64", shape))
    for run in runs:
        matches_reference(run, reference_result("gpt"))
        assert run["layout"]["blocks.0.attn.q.weight"][0] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
    duplicated_identical(runs, shape)


def test_dcp_across_tp_shapes():
    """Saved at (dp 2, tp 2) after two steps; loaded at (dp 4, tp 1) and (dp 1, tp 4), where the
    parameters and Adam states are the reference's after two steps and a third step matches."""
    ref = reference_result("gpt")
    for run in _cells("dcp"):
        matches_reference(run["saved"], ref, steps=2)
        close_at_scale(run["full_state_dict"], ref["snaps"][1]["params"], "full_state_dict")
        for shape in ((4, 1), (1, 4)):
            loaded = run[shape]["loaded"]
            close_at_scale(loaded["params"], ref["snaps"][1]["params"], f"{shape} loaded params")
            close_at_scale(loaded["states"], ref["snaps"][1]["states"], f"{shape} loaded Adam states")
            assert run[shape]["after"]["snaps"].keys() == {2}
            matches_reference(run[shape]["after"], ref, steps=1, first=2)
        # FSDP2's: _StridedShard over the 4 TP shards of dim 0 even on a dp dim of size 1
        assert run[(1, 4)]["layout"]["embed.tok.weight"][0] == "(_StridedShard(dim=0, sf=4), Shard(dim=0))"
        assert run[(4, 1)]["layout"]["embed.tok.weight"][0] == "(Shard(dim=0), Shard(dim=0))"
