"""GPU kernel report: achieved GB/s of the engine's CUDA kernels over bucket sizes from 1 MB to
1 GB, against a device-to-device copy and torch's own `.to(torch.bfloat16)` measured in the same
run (GB/s = (bytes read + bytes written) / median time per call, calls back to back on the GPU).
The kernels: the fp32 -> bf16 cast, accumulate (fp32 += bf16), scale (fp32), the one-launch
12-tensor pack (fp32), and int8 quantize (fp32 -> wire) and dequantize (wire -> fp32) in the
quantized wire format, block 128.

Goals (the GPU issue): at least 90% of the copy's GB/s from 64 MB up, and the cast never slower
than torch's `.to(torch.bfloat16)` at any size. The last lines say whether each holds.

    python benchmarks/kernels.py [--max-mb 1024] [--json out.json]   # a CUDA device and build
"""
import argparse
import json
import statistics
import sys
import time

import torch

from megatron_fsdp_c import _C

GOAL_FROM_MB, GOAL_FRACTION = 64, 0.90
BLOCK = 128


def sleep_cycles_per_second():
    """How many torch.cuda._sleep cycles make a second, measured (the clock varies)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def timed(fn, cycles_per_s, trials=5, min_trial_s=0.02):
    """GPU seconds per call of fn: `reps` calls back to back between two events, queued behind
    a sleep kernel long enough for the host to queue them all, so the GPU never idles waiting
    for the host. (Recording the start event on an idle stream and synchronising after every
    call measured the ~10 us launch path of the Python glue at small sizes, not bandwidth.)
    Median over trials."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    host_s = (time.perf_counter() - t0) / 5  # what one call costs the host
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once_s = start.elapsed_time(end) / 1e3  # an upper bound of the GPU time of one call
    reps = max(10, min(1000, int(min_trial_s / max(once_s, 1e-7))))
    per_call = []
    for _ in range(trials):
        torch.cuda._sleep(int(1.5 * reps * host_s * cycles_per_s) + 10_000)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(per_call)


def measure(mb, cps):
    """GB/s of each kernel on a bucket of `mb` MB of fp32 values."""
    n = mb * (1 << 20) // 4
    g = torch.Generator(device="cuda").manual_seed(mb)
    a = torch.randn(n, device="cuda", generator=g)  # never zeros: they can run faster than data
    b = torch.empty_like(a)
    h = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    h2 = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    code = _C.QUANT_MODES["int8"]
    wire_bytes = _C.quant_wire_bytes(code, n, BLOCK)
    wire = torch.empty(wire_bytes, device="cuda", dtype=torch.uint8)
    _C.quantize_(wire, a, code, BLOCK)
    sizes = [n * w // 78 for w in (12, 4, 16, 16, 1, 1, 3, 1, 12, 4, 4, 4)]  # a unit's 12 gradients
    sizes[-1] += n - sum(sizes)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    parts = list(a.split(sizes))
    row = {"mb": mb}
    row["copy"] = 8 * n / timed(lambda: b.copy_(a), cps) / 1e9
    row["torch_to_bf16"] = 6 * n / timed(lambda: a.to(torch.bfloat16), cps) / 1e9
    row["cast_f32_bf16"] = 6 * n / timed(lambda: _C.cuda_copy_(h2, a), cps) / 1e9
    row["accumulate"] = 10 * n / timed(lambda: _C.cuda_accumulate_(b, h), cps) / 1e9
    row["scale"] = 8 * n / timed(lambda: _C.cuda_scale_(b, 0.5), cps) / 1e9
    row["pack12"] = 8 * n / timed(lambda: _C.cuda_pack_(b, parts, offsets), cps) / 1e9
    row["quantize_int8"] = (4 * n + wire_bytes) / timed(lambda: _C.quantize_(wire, a, code, BLOCK), cps) / 1e9
    row["dequantize_int8"] = (wire_bytes + 4 * n) / timed(lambda: _C.dequantize_(b, wire, code, BLOCK), cps) / 1e9
    return row


KERNELS = ["cast_f32_bf16", "accumulate", "scale", "pack12", "quantize_int8", "dequantize_int8"]


def verdicts(rows):
    """(goal, held, detail) for each goal of the issue."""
    big = [r for r in rows if r["mb"] >= GOAL_FROM_MB]
    worst = min(((r[k] / r["copy"], k, r["mb"]) for r in big for k in KERNELS), default=(float("nan"), "-", 0))
    cast = min(((r["cast_f32_bf16"] / r["torch_to_bf16"], r["mb"]) for r in rows), default=(float("nan"), 0))
    return [(f">= {100 * GOAL_FRACTION:.0f}% of the copy from {GOAL_FROM_MB} MB", worst[0] >= GOAL_FRACTION,
             f"worst {100 * worst[0]:.0f}% ({worst[1]} at {worst[2]} MB)"),
            ("cast never slower than torch's .to(bfloat16)", cast[0] >= 1.0,
             f"worst {cast[0]:.2f}x torch's (at {cast[1]} MB)")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-mb", type=int, default=1024)
    ap.add_argument("--json", default=None, help="write the rows and verdicts here")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not hasattr(_C, "cuda_copy_"):
        sys.exit("kernels: needs a CUDA device and a CUDA build of megatron_fsdp_c")
    print(f"{torch.cuda.get_device_name(0)}; GB/s = (bytes read + bytes written) / median time per call")
    cps = sleep_cycles_per_second()
    head = ["MB", "copy", "torch .to(bf16)"] + KERNELS + ["worst % of copy"]
    print(" ".join(f"{h:>15}" for h in head))
    rows = []
    mb = 1
    while mb <= args.max_mb:
        r = measure(mb, cps)
        rows.append(r)
        worst = min(r[k] for k in KERNELS) / r["copy"]
        print(" ".join(f"{v:>15.0f}" for v in [r["mb"], r["copy"], r["torch_to_bf16"]] + [r[k] for k in KERNELS])
              + f" {100 * worst:>14.0f}%", flush=True)
        torch.cuda.empty_cache()
        mb *= 4
    results = verdicts(rows)
    for goal, held, detail in results:
        print(f"goal {goal}: {'MET' if held else 'MISSED'} ({detail})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows,
                       "goals": [dict(goal=g, met=m, detail=d) for g, m, d in results]}, f, indent=1)


if __name__ == "__main__":
    main()
