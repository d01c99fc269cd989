"""The GPU check's one-screen summary (benchmarks/gpu_check.sh): each stage's exit and time, the
build's library check and GPU tests, the kernels' goals, the training table with ratios to DDP and
the issue's goals, CPU offload against FSDP2's, and the profile's numbers. Merges the stages' JSON files into OUT/summary.json
(the device tool brings back at most 8 files).

    python benchmarks/gpu_summary.py OUT
"""
import json
import re
import sys
from pathlib import Path

GOAL_1B_RATIO = 1.10  # ours at most 1.10x DDP's step on the ~1B GPT, peak memory at most FSDP2's


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def training_goals(rows):
    """(goal, met or None when not measured, detail)."""
    got = {(r["model"], r["framework"]): r for r in rows if "step_ms" in r}
    out = []
    ddp, ours, fsdp2 = (got.get(("gpt-large", f)) for f in ("ddp", "ours", "fsdp2"))
    if ddp and ours:
        ratio = ours["step_ms"] / ddp["step_ms"]
        out.append((f"1B: ours <= {GOAL_1B_RATIO:.2f}x DDP", ratio <= GOAL_1B_RATIO, f"{ratio:.2f}x"))
    else:
        out.append((f"1B: ours <= {GOAL_1B_RATIO:.2f}x DDP", None, "not measured"))
    if ours and fsdp2 and ours.get("peak_gib") is not None:
        out.append(("1B: peak memory <= FSDP2's", ours["peak_gib"] <= fsdp2["peak_gib"],
                    f"{ours['peak_gib']:.2f} vs {fsdp2['peak_gib']:.2f} GiB"))
    small = {f: got.get(("gpt-small", f)) for f in ("ours", "fsdp2", "megatron_fsdp")}
    if small["ours"] and (small["fsdp2"] or small["megatron_fsdp"]):
        peers = {f: r["step_ms"] for f, r in small.items() if r and f != "ours"}
        out.append(("small: ours ahead of both peers", all(small["ours"]["step_ms"] < v for v in peers.values())
                    and len(peers) == 2, ", ".join(f"{f} {v:.1f} ms" for f, v in peers.items())
                    + f", ours {small['ours']['step_ms']:.1f} ms"))
    return out


def offload_lines(rows):
    """The offload stage: each configuration's step, peak and host step, then ours against FSDP2 and
    the share of the host step the backward hid."""
    got = {r["framework"]: r for r in rows if "step_ms" in r}
    lines = []
    for r in rows:
        if "step_ms" in r:
            lines.append(f"    {r['framework']:<20} {r['step_ms']:>8.1f} ms, host step after the backward "
                         f"{r['opt_ms']:>7.1f} ms, peak {r['peak_gib'] if r['peak_gib'] is None else round(r['peak_gib'], 2)} GiB")
        else:
            lines.append(f"    {r['framework']:<20} {r['skipped'][:70]}")
    ours, after, fsdp2 = got.get("ours_offload"), got.get("ours_offload_after"), got.get("fsdp2_offload")
    if ours and fsdp2:
        lines.append(f"    ours / FSDP2 + CPUOffloadPolicy: step {ours['step_ms'] / fsdp2['step_ms']:.2f}x, peak "
                     f"{ours['peak_gib']:.2f} vs {fsdp2['peak_gib']:.2f} GiB")
    if ours and after and after["opt_ms"] > 0:
        lines.append(f"    host step hidden under the backward: {100 * (1 - ours['opt_ms'] / after['opt_ms']):.0f}% "
                     f"({after['opt_ms']:.1f} ms after the backward without, {ours['opt_ms']:.1f} ms with)")
    return lines


def main():
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_out")
    summary = {"stages": [], "kernels": load(out / "kernels.json"), "train": load(out / "train.json"),
               "offload": load(out / "offload.json"), "profile": load(out / "profile.json")}
    print("=" * 100)
    print("GPU check summary")
    for line in (out / "stages.txt").read_text().splitlines() if (out / "stages.txt").exists() else []:
        name, rc, secs, budget = line.split()
        summary["stages"].append(dict(stage=name, exit=int(rc), seconds=int(secs), budget=int(budget)))
        print(f"  stage {name:<8} exit {rc:>3}  {secs:>4} s of {budget} s")
    build = (out / "build.log").read_text(errors="replace") if (out / "build.log").exists() else ""
    libs = re.findall(r"^LIBRARIES (\w+)", build, re.M)
    tests = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", build, re.M)
    summary["libraries"], summary["tests"] = (libs or ["not reached"])[-1], (tests or ["not reached"])[-1]
    print(f"  build: libraries {summary['libraries']}; GPU tests: {summary['tests']}")
    k = summary["kernels"]
    if k:
        print(f"  kernels on {k['device']}: " + "; ".join(f"{g['goal']}: {'MET' if g['met'] else 'MISSED'} "
                                                      f"({g['detail']})" for g in k["goals"]))
        big = k["rows"][-1]
        print("    at " + f"{big['mb']} MB, GB/s: " + ", ".join(f"{n} {v:.0f}" for n, v in big.items() if n != "mb"))
    else:
        print("  kernels: no result")
    t = summary["train"]
    if t:
        print(f"  training on {t['device']} (torch {t['torch']}), median step and peak memory:")
        ddp = {r["model"]: r["step_ms"] for r in t["rows"] if r["framework"] == "ddp" and "step_ms" in r}
        for r in t["rows"]:
            if "step_ms" in r:
                ratio = f"{r['step_ms'] / ddp[r['model']]:.2f}x DDP" if r["model"] in ddp else ""
                print(f"    {r['model']:<10} {r['framework']:<16} {r['step_ms']:>8.1f} ms {ratio:>10} "
                      f"{r['peak_gib'] if r['peak_gib'] is None else round(r['peak_gib'], 2):>7} GiB")
            else:
                print(f"    {r['model']:<10} {r['framework']:<16} {r['skipped'][:70]}")
        summary["training_goals"] = [dict(goal=g, met=m, detail=d) for g, m, d in training_goals(t["rows"])]
        for g in summary["training_goals"]:
            print(f"    goal {g['goal']}: {'-' if g['met'] is None else 'MET' if g['met'] else 'MISSED'} ({g['detail']})")
    else:
        print("  training: no result")
    o = summary["offload"]
    print("  CPU offload, ~1B GPT:" if o else "  CPU offload: no result")
    for line in offload_lines(o["rows"]) if o else []:
        print(line)
    p = summary["profile"]
    if p and p.get("kernels"):
        print(f"  profile ({p['model']}, {p['steps']} steps): {p['profiled_wall_ms_per_step']:.1f} ms a step, GPU busy "
              f"{p['busy_ms_per_step']:.1f} ms; by kind (ms a step): "
              + ", ".join(f"{n} {v}" for n, v in p["ms_per_step_by_kind"].items()))
        for kind in ("all-gather", "reduce-scatter"):
            if kind in p:
                c = p[kind]
                print(f"    {kind}: {c['count_per_step']:.0f} a step, {c['ms_per_step']:.2f} ms, "
                      f"{100 * c['overlapped_share']:.0f}% of it under compute on another stream "
                      f"({c['mostly_overlapped']} kernels mostly hidden)")
    else:
        print(f"  profile: {p.get('note') if p else 'no result'}")
    print("=" * 100)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for name in ("kernels.json", "train.json", "offload.json", "profile.json", "stages.txt"):  # merged: 8 files come back at most
        (out / name).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
