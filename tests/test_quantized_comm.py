"""Quantized communication ([Note: quantized communication] in csrc/comm/wire.c) against DDP, in
float64, as rank_grid cells: the tiny test GPT, a few AdamW steps per configuration.

[Note: quantization error bound]
Every step is checked element by element against the error the wire format allows ([Note:
quantized wire format] in csrc/core/mfsdp_quant.h). For an element x of a block whose float32
absmax is a, with scale s = max(a / qmax, 2^-126) (qmax: int8 127, int4 7, fp8_e4m3 448):
    int8, int4:  |q(x) - x| <= s * (1/2 + 2^-17) + 2^-24 |x|
    fp8_e4m3:    |q(x) - x| <= |x| / 16 + s * 2^-10 * (1 + 2^-16) + 2^-24 |x|
(the last term: a float64 value is read as float32 before it is quantized). Blocks are runs of B
elements of one rank's piece, its shard in the bucket's rank-major layout (crossing parameter
boundaries), so the test rebuilds every rank's pieces from the bucket plan.
- Weights: the compute weights a forward sees (captured by pre-hooks on every module) must be
  within q's bound of the main weights (full_parameters()), the blocks taken over each rank's
  shard of them; exactly equal where nothing is gathered.
- Gradients: each rank's local gradients at those compute weights are recomputed on a plain copy
  of the module, all-gathered, and summed exactly (pre-scaled by 1/W): the engine's reduced
  gradient must be within sum over ranks of q's bound on that rank's pre-scaled piece (a local sum
  over microbatches for no_shard/ZeRO-1, which reduce once a step; one bound per microbatch for
  ZeRO-2/3, which reduce every backward: the errors add), plus float64 summation slack.
DDP, trained alongside from the same weights on the same data with exact collectives, gives the
end-to-end measure: the losses' and final weights' deviation are reported (test output and the
`measured` field) and sanity-bounded (loss within 2% of DDP's: a bound of the experiment, not of
the format). Bad input gets clear errors (tests at the end).
"""
import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid

CFG = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=2)
STEPS = 3
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "int4": 7.0}
CELLS = rank_grid.Cells(__name__)

# (name, strategy, weights, grads, block, microbatches, per-module API)
CONFIGS = [
    ("zero3 int8 weights int8 grads", 3, "int8", "int8", 128, 1, False),
    ("zero3 fp8 weights int4 grads x2", 3, "fp8_e4m3", "int4", 32, 2, False),
    ("zero3 int4 weights block 50", 3, "int4", None, 50, 1, False),
    ("zero2 int8 weights fp8 grads", 2, "int8", "fp8_e4m3", 64, 1, False),
    ("zero1 int8 weights int4 grads x2", 1, "int8", "int4", 128, 2, False),
    ("no_shard int8 grads", 0, None, "int8", 100, 1, False),
    ("per-module zero3 int8 weights int4 grads", 3, "int8", "int4", 128, 1, True),
]


def q_bound(x: torch.Tensor, mode: str, block: int) -> torch.Tensor:
    """Per-element bound of |dequantize(quantize(x)) - x| for one piece x (float64), see [Note:
    quantization error bound]."""
    n = x.numel()
    x32 = x.to(torch.float32).to(torch.float64)
    nb = max(1, math.ceil(n / block))
    padded = torch.zeros(nb * block, dtype=torch.float64)
    padded[:n] = x32.abs()
    a = padded.view(nb, block).amax(dim=1)
    s = torch.clamp(a / QMAX[mode] * (1 + 2.0 ** -23), min=2.0 ** -126).repeat_interleave(block)[:n]
    if mode == "fp8_e4m3":
        e = x32.abs() / 16 + s * 2.0 ** -10 * (1 + 2.0 ** -16)
    else:
        e = s * (0.5 + 2.0 ** -17)
    return e + x.abs() * 2.0 ** -24


class Layout:
    """Where each parameter's elements sit in its bucket's rank-major pieces (the plan)."""

    def __init__(self, pb):
        self.pb = pb
        self.records = {r.name: r for r in pb.records}

    def owner_pos(self, r):
        bp = self.pb.plan[r.bucket]
        piece = bp["pieces"][r.item]
        j = torch.arange(math.prod(r.shape))
        owner = torch.div(j, piece, rounding_mode="floor") if bp["shards"] > 1 else torch.zeros_like(j)
        pos = bp["shard_offsets"][r.item] + j - owner * (piece if bp["shards"] > 1 else 0)
        return owner, pos

    def pieces(self, b: int, values: dict) -> torch.Tensor:
        """(shards, shard_size): the bucket's rank-major pieces of `values` (name -> tensor)."""
        bp = self.pb.plan[b]
        out = torch.zeros(bp["shards"], bp["shard_size"], dtype=torch.float64)
        for r in self.pb.records:
            if r.bucket == b and r.name in values:
                owner, pos = self.owner_pos(r)
                out[owner, pos] = values[r.name].reshape(-1).to(torch.float64)
        return out

    def back(self, b: int, per_piece: torch.Tensor) -> dict:
        """name -> per-element tensor of a (shards, shard_size) result."""
        out = {}
        for r in self.pb.records:
            if r.bucket == b:
                owner, pos = self.owner_pos(r)
                out[r.name] = per_piece[owner, pos].view(r.shape)
        return out


def weight_bounds(layout: Layout, main: dict, quant) -> dict:
    """name -> bound on |compute - main| (0 where the weights are not gathered, or plain)."""
    out = {}
    for b, spec in enumerate(layout.pb.specs):
        gathered = (spec["weights_sharded"] or spec["weights_regather"]) and spec.get("wire_weights", 0)
        pieces = layout.pieces(b, main)
        if gathered:
            bound = torch.stack([q_bound(p, quant.weights, quant.block) for p in pieces])
        else:
            bound = torch.zeros_like(pieces)
        out.update(layout.back(b, bound))
    return out


def grad_bounds(layout: Layout, local_sums: list, quant, world: int) -> dict:
    """name -> bound on |engine's reduced gradient - exact sum|, for one reduction of the
    pre-scaled local gradients `local_sums` (one dict per rank)."""
    out = {}
    for b, spec in enumerate(layout.pb.specs):
        if spec["grad_mode"] == mf._C.GRAD_NONE:
            continue
        total = torch.zeros(layout.pb.plan[b]["shards"], layout.pb.plan[b]["shard_size"], dtype=torch.float64)
        for q in range(world):
            pieces = layout.pieces(b, {k: v / world for k, v in local_sums[q].items()})
            if not spec.get("wire_grads", 0) or world == 1:
                continue
            if spec["grad_mode"] == mf._C.GRAD_ALL_REDUCE:  # the exchange cuts the buffer in W blocks
                full = pieces.reshape(-1)
                e = math.ceil(full.numel() / world)
                padded = torch.zeros(world * e, dtype=torch.float64)
                padded[:full.numel()] = full
                bound = torch.cat([q_bound(row, quant.grads, quant.block) for row in padded.view(world, e)])
                total += bound[:full.numel()].view_as(pieces)
            else:
                total += torch.stack([q_bound(p, quant.grads, quant.block) for p in pieces])
        out.update(layout.back(b, total))
    return out


def all_gather_dict(d: dict, world: int) -> list:
    names = sorted(d)
    flat = torch.cat([d[n].reshape(-1) for n in names])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    out = []
    for p in parts:
        rec, at = {}, 0
        for n in names:
            rec[n] = p[at:at + d[n].numel()].view_as(d[n])
            at += d[n].numel()
        out.append(rec)
    return out


def run_config(rank, world, cfg_row):
    name, strategy, wmode, gmode, block, micro, per_module = cfg_row
    quant = mf.QuantizedCommPolicy(weights=wmode, grads=gmode, block=block)
    torch.manual_seed(0)
    model = GPT(CFG).double()
    plain = copy.deepcopy(model)  # the reference of the local gradients
    ddp_model = copy.deepcopy(model)
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2, weight_decay=0.1)
    if per_module:
        from megatron_fsdp_c.per_module import fully_shard
        for block_mod in model.blocks:
            fully_shard(block_mod, quantized_comm_policy=quant, zero_dp_strategy=strategy)
        fsdp = fully_shard(model, quantized_comm_policy=quant, zero_dp_strategy=strategy)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2, weight_decay=0.1)
        root = fsdp
        owner = lambda: fsdp._mfsdp_group.owner  # noqa: E731 - built by the first forward
        full_params = lambda: {n: p.full_tensor() for n, p in fsdp.named_parameters()}  # noqa: E731
        reduced_grads = lambda: {n: p.grad.full_tensor() for n, p in fsdp.named_parameters()}  # noqa: E731
        no_sync = lambda quiet: torch.enable_grad()  # noqa: E731 - one microbatch
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                   quantized_comm_policy=quant)
        root = fsdp.module
        owner = lambda: fsdp  # noqa: E731
        full_params = fsdp.full_parameters

        def reduced_grads():
            fsdp.finish_grad_sync()
            return fsdp.full_grads()
        no_sync = lambda quiet: fsdp.no_sync() if quiet else torch.enable_grad()  # noqa: E731
    captured = {}

    def capture(mod, prefix):
        for attr, p in mod._parameters.items():
            if p is not None:
                captured[f"{prefix}{attr}"] = p.detach().clone()

    for mname, mod in root.named_modules():
        if mod._parameters:
            mod.register_forward_pre_hook(lambda m, a, prefix=(mname + "." if mname else ""): capture(m, prefix))

    measured = {"weight_err": 0.0, "weight_bound": 0.0, "grad_err": 0.0, "grad_bound": 0.0, "losses": [],
                "ddp_losses": [], "weight_violations": 0, "grad_violations": 0, "ranks_differ": 0}
    for step in range(STEPS):
        main = {k: v.detach().clone() for k, v in full_params().items()}
        exact = {k: torch.zeros_like(v) for k, v in main.items()}
        magnitude = {k: torch.zeros_like(v) for k, v in main.items()}  # sum of |terms|: the float64 slack
        gbound = {k: torch.zeros_like(v) for k, v in main.items()}
        local_sum = {k: torch.zeros_like(v) for k, v in main.items()}
        for m in range(micro):
            x, y = batch(CFG, 2, seed=10_000 * step + 100 * m + rank)
            quiet = m < micro - 1
            captured.clear()
            with no_sync(quiet):
                loss = root(x, y) if per_module else fsdp(x, y)
                layout = Layout(owner().param_buffer)
                wb = weight_bounds(layout, main, quant)
                same = all_gather_dict(captured, world)  # every rank computes with the same full weights
                measured["ranks_differ"] += sum(int(not torch.equal(e[k], captured[k])) for e in same for k in captured)
                for k, c in captured.items():  # the compute weights of this forward against the main weights
                    err = (c - main[k]).abs()
                    measured["weight_err"] = max(measured["weight_err"], float(err.max()))
                    measured["weight_bound"] = max(measured["weight_bound"], float(wb[k].max()))
                    measured["weight_violations"] += int((err > wb[k]).sum())
                with torch.no_grad():  # this rank's local gradient at those weights, on a plain copy
                    for k, p in plain.named_parameters():
                        p.copy_(captured[k])
                plain.zero_grad(set_to_none=True)
                plain(x, y).backward()
                g = {k: p.grad.detach().clone() for k, p in plain.named_parameters()}
                loss.backward()
            everyone = all_gather_dict(g, world)
            for k in exact:
                exact[k] += sum(e[k] for e in everyone) / world
                magnitude[k] += sum(e[k].abs() for e in everyone) / world
                local_sum[k] += g[k]
            if strategy >= 2 and quant.grads:  # reduced every backward: one bound per microbatch
                for k, v in grad_bounds(layout, everyone, quant, world).items():
                    gbound[k] += v
            measured["losses"].append(loss.item())
            with ddp.no_sync() if quiet else torch.enable_grad():
                ddp_loss = ddp(x, y)
                ddp_loss.backward()
            measured["ddp_losses"].append(ddp_loss.item())
        if strategy < 2 and quant.grads:  # the local sums over microbatches, reduced once
            for k, v in grad_bounds(layout, all_gather_dict(local_sum, world), quant, world).items():
                gbound[k] += v
        for k, gr in reduced_grads().items():
            err = (gr - exact[k]).abs()
            measured["grad_err"] = max(measured["grad_err"], float(err.max()))
            measured["grad_bound"] = max(measured["grad_bound"], float(gbound[k].max()))
            measured["grad_violations"] += int((err > gbound[k] + 1e-13 * magnitude[k] + 1e-300).sum())
        opt.step()
        opt.zero_grad()
        ddp_opt.step()
        ddp_opt.zero_grad()
    final = full_params()
    ref = dict(ddp_model.named_parameters())
    measured["param_dev"] = max(float((final[k].detach() - ref[k].detach()).abs().max()) for k in final)
    measured["stats"] = owner().comm_stats()
    return measured


for _row in CONFIGS:
    CELLS.add(_row[0], run_config, _row, worlds=(1, 2, 4), tests=["test_quantized_against_ddp"], match={"row": _row})


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("row", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_quantized_against_ddp(world, row, capsys):
    results = CELLS.result(row[0], world)
    name, strategy, wmode, gmode = row[:4]
    for rank, m in enumerate(results):
        with capsys.disabled():
            if rank == 0:
                print(f"\n[world {world}] {name}: weights max err {m['weight_err']:.3e} (bound {m['weight_bound']:.3e}), "
                      f"grads max err {m['grad_err']:.3e} (bound {m['grad_bound']:.3e}), "
                      f"loss dev vs DDP {max(abs(a - b) for a, b in zip(m['losses'], m['ddp_losses'])):.3e}, "
                      f"param dev {m['param_dev']:.3e}")
        assert m["ranks_differ"] == 0, (name, rank, m)
        assert m["weight_violations"] == 0, (name, rank, m)
        assert m["grad_violations"] == 0, (name, rank, m)
        stats = m["stats"]
        quantized_weights = wmode is not None and world > 1 and strategy > 0
        quantized_grads = gmode is not None and world > 1
        assert (stats["quantized_all_gathers"] > 0) == quantized_weights, stats
        assert (stats["all_gathers"] == 0) or not quantized_weights, stats
        reductions = stats["quantized_reduce_scatters"] + stats["quantized_all_reduces"]
        assert (reductions > 0) == quantized_grads, stats
        if quantized_grads:  # nothing reduced plainly (the engine's own buckets are all quantized)
            assert stats["reduce_scatters"] + stats["all_reduces"] == 0, stats
        if world == 1:  # nothing crosses a wire: exact
            assert m["weight_err"] == 0.0 and m["grad_err"] < 1e-12, m
        if quantized_weights:  # the errors are real, and within the bound
            assert 0 < m["weight_err"] <= m["weight_bound"], m
        for a, b in zip(m["losses"], m["ddp_losses"]):
            assert abs(a - b) <= 0.02 * abs(b), (name, m["losses"], m["ddp_losses"])


@CELLS.cell("hfsdp", worlds=(4,), tests=["test_hfsdp_every_wire_quantized"])
def hfsdp_run(rank, world):
    """HFSDP 2x2 with every wire quantized, the replicas' gather too: the compute weights are
    quantized twice (across replicas, then inside the replica), so only the invariants and the
    end-to-end deviation from DDP are checked here; the exact values are checked in C
    (test_hfsdp_quantized in csrc/tests/core/test_replicas.c)."""
    torch.manual_seed(0)
    model = GPT(CFG).double()
    ddp_model = copy.deepcopy(model)
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mesh = rank_grid.device_mesh("cpu", (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    quant = mf.QuantizedCommPolicy(weights="int8", grads="int8", outer_weights="int8", block=64)
    fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], device_mesh=mesh, dp_shard_dim="dp_shard",
                               dp_outer_dim="dp_outer", hybrid_fsdp_group=dist.group.WORLD,
                               outer_dp_sharding_strategy="optim", quantized_comm_policy=quant)
    captured = {}
    for mname, mod in fsdp.module.named_modules():
        if mod._parameters:
            mod.register_forward_pre_hook(lambda m, a, prefix=(mname + "." if mname else ""): captured.update(
                {f"{prefix}{k}": p.detach().clone() for k, p in m._parameters.items() if p is not None}))
    out = {"losses": [], "ddp_losses": [], "ranks_differ": 0}
    for step in range(STEPS):
        x, y = batch(CFG, 2, seed=10_000 * step + rank)
        captured.clear()
        loss = fsdp(x, y)
        loss.backward()
        out["ranks_differ"] += sum(int(not torch.equal(e[k], captured[k])) for e in all_gather_dict(captured, world)
                                   for k in captured)
        opt.step()
        opt.zero_grad()
        ddp_loss = ddp(x, y)
        ddp_loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        out["losses"].append(loss.item())
        out["ddp_losses"].append(ddp_loss.item())
    out["stats"] = fsdp.comm_stats()
    return out


def test_hfsdp_every_wire_quantized():
    for rank, m in enumerate(CELLS.result("hfsdp", 4)):
        assert m["ranks_differ"] == 0, (rank, m)
        s = m["stats"]
        assert s["outer_quantized_all_gathers"] > 0 and s["outer_all_gathers"] == 0, s
        assert s["quantized_all_gathers"] > 0 and s["all_gathers"] == 0, s
        assert s["quantized_reduce_scatters"] > 0 and s["reduce_scatters"] == 0, s
        assert s["outer_reduce_scatters"] > 0, s  # the reduction across replicas stays in the gradient dtype
        for a, b in zip(m["losses"], m["ddp_losses"]):
            assert abs(a - b) <= 0.02 * abs(b), m


# ---- bad input ----

def test_policy_refusals():
    with pytest.raises(ValueError, match="not a quantization mode"):
        mf.QuantizedCommPolicy(weights="int3")
    with pytest.raises(ValueError, match="not a quantization mode"):
        mf.QuantizedCommPolicy(grads="bf16")
    with pytest.raises(ValueError, match="int4 needs an even block"):
        mf.QuantizedCommPolicy(grads="int4", block=33)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="positive int"):
            mf.QuantizedCommPolicy(weights="int8", block=bad)
    assert mf.QuantizedCommPolicy(weights="int8", block=33).block == 33  # odd blocks are fine for int8


@CELLS.cell("errors", worlds=(2,), tests=["test_errors"])
def errors_on_ranks(rank, world):
    from megatron_fsdp_c.per_module import fully_shard
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[key] = f"{type(e).__name__}: {e}"

    model = lambda dtype=torch.float32: GPT(CFG).to(dtype)  # noqa: E731
    attempt("bf16 grads", lambda: mf.fully_shard(model(torch.bfloat16), fsdp_unit_modules=[Block],
                                                 quantized_comm_policy=mf.QuantizedCommPolicy(grads="int8")))
    attempt("outer without hfsdp", lambda: mf.fully_shard(
        model(), fsdp_unit_modules=[Block], quantized_comm_policy=mf.QuantizedCommPolicy(outer_weights="int8")))
    attempt("comm dtype conflict", lambda: mf.fully_shard(
        model(), fsdp_unit_modules=[Block], quantized_comm_policy=mf.QuantizedCommPolicy(grads="int8"),
        mixed_precision_policy=mf.MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)))
    attempt("not a policy", lambda: mf.fully_shard(model(), fsdp_unit_modules=[Block],
                                                   quantized_comm_policy={"weights": "int8"}))
    attempt("per-module outer", lambda: fully_shard(model(), quantized_comm_policy=mf.QuantizedCommPolicy(
        outer_weights="int8")))
    m = mf.fully_shard(model(), fsdp_unit_modules=[Block],
                       quantized_comm_policy=mf.QuantizedCommPolicy(grads="int8"))[0]
    attempt("comm dtype change", lambda: m.reset_mixed_precision_policy(
        mf.MixedPrecisionPolicy(grad_comm_dtype=torch.bfloat16)))
    return out


def test_errors():
    out = CELLS.result("errors", 2)[0]
    assert "main gradient dtype, which is torch.bfloat16" in out["bf16 grads"], out
    assert "only HFSDP has" in out["outer without hfsdp"], out
    assert "both say how gradients cross the wire" in out["comm dtype conflict"], out
    assert out["not a policy"].startswith("TypeError: quantized_comm_policy must be"), out
    assert "per-module API does not have" in out["per-module outer"], out
    assert "cannot change to bfloat16" in out["comm dtype change"], out


@pytest.mark.parametrize("mode", ["int8", "fp8_e4m3", "int4"])
def test_kernels_on_tensors(mode):
    """_C.quantize_ / dequantize_ (what benchmarks/kernels.py times on a GPU): one piece through the
    wire and back within the format's bound, an accumulate adds alpha times the same values, and a
    wire of the wrong size or dtype is refused."""
    code, n, block = _C.QUANT_MODES[mode], 1000, 128
    x = torch.randn(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4
    wire = torch.zeros(_C.quant_wire_bytes(code, n, block), dtype=torch.uint8)
    _C.quantize_(wire, x.float(), code, block)
    back = torch.empty(n, dtype=torch.float64)
    _C.dequantize_(back, wire, code, block)
    assert torch.all((back - x).abs() <= q_bound(x, mode, block))
    acc = torch.ones(n, dtype=torch.float64)
    _C.dequantize_(acc, wire, code, block, 0.5, True)
    assert torch.equal(acc, 1 + 0.5 * back)
    with pytest.raises(ValueError, match="uint8 tensor of at least"):
        _C.quantize_(wire[:-1], x.float(), code, block)
    with pytest.raises(ValueError, match="uint8 tensor of at least"):
        _C.quantize_(wire.view(torch.float32) if wire.numel() % 4 == 0 else wire.float(), x.float(), code, block)
