"""Where the time of our training step goes on one GPU (the GPU check's stage 4): a torch-profiler
trace of 3 steps of megatron_fsdp_c (the Megatron-style API, ZeRO-3, native NCCL transport, every
collective issued at one rank) on the ~1B GPT, after warm-up, summarised in numbers:
- GPU time by kind of kernel (matrix products, attention, NCCL all-gathers and reduce-scatters,
  our kernels, the optimizer, other) and how much of the step the GPU is busy;
- overlap: the share of each collective's kernel time during which a compute kernel runs on
  another stream. A gather issued ahead (unit i+1 during the compute of unit i) overlaps; one
  waited for where it is used does not. Likewise the reduce-scatter of unit i during the
  backward of unit i-1.

    python benchmarks/gpu_profile.py [--model gpt-large] [--json out.json] [--trace out.json.gz]
    python benchmarks/gpu_profile.py --smoke     # the CPU: the code path, no kernels to count
"""
import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_fsdp_c as mfsdp  # noqa: E402
from megatron_fsdp_c.testing import GPT, Block, batch  # noqa: E402
from bench_worker import MODELS  # noqa: E402
from gpu_train import SMOKE  # noqa: E402

KINDS = [  # (kind, substrings of kernel names), the first match wins
    ("all-gather", ("AllGather",)),
    ("reduce-scatter", ("ReduceScatter",)),
    ("other NCCL", ("nccl",)),
    ("megatron_fsdp_c", ("mfsdp",)),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "nvjet")),
    ("optimizer", ("multi_tensor", "adam", "Adam")),
]


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def merged(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap_with(a, spans):
    """Microseconds of interval a covered by the merged spans."""
    s, e = a
    return sum(max(0.0, min(e, t) - max(s, f)) for f, t in spans if t > s and f < e)


def summarise(events, steps):
    """The numbers of the module docstring, from a chrome trace's events."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return dict(kernels=0, note="no GPU kernels in the trace")
    by_kind = {}
    for k in kernels:
        kind = kind_of(k["name"])
        by_kind[kind] = by_kind.get(kind, 0.0) + k["dur"]
    first = min(k["ts"] for k in kernels)
    last = max(k["ts"] + k["dur"] for k in kernels)
    busy = sum(e - s for s, e in merged([(k["ts"], k["ts"] + k["dur"]) for k in kernels]))
    out = dict(kernels=len(kernels), steps=steps, span_ms_per_step=(last - first) / 1e3 / steps,
               busy_ms_per_step=busy / 1e3 / steps,
               ms_per_step_by_kind={kind: round(v / 1e3 / steps, 3) for kind, v in
                                    sorted(by_kind.items(), key=lambda kv: -kv[1])})
    compute = [k for k in kernels if kind_of(k["name"]) not in ("all-gather", "reduce-scatter", "other NCCL")]
    for kind in ("all-gather", "reduce-scatter"):
        comm = [k for k in kernels if kind_of(k["name"]) == kind]
        if not comm:
            continue
        covered = total = 0.0
        hidden = 0
        for c in comm:
            others = merged([(k["ts"], k["ts"] + k["dur"]) for k in compute if k.get("tid") != c.get("tid")])
            got = overlap_with((c["ts"], c["ts"] + c["dur"]), others)
            covered += got
            total += c["dur"]
            hidden += got >= 0.5 * c["dur"]
        out[kind] = dict(count_per_step=len(comm) / steps, ms_per_step=total / 1e3 / steps,
                         overlapped_share=covered / total if total else 0.0,
                         mostly_overlapped=f"{hidden} of {len(comm)}",
                         streams=sorted({str(c.get("tid")) for c in comm}))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-large")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None, help="also keep the chrome trace here, gzipped")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("gpu_profile: needs a CUDA device (or --smoke, the code path on the CPU)")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    spec = SMOKE if args.smoke else MODELS[args.model]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(spec["cfg"]).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = mfsdp.fully_shard(
        model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=3,
        mixed_precision_policy=mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                          main_grads_dtype=torch.float32),
        transport="nccl" if cuda else "auto", single_rank_collectives=cuda)

    def step(i):
        x, y = batch(spec["cfg"], spec["batch"], seed=1000 * i, device=device)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    for i in range(args.warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.steps):
            with torch.profiler.record_function(f"step {i}"):
                step(args.warmup + i)
        if cuda:
            torch.cuda.synchronize()
    wall_ms = 1e3 * (time.perf_counter() - t0) / args.steps
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if args.trace:
            with open(path, "rb") as src, gzip.open(args.trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    summary = dict(device=torch.cuda.get_device_name(0) if cuda else "cpu", model=args.model if cuda else "smoke",
                   profiled_wall_ms_per_step=wall_ms, **summarise(events, args.steps))
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    mfsdp.close(model)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
