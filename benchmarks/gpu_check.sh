#!/usr/bin/env bash
# The GPU check, in stages: each is one command on a lent GPU machine (10 minutes a command,
# 30 minutes a session), with its own time budget, enforced here, and its own log in $OUT.
#
#   benchmarks/gpu_check.sh build          # <= 6 min: CUDA build, library check, GPU tests
#   benchmarks/gpu_check.sh kernels        # <= 3 min: kernel bandwidth report
#   benchmarks/gpu_check.sh train-small    # <= 8 min: one-GPU training benchmark, gpt-small
#   benchmarks/gpu_check.sh train-large    # <= 8 min: the same, gpt-large (0.9B parameters)
#   benchmarks/gpu_check.sh hooks          # <= 3 min: hook overhead (64 tiny units)
#
# Run them in this order: a later stage builds first if this machine has no CUDA build yet (a
# fresh machine: about a minute of its budget). Uses the machine's own Python with a CUDA torch
# ($PYTHON, default python3); the extension is built in place (no pip), so nothing outside the
# working tree changes. Training stages run megatron_fsdp_c with the native NCCL transport
# ($TRANSPORT, default nccl) issuing real collectives on one GPU (single_rank_collectives), and
# $STEPS timed steps (default 20).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-}
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-bench_out}
STEPS=${STEPS:-20}
TRANSPORT=${TRANSPORT:-nccl}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

case "$STAGE" in
  build) BUDGET=360 ;;
  kernels) BUDGET=180 ;;
  train-small | train-large) BUDGET=480 ;;
  hooks) BUDGET=180 ;;
  *)
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2 ;;
esac
mkdir -p "$LOG_DIR"
exec > >(tee "$LOG_DIR/gpu_check-$STAGE.log") 2>&1  # everything below is kept for the report
DEADLINE=$((SECONDS + BUDGET))
echo "[gpu_check] stage $STAGE, budget ${BUDGET} s, $(date -u +%FT%TZ)"

# Runs a step within what is left of the stage's budget: a step that overruns is killed and
# reported, so the stage ends (with its log) before the device tool's own limit.
step() {
  local left=$((DEADLINE - SECONDS))
  echo "[gpu_check] $* (at most ${left} s)"
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$left" "$@" || rc=$?
  echo "[gpu_check]   -> exit $rc after $((SECONDS - t0)) s"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "[gpu_check] OUT OF TIME in stage $STAGE"; fi
  return "$rc"
}

built() {
  "$PY" -c "import megatron_fsdp_c._C as c; assert hasattr(c, 'NcclTransport')" 2>/dev/null
}

build() {
  step env MFSDP_CUDA=1 "$PY" setup.py -q build_ext --inplace && built
}

if [ "$STAGE" = build ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" || true
  command -v nvcc && nvcc --version | tail -1
  build
  so=$(ls megatron_fsdp_c/_C*.so)
  echo "[gpu_check] $so: dynamic libraries (one libnccl, no libcudart: the runtime is static)"
  readelf -d "$so" | grep -E 'NEEDED|RUNPATH'
  ldd "$so" | grep -E 'nccl|cudart' || true
  # loads with and without torch first; one libnccl in the process, the version torch runs
  step "$PY" - <<'EOF'
import ctypes, glob, subprocess, sys
so = glob.glob("megatron_fsdp_c/_C*.so")[0]
code = "import ctypes,sys; ctypes.CDLL(sys.argv[1]); print('raw dlopen without torch: ok')"
subprocess.run([sys.executable, "-c", code, so], check=True)
import megatron_fsdp_c
from megatron_fsdp_c import _C, _nccl
import torch
libs = _nccl.loaded_nccl_libraries()
print("libnccl mapped:", libs, "| libcudart mapped:", sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcudart" in l}))
print("NCCL: ours", _C.nccl_version(), "built against", _C.NCCL_BUILD_VERSION,
      "torch", torch.cuda.nccl.version() if torch.cuda.is_available() else "(no GPU here)")
_nccl.check_one_nccl()
EOF
  step "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_setup.py
  exit 0
fi

built || build
case "$STAGE" in
  kernels) step "$PY" benchmarks/kernels.py ;;
  train-small | train-large)
    step "$PY" benchmarks/run.py --worlds 1 --models "gpt-${STAGE#train-}" --parts train --steps "$STEPS" \
      --transport "$TRANSPORT" --out "$LOG_DIR/$STAGE" ;;
  hooks) step "$PY" benchmarks/run.py --worlds 1 --parts hooks --steps "$STEPS" --out "$LOG_DIR/hooks" ;;
esac
