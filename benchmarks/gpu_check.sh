#!/usr/bin/env bash
# On a lent GPU machine (its own Python with CUDA torch): build from source with CUDA, run the
# GPU tests, the kernel report and the one-GPU training benchmark. Used through the device tool.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-bench_out}
mkdir -p "$LOG_DIR"
exec > >(tee "$LOG_DIR/gpu_check.log") 2>&1  # everything below is also kept for the report
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
$PY -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
$PY -c "import megatron_fsdp_c._C as c; assert hasattr(c, 'NcclTransport'), 'not a CUDA build'"
failed=0  # a failing step is reported, the rest still run
$PY -m pytest -q tests/test_cuda.py -p no:cacheprovider || failed=1
$PY benchmarks/kernels.py || failed=1
$PY benchmarks/run.py --worlds 1 --steps 20 --out "$LOG_DIR/gpu" || failed=1
exit $failed
