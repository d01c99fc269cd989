"""Convergence with quantized communication on real data: a byte-level GPT trained on the Python
standard library's own sources (the .py files next to this interpreter's os.py), one run per
mode, same initial weights and same batches, at world 2 (gloo on CPU, megatron_fsdp_c ZeRO-3).

    python benchmarks/quantized_convergence.py [--steps 300] [--world 2] [--out bench_out]

Modes: the baseline (fp32 compute and main weights, gradients communicated in bf16: this CPU has
no bf16 units, a bf16 forward+backward of the model measured 15x slower than fp32, so the
baseline keeps fp32 compute and the usual bf16 gradient communication), int8 weights, fp8_e4m3
weights, int8 gradients, int4 gradients, int8 weights + int4 gradients (QuantizedCommPolicy,
block 128; the quantized-gradient modes sum in fp32 main gradients). Writes
bench_out/quantized_convergence.{md,png,json}: training curves, final train loss (mean of the
last 20 steps) and held-out loss, and each mode's difference from the baseline.
"""
import argparse
import glob
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODES = [  # (label, QuantizedCommPolicy kwargs or None, gradients communicated in bf16)
    ("baseline (bf16 gradient comm)", None, True),
    ("int8 weights", dict(weights="int8"), True),
    ("fp8_e4m3 weights", dict(weights="fp8_e4m3"), True),
    ("int8 gradients", dict(grads="int8"), False),
    ("int4 gradients", dict(grads="int4"), False),
    ("int8 weights + int4 gradients", dict(weights="int8", grads="int4"), False),
]
SEQ, BATCH, D, HEADS, LAYERS = 64, 8, 96, 4, 3
LR, WARMUP = 3e-3, 20


def corpus() -> torch.Tensor:
    """The bytes of the standard library's top-level sources, in name order."""
    lib = os.path.dirname(os.__file__)
    data = b"".join(open(f, "rb").read() for f in sorted(glob.glob(os.path.join(lib, "*.py"))))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def windows(data: torch.Tensor, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - SEQ - 1, (n,), generator=g)
    rows = torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def train(rank, world, steps, mode_index):
    import megatron_fsdp_c as mf
    from megatron_fsdp_c.testing import GPT, Block, GPTConfig

    label, quant, bf16_comm = MODES[mode_index]
    data = corpus()
    split = int(data.numel() * 0.95)
    train_data, val_data = data[:split], data[split:]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=SEQ, d=D, heads=HEADS, layers=LAYERS))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, betas=(0.9, 0.95))
    policy = mf.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                     grad_comm_dtype=torch.bfloat16 if bf16_comm else None)
    model, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=3,
                                mixed_precision_policy=policy,
                                quantized_comm_policy=mf.QuantizedCommPolicy(**quant) if quant else None)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / WARMUP) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    losses, evals = [], []

    def evaluate():
        with torch.no_grad():
            total = 0.0
            for k in range(8):  # every rank its own held-out windows, averaged over ranks
                x, y = windows(val_data, BATCH, 999_000 + 100 * k + rank)
                total += model(x, y).item()
            t = torch.tensor([total / 8])
            torch.distributed.all_reduce(t)
            return t.item() / world

    start = time.monotonic()
    for step in range(steps):
        x, y = windows(train_data, BATCH, 1_000 * step + rank)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        t = torch.tensor([loss.item()])
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
        if (step + 1) % 50 == 0 or step + 1 == steps:
            evals.append((step + 1, evaluate()))
    return dict(label=label, losses=losses, evals=evals, seconds=time.monotonic() - start,
                stats=model.comm_stats())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--modes", default=",".join(str(i) for i in range(len(MODES))))
    ap.add_argument("--replot", action="store_true", help="only redraw the table and curves from the JSON")
    args = ap.parse_args()
    if args.replot:
        out = Path(args.out)
        return report(json.loads((out / "quantized_convergence.json").read_text()), args, out)
    from megatron_fsdp_c.testing import run_on_ranks

    out = Path(args.out)
    out.mkdir(exist_ok=True)
    results = []
    for i in (int(m) for m in args.modes.split(",")):
        print(f"[convergence] {MODES[i][0]}: {args.steps} steps at world {args.world}", flush=True)
        r = run_on_ranks(train, args.world, args.steps, i, timeout_s=6 * 3600)[0]
        print(f"[convergence]   final train {sum(r['losses'][-20:]) / len(r['losses'][-20:]):.4f}, held-out {r['evals'][-1][1]:.4f}, "
              f"{r['seconds']:.0f} s", flush=True)
        results.append(r)
        (out / "quantized_convergence.json").write_text(json.dumps(results))
    report(results, args, out)


def report(results, args, out):
    base = results[0]
    b_train, b_val = sum(base["losses"][-20:]) / len(base["losses"][-20:]), base["evals"][-1][1]
    lines = [f"#### Convergence with quantized communication: byte-level GPT on the Python standard library "
             f"({args.steps} steps, world {args.world}, ZeRO-3)", "",
             "| mode | final train loss (last 20 steps) | x baseline | held-out loss | x baseline | "
             "wire MiB/step (gathers + reductions; evaluations' gathers included) | s/step |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        tr, va = sum(r["losses"][-20:]) / len(r["losses"][-20:]), r["evals"][-1][1]
        s = r["stats"]
        wire = (s["all_gather_bytes"] + s["quantized_all_gather_bytes"] + s["reduce_scatter_bytes"]
                + s["quantized_reduce_scatter_bytes"]) / args.steps / 2**20
        lines.append(f"| {r['label']} | {tr:.4f} | {tr / b_train:.4f} | {va:.4f} | {va / b_val:.4f} | {wire:.3f} | "
                     f"{r['seconds'] / args.steps:.2f} |")
    text = "\n".join(lines) + "\n"
    (out / "quantized_convergence.md").write_text(text)
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a, c, b) = plt.subplots(1, 3, figsize=(17, 4.5))

        def smooth(values):
            ema, out = None, []
            for v in values:
                ema = v if ema is None else 0.9 * ema + 0.1 * v
                out.append(ema)
            return out
        base_curve = smooth(base["losses"])
        for r in results:
            curve = smooth(r["losses"])
            a.plot(range(1, len(curve) + 1), curve, label=r["label"], linewidth=1)
            c.plot(range(1, len(curve) + 1), [v - w for v, w in zip(curve, base_curve)], label=r["label"], linewidth=1)
            b.plot([e[0] for e in r["evals"]], [e[1] for e in r["evals"]], marker="o", label=r["label"], linewidth=1)
        a.set(xlabel="step", ylabel="train loss (EMA 0.9)", title="training loss")
        c.set(xlabel="step", ylabel="train loss - baseline's (EMA 0.9)", title="difference from the baseline")
        b.set(xlabel="step", ylabel="held-out loss", title="held-out loss")
        for ax in (a, c, b):
            ax.grid(alpha=0.3)
        a.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "quantized_convergence.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no curves")


if __name__ == "__main__":
    main()
