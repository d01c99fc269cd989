"""The host optimizer step: megatron_fsdp_c.FusedAdamW against torch.optim.AdamW (foreach=True and
fused=True) on the same machine, in one run, with a STREAM-like triad measured here as the
bandwidth yardstick.

    python benchmarks/optimizer.py                       # 10M, 30M and 100M fp32 parameters
    python benchmarks/optimizer.py --sizes 10 --threads 2
    python benchmarks/optimizer.py --sizes 100 --repeats 5 --kinds fused,ours   # the GPU check's host

Each optimizer steps one flat fp32 parameter split into 64 tensors (a model's shapes do not
matter to an elementwise step; the count of tensors sets the per-tensor overhead) with a fixed
gradient, after two warm-up steps; the median of --repeats steps is reported, the optimizers
stepping in turn (one step of each, then the next round) so that the machine's drift reaches
all. AdamW moves 28 bytes a parameter (reads p, g, m, v; writes p, m, v, each into a line it
read); the triad a = a + s*c 12 bytes an element (torch.add(a, c, alpha=s, out=a): one
vectorised pass on both threads, and like the optimizer it writes only lines it read, so no
write-allocate traffic is left uncounted), over as many bytes as the step touches. GB/s = bytes / median time. Prints a
Markdown table, then each optimizer's fixed cost a tensor (the Python side and the glue: a step
of 1024 tiny tensors against one of 64).
"""
import argparse
import statistics
import time

import torch

import megatron_fsdp_c as mf

BYTES_PER_PARAM = 28  # AdamW: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq


def timed(fn, repeats):
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def triad_gbps(n, repeats):
    """The triad over the step's footprint: two arrays of 2n floats hold the bytes of the step's
    four arrays of n (parameter, gradient, two moments), so neither fits a cache the other does
    not (this machine's L3 can hold 10M parameters' state)."""
    a, c = torch.rand(2 * n), torch.rand(2 * n)
    t = timed(lambda: torch.add(a, c, alpha=1e-9, out=a), repeats)
    return 12 * 2 * n / t / 1e9


def step_times(makes, n, tensors, repeats):
    """The median step of each optimizer, their steps taken in turn (one of each, then again), so
    that a shared machine's drifting bandwidth reaches all of them alike."""
    flat = torch.randn(n)
    opts = []
    for make in makes:
        params = [torch.nn.Parameter(x.clone()) for x in flat.chunk(tensors)]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opts.append(make(params))
    for opt in opts:  # warm-up: states made, pages touched
        opt.step()
        opt.step()
    times = [[] for _ in opts]
    for _ in range(repeats):
        for opt, ts in zip(opts, times):
            t0 = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 30, 100], help="millions of fp32 parameters")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--kinds", default="foreach,fused,ours", help="which of foreach, fused, ours to run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    every = {
        "foreach": ("torch foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)),
        "fused": ("torch fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
        "ours": ("ours (FusedAdamW)", lambda ps: mf.FusedAdamW(ps, lr=1e-3, threads=args.threads)),
    }
    kinds = dict(every[k] for k in args.kinds.split(","))
    if not {"fused", "ours"} <= set(args.kinds.split(",")):
        ap.error("--kinds must include fused and ours (the table compares them)")
    print(f"threads {args.threads}, {args.tensors} tensors, SIMD path {mf._C.adam_isa()}, torch {torch.__version__}")
    print()
    print("| params | triad GB/s | " + " | ".join(f"{k} ms (GB/s, steps/s)" for k in kinds)
          + " | ours / triad | ours vs torch fused |")
    print("|---|---|" + "---|" * len(kinds) + "---|---|")
    for millions in args.sizes:
        n = millions * 1_000_000
        triad = triad_gbps(n, args.repeats)
        times = dict(zip(kinds, step_times(list(kinds.values()), n, args.tensors, args.repeats)))
        cells = [f"{t * 1e3:.1f} ({BYTES_PER_PARAM * n / t / 1e9:.1f}, {1 / t:.1f})" for t in times.values()]
        ours = BYTES_PER_PARAM * n / times["ours (FusedAdamW)"] / 1e9
        print(f"| {millions}M | {triad:.1f} | " + " | ".join(cells)
              + f" | {ours / triad:.2f} | {times['torch fused'] / times['ours (FusedAdamW)']:.2f}x |")
    print()
    print("fixed cost a tensor (1024 tensors of 64 elements against 64 of them, median of 31 steps): "
          + ", ".join(f"{k} {fixed_cost(make) * 1e6:.1f} us" for k, make in kinds.items() if k != "torch foreach"))


def fixed_cost(make):
    """What one more tensor costs a step, beyond its elements."""
    def step_of(count):
        params = [torch.nn.Parameter(torch.randn(64)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn(64)
        return timed(make(params).step, 31)
    return (step_of(1024) - step_of(64)) / 960


if __name__ == "__main__":
    main()
