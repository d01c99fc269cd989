"""MixedPrecisionPolicy end to end: casts bit-exact with torch, bf16 training against a
data-parallel reference with fp32 master weights, low-precision communication, microbatches
that never count a gradient twice, NaN reporting, and the runtime policy switch.

[Note: bf16 tolerance]
The reference is DDP's arithmetic written out on an fp32 master model: bf16 forward/backward,
gradients upcast to fp32, multiplied by 1/world and summed across ranks, AdamW on fp32 master
weights, master weights cast back to bf16. The sharded model does the same operations; only the
order of the cross-rank fp32 sums may differ (two ranks: never; four ranks: last-bit
differences in about a third of the elements, see tests/test_parity.py). An fp32 master weight
that differs in its last bit changes its bf16 copy only if it sits on a bf16 rounding boundary,
and then by one bf16 ulp (2^-8 relative) of that one weight.

With grad_comm_dtype=bf16 the reference sends each rank's gradient rounded to bf16 and sums
the pieces in fp32, as the engine's exchange reduction does (csrc/comm/reduce.c, [Note:
exchange reduction]); no_shard then also gathers the reduced gradient in bf16, so it is rounded
once more (2^-9 relative per element) than in the reference.

Measured (20 AdamW steps, per-rank loss, max relative difference): 0 for every strategy with
fp32 communication at world 2 and 4, 0 for ZeRO-1/2/3 with bf16 communication, and up to
1.8e-3 for no_shard with bf16 communication at world 4 (the extra rounding). The tolerance is
one bf16 ulp of the loss, 2^-8 = 3.9e-3: the two runs agree to the precision of the compute
dtype. Skipping the gradient reduction altogether is shown to exceed it below.
"""
import copy

import pytest
import torch
import torch.distributed as dist

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid
from support.checks import ATOL, RTOL

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
LOSS_RTOL = 2.0 ** -8  # see [Note: bf16 tolerance]
CFG = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=3)
STEPS = 20
CELLS = rank_grid.Cells(__name__)


# -- kernels ------------------------------------------------------------------------------------

def _hard_values(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, (n,), generator=g))
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-45, 1e-310, 6e-8, 3e-8,
                            65504.0, 65519.0, 65520.0, 3.4e38, 1.00390625, 1.01171875, 1 + 2**-8 + 2**-30,
                            2**-24, 2**-25, 2**-149], dtype=torch.float64)
    x[: len(special)] = special
    # exact ties of bf16 and fp16 rounding
    base = torch.randn(200, generator=g, dtype=torch.float64).to(torch.float32)
    bits = base.view(torch.int32)
    x[100:200] = ((bits[:100] & ~0xFFFF) | 0x8000).view(torch.float32).double()
    x[200:300] = ((bits[100:200] & ~0x1FFF) | 0x1000).view(torch.float32).double() * 1e-3
    return x


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dst_dtype", FLOATS, ids=str)
def test_cast_bit_exact_with_torch(src_dtype, dst_dtype):
    ref64 = _hard_values(4099, seed=FLOATS.index(src_dtype) * 4 + FLOATS.index(dst_dtype))
    src = ref64.to(src_dtype)
    expected = src.to(dst_dtype)
    out = torch.full_like(expected, 7.0)
    _C.copy_(out, src)
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.uint8), expected[~nan].view(torch.uint8)), "not bit-exact with .to()"
    # and against the float64 value: within half a unit in the last place of dst (round to nearest)
    finite = (~nan) & out.isfinite() & src.isfinite()
    exact = src[finite].double()
    got = out[finite].double()
    info = torch.finfo(dst_dtype)
    ulp = torch.clamp(torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(info.tiny)))) * info.eps, min=info.tiny * info.eps)
    # float64 -> 16-bit types round through float32 like torch: allow that one extra float32 rounding
    slack = 1.0 if src_dtype == torch.float64 and dst_dtype in (torch.bfloat16, torch.float16) else 0.5
    assert bool(((got - exact).abs() <= slack * ulp + 1e-300).all())


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("dst_dtype", FLOATS, ids=str)
def test_accumulate_promotes_before_adding(src_dtype, dst_dtype):
    g = torch.Generator().manual_seed(7)
    dst = torch.randn(2049, generator=g).to(dst_dtype)
    src = torch.randn(2049, generator=g).to(src_dtype)
    wide = torch.float64 if torch.float64 in (src_dtype, dst_dtype) else torch.float32
    for alpha in (1.0, 0.25):
        expected = (dst.to(wide) + src.to(wide) * alpha if alpha != 1.0 else dst.to(wide) + src.to(wide)).to(dst_dtype)
        out = dst.clone()
        _C.accumulate_(out, src, alpha)
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def test_summing_in_fp32_keeps_what_bf16_summing_loses():
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(4096, generator=g).to(torch.bfloat16) for _ in range(8)]
    exact = sum(p.double() for p in parts)
    in_bf16 = parts[0].clone()
    for p in parts[1:]:
        in_bf16 += p
    in_fp32 = torch.zeros(4096)
    for p in parts:
        _C.accumulate_(in_fp32, p)
    assert (in_fp32.double() - exact).abs().max() < 1e-5
    assert (in_bf16.double() - exact).abs().max() > 1e-3


# -- training -----------------------------------------------------------------------------------

def _reference_losses(rank, world, comm_dtype, steps, reduce=True):
    """DDP's arithmetic on an fp32 master model with bf16 compute (see the note)."""
    torch.manual_seed(0)
    compute = GPT(CFG).to(torch.bfloat16)
    master = copy.deepcopy(compute).float()
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(CFG, 2, seed=1000 * step + rank)
        loss = compute(x, y)
        loss.backward()
        for pm, pc in zip(master.parameters(), compute.parameters()):
            g = pc.grad.float() * (1.0 / world)
            if not reduce:
                g = g * world
            elif comm_dtype is None:
                dist.all_reduce(g)
            else:  # every rank's narrow piece, summed in fp32 in rank order
                pieces = [torch.empty_like(g, dtype=comm_dtype) for _ in range(world)]
                dist.all_gather(pieces, g.to(comm_dtype))
                g = torch.zeros_like(g)
                for piece in pieces:
                    g += piece.float()
            pm.grad = g
            pc.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pc in zip(master.parameters(), compute.parameters()):
                pc.copy_(pm)
        losses.append(loss.item())
    return losses


def _sharded_losses(rank, world, strategy, comm_dtype, steps, **shard_kwargs):
    torch.manual_seed(0)
    model = GPT(CFG).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    policy = mf.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                     grad_comm_dtype=comm_dtype)
    fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                               mixed_precision_policy=policy, **shard_kwargs)
    losses = []
    for step in range(steps):
        x, y = batch(CFG, 2, seed=1000 * step + rank)
        loss = fsdp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    main_dtypes = {r.dist_param.dtype for r in fsdp.param_buffer.records}
    compute_dtypes = {r.param.dtype for r in fsdp.param_buffer.records}
    return losses, main_dtypes, compute_dtypes


for _comm in (None, torch.bfloat16):
    _tests = ["test_bf16_compute_fp32_main_matches_reference", "test_tolerance_catches_a_missing_reduction"]
    CELLS.add(("reference", str(_comm)), _reference_losses, _comm, STEPS, worlds=(2, 4), tests=_tests,
              match=dict(comm=_comm))
    for _strategy in range(4):
        CELLS.add((_strategy, str(_comm)), _sharded_losses, _strategy, _comm, STEPS, worlds=(2, 4), tests=_tests[:1],
                  match=dict(comm=_comm, strategy=_strategy))
# training on local gradients only, to show the tolerance discriminates
CELLS.add("no reduction", _reference_losses, None, STEPS, reduce=False, worlds=(4,), tests=_tests[1:])


def _rel_diff(a, b):
    a, b = torch.tensor(a), torch.tensor(b)
    return ((a - b).abs() / b.abs()).max().item()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.parametrize("comm", [None, torch.bfloat16], ids=["comm=fp32", "comm=bf16"])
def test_bf16_compute_fp32_main_matches_reference(world, strategy, comm):
    refs, values = CELLS.result(("reference", str(comm)), world), CELLS.result((strategy, str(comm)), world)
    for rank, (ref, (losses, main_dtypes, compute_dtypes)) in enumerate(zip(refs, values)):
        assert main_dtypes == {torch.float32} and compute_dtypes == {torch.bfloat16}
        diff = _rel_diff(losses, ref)
        print(f"world {world} strategy {strategy} comm {comm} rank {rank}: max relative loss difference {diff:.2e}")
        assert diff <= LOSS_RTOL, diff
        assert losses[-1] < 0.7 * losses[0], "it trains"


def test_tolerance_catches_a_missing_reduction():
    diff = _rel_diff(CELLS.result("no reduction", 4)[0], CELLS.result(("reference", "None"), 4)[0])
    print(f"local gradients only: {diff:.2e}")
    assert diff > 3 * LOSS_RTOL


# -- microbatches: no gradient counted twice ----------------------------------------------------

MICROBATCH_KEYS = [(1, True, False), (1, True, True), (1, False, False), (0, True, False), (0, False, False),
                   (0, True, True), (2, True, False), (3, True, False)]  # (strategy, auto sync, no_sync)


def microbatch_grads(rank, world, strategy, auto_sync, use_no_sync):
    """3 microbatches under per-token loss (sums: double counting cannot hide in averaging), in
    float64: the library and DDP sum the microbatches and ranks in different orders (see [Note:
    reduction order] in tests/test_parity.py), a gradient counted twice is off by a third."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = GPT(CFG).double()
    ref = DDP(copy.deepcopy(model))
    fsdp, _ = mf.fully_shard(model, None, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                             calculate_per_token_loss=True, sync_model_each_microbatch=auto_sync)
    for m in range(3):
        x, y = batch(CFG, 2, seed=10 * m + rank)
        quiet = use_no_sync and m < 2
        with fsdp.no_sync() if quiet else torch.enable_grad():
            fsdp(x, y).backward()
        with ref.no_sync() if m < 2 else torch.enable_grad():
            ref(x, y).backward()
    fsdp.finish_grad_sync()
    ours = fsdp.full_grads()
    return {n: (ours[n], p.grad * world) for n, p in ref.module.named_parameters()}


for _key in MICROBATCH_KEYS:
    CELLS.add(("microbatches",) + _key, microbatch_grads, *_key, tests=["test_three_microbatches_count_each_gradient_once"],
              match=dict(key=_key))


@pytest.mark.parametrize("key", MICROBATCH_KEYS, ids=lambda k: f"strategy{k[0]}-autosync{int(k[1])}-nosync{int(k[2])}")
def test_three_microbatches_count_each_gradient_once(key):
    grads = CELLS.result(("microbatches",) + key, 2)[0]
    for name, (ours, expected) in grads.items():
        assert ours.dtype == torch.float64
        torch.testing.assert_close(ours, expected, rtol=RTOL, atol=ATOL, msg=name)


# -- NaN report, policy switch, bad input -------------------------------------------------------

@CELLS.cell("nan and context", tests=["test_nan_gradient_is_reported_with_its_name",
                                      "test_mixed_precision_context_switches_comm_dtype_and_back",
                                      "test_lossy_policy_is_refused_at_fully_shard"])
def nan_and_context(rank, world):
    out = {}
    torch.manual_seed(0)
    model = GPT(CFG)
    fsdp, _ = mf.fully_shard(model, None, fsdp_unit_modules=[Block], report_nan_in_param_grad=True)
    poisoned = next(r.param for r in fsdp.param_buffer.records if r.name == "blocks.1.fc.weight")
    if rank == 1:
        poisoned.register_hook(lambda g: g * float("nan"))
    x, y = batch(CFG, 2, seed=rank)
    try:
        fsdp(x, y).backward()
        out["nan"] = ("no error", "")
    except FloatingPointError as e:
        out["nan"] = ("FloatingPointError", str(e))

    torch.manual_seed(0)
    model = GPT(CFG).to(torch.bfloat16)
    fsdp, opt = mf.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=[Block],
                               mixed_precision_policy=mf.MixedPrecisionPolicy(main_grads_dtype=torch.float32))
    engine = fsdp.param_buffer.engine
    trainable = [b for b, s in enumerate(fsdp.param_buffer.specs) if s["grad_mode"]]
    before = engine.tensor(trainable[0], _C.BUF_GRAD).dtype
    with fsdp.mixed_precision_context(mf.MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)):
        inside = engine.tensor(trainable[0], _C.BUF_GRAD).dtype
        x, y = batch(CFG, 2, seed=rank)
        fsdp(x, y).backward()
        opt.step()
        opt.zero_grad()
    after = engine.tensor(trainable[0], _C.BUF_GRAD).dtype
    out["context"] = (before, inside, after)
    try:
        fsdp.reset_mixed_precision_policy(mf.MixedPrecisionPolicy(grad_comm_dtype=torch.float64))
        out["lossy switch"] = ("no error", "")
    except ValueError as e:
        out["lossy switch"] = ("ValueError", str(e))
    try:
        mf.fully_shard(GPT(CFG).to(torch.bfloat16), fsdp_unit_modules=[Block],
                       mixed_precision_policy=mf.MixedPrecisionPolicy(grad_comm_dtype=torch.float32))
        out["lossy at fully_shard"] = ("no error", "")
    except ValueError as e:
        out["lossy at fully_shard"] = ("ValueError", str(e))
    return out


def test_nan_gradient_is_reported_with_its_name():
    results = CELLS.result("nan and context", 2)
    messages = [r["nan"] for r in results]
    assert all(kind == "FloatingPointError" for kind, _ in messages), messages
    assert any("blocks.1.fc.weight" in text for _, text in messages), messages


def test_mixed_precision_context_switches_comm_dtype_and_back():
    r = CELLS.result("nan and context", 2)[0]
    assert r["context"] == (torch.float32, torch.bfloat16, torch.float32)
    kind, text = r["lossy switch"]
    assert kind == "ValueError" and "float64" in text


def test_lossy_policy_is_refused_at_fully_shard():
    kind, text = CELLS.result("nan and context", 2)[0]["lossy at fully_shard"]
    assert kind == "ValueError" and "main_grads_dtype" in text and "allow_lossy_accumulation" in text
