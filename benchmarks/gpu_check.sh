#!/usr/bin/env bash
# The GPU check: one command on a lent GPU machine, about 7.5 minutes (the device tool's
# timeout_s 480), in five stages, each with its own time budget (enforced here: a stage that runs
# over is killed and reported, and the later stages keep their own budgets) and its own log in
# $OUT; a one-screen summary at the end (benchmarks/gpu_summary.py), so the reply's output tail
# holds the result even if no file comes back.
#
#   1. build   160 s  the CUDA build in place (MFSDP_CUDA=1) against the machine's torch; the
#                     libraries it maps (one libnccl, torch's; no libcudart of its own); tests/test_cuda.py
#                     (offload on the GPU included) and tests/test_cuda_setup.py
#   2. kernels  45 s  kernel GB/s against a device-to-device copy and torch's .to(bf16), 1 MB-1 GB
#                     (benchmarks/kernels.py); the host's optimizer step, FusedAdamW against
#                     torch's fused CPU AdamW, 100M parameters (benchmarks/optimizer.py, ~10 s)
#   3. train   140 s  the training step at world 1, DDP, FSDP2, Megatron-FSDP and both our APIs,
#                     the small GPT and the ~1B GPT (benchmarks/gpu_train.py)
#   4. offload  70 s  CPU offload on the ~1B GPT at world 1: FSDP2 + CPUOffloadPolicy + torch's
#                     fused CPU AdamW against ours stepping inside the backward and after it
#                     (benchmarks/gpu_train.py --frameworks fsdp2_offload,...): step time, GPU
#                     peak memory, how much of the host step the backward hides
#   5. profile  45 s  a torch-profiler trace of 3 steps of ours on the ~1B GPT, in numbers
#                     (benchmarks/gpu_profile.py)
#
#   benchmarks/gpu_check.sh                    # on the device: run(command=..., carry=[".whl"])
#   DRY_RUN=1 benchmarks/gpu_check.sh          # here, on a copy of the tree: every stage reaches
#                                              # its command; only what needs a GPU fails
#   STAGES="train profile" benchmarks/gpu_check.sh   # a rerun of the stages that failed (without
#                                              # `build`, the extension is still built, untested)
#
# Megatron-FSDP is the `megatron-fsdp` wheel, carried in .whl/ (the device has no network; its
# needs, torch, einops and packaging, are there): installed here into /tmp/site. Uses the
# machine's python3 ($PYTHON); nothing outside the working tree and /tmp changes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench_out}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
START=$SECONDS
echo "[gpu_check] $(date -u +%FT%TZ) $(hostname); dry run: $DRY_RUN; logs in $OUT"

# stage NAME BUDGET: the commands after it (a function) run within BUDGET seconds, logged.
stage() {
  local name=$1 budget=$2 fn=$3 t0=$SECONDS rc=0
  echo "[gpu_check] stage $name: budget $budget s (at $((SECONDS - START)) s)"
  timeout --kill-after=5 "$budget" bash -c "$(declare -f "$fn" say build); $fn" > "$OUT/$name.log" 2>&1 || rc=$?
  tail -n 4 "$OUT/$name.log" | sed "s/^/[gpu_check]   $name: /"
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "[gpu_check]   $name: OUT OF TIME after $budget s" >> "$OUT/$name.log"
  echo "[gpu_check] stage $name: exit $rc after $((SECONDS - t0)) s"
  echo "$name $rc $((SECONDS - t0)) $budget" >> "$OUT/stages.txt"
}
say() { echo "== $* (at $SECONDS s)"; }
# The CUDA build in place against the machine's torch (what every stage after it imports).
build() { rm -f megatron_fsdp_c/_C*.so; MFSDP_CUDA=1 "$PY" setup.py -q build_ext --inplace; }
export PY OUT DRY_RUN

build_stage() {
  say "machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  command -v nvcc > /dev/null && nvcc --version | tail -1
  say "CUDA build in place"
  build || { echo "BUILD FAILED"; exit 1; }
  so=$(ls megatron_fsdp_c/_C*.so)
  readelf -d "$so" | grep -E 'NEEDED|RUNPATH'
  say "libraries in one process (one libnccl, torch's; no libcudart of ours: cudart is static)"
  "$PY" - "$so" <<'EOF'
import ctypes, subprocess, sys
so = sys.argv[1]
subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print('dlopen without torch: ok')", so],
               check=True)
needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True).stdout
def mapped():
    return {l.split()[-1] for l in open("/proc/self/maps") if ".so" in l}
import torch
torchs = mapped()  # torch's CUDA wheels map their own libcudart.so.13 and libnccl.so.2
import megatron_fsdp_c
from megatron_fsdp_c import _C, _nccl
maps = mapped()
nccl = sorted(m for m in maps if "libnccl" in m)
cudart_torch = sorted(m for m in torchs if "libcudart" in m)
cudart_ours = sorted(m for m in maps - torchs if "libcudart" in m) + (["NEEDED libcudart"] if "libcudart" in needed else [])
print("libnccl mapped:", nccl, "(torch's)" if set(nccl) <= torchs else "(not torch's)",
      "| libcudart: torch's", cudart_torch, "ours", cudart_ours or "none")
print("NCCL: ours", _C.nccl_version(), "built against", _C.NCCL_BUILD_VERSION,
      "torch", torch.cuda.nccl.version() if torch.cuda.is_available() else "(no GPU here)")
_nccl.check_one_nccl()
print("LIBRARIES", "OK" if len(nccl) == 1 and not cudart_ours else "WRONG")
EOF
  say "GPU tests"
  "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rs tests/test_cuda.py tests/test_cuda_setup.py
}

kernels_stage() {
  "$PY" benchmarks/kernels.py --json "$OUT/kernels.json"
  say "host optimizer step (the CPU offload's side)"
  "$PY" benchmarks/optimizer.py --sizes 100 --repeats 5 --kinds fused,ours
}

train_stage() {
  [ "$DRY_RUN" = 1 ] && { say "smoke (CPU)"; "$PY" benchmarks/gpu_train.py --smoke; }
  "$PY" benchmarks/gpu_train.py --models gpt-large,gpt-small --steps 10 --warmup 3 --deadline 110 \
    --json "$OUT/train.json"
}

offload_stage() {
  "$PY" benchmarks/gpu_train.py --models gpt-large --frameworks fsdp2_offload,ours_offload,ours_offload_after \
    --steps 4 --warmup 1 --deadline 50 --json "$OUT/offload.json"
}

profile_stage() {
  [ "$DRY_RUN" = 1 ] && { say "smoke (CPU)"; "$PY" benchmarks/gpu_profile.py --smoke; }
  "$PY" benchmarks/gpu_profile.py --model gpt-large --steps 3 --json "$OUT/profile.json" \
    --trace "$OUT/trace.json.gz"
}

ALL_STAGES="build kernels train offload profile"
STAGES=${STAGES:-$ALL_STAGES}
for s in $STAGES; do
  [[ " $ALL_STAGES " == *" $s "* ]] || { echo "[gpu_check] STAGES: no stage '$s'; the stages are: $ALL_STAGES"; exit 2; }
done
want() { [[ " $STAGES " == *" $1 "* ]]; }
rm -f "$OUT/stages.txt"
if ! want build; then  # a rerun on a fresh machine: the later stages need the CUDA build
  echo "[gpu_check] CUDA build in place (stage build not asked for: no library check or tests)"
  build > "$OUT/build-only.log" 2>&1 || { tail -n 20 "$OUT/build-only.log"; echo "[gpu_check] BUILD FAILED"; }
fi
want build && stage build 160 build_stage
want kernels && stage kernels 45 kernels_stage
want train && stage train 140 train_stage
want offload && stage offload 70 offload_stage
want profile && stage profile 45 profile_stage
"$PY" benchmarks/gpu_summary.py "$OUT"
echo "[gpu_check] done in $((SECONDS - START)) s"
