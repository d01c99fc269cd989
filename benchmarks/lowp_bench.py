"""Low-precision training with torchao under torchrun on CPU ranks ([Note: extension parameters] in
megatron_fsdp_c/_extensions.py): one transformer-like MLP stack (blocks of LayerNorm + two linears),
its blocks' linears converted to torchao's float8 training with the fp8 all-gather
(`Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)`, scales precomputed after
each step as torchtitan does), sharded per block and at the root with megatron_fsdp_c's per-module
fully_shard and with torch's FSDP2, one after the other in this process on the same data (AdamW);
the float8 model on megatron_fsdp_c's Megatron-style API (ZeRO-3, the blocks as units); and, for
scale, the same model unconverted with a bf16 compute policy on both. Rank 0 writes a
markdown table: median step time, all-gathered bytes per step and rank (ours: the engine's
counters; FSDP2: the outputs of its all-gather calls, counted by a wrapper), and the
final loss (ours and FSDP2 agree bit for bit; the bf16 run is another computation).

    torchrun --nproc_per_node 2 benchmarks/lowp_bench.py --steps 10 --out bench_out/lowp.md
"""
import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

D, LAYERS, ROWS = 512, 4, 16


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build(float8: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, D), *[Block(D) for _ in range(LAYERS)], nn.Linear(D, 64))
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True),
                                   module_filter_fn=lambda mod, fqn: fqn not in ("0", str(LAYERS + 1)))
    return model


class GatherCounter:
    """Bytes of every all-gather output of torch.distributed's single-tensor all-gathers while
    installed (FSDP2's: all_gather_single from torch 2.13, all_gather_into_tensor before)."""
    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        self.bytes = 0
        self.orig = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self):
        for name, fn in self.orig.items():
            def counted(out, *args, _fn=fn, **kwargs):
                self.bytes += out.numel() * out.element_size()
                return _fn(out, *args, **kwargs)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.orig.items():
            setattr(dist, name, fn)


def run(label, impl, float8, mesh, rank, world, steps):
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy  # both APIs take torch's policy
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from megatron_fsdp_c.per_module import fully_shard
    kw = {} if float8 else dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    model = build(float8)
    if impl == "megatron":  # the Megatron-style API: one call, the blocks as units, ZeRO-3
        import megatron_fsdp_c
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = megatron_fsdp_c.fully_shard(model, opt, device_mesh=mesh, fsdp_unit_modules=[Block],
                                                 zero_dp_strategy="optim_grads_params")
    else:
        for block in model[1:LAYERS + 1]:
            fully_shard(block, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, loss = [], None
    with GatherCounter() as counter:
        for step in range(steps + 1):  # the first step (lazy init, first gathers) is not timed
            x = torch.randn(ROWS * world, 64, generator=torch.Generator().manual_seed(step))[rank * ROWS:(rank + 1) * ROWS]
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if float8:
                precompute_float8_dynamic_scale_for_fsdp(model)
            dist.barrier()
            if step:
                times.append(time.perf_counter() - t0)
            if step == 0:
                counter.bytes = 0
                first = gathered_ours(model, impl) if impl != "torch" else 0
    per_step = (gathered_ours(model, impl) - first if impl != "torch" else counter.bytes) / steps
    return dict(label=label, ms=1e3 * statistics.median(times), bytes=per_step, loss=loss.item())


def gathered_ours(model, impl) -> int:
    owner = model if impl == "megatron" else model._mfsdp_group.owner
    return owner.param_buffer.engine.stats()["all_gather_bytes"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = [run("megatron_fsdp_c, float8 (fp8 gather)", "ours", True, mesh, rank, world, args.steps),
            run("torch FSDP2, float8 (fp8 gather)", "torch", True, mesh, rank, world, args.steps),
            run("megatron_fsdp_c Megatron-style API, float8 (fp8 gather)", "megatron", True, mesh, rank, world,
                args.steps),
            run("megatron_fsdp_c, bf16 compute (no float8)", "ours", False, mesh, rank, world, args.steps),
            run("torch FSDP2, bf16 compute (no float8)", "torch", False, mesh, rank, world, args.steps)]
    if rank == 0:
        params = sum(p.numel() for p in build(False).parameters())
        base = rows[1]
        lines = [f"#### Low-precision training, {world} ranks (cpu, {LAYERS} blocks of d={D}, {params / 1e6:.2f}M "
                 f"params, {ROWS} rows a rank, median of {args.steps} steps)", "",
                 "| run | step (ms) | x FSDP2 float8 | all-gathered MB / step / rank | x FSDP2 float8 | final loss |",
                 "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['label']} | {r['ms']:.1f} | {r['ms'] / base['ms']:.2f} | {r['bytes'] / 1e6:.3f} | "
                         f"{r['bytes'] / base['bytes']:.2f} | {r['loss']:.6f} |")
        text = "\n".join(lines) + "\n"
        print(text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
