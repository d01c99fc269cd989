#!/usr/bin/env bash
# On a lent GPU machine (its own Python with CUDA torch): build from source with CUDA, run the
# GPU tests, the kernel report and the one-GPU training benchmark. Used through the device tool.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -2
$PY -c "import megatron_fsdp_c._C as c; assert hasattr(c, 'NcclTransport'), 'not a CUDA build'"
$PY -m pytest -q tests/test_cuda.py -p no:cacheprovider
$PY benchmarks/kernels.py
$PY benchmarks/run.py --worlds 1 --steps 20 --out "${OUT:-bench_out}/gpu"
