# Developer entry points. The README's two commands are `make example` and `make test`;
# both create .venv and install everything they need first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CC ?= gcc

# The collective pipeline, one file per concern, floor to roof (map at the top of csrc/comm/pipeline.c);
# setup.py's COMM lists the same files.
COMM_SRC := $(addprefix csrc/comm/,guards.c geometry.c buffers.c wire.c replicas.c reduce.c weights.c backward.c trainable.c \
	              pipeline.c)
CORE_SRC := csrc/core/status.c csrc/core/layout.c csrc/core/kernels_cpu.c csrc/core/quant_cpu.c csrc/core/cpu_table.c \
	           csrc/core/adam_cpu.c \
	           $(COMM_SRC)
C_TEST_FLAGS := -std=c11 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -fno-math-errno -Wall -Wextra -Werror \
	             -Wno-unused-parameter -Wno-missing-field-initializers -pthread -fopenmp -D_POSIX_C_SOURCE=200809L
TEST_CFLAGS := $(C_TEST_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=undefined
TEST_HARNESS_C := csrc/tests/harness.c csrc/tests/pipeline_cases.c
TEST_HARNESS := $(TEST_HARNESS_C) csrc/tests/harness.h csrc/tests/pipeline_cases.h
# The parts of test_core and test_emu, one file per concern (their runners call each by name).
TEST_CORE_C := $(addprefix csrc/tests/core/,test_kernels.c test_quant.c test_layout.c test_reduce.c test_replicas.c \
	             test_trainable.c test_adam.c test_misuse.c test_in_flight.c)
TEST_EMU_C := $(addprefix csrc/tests/cuda/,nccl_rig.c test_kernels.c test_emulator.c test_quant.c test_grouped.c \
	            test_hfsdp.c test_hangs.c)
# The CUDA half, floor to roof (maps at the top of csrc/cuda/kernels.cu and nccl_transport.c);
# setup.py's CUDA_CU and CUDA_C list the same files.
CUDA_CU := $(addprefix csrc/cuda/,kernels_cast.cu kernels_quant.cu kernels.cu)
CUDA_C := $(addprefix csrc/cuda/,nccl_watch.c nccl_collectives.c nccl_transport.c)
# The emulated device (csrc/tests/emu): the shipped CUDA kernels and NCCL transport, compiled for
# the host against an emulated CUDA runtime and NCCL.
CXX ?= g++
EMU_FLAGS := -O1 -g -fno-omit-frame-pointer -ffp-contract=off -Wall -Wextra -Werror -Wno-unused-parameter -pthread -fopenmp \
	           -fsanitize=address,undefined -fno-sanitize-recover=undefined -DMFSDP_WITH_CUDA -Icsrc/tests/emu
EMU_DEPS := csrc/tests/emu/cuda_runtime.h csrc/tests/emu/nccl.h csrc/tests/emu/emu_runtime.cpp \
	          csrc/tests/emu/host_kernels.py $(CUDA_CU) $(wildcard csrc/cuda/*.cuh) $(CUDA_C) csrc/tests/test_emu.c \
	          $(TEST_EMU_C) csrc/tests/cuda/cuda_tests.h
EMU_OBJ_DIR := csrc/tests/bin/emu
FUZZ_SECONDS ?= 20

.PHONY: setup example test compat ctest cuda-check pytest bench bench-quant asan asan-build tsan clean

$(VENV)/.ready: pyproject.toml setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 numpy pytest matplotlib transformers==5.23.0
	# tests/test_frameworks.py: accelerate and Lightning, pure Python (~10 MB, seconds). --no-deps: their
	# other requirements come with transformers above, and Lightning's extras (aiohttp, ...) are not needed.
	# tests/test_per_module_extensions.py: torchao's float8 and int8 training (its CUDA kernels do not
	# load on the CPU; the emulated paths the tests use need none).
	$(PY) -m pip install -q --no-deps accelerate==1.15.0 psutil==7.2.2 lightning==2.6.6 lightning-utilities==0.15.3 \
	  torchmetrics==1.9.0 torchao==0.18.0
	@touch $@

$(VENV)/.built: $(VENV)/.ready $(wildcard csrc/*/*.c csrc/*/*.h csrc/*/*.cu csrc/*/*.cuh) setup.py
	$(PY) -m pip install -q --no-build-isolation -e .
	@touch $@

setup: $(VENV)/.built

example: setup
	$(VENV)/bin/torchrun --nproc_per_node 2 examples/train_gpt.py

# test_core and fuzz_layout link the same sanitized objects: each source compiles once.
TEST_OBJ_DIR := csrc/tests/bin/obj
TEST_OBJS := $(patsubst csrc/%.c,$(TEST_OBJ_DIR)/%.o,$(CORE_SRC) $(TEST_HARNESS_C))
$(TEST_OBJ_DIR)/%.o: csrc/%.c $(wildcard csrc/*/*.h csrc/tests/*/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(TEST_CFLAGS) -c $< -o $@

csrc/tests/bin/test_core: $(TEST_OBJS) $(patsubst csrc/%.c,$(TEST_OBJ_DIR)/%.o,csrc/tests/test_core.c $(TEST_CORE_C))
	$(CC) $(TEST_CFLAGS) -o $@ $^ -lm

csrc/tests/bin/fuzz_layout: $(TEST_OBJS) $(TEST_OBJ_DIR)/tests/fuzz_layout.o
	$(CC) $(TEST_CFLAGS) -o $@ $^ -lm

csrc/tests/bin/test_emu: $(CORE_SRC) $(TEST_HARNESS) $(EMU_DEPS) $(wildcard csrc/*/*.h)
	@rm -rf $(EMU_OBJ_DIR) && mkdir -p $(EMU_OBJ_DIR)
	for f in $(CUDA_CU); do o=$(EMU_OBJ_DIR)/$$(echo $${f%.cu} | tr / _); \
	  $(PYTHON) csrc/tests/emu/host_kernels.py $$f $$o.cpp && \
	  $(CXX) -std=c++17 $(EMU_FLAGS) -Wno-unknown-pragmas -Icsrc/cuda -c $$o.cpp -o $$o.o || exit 1; done
	$(CXX) -std=c++17 $(EMU_FLAGS) -c csrc/tests/emu/emu_runtime.cpp -o $(EMU_OBJ_DIR)/emu_runtime.o
	for f in $(CUDA_C) csrc/tests/test_emu.c $(TEST_EMU_C) $(TEST_HARNESS_C) $(CORE_SRC); do \
	  $(CC) $(TEST_CFLAGS) -DMFSDP_WITH_CUDA -Icsrc/tests/emu -c $$f -o $(EMU_OBJ_DIR)/$$(echo $${f%.c} | tr / _).o || exit 1; done
	$(CXX) $(EMU_FLAGS) -o $@ $(EMU_OBJ_DIR)/*.o -lm

# The engine's real thread mix (csrc/tests/test_threads.c): under ASan here, one repetition (about
# 5 s); under ThreadSanitizer in make tsan.
csrc/tests/bin/test_threads: $(TEST_OBJS) $(TEST_OBJ_DIR)/tests/test_threads.o
	$(CC) $(TEST_CFLAGS) -o $@ $^ -lm

ctest: csrc/tests/bin/test_core csrc/tests/bin/fuzz_layout csrc/tests/bin/test_emu csrc/tests/bin/test_threads
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 csrc/tests/bin/test_core
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 csrc/tests/bin/test_threads 1
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 csrc/tests/bin/test_emu
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 csrc/tests/bin/fuzz_layout $(FUZZ_SECONDS)

# The CUDA kernels and the NCCL transport must compile and link wherever nvcc is, GPU or not.
# The NCCL headers come with the nvidia-nccl-cu13 wheel (installed before pytest starts: see test).
$(VENV)/.nccl: $(VENV)/.ready
	@if command -v nvcc >/dev/null 2>&1; then $(PY) -m pip install -q nvidia-nccl-cu13; fi
	@touch $@

cuda-check: $(VENV)/.nccl
	@if command -v nvcc >/dev/null 2>&1; then \
	  MFSDP_CUDA=1 $(PY) setup.py -q build_ext --build-temp build/cuda/tmp --build-lib build/cuda/lib && \
	  for f in $(CUDA_CU); do ptx=build/cuda/$$(basename $$f .cu).ptx; \
	    nvcc -ptx -O3 -std=c++17 -arch=compute_$${MFSDP_CUDA_ARCH:-90} --expt-relaxed-constexpr $$f -o $$ptx || exit 1; \
	    if grep -n 'fma\.' $$ptx | head -3 | grep .; then \
	      echo "cuda-check: $$f contracts multiply-add into FMA (see [Note: no FMA])"; exit 1; fi; done && \
	  if readelf -d build/cuda/lib/megatron_fsdp_c/_C*.so | grep -E 'NEEDED.*lib(cudart|cuda)\.so'; then \
	    echo "cuda-check: the extension needs a shared CUDA runtime (cudart must be static: setup.py)"; exit 1; fi && \
	  echo "cuda-check: CUDA kernels + NCCL transport compiled and linked (build/cuda/lib), no FMA in the kernels," \
	    "no shared CUDA runtime"; \
	else echo "cuda-check: nvcc not found, CUDA build skipped"; fi

pytest: setup
	$(PY) -m pytest -q tests

# [Note: make test's two sides]
# The C side (the sanitized builds, test_core, test_emu, the fuzz run and the CUDA compile check)
# is single-threaded compiling and running, about 2.5 minutes; the set-up (pip unpacking torch)
# and pytest's multi-rank spawns leave part of the second core idle. So the C tests start first,
# beside the set-up (they need only the C compiler), and the CUDA compile check, which needs the
# venv's torch and the NCCL wheel, starts when the set-up is done, beside pytest. Their output
# goes to build/c-side.log, printed when both sides are done; make test fails if either does.
# `make ctest`, `make cuda-check` and `make pytest` run one part alone.
test:
	@mkdir -p build && rm -f build/c-side.status build/setup.status
	@( $(MAKE) --no-print-directory ctest > build/c-side.log 2>&1; c=$$?; \
	   while [ ! -e build/setup.status ]; do sleep 1; done; \
	   if [ "$$(cat build/setup.status)" = 0 ]; then $(MAKE) --no-print-directory cuda-check >> build/c-side.log 2>&1 || c=1; \
	   else c=1; fi; echo $$c > build/c-side.status ) & \
	  $(MAKE) --no-print-directory setup $(VENV)/.nccl; echo $$? > build/setup.status; \
	  if [ "$$(cat build/setup.status)" = 0 ]; then $(PY) -m pytest -q tests; py=$$?; else py=1; fi; wait; \
	  echo "== the C side: make ctest cuda-check (build/c-side.log) =="; cat build/c-side.log; \
	  c=$$(cat build/c-side.status 2>/dev/null || echo 1); \
	  echo "== make test: pytest exit $$py, C side exit $$c =="; [ "$$py" = 0 ] && [ "$$c" = 0 ]

# The compatibility pass on one torch of the supported range ([Note: supported torch versions] in
# megatron_fsdp_c/_torch_compat.py): a fresh venv with PyPI's torch==$(TORCH), the install line
# of docs/setup.md, the example and the pytest suite, on a copy of the tree (.ci/compat says what and how long).
# CI runs it at both ends: make compat TORCH=2.11.0 and TORCH=2.15.0.
compat:
	TORCH=$(TORCH) PYTHON=$(PYTHON) .ci/compat

bench: setup
	$(VENV)/bin/python benchmarks/run.py

# CPU throughput of the quantization kernels (a C micro-benchmark; ARGS="n block" to change).
build/bench/quant_cpu: benchmarks/quant_cpu.c $(CORE_SRC) $(wildcard csrc/*/*.h)
	@mkdir -p build/bench
	$(CC) -std=c11 -O3 -ffp-contract=off -fno-strict-aliasing -D_POSIX_C_SOURCE=200809L -o $@ benchmarks/quant_cpu.c \
	  csrc/core/status.c csrc/core/kernels_cpu.c csrc/core/quant_cpu.c

bench-quant: build/bench/quant_cpu
	build/bench/quant_cpu $(ARGS)

# The sanitized pass ([Note: the sanitized build] in setup.py): _C built with ASan + UBSan into
# build/asan/pkg (a copy of the package with that _C, first on PYTHONPATH: the editable install's
# finder comes after it; PYTHONSAFEPATH: not the checkout before it), then the stress harness (benchmarks/stress.py) for ASAN_BUDGET_S seconds
# and ASAN_TESTS under it; output in build/asan/*.log. Why each setting:
# - LD_PRELOAD: Python is not linked with ASan, so its runtime must be the first library loaded;
#   libstdc++ with it: ASan binds its __cxa_throw interceptor to the real one when it starts, and
#   Python loads libstdc++ only with torch, later: without it the first C++ exception (torch's
#   error out of a Python hook in a backward) stops the process in ASan's own CHECK
#   (asan_interceptors.cpp:320 "real___cxa_throw != 0"), no fault of the program;
# - detect_leaks=0: CPython and torch keep their interned objects and caches to the end (thousands
#   of "leaks" at exit that are no fault; the C tests, make ctest, check our own leaks);
# - abort_on_error=1 and halt_on_error=1: the first report kills the rank, which the harness and
#   the grids report with its stderr (the report); any report fails the run;
# - UBSAN_OPTIONS print_stacktrace=1: where; the build makes every UB report fatal.
ASAN_BUDGET_S ?= 300
ASAN_TESTS ?= tests/test_fused_adam.py tests/test_backward_step.py tests/test_offload.py
ASAN_ENV := LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so.6)" PYTHONPATH=$(CURDIR)/build/asan/pkg PYTHONSAFEPATH=1 \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 MFSDP_SANITIZE=address
asan-build: setup
	MFSDP_SANITIZE=address MFSDP_CUDA=0 $(PY) setup.py -q build_ext --build-temp build/asan/tmp --build-lib build/asan/lib
	rm -rf build/asan/pkg && mkdir -p build/asan/pkg && cp -r megatron_fsdp_c build/asan/pkg/
	rm -f build/asan/pkg/megatron_fsdp_c/_C*.so && cp build/asan/lib/megatron_fsdp_c/_C*.so build/asan/pkg/megatron_fsdp_c/
	$(ASAN_ENV) $(PY) -c "import megatron_fsdp_c, os; assert megatron_fsdp_c.__file__.startswith(os.path.abspath('build/asan/pkg')), megatron_fsdp_c.__file__"

asan: asan-build
	$(ASAN_ENV) $(PY) benchmarks/stress.py --budget-s $(ASAN_BUDGET_S) --threads 1,2 --jitter-ms 2 \
	  > build/asan/stress.log 2>&1; rc=$$?; sed -n '/ failures\/runs = /,$$p' build/asan/stress.log | tail -n 150; [ $$rc = 0 ]
	$(ASAN_ENV) $(PY) -m pytest -q -p no:cacheprovider $(ASAN_TESTS) > build/asan/pytest.log 2>&1; rc=$$?; \
	  tail -n 5 build/asan/pytest.log; [ $$rc = 0 ]

# The ThreadSanitizer pass over the threaded C test (csrc/tests/test_threads.c says what runs at
# once and what TSan cannot see): the engine, the fused step and the test built with
# -fsanitize=thread, TSAN_REPS repetitions of each case. Any report fails it (exit 66). Why each
# setting: OMP_WAIT_POLICY=passive: a libgomp team spins between regions, and on 2 cores a dozen
# instrumented spinning threads (ranks, sealers, workers and their teams) took the first run past
# 600 s, 34 s with it (the waits are futexes, not a program change); the suppression file's one
# line is the OpenMP region's own prologue ([Note: the team under ThreadSanitizer] in
# csrc/core/adam_cpu.c).
TSAN_REPS ?= 3
TSAN_CFLAGS := $(C_TEST_FLAGS) -fsanitize=thread
csrc/tests/bin/tsan/test_threads: $(CORE_SRC) csrc/tests/harness.c csrc/tests/test_threads.c $(wildcard csrc/*/*.h)
	@mkdir -p $(dir $@)
	$(CC) $(TSAN_CFLAGS) -o $@ $(CORE_SRC) csrc/tests/harness.c csrc/tests/test_threads.c -lm

tsan: csrc/tests/bin/tsan/test_threads
	OMP_WAIT_POLICY=passive TSAN_OPTIONS="halt_on_error=1 exitcode=66 suppressions=$(CURDIR)/csrc/tests/tsan.supp" \
	  csrc/tests/bin/tsan/test_threads $(TSAN_REPS)

clean:
	rm -rf build csrc/tests/bin megatron_fsdp_c/*.so *.egg-info
