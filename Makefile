# Developer entry points. The README's two commands are `make example` and `make test`;
# both create .venv and install everything they need first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CC ?= gcc

CORE_SRC := csrc/core/status.c csrc/core/layout.c csrc/core/kernels_cpu.c csrc/comm/pipeline.c
TEST_CFLAGS := -std=c11 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -Wall -Wextra -Werror \
	             -Wno-unused-parameter -Wno-missing-field-initializers -pthread -D_POSIX_C_SOURCE=200809L \
	             -fsanitize=address,undefined -fno-sanitize-recover=undefined
FUZZ_SECONDS ?= 20

.PHONY: setup example test ctest cuda-check pytest bench clean

$(VENV)/.ready: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 numpy pytest matplotlib
	@touch $@

$(VENV)/.built: $(VENV)/.ready $(wildcard csrc/*/*.c csrc/*/*.h csrc/*/*.cu) setup.py
	$(PY) -m pip install -q --no-build-isolation -e .
	@touch $@

setup: $(VENV)/.built

example: setup
	$(VENV)/bin/torchrun --nproc_per_node 2 examples/train_gpt.py

csrc/tests/bin/test_core: $(CORE_SRC) csrc/tests/test_core.c csrc/tests/harness.c csrc/tests/harness.h $(wildcard csrc/*/*.h)
	@mkdir -p csrc/tests/bin
	$(CC) $(TEST_CFLAGS) -o $@ csrc/tests/test_core.c csrc/tests/harness.c $(CORE_SRC) -lm

csrc/tests/bin/fuzz_layout: $(CORE_SRC) csrc/tests/fuzz_layout.c csrc/tests/harness.c csrc/tests/harness.h $(wildcard csrc/*/*.h)
	@mkdir -p csrc/tests/bin
	$(CC) $(TEST_CFLAGS) -o $@ csrc/tests/fuzz_layout.c csrc/tests/harness.c $(CORE_SRC) -lm

ctest: csrc/tests/bin/test_core csrc/tests/bin/fuzz_layout
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 csrc/tests/bin/test_core
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 csrc/tests/bin/fuzz_layout $(FUZZ_SECONDS)

# The CUDA kernels and the NCCL transport must compile and link wherever nvcc is, GPU or not.
cuda-check: $(VENV)/.ready
	@if command -v nvcc >/dev/null 2>&1; then \
	  $(PY) -m pip install -q nvidia-nccl-cu13 && \
	  MFSDP_CUDA=1 $(PY) setup.py -q build_ext --build-temp build/cuda/tmp --build-lib build/cuda/lib && \
	  echo "cuda-check: CUDA kernels + NCCL transport compiled and linked (build/cuda/lib)"; \
	else echo "cuda-check: nvcc not found, CUDA build skipped"; fi

pytest: setup
	$(PY) -m pytest -q tests

test: ctest cuda-check pytest

bench: setup
	$(VENV)/bin/python benchmarks/run.py

clean:
	rm -rf build csrc/tests/bin megatron_fsdp_c/*.so *.egg-info
