"""GPU: the CUDA kernels bit-exact with torch's casts, and world-1 training with the native NCCL
transport against the torch transport and DDP. Skipped without CUDA or in CPU-only builds; run
on the lent GPU (see benchmarks/gpu_check.sh)."""
import copy

import pytest
import torch

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch, run_on_ranks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not hasattr(_C, "NcclTransport"),
                                 reason="needs a CUDA device and a CUDA build of megatron_fsdp_c")]

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _values(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, 30, (n,), generator=g))
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 65520.0, 1.00390625])
    return x


@pytest.mark.parametrize("offset", [0, 3], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("src", FLOATS, ids=str)
@pytest.mark.parametrize("dst", FLOATS, ids=str)
def test_cuda_cast_bit_exact(dst, src, offset):
    x = _values(1 << 16, seed=FLOATS.index(src) * 4 + FLOATS.index(dst)).to(src).cuda()[offset:]
    expected = x.to(dst)
    out = torch.full_like(expected, 3.0)
    _C.cuda_copy_(out, x)
    torch.cuda.synchronize()
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.uint8), expected[~nan].view(torch.uint8))
    # the CUDA and CPU kernels round identically
    cpu = torch.full_like(expected, 3.0, device="cpu")
    _C.copy_(cpu, x.cpu())
    assert torch.equal(out.cpu()[~nan.cpu()].view(torch.uint8), cpu[~nan.cpu()].view(torch.uint8))


# 1/3 is not a power of two: a fused multiply-add would round out + alpha * v once, not twice
@pytest.mark.parametrize("alpha", [0.25, 1 / 3], ids=["quarter", "third"])
@pytest.mark.parametrize("src", FLOATS, ids=str)
@pytest.mark.parametrize("dst", FLOATS, ids=str)
def test_cuda_accumulate_matches_cpu(dst, src, alpha):
    g = torch.Generator().manual_seed(5)
    a = torch.randn(100_003, generator=g).to(dst)
    b = torch.randn(100_003, generator=g).to(src)
    cpu = a.clone()
    _C.accumulate_(cpu, b, alpha)
    gpu = a.cuda()
    _C.cuda_accumulate_(gpu, b.cuda(), alpha)
    assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_cuda_scale_matches_cpu(dtype):
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(6)).to(dtype)
    cpu = x.clone()
    _C.scale_(cpu, 1 / 3)
    gpu = x.cuda()
    _C.cuda_scale_(gpu, 1 / 3)
    assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8))


@pytest.mark.parametrize("mode", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("src", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_quantize_matches_cpu(mode, src):
    """The wire's bytes and the values read back, bit for bit with the CPU kernels (the benchmark's
    quantize and dequantize, benchmarks/kernels.py)."""
    code, n, block = _C.QUANT_MODES[mode], 100_003, 128
    x = _values(n, seed=9).clamp(-1e30, 1e30).nan_to_num(0.0).to(src)
    wire = torch.zeros(_C.quant_wire_bytes(code, n, block), dtype=torch.uint8)
    _C.quantize_(wire, x, code, block)
    gwire = torch.zeros_like(wire, device="cuda")
    _C.quantize_(gwire, x.cuda(), code, block)
    assert torch.equal(gwire.cpu(), wire)
    back = torch.empty(n, dtype=torch.float32)
    _C.dequantize_(back, wire, code, block)
    gback = torch.empty(n, dtype=torch.float32, device="cuda")
    _C.dequantize_(gback, gwire, code, block)
    assert torch.equal(gback.cpu().view(torch.uint8), back.view(torch.uint8))


@pytest.mark.parametrize("accumulate", [False, True], ids=["copy", "accumulate"])
@pytest.mark.parametrize("dst", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_cuda_pack_matches_cpu(dst, accumulate):
    # a bucket's gradients: mixed dtypes and sizes, aligned and unaligned offsets, one empty
    g = torch.Generator().manual_seed(7)
    sizes = [1, 7, 8, 4096, 100_003, 33, 0, 6144, 5]
    srcs = [torch.randn(n, generator=g).to(FLOATS[i % 3]) for i, n in enumerate(sizes)]
    offsets, total = [], 0
    for i, s in enumerate(srcs):
        total += i % 3  # holes shift the alignment
        offsets.append(total)
        total += s.numel()
    base = torch.randn(total, generator=g).to(dst)
    cpu = base.clone()
    for s, o in zip(srcs, offsets):
        (_C.accumulate_ if accumulate else _C.copy_)(cpu[o:o + s.numel()], s, 0.5)
    gpu = base.cuda()
    _C.cuda_pack_(gpu, [s.cuda() for s in srcs], offsets, 0.5, accumulate)
    assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8))
    with pytest.raises(ValueError, match="does not fit"):
        _C.cuda_pack_(gpu, [srcs[4].cuda()], [total - 10])


def test_cuda_pack_many_items():
    # one item per (parameter, rank) piece: more items than one launch's table (1280) carries
    g = torch.Generator().manual_seed(9)
    sizes = [i % 7 for i in range(5000)]
    srcs = [torch.randn(n, generator=g) for n in sizes]
    offsets = [sum(sizes[:i]) + i for i in range(len(sizes))]
    base = torch.randn(offsets[-1] + sizes[-1] + 3, generator=g)
    cpu = base.clone()
    for s, o in zip(srcs, offsets):
        _C.accumulate_(cpu[o:o + s.numel()], s, 1 / 3)
    gpu = base.cuda()
    _C.cuda_pack_(gpu, [s.cuda() for s in srcs], offsets, 1 / 3, True)
    assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8))


def world1(rank, world, dtype):
    torch.cuda.set_device(0)
    cfg = GPTConfig(vocab=256, seq=64, d=128, heads=4, layers=3)
    out = {}
    for name, kwargs in (("nccl", dict(transport="nccl")), ("torch", dict(transport="torch"))):
        for strategy in range(4):
            torch.manual_seed(0)
            model = GPT(cfg).cuda().to(dtype)
            ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
            policy = mf.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
            fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                       single_rank_collectives=True, mixed_precision_policy=policy, **kwargs)
            losses, ref_losses = [], []
            for step in range(5):
                x, y = batch(cfg, 4, seed=step, device="cuda")
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                    ref_loss = ref(x, y)
                loss = fsdp(x, y)
                loss.backward()
                ref_loss.backward()
                opt.step()
                opt.zero_grad()
                ref_opt.step()
                ref_opt.zero_grad()
                losses.append(loss.item())
                ref_losses.append(ref_loss.item())
            out[(name, strategy)] = (losses, ref_losses, fsdp.comm_stats())
            mf.close(fsdp)  # the native transport's collective end (finalize + destroy, not abort)
            if name == "nccl":
                assert fsdp.dist_ctx.transport.failure is None
    return out


def test_world1_nccl_matches_torch_transport_and_ddp_fp32():
    res = run_on_ranks(world1, 1, torch.float32, timeout_s=600)[0]
    for strategy in range(4):
        nccl, ref, stats = res[("nccl", strategy)]
        torch_t = res[("torch", strategy)][0]
        assert stats["reduce_scatters"] + stats["all_reduces"] > 0, "the NCCL path really ran"
        assert nccl == torch_t, (strategy, nccl, torch_t)
        torch.testing.assert_close(torch.tensor(nccl), torch.tensor(ref), rtol=1e-5, atol=1e-6)


def test_world1_nccl_bf16_compute_fp32_main():
    res = run_on_ranks(world1, 1, torch.bfloat16, timeout_s=600)[0]
    for strategy in range(4):
        nccl, ref, _ = res[("nccl", strategy)]
        # DDP runs the bf16 model under autocast with fp32 Adam on bf16 weights; both compute in bf16:
        # one bf16 ulp of the loss (see tests/test_mixed_precision.py) over 5 steps.
        torch.testing.assert_close(torch.tensor(nccl), torch.tensor(ref), rtol=2 ** -7, atol=0)


def offload_world1(rank, world):
    """CPU offload on a GPU ([Note: offloaded buckets] in csrc/comm/buffers.c), world 1 with real
    collectives. The Megatron-style API: every strategy with optimizer_cpu_offload on (FusedAdamW on
    the host shards, stepping inside the backward where the engine allows) against the same model
    off (torch's AdamW on the device). The per-module API: ZeRO-3 with CPUOffloadPolicy and
    FusedAdamW stepping inside the backward against torch's FSDP2 with CPUOffloadPolicy and torch's
    AdamW on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard as torch_fully_shard
    torch.cuda.set_device(0)
    cfg = GPTConfig(vocab=256, seq=64, d=128, heads=4, layers=3)
    out = {}

    def train(model, opt, steppers):
        losses, during = [], 0
        for step in range(5):
            loss = model(*batch(cfg, 4, seed=step, device="cuda"))
            loss.backward()
            during += sum(s.counts["during"] + s.counts["at_end"] for s in steppers)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        torch.cuda.synchronize()
        return losses, during

    for strategy in (0, 1, 2, 3):
        for offload in (False, True):
            torch.manual_seed(0)
            model = GPT(cfg).cuda()
            opt = mf.FusedAdamW(model.parameters(), lr=1e-3, step_in_backward=True) if offload else \
                torch.optim.AdamW(model.parameters(), lr=1e-3)
            fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                       single_rank_collectives=True, transport="nccl", optimizer_cpu_offload=offload)
            losses, stepped = train(fsdp, opt, [o.hooks.backward_steps for o in fsdp.owners()])
            out[(strategy, offload)] = (losses, fsdp.memory_report(opt, locations=True)["locations"],
                                        [bool(s["offload"]) for s in fsdp.param_buffer.specs], stepped)
            mf.close(fsdp)
    from torch.distributed.device_mesh import DeviceMesh
    mesh = DeviceMesh.from_group(torch.distributed.new_group([0], backend="nccl"), "cuda")  # (the test group: gloo)
    for ours in (True, False):
        torch.manual_seed(0)
        model = GPT(cfg).cuda()
        shard = mf.fully_shard if ours else torch_fully_shard
        for block in model.blocks:
            shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
        shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=True))
        opt = mf.FusedAdamW(model.parameters(), lr=1e-3, step_in_backward=True) if ours else \
            torch.optim.AdamW(model.parameters(), lr=1e-3)
        where = {p._local_tensor.device.type for p in model.parameters()}
        losses, stepped = train(model, opt, [model._mfsdp_group.owner.hooks.backward_steps] if ours else [])
        out[("per_module", ours)] = (losses, where, stepped)
    return out


def test_world1_offload():
    res = run_on_ranks(offload_world1, 1, timeout_s=600)[0]
    for strategy in range(4):
        (ours, where, offloaded, stepped), (ref, ref_where, _, _) = res[(strategy, True)], res[(strategy, False)]
        assert all(offloaded), offloaded
        assert where["main_weights"] == ["cpu"] and where["main_grads"] == ["cpu"], where
        assert where["optimizer_state"] == ["cpu"] and ref_where["main_weights"] == ["cuda:0"], (where, ref_where)
        if strategy >= 2:  # ZeRO-2/3: buckets stepped inside the backward, after wait_grads
            assert stepped > 0, (strategy, stepped)
        # the same reductions; FusedAdamW (host, IEEE sqrt) against torch's CUDA AdamW: fp32 rounding apart
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), rtol=1e-5, atol=1e-6, msg=str(strategy))
    (ours, where, stepped), (theirs, their_where, _) = res[("per_module", True)], res[("per_module", False)]
    assert where == their_where == {"cpu"}, (where, their_where)
    assert stepped > 0
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=1e-6)
