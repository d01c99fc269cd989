"""The GPU check's CPU side (benchmarks/gpu_check.sh): its training and profile scripts in their
--smoke runs and its one-screen summary, so that what a lent GPU runs (minutes of device time,
one try) is proven here on every change first."""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench(script, *args):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, f"{script} {' '.join(args)}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_training_stage_smoke_runs_every_framework(tmp_path):
    """Every framework of the training and offload stages trains on the CPU, and the per-module API
    gives torch FSDP2's loss bit for bit in the check's own set-up (bf16 compute, fp32 main
    weights and gradients, AdamW), with and without CPU offload."""
    _bench("gpu_train.py", "--smoke", "--json", str(tmp_path / "train.json"))
    rows = {r["framework"]: r for r in json.loads((tmp_path / "train.json").read_text())["rows"]}
    assert set(rows) == {"ddp", "fsdp2", "megatron_fsdp", "ours", "ours_per_module", "fsdp2_offload", "ours_offload",
                         "ours_offload_after"}
    # Megatron-FSDP only where its wheel is importable (the check carries it), and it needs a GPU
    ran = {f: r for f, r in rows.items() if f != "megatron_fsdp"}
    assert all("step_ms" in r and math.isfinite(r["last_loss"]) for r in ran.values()), rows
    for f in ("ours_per_module", "fsdp2_offload", "ours_offload", "ours_offload_after"):
        assert rows[f]["last_loss"] == rows["fsdp2"]["last_loss"], (f, rows[f]["last_loss"], rows["fsdp2"]["last_loss"])
    assert all(rows[f]["opt_ms"] > 0 for f in ("fsdp2_offload", "ours_offload", "ours_offload_after"))


def test_summary_reads_every_stage(tmp_path):
    """The summary (the reply's output tail on the device) from the stages' files: the profile's
    smoke run as it comes, and the training and offload figures of a GPU run, where the issue's
    goals are judged."""
    _bench("gpu_profile.py", "--smoke", "--json", str(tmp_path / "profile.json"))
    assert json.loads((tmp_path / "profile.json").read_text())["kernels"] == 0  # no GPU kernels on the CPU
    (tmp_path / "stages.txt").write_text("build 0 31 160\nkernels 1 45 45\n")
    (tmp_path / "build.log").write_text("LIBRARIES OK\n== GPU tests (at 30 s)\n92 passed in 12.34s\n")

    def row(model, framework, ms, peak, **extra):
        return dict(framework=framework, model=model, step_ms=ms, peak_gib=peak, last_loss=1.0, **extra)
    train = [row("gpt-large", "ddp", 100.0, 20.0), row("gpt-large", "fsdp2", 136.0, 12.0),
             row("gpt-large", "ours", 105.0, 11.5), row("gpt-small", "ours", 9.0, 1.0),
             row("gpt-small", "fsdp2", 12.0, 1.0), dict(framework="megatron_fsdp", model="gpt-small",
                                                        skipped="failed: RuntimeError: out of time")]
    (tmp_path / "train.json").write_text(json.dumps(dict(device="H200", torch="2.11.0", rows=train)))
    offload = [row("gpt-large", "fsdp2_offload", 300.0, 6.0, opt_ms=120.0),
               row("gpt-large", "ours_offload", 200.0, 5.0, opt_ms=30.0),
               row("gpt-large", "ours_offload_after", 260.0, 5.0, opt_ms=120.0)]
    (tmp_path / "offload.json").write_text(json.dumps(dict(device="H200", torch="2.11.0", rows=offload)))

    out = _bench("gpu_summary.py", str(tmp_path))
    assert "stage build    exit   0    31 s of 160 s" in out and "stage kernels  exit   1" in out
    assert "build: libraries OK; GPU tests: 92 passed" in out
    assert "kernels: no result" in out
    assert "goal 1B: ours <= 1.10x DDP: MET (1.05x)" in out
    assert "goal 1B: peak memory <= FSDP2's: MET (11.50 vs 12.00 GiB)" in out
    # one peer failed: "ahead of both" is not met
    assert "goal small: ours ahead of both peers: MISSED" in out
    assert "ours / FSDP2 + CPUOffloadPolicy: step 0.67x" in out
    assert "host step hidden under the backward: 75%" in out
    assert "profile: no GPU kernels in the trace" in out
    summary = json.loads((tmp_path / "summary.json").read_text())  # the stages' files merged into one
    assert summary["libraries"] == "OK" and summary["train"]["rows"] == train and summary["profile"]["kernels"] == 0
    assert [g["met"] for g in summary["training_goals"]] == [True, True, False]
    assert not any((tmp_path / n).exists() for n in ("train.json", "offload.json", "profile.json", "stages.txt"))
