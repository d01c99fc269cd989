"""GPU kernel report: achieved GB/s of the engine's CUDA kernels (cast-copy, accumulate,
multi-tensor pack via the engine) over bucket sizes, against a device-to-device copy measured in
the same run (bytes read + bytes written). Goal: >= 90% of the copy rate at 64 MB and up.

    python benchmarks/kernels.py      # needs a CUDA device and a CUDA build
"""
import statistics
import sys
import time

import torch

from megatron_fsdp_c import _C


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


def main():
    if not torch.cuda.is_available() or not hasattr(_C, "cuda_copy_"):
        sys.exit("needs a CUDA device and a CUDA build of megatron_fsdp_c")
    print(f"{torch.cuda.get_device_name(0)}; GB/s = (bytes read + bytes written) / median time per call "
          "(calls back to back on the GPU)")
    cps = sleep_cycles_per_second()
    print(f"{'MB (fp32)':>9} {'d2d copy':>9} {'f32->bf16':>10} {'bf16->f32':>10} {'acc f32+=bf16':>14} "
          f"{'pack 12 f32':>12} {'pack 12 bf16':>13} {'% of copy (worst)':>18}")
    for mb in (1, 4, 16, 64, 256, 1024):
        n = mb * (1 << 20) // 4
        a = torch.randn(n, device="cuda")
        b = torch.empty_like(a)
        h = torch.randn(n, device="cuda").to(torch.bfloat16)
        h2 = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        copy = 8 * n / timed(lambda: b.copy_(a), cps) / 1e9
        to_bf16 = 6 * n / timed(lambda: _C.cuda_copy_(h2, a), cps) / 1e9
        to_f32 = 6 * n / timed(lambda: _C.cuda_copy_(b, h), cps) / 1e9
        acc = 10 * n / timed(lambda: _C.cuda_accumulate_(b, h), cps) / 1e9
        # a unit's gradients into its fp32 bucket: 12 tensors of uneven sizes, one launch
        sizes = [n * w // 78 for w in (12, 4, 16, 16, 1, 1, 3, 1, 12, 4, 4, 4)]
        sizes[-1] += n - sum(sizes)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        f32_parts, bf16_parts = list(a.split(sizes)), list(h.split(sizes))
        pack32 = 8 * n / timed(lambda: _C.cuda_pack_(b, f32_parts, offsets), cps) / 1e9
        pack16 = 6 * n / timed(lambda: _C.cuda_pack_(b, bf16_parts, offsets), cps) / 1e9
        worst = min(to_bf16, to_f32, acc, pack32, pack16) / copy
        print(f"{mb:>9} {copy:>9.0f} {to_bf16:>10.0f} {to_f32:>10.0f} {acc:>14.0f} {pack32:>12.0f} {pack16:>13.0f} "
              f"{100 * worst:>17.0f}%")


if __name__ == "__main__":
    main()
