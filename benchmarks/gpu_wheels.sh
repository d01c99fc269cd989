#!/usr/bin/env bash
# Fetches what the GPU check carries to the lent machine (it has no network): the megatron-fsdp
# wheel (pure Python; its needs, torch, einops and packaging, are there), into .whl/, which git
# ignores through .git/info/exclude. Run here before the device call:
#   benchmarks/gpu_wheels.sh && run(command="benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=480)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .git/info
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-fsdp==0.6.1
ls -l .whl
