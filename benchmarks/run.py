"""The benchmark: DDP, torch FSDP2 and megatron_fsdp_c (every strategy) on the same GPT, in one
invocation, under torchrun; CPU (gloo) at 2 and 4 ranks, or the GPU(s) when CUDA is present. On
CPU also hybrid sharding (HSDP, HFSDP) and 2-D parallelism (FSDP + tensor parallelism, dp 2 x
tp 2 against torch's FSDP2 + TP) at 4 ranks, and (part `moe`) an expert-parallel MoE at 4 ranks,
ep 2, both APIs (per-module, and fully_shard with expt_device_mesh) against FSDP2 on the same two
meshes (benchmarks/moe_bench.py).

    python benchmarks/run.py [--worlds 2,4] [--steps 20] [--models gpt] [--precision fp32] [--out bench_out]
                             [--parts train,hooks,hybrid,quant,moe] [--transport auto]

Defaults: on CPU the 5.8M-parameter `gpt` in fp32; with CUDA the CUDA issue's two models,
`gpt-small` (vocab 8192, d 512, 8 heads, 12 layers, seq 256, batch 4) and `gpt-large` (vocab
32768, d 2048, 16 heads, 16 layers, seq 1024, batch 4), in bf16 (DDP under bf16 autocast, FSDP2
bf16 params with fp32 reduction, megatron_fsdp_c a bf16 model with fp32 main weights and
gradients), AdamW, one unit per block.

Writes bench_out/results.md (tables: step time and its ratios to DDP and FSDP2, memory held per
rank, peak memory, collective bytes against the theoretical volume, hook overhead per unit on a
model of many tiny layers) and bench_out/results.png, and prints the markdown.
"""
import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_worker import MODELS, is_gpt  # noqa: E402  (the worker's table of models)
NAMES = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world, out, framework, model, steps, strategy=3, precision="fp32", transport="auto", mesh=None,
           outer="no_shard", tp=0, quant=None, grad_comm="fp32"):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
           "--master_port", str(free_port()), str(HERE / "bench_worker.py"), "--framework", framework,
           "--model", model, "--steps", str(steps), "--strategy", str(strategy), "--precision", precision,
           "--transport", transport, "--out", str(out)] + (["--mesh", mesh, "--outer", outer] if mesh else []) + \
        (["--tp", str(tp)] if tp else []) + \
        (["--quant", quant] if quant else []) + (["--grad-comm", grad_comm] if framework == "mfsdp" else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    label = {"mfsdp": f"megatron_fsdp_c {NAMES[strategy]} ({transport} transport{', ' + quant if quant else ''})",
             "mfsdp2": f"megatron_fsdp_c per-module {NAMES[strategy]}"}.get(framework, framework) + \
        (f" on a {mesh} mesh" if mesh else "") + (" (HFSDP)" if outer == "optim" else "") + \
        (f" + TP {tp} (dp {world // tp})" if tp else "")
    print(f"[bench] world {world}: {model} ({precision}) {label}", flush=True)
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(f"[bench]   {time.monotonic() - start:.0f} s", flush=True)  # where a stage's time budget goes
    if done.returncode != 0:
        print(done.stdout[-3000:])
        raise SystemExit(f"benchmark run failed: {' '.join(cmd)}")


def quant_label(r):
    """What crosses the wire in a quantized-part row: weights / gradients."""
    if r.get("quant"):
        parts = r["quant"].split(",")
        w = parts[0] if parts[0] != "none" else "fp32"
        g = parts[1] if parts[1] != "none" else (r.get("grad_comm") or "fp32")
        return f"{w} weights, {g} gradients" + (f", block {parts[2]}" if len(parts) > 2 else "")
    return f"fp32 weights, {r.get('grad_comm') or 'fp32'} gradients"


def label(r):
    mesh = f" {'HFSDP' if r.get('outer') == 'optim' else 'HSDP'} {r['mesh']}" if r.get("mesh") else ""
    if r.get("tp"):
        mesh += f" + TP (dp {r['world'] // r['tp']} x tp {r['tp']})"
    if r["framework"] == "mfsdp" and r.get("quant_part"):
        return f"megatron_fsdp_c {NAMES[r['strategy']]}: {quant_label(r)}"
    if r["framework"] == "mfsdp":
        return f"megatron_fsdp_c {NAMES[r['strategy']]}{mesh}"
    if r["framework"] == "mfsdp2":
        return f"megatron_fsdp_c per-module {NAMES[r['strategy']]}{mesh}"
    return r["framework"].upper() + mesh


def mib(x):
    return f"{x / 2**20:.2f}"


def machine():
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return (f"{datetime.date.today().isoformat()}, {gpu or cpu} ({os.cpu_count()} cores), torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def own_part(r):
    """A row of the hybrid, 2-D or quantized parts (their own tables), not of the training benchmark."""
    return bool(r.get("hybrid_part") or r.get("tp_part") or r.get("quant_part"))


def training_groups(results):
    """(model, world) pairs of the training benchmark, in the order they ran."""
    keys = []
    for r in results:
        if is_gpt(r["model"]) and not own_part(r) and (r["model"], r["world"]) not in keys:
            keys.append((r["model"], r["world"]))
    return keys


def summary(results):
    """One line per (model, world): megatron_fsdp_c ZeRO-3 against DDP and FSDP2 (the CUDA issue's
    goal: <= 1.10x DDP's step time on gpt-large, peak memory <= FSDP2's, ahead of FSDP2 everywhere)."""
    lines = ["### Summary: megatron_fsdp_c optim_grads_params against the peers", "",
             "| model | ranks | step x DDP | step x FSDP2 | peak x FSDP2 |", "|---|---|---|---|---|"]
    for model, world in training_groups(results):
        rows = [r for r in results if r["model"] == model and r["world"] == world and not own_part(r)]
        ddp = next((r for r in rows if r["framework"] == "ddp"), None)
        fsdp2 = next((r for r in rows if r["framework"] == "fsdp2"), None)
        ours = next((r for r in rows if r["framework"] == "mfsdp" and r["strategy"] == 3), None)
        if not (ddp and fsdp2 and ours):
            continue
        lines.append(f"| {model} | {world} | {ours['step_ms'] / ddp['step_ms']:.2f} | "
                     f"{ours['step_ms'] / fsdp2['step_ms']:.2f} | {ours['peak_bytes'] / fsdp2['peak_bytes']:.2f} |")
    return lines + [""] if len(lines) > 4 else []  # no training rows (e.g. --parts hybrid): no table


def ring_bytes(kind, size, ranks):
    """Bytes one rank sends in a ring collective over `ranks` ranks on a buffer of `size` bytes
    (all-gather and reduce-scatter: (n-1)/n of it; all-reduce: twice that)."""
    if ranks <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * (ranks - 1) / ranks * size


def inter_node_bytes(r, nodes=2):
    """Bytes per step one rank sends over collectives whose group spans nodes, on `nodes` nodes
    of world/nodes ranks with the (outer, shard) mesh laid out shard-within-node: a 1-D group of
    all ranks (DDP, FSDP) spans nodes; HSDP's shard groups stay inside a node and only its
    all-reduce across replicas crosses (HFSDP: its reduce-scatter and all-gather across replicas).
    From our measured buffer sizes per step; DDP and FSDP2, whose collectives we do not count,
    from the same formula on the gradient bytes."""
    world = r["world"]
    if r.get("mesh"):
        outer, _ = (int(v) for v in r["mesh"].split("x"))
        if r.get("comm_per_step"):
            per = r["comm_per_step"]
            return ring_bytes("all_reduce", per["outer_all_reduce_bytes"] / max(per["outer_all_reduces"], 1), outer) * \
                per["outer_all_reduces"] + ring_bytes("reduce_scatter", per.get("outer_reduce_scatter_bytes", 0), outer) \
                + ring_bytes("all_gather", per.get("outer_all_gather_bytes", 0), outer)
        return ring_bytes("all_reduce", r["grad_bytes"] / (world // outer), outer)  # FSDP2: shard-sized all-reduce
    if r.get("comm_per_step"):
        per = r["comm_per_step"]
        # buffer sizes: all-gather/reduce-scatter count the full bucket, all-reduce the whole buffer. A quantized
        # gather or exchange sends W-1 of its W wire pieces, as a ring all-gather / reduce-scatter does; a quantized
        # all-reduce counts its exchange's wire plus the gather of the reduced blocks, each sent that way once
        return sum(ring_bytes(k, per.get(f"{k}_bytes", 0) + per.get(f"quantized_{k}_bytes", 0), world)
                   for k in ("all_gather", "reduce_scatter")) + ring_bytes("all_reduce", per["all_reduce_bytes"], world) \
            + ring_bytes("all_gather", per.get("quantized_all_reduce_bytes", 0), world)
    if r["framework"] == "ddp":
        return ring_bytes("all_reduce", r["grad_bytes"], world)
    return ring_bytes("all_gather", 2 * r["grad_bytes"], world) + ring_bytes("reduce_scatter", r["grad_bytes"], world)


def hybrid_table(results):
    rows = [r for r in results if r.get("hybrid_part")]
    if not rows:
        return []
    ddp = next(r for r in rows if r["framework"] == "ddp")
    world, model = ddp["world"], ddp["model"]
    lines = [f"### Hybrid sharding, {world} ranks ({rows[0]['device']}, {model}, {rows[0]['precision']}): HSDP and "
             "HFSDP on a (dp_outer x dp_shard) mesh against FSDP over all ranks", "",
             "| configuration | step ms | x DDP | held MiB | optimizer state MiB | peak MiB | inner all-gather MiB/step | "
             "inner reduce-scatter MiB/step | inner all-reduce MiB/step | outer all-reduce MiB/step | outer "
             "reduce-scatter MiB/step | outer all-gather MiB/step | inter-node MiB/step/rank (2 nodes) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = ("all_gather_bytes", "reduce_scatter_bytes", "all_reduce_bytes", "outer_all_reduce_bytes",
            "outer_reduce_scatter_bytes", "outer_all_gather_bytes")
    for r in rows:
        held = sum(r["held"].values())
        per = r.get("comm_per_step")
        comm = " | ".join(mib(per.get(k, 0)) for k in keys) if per else " | ".join("-" for _ in keys)
        lines.append(f"| {label(r)} | {r['step_ms']:.1f} | {r['step_ms'] / ddp['step_ms']:.2f} | {mib(held)} | "
                     f"{mib(r['held']['optim'])} | {mib(r['peak_bytes'])} | {comm} | {mib(inter_node_bytes(r))} |")
    return lines + ["", "Buffer bytes per step by communicator (our counters); inter-node: bytes one rank sends "
                        "through a ring over the collectives that cross nodes, with 2 ranks a node (see "
                        "`inter_node_bytes` in benchmarks/run.py).", ""]


def tp_table(results):
    """2-D parallelism: FSDP over dp composed with torch's sequence-parallel TP plan, ours on both
    APIs against torch's FSDP2 + TP."""
    rows = [r for r in results if r.get("tp_part")]
    if not rows:
        return []
    base = next((r for r in rows if r["framework"] == "fsdp2"), rows[0])
    first = rows[0]
    lines = [f"### 2-D parallelism, {first['world']} ranks as dp {first['world'] // first['tp']} x tp {first['tp']} "
             f"({first['device']}, {first['model']} with separate q/k/v, {first['params'] / 1e6:.2f}M params, "
             f"{first['precision']}): torch's sequence-parallel plan, then FSDP over dp", "",
             "| configuration | step ms | x FSDP2 + TP | params MiB | grads MiB | optimizer MiB | held MiB | peak MiB | "
             "all-gather MiB/step | reduce-scatter MiB/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        held = r["held"]
        per = r.get("comm_per_step")
        comm = f"{mib(per['all_gather_bytes'])} | {mib(per['reduce_scatter_bytes'])}" if per else "- | -"
        lines.append(f"| {label(r)} | {r['step_ms']:.1f} | {r['step_ms'] / base['step_ms']:.2f} | {mib(held['param'])} | "
                     f"{mib(held['grad'])} | {mib(held['optim'])} | {mib(sum(held.values()))} | "
                     f"{mib(r['peak_bytes'])} | {comm} |")
    return lines + ["", "Held: what one rank keeps between steps (its TP shard's data-parallel shard of parameters, "
                        "gradients, AdamW states); collective bytes: our engine's counters (the data-parallel "
                        "collectives; TP's own collectives are torch's in both).", ""]


def quant_table(results):
    """The quantized-communication part: ZeRO-3 at 4 ranks, bytes per step by communicator (measured
    wire bytes / the plan's theory), step time, inter-node bytes per rank, against the
    unquantized runs and FSDP2."""
    rows = [r for r in results if r.get("quant_part")]
    if not rows:
        return []
    world, model = rows[0]["world"], rows[0]["model"]
    ddp = next((r for r in rows if r["framework"] == "ddp"), None)
    base = next((r for r in rows if r["framework"] == "mfsdp" and not r.get("quant") and r.get("grad_comm") == "fp32"),
                None)
    lines = [f"### Quantized communication, {world} ranks ({rows[0]['device']}, {model}, {rows[0]['precision']} "
             "compute, ZeRO-3)", "",
             "| configuration | step ms | x DDP | gather communicator MiB/step (measured / theory) | reduction "
             "communicator MiB/step (measured / theory) | inter-node MiB/step/rank (2 nodes) | x unquantized fp32 | "
             "x bf16 (theory) |", "|---|---|---|---|---|---|---|---|"]
    base_inter = inter_node_bytes(base) if base else None
    for r in rows:
        per, theory = r.get("comm_per_step"), r.get("wire_theory")
        if per:
            gather = per.get("all_gather_bytes", 0) + per.get("quantized_all_gather_bytes", 0)
            reduce = sum(per.get(k, 0) for k in ("reduce_scatter_bytes", "quantized_reduce_scatter_bytes",
                                                 "all_reduce_bytes", "quantized_all_reduce_bytes"))
            cell = lambda m, t: f"{mib(m)} / {mib(t)} = {m / t:.3f}" if t else mib(m)  # noqa: E731
            comm = f"{cell(gather, theory and theory['all_gather'])} | {cell(reduce, theory and theory['reduce_scatter'])}"
        else:
            comm = "- | -"
        inter = inter_node_bytes(r)
        ratio = f"{inter / base_inter:.3f}" if base_inter else "-"
        vs_bf16 = f"{inter / (base_inter / 2):.3f}" if base_inter else "-"
        vs_ddp = f"{r['step_ms'] / ddp['step_ms']:.2f}" if ddp else "-"
        lines.append(f"| {label(r)} | {r['step_ms']:.1f} | {vs_ddp} | {comm} | {mib(inter)} | {ratio} | {vs_bf16} |")
    if base_inter:
        lines.append(f"| megatron_fsdp_c optim_grads_params: bf16 weights, bf16 gradients (theory: half the fp32 "
                     f"wire, not run) | - | - | - | - | {mib(base_inter / 2)} | 0.500 | 1.000 |")
    return lines + ["", "Wire bytes per step by communicator, as our counters record them (quantized pieces: payload "
                        "and scales) against the bucket plan's theory (`theoretical_wire_bytes` in "
                        "benchmarks/bench_worker.py); inter-node: bytes one rank sends through a ring over the 1-D "
                        "group of 4 ranks on 2 nodes (`inter_node_bytes` in benchmarks/run.py). FSDP2 and DDP from the "
                        "same formula on fp32 bytes. The bf16 row is half the fp32 run's wire: this CPU has no bf16 "
                        "units, a bf16 run would measure compute, not communication.", ""]


def tables(results):
    lines = summary(results)
    for model, world in training_groups(results):
        rows = [r for r in results if r["model"] == model and r["world"] == world and not own_part(r)]
        ddp = next(r for r in rows if r["framework"] == "ddp")
        fsdp2 = next((r for r in rows if r["framework"] == "fsdp2"), None)
        precision = rows[0].get("precision", "fp32")
        lines += [f"### Training step, {world} rank{'s' if world > 1 else ''} ({rows[0]['device']}, {model} "
                  f"{rows[0]['params'] / 1e6:.2f}M params, {precision})",
                  "", "| configuration | step ms | x DDP | x FSDP2 | params MiB | grads MiB | optimizer MiB | held MiB "
                      "| peak MiB | transient MiB | unused-flag sync ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            held = r["held"]
            total = held["param"] + held["grad"] + held["optim"]
            vs_fsdp2 = f"{r['step_ms'] / fsdp2['step_ms']:.2f}" if fsdp2 else "-"
            lines.append(f"| {label(r)} | {r['step_ms']:.1f} | {r['step_ms'] / ddp['step_ms']:.2f} | {vs_fsdp2} | "
                         f"{mib(held['param'])} | {mib(held['grad'])} | {mib(held['optim'])} | {mib(total)} | "
                         f"{mib(r['peak_bytes'])} | {mib(r.get('transient_bytes', 0))} | "
                         f"{'-' if r.get('flag_sync_ms') is None else format(r['flag_sync_ms'], '.3f')} |")
        lines.append("")
        comm = [r for r in rows if r.get("comm_theory")]
        if comm:
            lines += [f"### Collective bytes per step, {model}, {world} ranks (measured by the transport / "
                      "theoretical)", "",
                      "| configuration | all-gather | reduce-scatter | all-reduce |", "|---|---|---|---|"]
            keys = {"all_gather": "all_gather_bytes", "reduce_scatter": "reduce_scatter_bytes",
                    "all_reduce": "all_reduce_bytes"}
            for r in comm:
                cells = []
                for k, measured_key in keys.items():
                    theory = r["comm_theory"].get(k, 0)
                    measured = r["comm_per_step"][measured_key]
                    cells.append(f"{mib(measured)} / {mib(theory)} MiB = {measured / theory:.3f}" if theory else
                                 (f"{mib(measured)} MiB" if measured else "0"))
                lines.append(f"| {label(r).replace('megatron_fsdp_c ', '')} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += hybrid_table(results)
    lines += tp_table(results)
    lines += quant_table(results)
    for world in sorted({r["world"] for r in results if r["model"] == "tiny"}):
        tiny = [r for r in results if r["model"] == "tiny" and r["world"] == world]
        ddp = next(r for r in tiny if r["framework"] == "ddp")
        units = tiny[0]["units"]
        what = "no communication: hooks and bookkeeping only" if world == 1 else "with communication"
        lines += [f"### Hook overhead: {units} tiny units (LayerNorm + Linear 32x32), forward + backward, "
                  f"{world} rank{'s' if world > 1 else ''} ({what})", "",
                  "| configuration | fwd+bwd ms | overhead vs DDP ms | per unit us |", "|---|---|---|---|"]
        for r in tiny:
            extra = r["step_ms"] - ddp["step_ms"]
            lines.append(f"| {label(r)} | {r['step_ms']:.2f} | {extra:.2f} | {1e3 * extra / units:.1f} |")
        lines.append("")
    return "\n".join(lines)


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib not installed: no plot")
        return False
    groups = training_groups(results)
    if not groups:
        return False
    fig, axes = plt.subplots(len(groups), 3, figsize=(16, 4.2 * len(groups)), squeeze=False)
    for row, (model, world) in zip(axes, groups):
        rs = [r for r in results if r["model"] == model and r["world"] == world]
        names = [label(r).replace("megatron_fsdp_c ", "mfsdp_c\n") for r in rs]
        colors = ["#888888" if r["framework"] == "ddp" else "#d62728" if r["framework"] == "fsdp2" else "#1f77b4"
                  for r in rs]
        row[0].bar(names, [r["step_ms"] for r in rs], color=colors)
        row[0].set_title(f"step time, {model}, {world} ranks (ms)")
        row[1].bar(names, [r["peak_bytes"] / 2**20 for r in rs], color=colors)
        row[1].set_title(f"peak memory per rank (MiB, {rs[0]['peak_kind']})", fontsize=9)
        bottom = [0.0] * len(rs)
        for key, color in (("param", "#4c72b0"), ("grad", "#55a868"), ("optim", "#c44e52")):
            vals = [r["held"][key] / 2**20 for r in rs]
            row[2].bar(names, vals, bottom=bottom, label=key, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        row[2].set_title(f"held per rank: params / grads / optimizer (MiB), {world} ranks")
        row[2].legend()
        for ax in row:
            ax.tick_params(axis="x", labelsize=7, labelrotation=25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def tag_rows(raw, mark, tag):
    """Marks the rows written after byte `mark` of the results file as a part's own."""
    with open(raw) as f:
        f.seek(mark)
        tagged = [dict(json.loads(line), **{tag: True}) for line in f.read().splitlines()]
    with open(raw, "r+") as f:
        f.truncate(mark)
        f.seek(mark)
        f.write("".join(json.dumps(t) + "\n" for t in tagged))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default=None, help="comma-separated rank counts (default: 2,4 on CPU, GPUs on GPU)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default=None, help="comma-separated (default: gpt on CPU, gpt-small,gpt-large on GPU)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=None, help="default: fp32 on CPU, bf16 on GPU")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--parts", default="train,hooks,hybrid,tp",
                    help="train (the models), hooks (the hook-overhead runs), hybrid (HSDP and HFSDP at 4 CPU ranks), "
                         "tp (FSDP + tensor parallelism, dp 2 x tp 2 at 4 CPU ranks), quant (quantized communication at "
                         "4 CPU ranks), moe (an expert-parallel MoE at 4 CPU ranks, ep 2, both our APIs against FSDP2 "
                         "with the same meshes), any of them comma-separated "
                         "(benchmarks/gpu_check.sh runs them as separate stages)")
    ap.add_argument("--transport", choices=["auto", "torch", "nccl"], default="auto",
                    help="megatron_fsdp_c's transport")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"train", "hooks", "hybrid", "tp", "quant", "moe"} or not parts:
        ap.error(f"--parts {args.parts}: choose from train, hooks, hybrid, tp, quant, moe")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / "results.jsonl"
    raw.unlink(missing_ok=True)
    cuda = torch.cuda.is_available()
    worlds = [int(w) for w in args.worlds.split(",")] if args.worlds else (
        [torch.cuda.device_count()] if cuda else [2, 4])
    models = args.models.split(",") if args.models else (["gpt-small", "gpt-large"] if cuda else ["gpt"])
    known = [name for name in MODELS if is_gpt(name)]
    if any(m not in known for m in models):
        ap.error(f"--models {args.models}: choose from {', '.join(known)}")
    precision = args.precision or ("bf16" if cuda else "fp32")
    for model in models if "train" in parts else []:
        for world in worlds:
            launch(world, raw, "ddp", model, args.steps, precision=precision)
            launch(world, raw, "fsdp2", model, args.steps, precision=precision)
            for strategy in range(4):
                launch(world, raw, "mfsdp", model, args.steps, strategy, precision, args.transport)
            launch(world, raw, "mfsdp2", model, args.steps, 3, precision)
    # Hook overhead: at 1 rank nobody communicates (the hooks and bookkeeping alone), then with
    # communication at the first benchmarked world size.
    for hook_world in sorted({1, worlds[0]}) if "hooks" in parts else []:
        launch(hook_world, raw, "ddp", "tiny", args.steps)
        launch(hook_world, raw, "fsdp2", "tiny", args.steps)
        launch(hook_world, raw, "mfsdp", "tiny", args.steps, 3, transport=args.transport)
        launch(hook_world, raw, "mfsdp", "tiny", args.steps, 0, transport=args.transport)
        launch(hook_world, raw, "mfsdp2", "tiny", args.steps, 3)
    if "hybrid" in parts and not cuda:  # 4 ranks as 2 nodes x 2; HSDP needs several ranks, not one GPU
        mark = raw.stat().st_size if raw.exists() else 0
        launch(4, raw, "ddp", models[0], args.steps, precision=precision)
        launch(4, raw, "mfsdp", models[0], args.steps, 3, precision, args.transport)
        launch(4, raw, "mfsdp", models[0], args.steps, 3, precision, args.transport, mesh="2x2")
        launch(4, raw, "mfsdp", models[0], args.steps, 3, precision, args.transport, mesh="2x2", outer="optim")
        launch(4, raw, "mfsdp2", models[0], args.steps, 3, precision, mesh="2x2")
        launch(4, raw, "fsdp2", models[0], args.steps, precision=precision, mesh="2x2")
        tag_rows(raw, mark, "hybrid_part")
    if "tp" in parts and not cuda:  # 4 ranks as dp 2 x tp 2: ours on both APIs against FSDP2 + TP
        mark = raw.stat().st_size if raw.exists() else 0
        launch(4, raw, "fsdp2", models[0], args.steps, precision=precision, tp=2)
        launch(4, raw, "mfsdp2", models[0], args.steps, 3, precision, tp=2)
        launch(4, raw, "mfsdp", models[0], args.steps, 3, precision, args.transport, tp=2)
        tag_rows(raw, mark, "tp_part")
    if "quant" in parts and not cuda:  # 4 ranks as 2 nodes x 2, one 1-D group over all: every collective crosses
        mark = raw.stat().st_size if raw.exists() else 0
        launch(4, raw, "ddp", models[0], args.steps, precision=precision)
        launch(4, raw, "fsdp2", models[0], args.steps, precision=precision)
        launch(4, raw, "mfsdp", models[0], args.steps, 3, precision, args.transport)
        launch(4, raw, "mfsdp", models[0], args.steps, 3, precision, args.transport, grad_comm="bf16")
        for quant in ("int8,none", "fp8_e4m3,none", "none,int8", "int8,int8", "int8,int4"):
            launch(4, raw, "mfsdp", models[0], args.steps, 3, precision, args.transport, quant=quant,
                   grad_comm="bf16")
        tag_rows(raw, mark, "quant_part")
    moe_table = ""
    if "moe" in parts and not cuda:  # 4 ranks, ep 2: ours and FSDP2 in one torchrun (moe_bench.py)
        moe_out = out_dir / "moe.md"
        moe_out.unlink(missing_ok=True)
        print("[bench] world 4: MoE, ep 2, FSDP2 and megatron_fsdp_c per-module", flush=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                        str(free_port()), str(HERE / "moe_bench.py"), "--steps", str(args.steps), "--out",
                        str(moe_out)], env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        moe_table = moe_out.read_text() + "\n" if moe_out.exists() else "MoE benchmark: no result (it failed)\n\n"
    results = [json.loads(line) for line in raw.read_text().splitlines()] if raw.exists() else []
    flags = "".join(f" --{k} {v}" for k, v in (("worlds", args.worlds), ("models", args.models),
                                                ("precision", args.precision),
                                                ("parts", None if args.parts == "train,hooks,hybrid,tp" else args.parts),
                                                ("transport", None if args.transport == "auto" else args.transport))
                    if v)
    text = f"## Benchmark ({machine()})\n\nCommand: `python benchmarks/run.py --steps {args.steps}{flags}`\n\n" + \
        tables(results) + moe_table
    (out_dir / "results.md").write_text(text)
    has_plot = plot(results, out_dir / "results.png")
    print(text)
    print(f"[bench] wrote {out_dir / 'results.md'}" + (f" and {out_dir / 'results.png'}" if has_plot else ""))


if __name__ == "__main__":
    main()
