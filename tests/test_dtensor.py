"""Every DTensor the library hands out is a true DTensor: torch's own machinery gathers,
redistributes, checkpoints and loads it (issue: DTensor-true shards).

World sizes 1, 2 and 4, strategies 0 to 3, on a GPT with deliberately awkward shapes (odd row
counts, fewer rows than ranks, a 1-d and a 0-d parameter) and on a transformers Llama. Each run
trains two AdamW steps with gradient clipping next to DDP on the same data and compares, through
torch's public APIs only: `full_tensor()` of every parameter, gradient and Adam state;
`redistribute` to Replicate and back; `get_model_state_dict` / `get_optimizer_state_dict` (full
and sharded, with cpu_offload); `set_model_state_dict` from a plain full state dict;
`clip_grad_norm_`'s returned norm. At world sizes 1 and 2 in fp32 (rtol 1e-5: the gradient norm
sums the shards' squares in another order than over whole tensors, a last-bit change of the clip
factor that Adam's update does not amplify); at world 4, where the gradients' sums run in another
order than DDP's, in float64 to rtol 1e-9 (see [Note: reduction order] in tests/test_parity.py).
At world 4 the same checks run under hybrid sharding on a 2x2 mesh: HSDP ([Replicate(),
Shard(0)]) and HFSDP (Shard(0) over all four ranks).
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict)
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid
from support.checks import ATOL, RTOL, to_full
from support.train_both import TrainBoth

STRATEGIES = [0, 1, 2, 3]
MODELS = ["gpt", "llama"]
AWKWARD = GPTConfig(vocab=67, seq=8, d=36, heads=4, layers=2)
CELLS = rank_grid.Cells(__name__)


class AwkwardGPT(GPT):
    """The test GPT plus a 3-element gate (fewer rows than 4 ranks) and a 0-d scale."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.scale = nn.Parameter(torch.tensor(0.9))

    def forward(self, idx, targets):
        loss = super().forward(idx, targets)
        return loss * self.scale + self.gate.square().sum() * 1e-2


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      attn_implementation="eager", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg), LlamaDecoderLayer, 61


def make_model(kind, dtype=torch.float32):
    torch.manual_seed(0)
    model, unit, vocab = (AwkwardGPT(AWKWARD), Block, AWKWARD.vocab) if kind == "gpt" else _llama()
    return model.to(dtype), unit, vocab


def dtype_at(world):
    return torch.float64 if world > 2 else torch.float32


def loss_of(kind, model, x, y):
    return model(x, y) if kind == "gpt" else model(input_ids=x, labels=y).loss


def unprefix(name):
    return name[len("module."):] if name.startswith("module.") else name


def strip(sd):
    return {unprefix(k): v for k, v in sd.items()}


HYBRID = {"hsdp": "no_shard", "hfsdp": "optim"}  # strategy 3 inside a 2x2 mesh's replicas


def dtensor_checks(rank, world, kind, strategy):
    model, unit, vocab = make_model(kind, dtype_at(world))
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    hybrid = {}
    if strategy in HYBRID:
        hybrid = dict(device_mesh=rank_grid.device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard")),
                      dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", hybrid_fsdp_group=dist.group.WORLD,
                      outer_dp_sharding_strategy=HYBRID[strategy])
        strategy = 3
    fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[unit], zero_dp_strategy=strategy, **hybrid)
    cfg = GPTConfig(vocab=vocab, seq=8)
    out = {"norms": [], "ref_norms": []}

    def clip_and_look(step):
        norm = torch.nn.utils.clip_grad_norm_(list(fsdp.parameters()), 1.0)
        out["norms"].append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).item())
        if step == 1:  # gradients after the sync (and the clip), as DTensors
            # copies: full_tensor() of a replicated gradient is its local tensor, which zero_grad clears
            out["grads"] = {n: to_full(p.grad) for n, p in fsdp.named_parameters() if p.grad is not None}
            out["ref_grads"] = {"module." + n: p.grad.clone() for n, p in ref.named_parameters()}
            # element-wise arithmetic between a parameter and its gradient, and norms
            out["sgd_like"] = {n: (p.detach() - 0.1 * p.grad).full_tensor() for n, p in fsdp.named_parameters()}
            out["ref_sgd_like"] = {"module." + n: p.detach() - 0.1 * p.grad for n, p in ref.named_parameters()}
            out["norm2"] = {n: torch.linalg.vector_norm(p.grad).full_tensor() for n, p in fsdp.named_parameters()}
            out["ref_norm2"] = {"module." + n: torch.linalg.vector_norm(p.grad) for n, p in ref.named_parameters()}
    TrainBoth(rank, world, fsdp, ref, optimizers=(opt, ref_opt), ddp=ddp).run(
        2, lambda step, mb: batch(cfg, 2, seed=100 * step + rank), loss=lambda m, xy: loss_of(kind, m, *xy),
        before_optimizer=clip_and_look)

    params = dict(fsdp.named_parameters())
    out["placements"] = {n: str(p.placements) for n, p in params.items()}
    out["all_dtensors"] = all(isinstance(p, DTensor) for p in params.values()) and all(
        isinstance(v, DTensor) for p in params.values() for k, v in opt.state[p].items() if k != "step")
    out["params"] = {n: p.full_tensor() for n, p in params.items()}
    out["ref_params"] = {"module." + n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_state = {"module." + n: ref_opt.state[p] for n, p in ref.named_parameters()}
    out["adam"] = {(n, k): v.full_tensor() for n, p in params.items() for k, v in opt.state[p].items() if k != "step"}
    out["ref_adam"] = {(n, k): v.clone() for n, st in ref_state.items() for k, v in st.items() if k != "step"}

    # redistribute to Replicate and back: the same local rows, the full values in between
    roundtrip_ok = True
    for n, p in params.items():
        replicated = [Replicate()] * p.device_mesh.ndim
        full = p.redistribute(p.device_mesh, replicated).to_local()
        back = DTensor.from_local(full, p.device_mesh, replicated).redistribute(p.device_mesh, p.placements)
        roundtrip_ok &= torch.equal(full, out["params"][n]) and torch.equal(back.to_local(), p.to_local())
    out["redistribute_ok"] = roundtrip_ok

    # torch.distributed.checkpoint.state_dict, full and sharded
    full = StateDictOptions(full_state_dict=True)
    out["model_sd"] = strip(get_model_state_dict(fsdp, options=full))
    out["ref_model_sd"] = get_model_state_dict(ref, options=full)
    offloaded = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["offload_ok"] = (offloaded == {} if rank > 0 else  # torch gives the offloaded full dict to rank 0 only
                         all(torch.equal(v, out["model_sd"][unprefix(k)]) for k, v in offloaded.items()))
    sharded = get_model_state_dict(fsdp, options=StateDictOptions(full_state_dict=False))
    out["sharded_sd_ok"] = all(
        torch.equal(v.full_tensor(), out["model_sd"][k[len("module."):]])
        for k, v in sharded.items() if isinstance(v, DTensor))
    osd = get_optimizer_state_dict(fsdp, opt, options=full)
    ref_osd = get_optimizer_state_dict(ref, ref_opt, options=full)
    out["optim_sd"] = {(unprefix(k), s): v for k, st in osd["state"].items() for s, v in st.items() if s != "step"}
    out["ref_optim_sd"] = {(k, s): v for k, st in ref_osd["state"].items() for s, v in st.items() if s != "step"}

    # load a plain full state dict (the reference's) into the sharded model: same loss as DDP's
    plain = {"module." + k: v for k, v in ref.state_dict().items()}
    set_model_state_dict(fsdp, plain, options=StateDictOptions(full_state_dict=True))
    x, y = batch(cfg, 2, seed=999 + rank)
    with torch.no_grad():
        out["loaded_loss"] = loss_of(kind, fsdp, x, y).item()
        out["ref_loss"] = loss_of(kind, ref, x, y).item()
    out["loaded_params"] = {n: p.full_tensor() for n, p in fsdp.named_parameters()}
    dist.barrier()
    return out


for _kind in MODELS:
    for _strategy in STRATEGIES:
        CELLS.add((_kind, _strategy), dtensor_checks, _kind, _strategy, worlds=(1, 2, 4),
                  tests=["test_dtensors_are_true_dtensors"], match=dict(kind=_kind, strategy=_strategy))
    for _hybrid in HYBRID:
        CELLS.add((_kind, _hybrid), dtensor_checks, _kind, _hybrid, worlds=(4,),
                  tests=["test_hybrid_dtensors_are_true_dtensors"], match=dict(kind=_kind, hybrid=_hybrid))


def close(a, b, what, rtol=1e-5, atol=1e-6):
    assert set(a) == set(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{what} {k}: {m}")


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dtensors_are_true_dtensors(world, kind, strategy):
    check_cell(world, kind, strategy)


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("hybrid", list(HYBRID))
def test_hybrid_dtensors_are_true_dtensors(kind, hybrid):
    check_cell(4, kind, hybrid)


def check_cell(world, kind, strategy):
    for r in CELLS.result((kind, strategy), world):
        assert r["all_dtensors"], "every parameter and Adam state is a DTensor"
        if strategy != 0 and world > 1:
            assert any("Shard(dim=0)" in p for p in r["placements"].values()), r["placements"]
        if strategy == "hfsdp":
            assert set(r["placements"].values()) <= {"(Shard(dim=0),)", "(Replicate(),)"}, r["placements"]
        assert {t.dtype for t in r["params"].values()} == {dtype_at(world)}
        if world > 2:  # float64: the algorithm, whatever the order of the sums
            tol = dict(rtol=RTOL, atol=ATOL)
            tol_state = tol_param = tol
        else:
            tol, tol_state, tol_param = dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-5, atol=1e-7), dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(r["norms"], dtype=torch.float64),
                                   torch.tensor(r["ref_norms"], dtype=torch.float64), **tol)
        close(r["grads"], r["ref_grads"], "grad.full_tensor()", **tol)
        close(r["sgd_like"], r["ref_sgd_like"], "p - 0.1 * p.grad", **tol)
        close(r["norm2"], r["ref_norm2"], "vector_norm(p.grad)", **tol)
        close(r["adam"], r["ref_adam"], "Adam state full_tensor()", **tol_state)
        close(r["params"], r["ref_params"], "param.full_tensor()", **tol_param)
        assert r["redistribute_ok"], "redistribute to Replicate and back"
        close(r["model_sd"], r["ref_model_sd"], "get_model_state_dict(full)", **tol_param)
        assert r["sharded_sd_ok"], "get_model_state_dict(sharded) DTensors gather to the full ones"
        assert r["offload_ok"], "get_model_state_dict(full, cpu_offload) on rank 0"
        close(r["optim_sd"], r["ref_optim_sd"], "get_optimizer_state_dict(full)", **tol_state)
        close(r["loaded_params"], r["ref_params"], "set_model_state_dict(full)", rtol=0, atol=0)
        assert r["loaded_loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
