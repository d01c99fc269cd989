"""Mixed precision and gradient clipping of megatron_fsdp_c.per_module.fully_shard, tested after
torch's own FSDP2 suite (test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py,
test_fully_shard_clip_grad_norm_.py) through public APIs only. The cells run in the shared
spawns (see [Note: one spawn per world size] in support/rank_grid.py).

torch's MixedPrecisionPolicy semantics, as documented by FSDP2 (and our one difference):
- param_dtype: the compute dtype; the sharded parameters, their gradients and the optimizer stay
  in the parameter's dtype. The reference here is an fp32 master model with a compute-dtype copy.
- reduce_dtype (default: param_dtype up to torch 2.14, the parameter's dtype from 2.15: each
  torch's own rule, DEFAULT_WIRE): the dtype gradients travel in and are summed in (FSDP2's
  reduce-scatter; ours too under torch's policy: `sum_in_comm_dtype`, [Note: exchange reduction]
  in csrc/comm/reduce.c). The reference sums the pre-scaled shares in that dtype in rank order,
  which gloo's sums match bit for bit at world 2; at world 4 gloo sums in another order, so
  there the check is against FSDP2 itself (torch_policy_sums_like_fsdp2, bit for bit). megatron_fsdp_c's own policy sums the narrow shares in the main
  dtype instead, and its reference does. Where reduce_dtype is the parameter's dtype the library reduce-scatters with gloo, whose
  fp32 sums of 4 ranks run in another order than the reference's (see [Note: reduction order] in
  tests/test_parity.py): at world 4 that policy (bf16 compute, fp32 reduction) runs with float64
  main weights and reduction instead, where sums of bf16 gradients are exact in any order, so it
  is bit for bit too.
- with sync off, unsharded gradients accumulate in reduce_dtype (fp32 under a bf16 compute dtype).
- cast_forward_inputs casts floating inputs (inside containers too) to param_dtype at every group,
  in recomputation too; output_dtype casts the outputs.

Behaviours (cell names):
- bf16 compute with fp32 or bf16 (default) reduction, fp32 compute with bf16 reduction, with
  reshard_after_forward True/False: mp_training
- a narrow reduce_dtype gives FSDP2's numbers bit for bit (bf16, fp16): torch_policy_sums_like_fsdp2
- torch 2.15's per-parameter policy (param_dtype_override_fn; grad_dtype=None), bit for bit with
  FSDP2 (registered where torch has it): torch_policy_per_parameter
- gradient accumulation with sync off under bf16 compute and fp32 reduction: mp_accumulation
- where the inputs and outputs are cast: test_per_module_casts.py
- megatron_fsdp_c's own MixedPrecisionPolicy with a bf16 wire, summed wide or (sum_in_comm_dtype)
  in bf16: our_policy_bf16_wire
- megatron_fsdp_c's own MixedPrecisionPolicy (bf16 model, fp32 main weights): our_policy; its
  sharded parameters are the fp32 main weights from fully_shard on (state dict, optimizer), a
  later dtype conversion is refused: our_policy_main_weights
- clip_grad_norm_ over DTensor gradients (norms 2, 1, inf): the same total norm and clipped
  gradients as DDP's: clip_grad_norm; with groups of different zero_dp_strategy (Replicate and
  Shard(0) gradients mixed): clip_grad_norm_mixed_strategies
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy as MP
from torch.distributed.tensor import DTensor

from megatron_fsdp_c.per_module import fully_shard
from megatron_fsdp_c.testing import GPT, GPTConfig, batch

from support import rank_grid
from support.checks import cached_alias, full, raised_by, recorder_cells, verify
from support.data import normal_batch
from support.train_both import TrainBoth

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)
BF16, FP32 = torch.bfloat16, torch.float32
# torch 2.15 changed MixedPrecisionPolicy(reduce_dtype=None): gradients reduce in the parameter's
# (gradient) dtype, no longer in param_dtype (its docstring's "versionchanged:: 2.15").
DEFAULT_WIRE = "param" if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 15) else "compute"
# torch 2.15's MixedPrecisionPolicy(param_dtype_override_fn=...): a per-parameter param_dtype
TORCH_PER_PARAMETER = "param_dtype_override_fn" in getattr(MP, "__dataclass_fields__", {})


class MLP(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def rank_order_sum(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` summed in rank order in t's dtype (what the exchange reduction does)."""
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, t)
    total = torch.zeros_like(t)
    for piece in pieces:
        total += piece
    return total


def mp_loop(ck, rank, world, model, mp, data, *, steps=4, accumulate=1, reshard=True, shard=None, master=None,
            wire=None, narrow=None):
    """Trains `model` (sharded here with `mp`; its dtype is the main weights' unless `master` says)
    against a master replica with a compute-dtype copy whose gradients are reduced as the
    documented semantics say (in `wire`, by default mp's reduce_dtype); bit for bit (see the
    module docstring)."""
    master = master or next(model.parameters()).dtype
    compute = getattr(mp, "param_dtype", None) or next(model.parameters()).dtype
    if wire is None and getattr(mp, "reduce_dtype", None) is None:
        torch_policy = hasattr(mp, "param_dtype")
        wire = next(model.parameters()).dtype if torch_policy and DEFAULT_WIRE == "param" else compute
    wire = wire or mp.reduce_dtype
    ref = copy.deepcopy(model).to(master)
    ref_compute = copy.deepcopy(model).to(compute)
    if shard:
        shard(model)
    else:
        for m in model:
            fully_shard(m, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)

    def ours(m, x):
        loss = m(x).sum()
        ck.true("loss in the compute dtype", loss.dtype == compute, str(loss.dtype))
        loss.backward()
        return loss

    def theirs(m, x):  # the compute copy runs; its gradients land on the master (m)
        loss = ref_compute(x.to(compute)).sum()
        loss.backward()
        for p, pc in zip(m.parameters(), ref_compute.parameters()):
            g = pc.grad.to(master)  # microbatches accumulate in the reduce dtype (fp32 under bf16)
            p.grad = g if p.grad is None else p.grad + g
            pc.grad = None
        return loss

    if narrow is None:  # torch's policy sums in the wire dtype (FSDP2's reduce-scatter); ours wide by default
        narrow = getattr(mp, "sum_in_comm_dtype", True)

    def reduce(m):  # each rank's share rounded once to the wire dtype, summed in the wire or main dtype
        for p in m.parameters():
            share = (p.grad / world).to(wire)
            p.grad = rank_order_sum(share).to(master) if narrow else rank_order_sum(share.to(master))

    def flags(step, mb):
        if accumulate > 1:
            is_last = mb == accumulate - 1
            model.set_requires_gradient_sync(is_last)
            model.set_reshard_after_backward(is_last or reshard)

    @torch.no_grad()
    def master_to_compute(step):
        for p, pc in zip(ref.parameters(), ref_compute.parameters()):
            pc.copy_(p)
    pair = TrainBoth(rank, world, model, ref, reference=reduce, ck=ck, tol=(0.0, 0.0))
    pair.run(steps, lambda step, mb: data(10 * step + mb, rank), micro=accumulate, forward_backward=ours,
             ref_forward_backward=theirs, before_micro=flags, zero_at_start=True,
             set_to_none=lambda step: step % 2 == 0, after_step=master_to_compute)
    pair.check_params()
    for name, p in model.named_parameters():
        ck.true(f"{name}: {master} DTensor parameter and gradient", isinstance(p, DTensor) and p.dtype == master
                and p.to_local().dtype == master and (p.grad is None or p.grad.dtype == master))


def _stack(dtype=FP32):
    torch.manual_seed(42)
    return nn.Sequential(MLP(), MLP(), MLP()).to(dtype)


def mp_data(step, rank):
    return normal_batch(step, rank, (4, 16), FP32)


@cell("mp_training[bf16-fp32_reduce-reshard]", param_dtype=BF16, reduce_dtype=FP32, reshard=True)
@cell("mp_training[bf16-float64_reduce-reshard]", worlds=(4,), param_dtype=BF16, reduce_dtype=torch.float64,
      reshard=True, master=torch.float64)  # world 4's bf16-fp32_reduce (see the module docstring)
@cell("mp_training[bf16-fp32_reduce-keep]", param_dtype=BF16, reduce_dtype=FP32, reshard=False)
# bf16 sums of 4 ranks run in gloo's order, not the reference's: world 4 is checked against FSDP2
# itself (torch_policy_sums_like_fsdp2[bf16])
@cell("mp_training[bf16-default_reduce-reshard]", param_dtype=BF16, reduce_dtype=None, reshard=True)
@cell("mp_training[fp32-bf16_reduce-reshard]", param_dtype=None, reduce_dtype=BF16, reshard=True)
def mp_training(rank, world, ck, param_dtype, reduce_dtype, reshard, master=FP32):
    mp_loop(ck, rank, world, _stack(master), MP(param_dtype=param_dtype, reduce_dtype=reduce_dtype), mp_data,
            reshard=reshard)


@cell("torch_policy_sums_like_fsdp2[bf16]", worlds=(2, 4), param_dtype=BF16, reduce_dtype=None)
@cell("torch_policy_sums_like_fsdp2[fp32-bf16_reduce]", param_dtype=None, reduce_dtype=BF16)
@cell("torch_policy_sums_like_fsdp2[fp16]", param_dtype=torch.float16, reduce_dtype=None)
def torch_policy_sums_like_fsdp2(rank, world, ck, param_dtype, reduce_dtype):
    """Under torch's MixedPrecisionPolicy a narrow reduce_dtype is summed in it, as FSDP2's
    reduce-scatter sums: the same script with torch's fully_shard gives the same losses and
    parameters bit for bit (4 Adam steps; fp16 at world 2 only, where FSDP2 divides by the world
    before the sum as we do: from world 4 on it divides before and after)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    runs = []
    for shard in (torch_fully_shard, fully_shard):
        model = _stack()
        mp = MP(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for m in model:
            shard(m, mp_policy=mp)
        shard(model, mp_policy=mp)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for step in range(4):
            loss = model(mp_data(step, rank)).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        runs.append((losses, [p.full_tensor() for p in model.parameters()]))
    (theirs, their_params), (ours, our_params) = runs
    ck.true("losses equal FSDP2's", theirs == ours, f"{theirs} vs {ours}")
    worst = max((a - b).abs().max().item() for a, b in zip(their_params, our_params))
    ck.true("parameters equal FSDP2's", worst == 0.0, f"max |diff| {worst:.3g}")


class Gated(nn.Module):
    """A linear layer and a gate vector applied in fp32 (a Mamba A_log or dt_bias: what
    param_dtype_override_fn keeps in fp32 under a bf16 policy)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.up = nn.Linear(dim, dim)
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, dim))

    def forward(self, x):
        h = torch.tanh(self.up(x))
        return (h.float() * torch.sigmoid(self.gate.float())).to(h.dtype)


if TORCH_PER_PARAMETER:
    @cell("torch_policy_per_parameter[override]", worlds=(2, 4), variant="override")
    @cell("torch_policy_per_parameter[grad_dtype_none]", variant="grad_dtype_none")
    def torch_policy_per_parameter(rank, world, ck, variant):
        """torch 2.15's per-parameter policy, against FSDP2 on the same script, bit for bit:
        param_dtype_override_fn keeps the gates in fp32 under param_dtype=bf16 (reduce_dtype None:
        the parameter's dtype, fp32, for all); grad_dtype=None set on the sharded parameters before
        the first forward, with an fp32 reduce_dtype (FSDP2's sharded gradients stay fp32). Without
        reduce_dtype, FSDP2 would leave bf16 gradients on fp32 parameters there: refused, naming the
        setting ([Note: reduce dtype by torch version] in megatron_fsdp_c/per_module/_policy.py)."""
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        def build(shard, reduce):
            torch.manual_seed(7)
            model = nn.Sequential(Gated(), Gated(), Gated())
            keep = {id(m.gate) for m in model}
            mp = MP(param_dtype=BF16, reduce_dtype=reduce, param_dtype_override_fn=(
                lambda p: FP32 if id(p) in keep else None) if variant == "override" else None)
            for m in model:
                shard(m, mp_policy=mp)
            shard(model, mp_policy=mp)
            if variant == "grad_dtype_none":
                for p in model.parameters():
                    p.grad_dtype = None
            return model

        runs = []
        for shard in (torch_fully_shard, fully_shard):
            model = build(shard, FP32 if variant == "grad_dtype_none" else None)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            losses = []
            for step in range(3):
                loss = model(mp_data(step, rank)).float().sum()
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.item())
            runs.append((losses, [p.full_tensor() for p in model.parameters()]))
        (theirs, their_params), (ours, our_params) = runs
        ck.true("losses equal FSDP2's", theirs == ours, f"{theirs} vs {ours}")
        worst = max((a - b).abs().max().item() for a, b in zip(their_params, our_params))
        ck.true("parameters equal FSDP2's", worst == 0.0, f"max |diff| {worst:.3g}")
        if variant == "grad_dtype_none":
            refused = build(fully_shard, None)
            ck.raised("grad_dtype=None without reduce_dtype", lambda: refused(mp_data(0, rank)))
            # every rank raised in its lazy init, before any collective: the group is still usable


@cell("mp_accumulation[reshard]", reshard=True)
@cell("mp_accumulation[keep]", reshard=False)
def mp_accumulation(rank, world, ck, reshard):
    mp_loop(ck, rank, world, _stack(), MP(param_dtype=BF16, reduce_dtype=FP32), mp_data, steps=2, accumulate=4,
            reshard=reshard)


@cell("our_policy_bf16_wire[wide_sums]", narrow=False)
@cell("our_policy_bf16_wire[sum_in_comm_dtype]", narrow=True)
def our_policy_bf16_wire(rank, world, ck, narrow):
    """megatron_fsdp_c.MixedPrecisionPolicy with a bf16 wire under fp32 main gradients: the shares
    are summed in fp32 (default) or, with sum_in_comm_dtype=True, in bf16 as FSDP2 sums; each
    against its reference, bit for bit (the two differ: the check tells them apart)."""
    from megatron_fsdp_c import MixedPrecisionPolicy as OurPolicy
    policy = OurPolicy(main_params_dtype=FP32, main_grads_dtype=FP32, grad_comm_dtype=BF16,
                       sum_in_comm_dtype=narrow)
    mp_loop(ck, rank, world, _stack(), policy, mp_data, steps=2, wire=BF16, narrow=narrow)


@cell("our_policy")
def our_policy(rank, world, ck):
    """megatron_fsdp_c.MixedPrecisionPolicy: compute in the module's dtype (bf16 here), fp32 main
    weights and gradients, fp32 reduction; the parameters the optimizer sees are the main weights."""
    from megatron_fsdp_c import MixedPrecisionPolicy as OurPolicy
    policy = OurPolicy(main_params_dtype=FP32, main_grads_dtype=FP32, grad_comm_dtype=FP32)

    def shard(model):
        for m in model:
            fully_shard(m, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        for name, p in model.named_parameters():
            ck.true(f"{name}: a DTensor whose dtype is its local shard's", p.dtype == p.to_local().dtype,
                    f"{p.dtype} vs {p.to_local().dtype}")
    # the wire is fp32: world 2 sums like DDP
    mp_loop(ck, rank, world, _stack().to(BF16), policy, lambda step, r: mp_data(step, r).to(BF16), steps=2,
            shard=shard, master=FP32, wire=FP32)


@cell("our_policy_main_weights")
def our_policy_main_weights(rank, world, ck):
    """Under megatron_fsdp_c's policy the sharded parameters are the float32 main weights from
    fully_shard on ([Note: main-weight parameters] in megatron_fsdp_c/per_module/_policy.py): a
    state dict taken before the first forward and an optimizer built then hold them, and the
    state dict keeps aliasing them through training; the module computes in bf16; converting it
    to another dtype after fully_shard is refused at the call, naming the fix."""
    from megatron_fsdp_c import MixedPrecisionPolicy as OurPolicy
    policy = OurPolicy(main_params_dtype=FP32)
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), nn.Linear(16, 16)).to(BF16)
    fully_shard(model[0], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    sd = model.state_dict()
    ck.true("state dict before the first forward: float32", all(v.dtype == FP32 for v in sd.values()),
            str({k: v.dtype for k, v in sd.items()}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        out = model(mp_data(step, rank).to(BF16))
        ck.true(f"step {step}: computes in bf16", out.dtype == BF16, str(out.dtype))
        out.float().sum().backward()
        ck.true(f"step {step}: float32 gradients", all(p.grad.dtype == FP32 for p in model.parameters()))
        opt.step()
        opt.zero_grad()
    params = dict(model.named_parameters())
    for k, v in sd.items():
        cached_alias(ck, f"{k}: the cached state dict", v, params[k])
    try:
        model.bfloat16()
        err = "no error"
    except ValueError as e:
        err = str(e)
    ck.true("bfloat16() after fully_shard raises ValueError naming the fix", "before fully_shard" in err, err)


# ------------------------------------------------------------------------------------------
# test_fully_shard_clip_grad_norm_.py

CFG = GPTConfig(vocab=32, seq=8, d=16, heads=2, layers=3)


@cell("clip_grad_norm[2]", worlds=(2, 4), norm_type=2.0)
@cell("clip_grad_norm[1]", worlds=(2, 4), norm_type=1.0)
@cell("clip_grad_norm[inf]", worlds=(2, 4), norm_type=float("inf"))
@cell("clip_grad_norm_mixed_strategies", norm_type=2.0, strategies=("no_shard", "optim", "optim_grads"))
def clip_grad_norm(rank, world, ck, norm_type, strategies=None):
    torch.manual_seed(0)
    model = GPT(CFG).double()
    ref = copy.deepcopy(model)
    for i, b in enumerate(model.blocks):
        fully_shard(b, **({"zero_dp_strategy": strategies[i]} if strategies else {}))
    fully_shard(model)

    def clip(step):  # after the gradients before clipping are checked
        unclipped = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad, norm_type) for p in ref.parameters()]), norm_type)
        max_norm = 0.5 * unclipped.item()  # the same on every rank: DDP's gradients are
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=max_norm, norm_type=norm_type)
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm, norm_type=norm_type,
                                               foreach=True)
        ck.close(f"step {step}: total norm", full(total), ref_total)
        ck.grads(f"step {step}: clipped", model, ref)
    pair = TrainBoth(rank, world, model, ref, ck=ck)
    pair.run(3, lambda step, mb: batch(CFG, 2, seed=100 * step + rank), loss=lambda m, xy: m(*xy), check_loss=False,
             zero_at_start=True, before_optimizer=clip)
    pair.check_params()


# ------------------------------------------------------------------------------------------

KNOWN_GAPS = {}  # cell -> how megatron_fsdp_c differs from FSDP2 there (strict xfails)


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys(), KNOWN_GAPS))
def test_precision_behaviour(name, world):
    verify(CELLS, name, world)
    if name == "torch_policy_per_parameter[grad_dtype_none]":
        for kind, message in raised_by(CELLS.result(name, world), "grad_dtype=None without reduce_dtype"):
            assert kind == "NotImplementedError" and "grad_dtype=None" in message and "reduce_dtype" in message, \
                (kind, message)
