"""The one-GPU training step, every framework in one process (the GPU check's stage 3): DDP, torch's
FSDP2, Megatron-FSDP (the `megatron_fsdp` package, where it is importable) and both megatron_fsdp_c
APIs, on the same GPT and the same batches, one after another, each with its own model built from
the same seed. bf16 compute with fp32 main weights and gradients, AdamW:
- DDP: an fp32 model under bf16 autocast;
- FSDP2 and our per-module API: torch's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32);
- Megatron-FSDP and our Megatron-style API: a bf16 model, MixedPrecisionPolicy(main_params_dtype=
  fp32, main_grads_dtype=fp32), ZeRO-3, one unit per block.
World 1 on NCCL. Ours issues every collective even at one rank (single_rank_collectives, the
native NCCL transport): the step measures the communication path, not an engine that skips it.
Per configuration: the median of the timed steps after warm-up, and the peak of
torch.cuda.max_memory_allocated during them, less what was allocated before the configuration
was built (left_before_gib: what earlier configurations left, reported beside it).

    python benchmarks/gpu_train.py [--models gpt-small,gpt-large] [--steps 10] [--json out.json]
    python benchmarks/gpu_train.py --smoke     # the CPU: every framework's code path, 2 steps, tiny

Each configuration runs under the stage's deadline (--deadline, seconds from start): one that
would start past it is skipped and reported, so the stage ends with a table.

CPU offload (the GPU check's offload stage, `--frameworks` from OFFLOAD): main weights, gradients
and AdamW state in pinned host memory, the same bf16/fp32 policy, the per-module API on both sides:
- fsdp2_offload: torch's FSDP2 with CPUOffloadPolicy() and torch's fused CPU AdamW, stepping after
  the backward (as FSDP2 does);
- ours_offload: ours with CPUOffloadPolicy() and FusedAdamW(step_in_backward=True), each bucket
  stepped on the host as its gradients land ([Note: stepping in backward]);
- ours_offload_after: the same with step_in_backward=False.
For these the host step is timed apart (opt_ms: optimizer.step() after the backward and a device
sync), and hidden = 1 - ours_offload's opt_ms / ours_offload_after's: the share of the host step
the backward hid.
"""
import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_fsdp_c as mfsdp  # noqa: E402
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch  # noqa: E402
from bench_worker import MODELS  # noqa: E402

FRAMEWORKS = ["ddp", "fsdp2", "megatron_fsdp", "ours", "ours_per_module"]
OFFLOAD = ["fsdp2_offload", "ours_offload", "ours_offload_after"]
SMOKE = dict(cfg=GPTConfig(vocab=128, seq=16, d=32, heads=2, layers=2), batch=2)


def build(framework, spec, device):
    """(model to call, optimizer, autocast or None, closer, parameters) for one framework."""
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs: a 1B model's init on the host takes seconds
        model = GPT(spec["cfg"])
    n_params = sum(p.numel() for p in model.parameters())
    bf16 = torch.bfloat16
    autocast, close = None, (lambda: None)
    if framework == "ddp":
        runner = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(runner.parameters(), lr=1e-4)
        autocast = torch.autocast(device.type, dtype=bf16)
    elif framework in ("fsdp2", "ours_per_module") or framework in OFFLOAD:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
        if framework.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard
        else:
            from megatron_fsdp_c.per_module import fully_shard
        policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if framework in OFFLOAD else OffloadPolicy()
        for m in model.modules():
            if isinstance(m, Block):
                fully_shard(m, mp_policy=policy, offload_policy=offload)
        runner = fully_shard(model, mp_policy=policy, offload_policy=offload)
        if framework == "fsdp2_offload":
            opt = torch.optim.AdamW(runner.parameters(), lr=1e-4, fused=True)
        elif framework in OFFLOAD:
            opt = mfsdp.FusedAdamW(runner.parameters(), lr=1e-4, step_in_backward=framework == "ours_offload")
        else:
            opt = torch.optim.AdamW(runner.parameters(), lr=1e-4)
        if not framework.startswith("fsdp2"):
            close = lambda: mfsdp.close(runner)  # noqa: E731
    elif framework == "megatron_fsdp":
        import megatron_fsdp
        model = model.to(bf16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runner, opt = megatron_fsdp.fully_shard(
            model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=3, device=device,
            mixed_precision_policy=megatron_fsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                                      main_grads_dtype=torch.float32))
    else:  # ours, the Megatron-style API
        model = model.to(bf16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cuda = device.type == "cuda"
        runner, opt = mfsdp.fully_shard(
            model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=3,
            mixed_precision_policy=mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                              main_grads_dtype=torch.float32),
            transport="nccl" if cuda else "auto", single_rank_collectives=cuda)
        close = lambda: mfsdp.close(runner)  # noqa: E731
    return runner, opt, autocast, close, n_params


def run(framework, model_name, spec, device, warmup, steps):
    cuda = device.type == "cuda"
    # what an earlier configuration may have left allocated (a framework's caches): not this one's
    base = torch.cuda.memory_allocated() if cuda else 0
    runner, opt, autocast, close, n_params = build(framework, spec, device)

    opt_times = []

    def step(i):
        x, y = batch(spec["cfg"], spec["batch"], seed=1000 * i, device=device)
        with autocast if autocast is not None else contextlib.nullcontext():
            loss = runner(x, y)
        loss.backward()
        if framework in OFFLOAD:  # the host step apart: what is left of it once the backward ended
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            opt_times.append(time.perf_counter() - t0)
        else:
            opt.step()
        opt.zero_grad()
        return loss

    for i in range(warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        loss = step(warmup + i)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    row = dict(framework=framework, model=model_name, params=n_params, step_ms=1e3 * statistics.median(times), steps=steps,
               peak_gib=(torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None,
               left_before_gib=base / 2**30, last_loss=losses[-1])
    if opt_times:
        row["opt_ms"] = 1e3 * statistics.median(opt_times[warmup:])
    close()
    runner = opt = None  # freed before the next configuration is built
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def table(rows):
    """Markdown: step time, its ratio to DDP's on the same model, peak memory."""
    out = ["| model | framework | step ms (median) | / DDP | peak GiB | host step ms |", "|---|---|---|---|---|---|"]
    ddp = {r["model"]: r["step_ms"] for r in rows if r["framework"] == "ddp" and "step_ms" in r}
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['model']} | {r['framework']} | {r['skipped']} | | | |")
            continue
        ratio = f"{r['step_ms'] / ddp[r['model']]:.2f}x" if r["model"] in ddp else "-"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        host = f"{r['opt_ms']:.1f}" if "opt_ms" in r else ""
        out.append(f"| {r['model']} | {r['framework']} | {r['step_ms']:.1f} | {ratio} | {peak} | {host} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt-large,gpt-small")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds from start: start no later")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny GPT, 2 steps, every framework that runs there")
    args = ap.parse_args()
    start = time.monotonic()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("gpu_train: needs a CUDA device (or --smoke, the code paths on the CPU)")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    models = {"smoke": SMOKE} if args.smoke else {m: MODELS[m] for m in args.models.split(",")}
    frameworks = args.frameworks.split(",")
    if args.smoke:
        frameworks += [f for f in OFFLOAD if f not in frameworks]
    steps, warmup = (2, 1) if args.smoke else (args.steps, args.warmup)
    rows = []
    for name, spec in models.items():
        for fw in frameworks:
            if time.monotonic() - start > args.deadline:
                rows.append(dict(framework=fw, model=name, skipped="skipped: the stage's deadline"))
                continue
            if fw == "megatron_fsdp":
                try:
                    import megatron_fsdp  # noqa: F401
                except ImportError as e:
                    rows.append(dict(framework=fw, model=name, skipped=f"not importable ({e})"))
                    continue
            t0 = time.monotonic()
            try:
                row = run(fw, name, spec, device, warmup, steps)
            except Exception as e:  # noqa: BLE001 - one framework's failure must not end the stage
                row = dict(framework=fw, model=name, skipped=f"failed: {type(e).__name__}: {str(e)[:200]}")
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            row["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__,
                           rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
