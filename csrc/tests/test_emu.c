/* test_emu.c: the shipped CUDA kernels (csrc/cuda/kernels.cu) and native NCCL transport
 * (csrc/cuda/nccl_transport.c) on the emulated device of csrc/tests/emu, for machines without
 * a GPU. Ranks are threads, each with its own "device", current stream and communicators.
 *
 *  - kernels: every dtype pair, aligned and misaligned, sizes around the vector width and past
 *    several grid strides, bit-identical to the CPU kernels; the one-launch pack; NaN counts;
 *    refusals with file:line.
 *  - the emulator's timing knobs and per-record events (emu/cuda_runtime.h).
 *  - quant: quantize and dequantize of every mode and float dtype, bit-identical to the CPU
 *    kernels (wire bytes and values), sizes 1 to 100003 with odd tails, blocks of 1-4100,
 *    misaligned sources, destinations and pieces; pieces of an all-to-all in one launch; the
 *    copy-out of ranges of W pieces in one launch per table, with a full memory pool.
 *  - the pipeline cases of pipeline_cases.c through NCCL transport + CUDA kernels, world 1-4,
 *    with stream-ordered frees (a buffer freed too early is an AddressSanitizer error), once as
 *    they come, once with every stream operation delayed at random (other interleavings) and
 *    once with every rank's stream deferred until its host synchronizes (a host that touches
 *    memory its stream has yet to use fails on every run).
 *  - a unit of three buckets (fp32, bf16, fp64) gathered as one NCCL group and read by the
 *    consumer stream straight after the wait.
 *  - HFSDP (2 replicas x 2 shards) over two steps of three microbatches, as it comes and with
 *    streams deferred or slowed (hf_modes): the collectives inside and across the replicas must
 *    be ordered by events, not by timing.
 *  - the watchdog: a collective a peer never joins aborts the communicators within the timeout
 *    and the next call raises MFSDP_ERR_TIMEOUT; the peer then sees MFSDP_ERR_NCCL.
 *
 * Built with AddressSanitizer and UndefinedBehaviorSanitizer by `make ctest`. */
#include <math.h>
#include <time.h>

#include "../cuda/mfsdp_cuda.h"
#include "../cuda/mfsdp_nccl.h"
#include "harness.h"
#include "pipeline_cases.h"

static void nap(double seconds) {
  struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* kernels: the CUDA table against the CPU one, bit for bit */

typedef struct kernel_rig {
  void* ctx;
  cudaStream_t stream;
} kernel_rig;

/* dst[shift..] <- src[shift..] through both tables; shift misaligns the 16-byte vector path. */
static void expect_binary(kernel_rig* k, int dt, int st, int64_t n, int shift, double alpha, int accumulate) {
  uint64_t rng = (uint64_t)(dt * 131 + st * 17 + n + shift);
  size_t bytes = (size_t)(n + 8) * 8;
  char* src = malloc(bytes);
  char* want = malloc(bytes);
  char* got = malloc(bytes);
  fill_test_values(src, st, n + 8, &rng);
  fill_test_values(want, dt, n + 8, &rng);
  memcpy(got, want, bytes);
  void* s = src + shift * mfsdp_dtype_size(st);
  int64_t off = shift * mfsdp_dtype_size(dt);
  mfsdp_status cpu = accumulate ? mfsdp_cpu_accumulate(want + off, dt, s, st, n, alpha)
                                : mfsdp_cpu_copy(want + off, dt, s, st, n, alpha);
  mfsdp_status gpu = accumulate ? mfsdp_cuda_kernels->accumulate(k->ctx, got + off, dt, s, st, n, alpha)
                                : mfsdp_cuda_kernels->copy(k->ctx, got + off, dt, s, st, n, alpha);
  cudaStreamSynchronize(k->stream);
  CHECK(cpu == MFSDP_OK && gpu == MFSDP_OK, "%s<-%s: %s", mfsdp_dtype_name(dt), mfsdp_dtype_name(st), mfsdp_last_error());
  int64_t wrong = count_differences(want, got, dt, n + 8); /* includes the untouched edges */
  CHECK(wrong == 0, "%s %s<-%s n=%lld shift=%d alpha=%g: %lld elements differ from the CPU kernel",
        accumulate ? "accumulate" : "copy", mfsdp_dtype_name(dt), mfsdp_dtype_name(st), (long long)n, shift, alpha,
        (long long)wrong);
  free(src);
  free(want);
  free(got);
}

/* A bucket of items from mixed source dtypes, packed (or accumulated) by both tables. */
static void expect_pack(kernel_rig* k, int dt, double alpha, int accumulate) {
  enum { ITEMS = 23 };
  uint64_t rng = (uint64_t)(dt * 7 + accumulate + 1);
  mfsdp_pack_item items[ITEMS];
  void* srcs[ITEMS];
  int64_t total = 0;
  for (int i = 0; i < ITEMS; ++i) {
    int64_t n = i == 5 ? 0 : i == 9 ? 40000 : rng_range(&rng, 1, 700); /* an empty item, a long one */
    int st = i < 8 ? MFSDP_F32 : i < 15 ? MFSDP_BF16 : i < 19 ? MFSDP_F32 : MFSDP_F64; /* runs of dtypes */
    srcs[i] = malloc((size_t)(n + 1) * 8);
    fill_test_values(srcs[i], st, n, &rng);
    total += rng_range(&rng, 0, 3); /* holes between items */
    items[i] = (mfsdp_pack_item){srcs[i], st, total, n};
    total += n;
  }
  size_t bytes = (size_t)total * 8 + 8;
  char* want = malloc(bytes);
  char* got = malloc(bytes);
  fill_test_values(want, dt, total, &rng);
  memcpy(got, want, bytes);
  CHECK_OK(mfsdp_cpu_pack(want, dt, items, ITEMS, alpha, accumulate));
  CHECK_OK(mfsdp_cuda_kernels->pack(k->ctx, got, dt, items, ITEMS, alpha, accumulate));
  cudaStreamSynchronize(k->stream);
  int64_t wrong = count_differences(want, got, dt, total);
  CHECK(wrong == 0, "pack into %s alpha=%g accumulate=%d: %lld elements differ", mfsdp_dtype_name(dt), alpha,
        accumulate, (long long)wrong);
  for (int i = 0; i < ITEMS; ++i) free(srcs[i]);
  free(want);
  free(got);
}

/* A bucket pack while torch's caching allocator holds every byte of the device: the kernels
 * may not allocate (no stream-ordered table, no pageable upload), and a pack of more items
 * than one launch's table takes still lands in one call. */
static void expect_pack_with_full_pool(kernel_rig* k, int device) {
  enum { ITEMS = 3000 };
  mfsdp_pack_item* items = calloc(ITEMS, sizeof *items);
  float* src = malloc(ITEMS * 5 * sizeof *src);
  float* want = calloc(ITEMS * 6, sizeof *want);
  float* got = calloc(ITEMS * 6, sizeof *got);
  uint64_t rng = 11;
  fill_test_values(src, MFSDP_F32, ITEMS * 5, &rng);
  for (int i = 0; i < ITEMS; ++i) /* runs of 0-4 elements, one gap each */
    items[i] = (mfsdp_pack_item){src + 5 * i, MFSDP_F32, 6 * i + 1, i % 5};
  size_t held = emu_device_memory_free(device);
  CHECK(emu_device_reserve(device, (long long)held), "torch takes the whole pool");
  long allocations = emu_runtime_allocations();
  CHECK_OK(mfsdp_cpu_pack(want, MFSDP_F32, items, ITEMS, 1.0 / 3.0, 1));
  CHECK_OK(mfsdp_cuda_kernels->pack(k->ctx, got, MFSDP_F32, items, ITEMS, 1.0 / 3.0, 1));
  int64_t bad = -1;
  CHECK_OK(mfsdp_cuda_kernels->count_nonfinite(k->ctx, got, MFSDP_F32, ITEMS * 6, &bad));
  cudaStreamSynchronize(k->stream);
  CHECK(count_differences(want, got, MFSDP_F32, ITEMS * 6) == 0, "pack of %d items with a full pool differs", ITEMS);
  CHECK(emu_runtime_allocations() == allocations, "the kernels allocated device memory %ld times",
        emu_runtime_allocations() - allocations);
  emu_device_reserve(device, -(long long)held);
  free(items);
  free(src);
  free(want);
  free(got);
}

static void test_kernels(void) {
  /* The engine's tensors and torch's stream are on device 1 while the calling thread's current
   * device is 0 (a rank that never called torch.cuda.set_device): every entry point must make
   * its own device current, and give the caller's back. */
  const int device = 1;
  kernel_rig k;
  cudaSetDevice(device);
  cudaStreamCreateWithPriority(&k.stream, cudaStreamNonBlocking, 0);
  CHECK_OK(mfsdp_cuda_kernel_context(device, &k.ctx));
  mfsdp_cuda_set_stream(k.ctx, k.stream);
  cudaSetDevice(0);
  /* 2 SMs x 8 blocks x 256 threads: 4096 threads, so 100003 elements take several strides */
  const int64_t sizes[] = {1, 7, 8, 9, 1031, 100003};
  for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt)
    for (int st = 0; st < MFSDP_NUM_FLOAT_DTYPES; ++st)
      for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; ++z)
        for (int shift = 0; shift < 2; ++shift) {
          expect_binary(&k, dt, st, sizes[z], shift, 1.0, 0);
          expect_binary(&k, dt, st, sizes[z], shift, 1.0 / 3.0, 0);
          expect_binary(&k, dt, st, sizes[z], shift, 0.25, 1);
          expect_binary(&k, dt, st, sizes[z], shift, 1.0 / 3.0, 1); /* not a power of two: no FMA */
        }
  for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt)
    for (int acc = 0; acc < 2; ++acc) {
      expect_pack(&k, dt, 1.0, acc);
      expect_pack(&k, dt, 0.125, acc);
      expect_pack(&k, dt, 1.0 / 3.0, acc);
    }
  expect_pack_with_full_pool(&k, device);
  int current = -1;
  cudaGetDevice(&current);
  CHECK(current == 0, "a kernel entry point left device %d current (the caller's was 0)", current);
  /* scale and fill_zero */
  float x[1000], y[1000];
  uint64_t rng = 5;
  fill_test_values(x, MFSDP_F32, 1000, &rng);
  memcpy(y, x, sizeof x);
  CHECK_OK(mfsdp_cpu_scale(x + 1, MFSDP_F32, 998, 0.5));
  CHECK_OK(mfsdp_cuda_kernels->scale(k.ctx, y + 1, MFSDP_F32, 998, 0.5));
  cudaStreamSynchronize(k.stream);
  CHECK(count_differences(x, y, MFSDP_F32, 1000) == 0, "scale differs");
  CHECK_OK(mfsdp_cuda_kernels->fill_zero(k.ctx, y + 3, MFSDP_F32, 990));
  cudaStreamSynchronize(k.stream);
  CHECK(y[3] == 0.0f && y[992] == 0.0f && y[993] == x[993] && y[2] == x[2], "fill_zero covers exactly its range");
  /* fill (the used-parameter flags, [Note: flag tail] in core/mfsdp_layout.h): every dtype, as the
   * CPU stores the value, exactly its range, on device 1 while device 0 is current */
  for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt) {
    const double values[3] = {1.0, -2.5, 1.0 / 3.0};
    for (int v = 0; v < 3; ++v) {
      char want[1100 * 8], got[1100 * 8];
      fill_test_values(want, dt, 1100, &rng);
      memcpy(got, want, sizeof got);
      CHECK_OK(mfsdp_cpu_fill(want + 3 * mfsdp_dtype_size(dt), dt, 1093, values[v]));
      CHECK_OK(mfsdp_cuda_kernels->fill(k.ctx, got + 3 * mfsdp_dtype_size(dt), dt, 1093, values[v]));
      cudaStreamSynchronize(k.stream);
      CHECK(count_differences(want, got, dt, 1100) == 0, "fill %s with %g differs from the CPU's",
            mfsdp_dtype_name(dt), values[v]);
      CHECK(load_as_double(got, dt, 3) != 0.0 && load_as_double(got, dt, 1095) == load_as_double(want, dt, 1095),
            "fill %s: its range, nothing past it", mfsdp_dtype_name(dt));
    }
  }
  int32_t no_float[2] = {0};
  CHECK(mfsdp_cuda_kernels->fill(k.ctx, no_float, MFSDP_I32, 2, 1.0) == MFSDP_ERR_UNSUPPORTED, "fill of ints refused");
  /* NaN / Inf counts */
  for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt) {
    char buf[70001 * 8];
    fill_test_values(buf, dt, 70001, &rng);
    int64_t want = -1, got = -2;
    CHECK_OK(mfsdp_cpu_count_nonfinite(buf, dt, 70001, &want));
    CHECK_OK(mfsdp_cuda_kernels->count_nonfinite(k.ctx, buf, dt, 70001, &got));
    CHECK(want == got && want > 0, "count_nonfinite %s: cpu %lld cuda %lld", mfsdp_dtype_name(dt), (long long)want,
          (long long)got);
  }
  /* refusals name the file and line */
  int32_t ints[4] = {0};
  CHECK(mfsdp_cuda_kernels->copy(k.ctx, x, MFSDP_F32, ints, MFSDP_I32, 4, 1.0) == MFSDP_ERR_UNSUPPORTED,
        "int -> float refused");
  CHECK(strstr(mfsdp_last_error(), "kernels_internal.cuh:") != NULL, "error names kernels_internal.cuh (the dtype "
        "dispatch): %s", mfsdp_last_error());
  CHECK(mfsdp_cuda_kernels->copy(k.ctx, x, MFSDP_F32, y, MFSDP_F32, -1, 1.0) == MFSDP_ERR_INVALID_ARGUMENT,
        "negative count refused");
  CHECK(mfsdp_cuda_kernels->copy(k.ctx, NULL, MFSDP_F32, y, MFSDP_F32, 4, 1.0) == MFSDP_ERR_INVALID_ARGUMENT,
        "null buffer refused");
  cudaStreamSynchronize(k.stream);
  mfsdp_cuda_set_stream(k.ctx, NULL);
  cudaStreamDestroy(k.stream);
}

/* ------------------------------------------------------------------------------------------ */
/* the emulator's own promises: the timing knobs the stress runs rely on, and events that
 * concern one record each (as in CUDA) */

static void set_flag(void* arg) { *(_Atomic int*)arg = 1; }

static double seconds_since(const struct timespec* a);

static void test_emulator(void) {
  cudaStream_t deferred, other, fast;
  cudaStreamCreateWithPriority(&deferred, cudaStreamNonBlocking, 0);
  cudaStreamCreateWithPriority(&other, cudaStreamNonBlocking, 0);
  cudaStreamCreateWithPriority(&fast, cudaStreamNonBlocking, 0);
  emu_stream_defer(deferred, 1);
  /* a deferred stream runs nothing until the host waits for it, and holds back its waiters */
  _Atomic int ran = 0, waiter_ran = 0;
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  emu_stream_host_fn(deferred, set_flag, (void*)&ran);
  cudaEventRecord(e, deferred);
  cudaStreamWaitEvent(other, e, 0);
  emu_stream_host_fn(other, set_flag, (void*)&waiter_ran);
  nap(0.02);
  CHECK(!ran && !waiter_ran && cudaEventQuery(e) == cudaErrorNotReady,
        "a deferred stream ran before the host waited for it (ran %d, its waiter %d)", (int)ran, (int)waiter_ran);
  /* the waiter waits for the record it saw: a later record of the same event on a stream that
   * runs at once completes the event, not that record */
  cudaEventRecord(e, fast);
  cudaStreamSynchronize(fast);
  nap(0.01);
  CHECK(cudaEventQuery(e) == cudaSuccess, "an event whose latest record passed is complete");
  CHECK(!waiter_ran, "a wait for an event's first record was released by its second");
  cudaStreamSynchronize(deferred);
  cudaStreamSynchronize(other);
  CHECK(ran && waiter_ran, "synchronizing a deferred stream runs it and releases its waiters (ran %d, waiter %d)",
        (int)ran, (int)waiter_ran);
  /* work queued after a synchronize stays deferred; switching deferral off lets it go */
  ran = 0;
  emu_stream_host_fn(deferred, set_flag, (void*)&ran);
  nap(0.01);
  CHECK(!ran, "work queued after a synchronize ran without one");
  emu_stream_defer(deferred, 0);
  cudaStreamSynchronize(deferred);
  CHECK(ran, "deferral off: the queued work ran");
  /* a slowed stream starts each operation at least its delay later */
  emu_set_stream_delay_us(2000);
  cudaStream_t slow;
  cudaStreamCreateWithPriority(&slow, cudaStreamNonBlocking, 0);
  emu_set_stream_delay_us(0);
  struct timespec a;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (int k = 0; k < 5; ++k) emu_stream_host_fn(slow, set_flag, (void*)&ran);
  cudaStreamSynchronize(slow);
  double took = seconds_since(&a);
  CHECK(took >= 0.01, "5 operations on a stream slowed by 2 ms each took %.4f s", took);
  cudaEventDestroy(e);
  cudaStream_t made[] = {deferred, other, fast, slow};
  for (size_t k = 0; k < sizeof made / sizeof made[0]; ++k) cudaStreamDestroy(made[k]);
}

/* ------------------------------------------------------------------------------------------ */
/* quantized pieces ([Note: quantized wire format] in core/mfsdp_quant.h): the CUDA table
 * against the CPU one, bit for bit */

/* `pieces` pieces of n elements quantized by both tables; shift misaligns the source by one
 * element and the wire by 4 bytes (still the 4 its scales need). Compares every byte of the
 * pieces and the guard bytes around them. */
static void expect_quantize(kernel_rig* k, int mode, int64_t block, int st, int64_t n, int shift, int32_t pieces) {
  uint64_t rng = (uint64_t)(mode * 7919 + block * 131 + st * 17 + n + shift);
  int64_t elem = mfsdp_dtype_size(st), W = mfsdp_quant_wire_bytes(mode, n, block);
  char* src = malloc((size_t)((n * pieces + 1) * elem));
  fill_quant_values(src + shift * elem, st, n * pieces, block, &rng, 1);
  size_t bytes = (size_t)(W * pieces + 64);
  uint8_t* want = malloc(bytes);
  uint8_t* got = malloc(bytes);
  memset(want, 0xa5, bytes);
  memset(got, 0xa5, bytes);
  int64_t at = shift ? 4 : 0;
  mfsdp_status cpu = mfsdp_cpu_quantize(want + at, mode, block, src + shift * elem, st, n, pieces);
  mfsdp_status gpu = mfsdp_cuda_kernels->quantize(k->ctx, got + at, mode, block, src + shift * elem, st, n, pieces);
  cudaStreamSynchronize(k->stream);
  CHECK(cpu == MFSDP_OK && gpu == MFSDP_OK, "quantize %s: %s", mfsdp_quant_mode_name(mode), mfsdp_last_error());
  int64_t wrong = 0;
  for (size_t b = 0; b < bytes; ++b) wrong += want[b] != got[b];
  CHECK(wrong == 0, "quantize %s from %s n=%lld block=%lld shift=%d pieces=%d: %lld bytes differ from the CPU kernel",
        mfsdp_quant_mode_name(mode), mfsdp_dtype_name(st), (long long)n, (long long)block, shift, pieces,
        (long long)wrong);
  free(src);
  free(want);
  free(got);
}

/* One piece dequantized into dst[shift..] by both tables (shift misaligns the vector path). */
static void expect_dequantize(kernel_rig* k, int mode, int64_t block, int dt, int64_t n, int shift, double alpha,
                              int accumulate) {
  uint64_t rng = (uint64_t)(mode * 31 + block + dt * 7 + n + shift);
  int64_t W = mfsdp_quant_wire_bytes(mode, n, block);
  float* src = malloc((size_t)(n + 1) * sizeof *src);
  uint8_t* wire = malloc((size_t)W + 16);
  fill_quant_values(src, MFSDP_F32, n, block, &rng, 1);
  CHECK_OK(mfsdp_cpu_quantize(wire, mode, block, src, MFSDP_F32, n, 1));
  size_t bytes = (size_t)(n + 8) * 8;
  char* want = malloc(bytes);
  char* got = malloc(bytes);
  fill_test_values(want, dt, n + 8, &rng);
  memcpy(got, want, bytes);
  int64_t off = shift * mfsdp_dtype_size(dt);
  mfsdp_status cpu = mfsdp_cpu_dequantize(want + off, dt, wire, mode, block, n, alpha, accumulate);
  mfsdp_status gpu = mfsdp_cuda_kernels->dequantize(k->ctx, got + off, dt, wire, mode, block, n, alpha, accumulate);
  cudaStreamSynchronize(k->stream);
  CHECK(cpu == MFSDP_OK && gpu == MFSDP_OK, "dequantize %s: %s", mfsdp_quant_mode_name(mode), mfsdp_last_error());
  int64_t wrong = count_differences(want, got, dt, n + 8); /* includes the untouched edges */
  CHECK(wrong == 0, "dequantize %s into %s n=%lld block=%lld shift=%d alpha=%g accumulate=%d: %lld elements differ",
        mfsdp_quant_mode_name(mode), mfsdp_dtype_name(dt), (long long)n, (long long)block, shift, alpha, accumulate,
        (long long)wrong);
  free(src);
  free(wire);
  free(want);
  free(got);
}

/* A gather's copy-out: W pieces cut into ranges (odd offsets, mid-block, mid-byte, empty) in
 * `items` items scattered over one destination with holes, by both tables. With a full pool:
 * torch holds every byte of the device, and the copy-out may not allocate. */
static void expect_dequantize_pack(kernel_rig* k, int device, int mode, int dt, int items_wanted, double alpha,
                                   int accumulate) {
  enum { PIECES = 4 };
  const int64_t piece_n = 5003, block = mode == MFSDP_QUANT_INT4 ? 50 : 97;
  uint64_t rng = (uint64_t)(mode * 5 + dt + items_wanted + accumulate);
  int64_t W = mfsdp_quant_wire_bytes(mode, piece_n, block);
  uint16_t* src = malloc((size_t)(PIECES * piece_n) * sizeof *src);
  uint8_t* wire = malloc((size_t)(PIECES * W));
  fill_quant_values(src, MFSDP_F16, PIECES * piece_n, block, &rng, 1);
  CHECK_OK(mfsdp_cpu_quantize(wire, mode, block, src, MFSDP_F16, piece_n, PIECES));
  mfsdp_quant_item* items = calloc((size_t)items_wanted, sizeof *items);
  int64_t dst_at = 0;
  for (int i = 0; i < items_wanted; ++i) {
    int64_t n = i % 9 == 4 ? 0 : rng_range(&rng, 1, i % 5 == 0 ? 3000 : 40);
    int64_t first = rng_range(&rng, 0, piece_n - n);
    dst_at += rng_range(&rng, 0, 3); /* holes */
    items[i] = (mfsdp_quant_item){wire + (i * 7 % PIECES) * W, first, dst_at, n};
    dst_at += n;
  }
  size_t bytes = (size_t)(dst_at + 8) * 8;
  char* want = malloc(bytes);
  char* got = malloc(bytes);
  fill_test_values(want, dt, dst_at + 8, &rng);
  memcpy(got, want, bytes);
  size_t held = emu_device_memory_free(device);
  CHECK(emu_device_reserve(device, (long long)held), "torch takes the whole pool");
  long allocations = emu_runtime_allocations();
  CHECK_OK(mfsdp_cpu_dequantize_pack(want, dt, items, items_wanted, mode, block, piece_n, alpha, accumulate));
  CHECK_OK(mfsdp_cuda_kernels->dequantize_pack(k->ctx, got, dt, items, items_wanted, mode, block, piece_n, alpha,
                                               accumulate));
  cudaStreamSynchronize(k->stream);
  CHECK(emu_runtime_allocations() == allocations, "the copy-out allocated device memory %ld times",
        emu_runtime_allocations() - allocations);
  emu_device_reserve(device, -(long long)held);
  int64_t wrong = count_differences(want, got, dt, dst_at + 8);
  CHECK(wrong == 0, "dequantize_pack %s into %s, %d items, alpha=%g accumulate=%d: %lld elements differ",
        mfsdp_quant_mode_name(mode), mfsdp_dtype_name(dt), items_wanted, alpha, accumulate, (long long)wrong);
  free(src);
  free(wire);
  free(items);
  free(want);
  free(got);
}

static void test_quant_kernels(void) {
  const int device = 1; /* as test_kernels: the tensors on device 1 while device 0 is current */
  kernel_rig k;
  cudaSetDevice(device);
  cudaStreamCreateWithPriority(&k.stream, cudaStreamNonBlocking, 0);
  CHECK_OK(mfsdp_cuda_kernel_context(device, &k.ctx));
  mfsdp_cuda_set_stream(k.ctx, k.stream);
  cudaSetDevice(0);
  /* sizes around the vector width and a block, odd tails, past several grid strides (4096
   * threads: 100003 elements in blocks of 2 are 50002 blocks, a thread each) */
  const int64_t sizes[] = {1, 7, 8, 9, 127, 128, 129, 1031, 100003};
  const int64_t blocks[] = {128, 100, 2, 4100};
  const int n_sizes = (int)(sizeof sizes / sizeof sizes[0]);
  for (int mode = 0; mode < MFSDP_NUM_QUANT_MODES; ++mode)
    for (int b = 0; b < 4; ++b)
      for (int z = 0; z < n_sizes; ++z) {
        int64_t block = blocks[b] == 2 && mode != MFSDP_QUANT_INT4 ? 1 : blocks[b];
        if (sizes[z] == 100003 && blocks[b] == 4100) continue;
        for (int t = 0; t < MFSDP_NUM_FLOAT_DTYPES; ++t)
          for (int shift = 0; shift < 2; ++shift) {
            if (sizes[z] < 100003 || (shift == 0 && t != MFSDP_F64) || (shift == 1 && t == MFSDP_BF16))
              expect_quantize(&k, mode, block, t, sizes[z], shift, 1);
            if (sizes[z] == 100003 && !(t == MFSDP_F32 || (t == MFSDP_BF16 && shift))) continue;
            expect_dequantize(&k, mode, block, t, sizes[z], shift, 1.0, 0);
            expect_dequantize(&k, mode, block, t, sizes[z], shift, 1.0 / 3.0, 0);
            expect_dequantize(&k, mode, block, t, sizes[z], shift, 1.0 / 3.0, 1); /* not a power of two: no FMA */
          }
      }
  for (int mode = 0; mode < MFSDP_NUM_QUANT_MODES; ++mode) {
    expect_quantize(&k, mode, 128, MFSDP_F32, 1031, 1, 5); /* an all-to-all's pieces in one launch */
    expect_quantize(&k, mode, 32, MFSDP_F16, 7, 0, 3);
    for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt)
      for (int acc = 0; acc < 2; ++acc) {
        expect_dequantize_pack(&k, device, mode, dt, 23, acc ? 0.25 : 1.0, acc);   /* one small table */
        expect_dequantize_pack(&k, device, mode, dt, 77, 1.0 / 3.0, acc);         /* one large table */
      }
    expect_dequantize_pack(&k, device, mode, MFSDP_BF16, 2000, 1.0, 0); /* three launches */
  }
  int current = -1;
  cudaGetDevice(&current);
  CHECK(current == 0, "a quantized entry point left device %d current (the caller's was 0)", current);
  /* refused as the CPU kernels refuse */
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  uint8_t w[64] __attribute__((aligned(16)));
  int32_t ints[8] = {0};
  CHECK(mfsdp_cuda_kernels->quantize(k.ctx, w, MFSDP_QUANT_INT4, 3, x, MFSDP_F32, 8, 1) == MFSDP_ERR_INVALID_ARGUMENT,
        "int4 odd block refused");
  CHECK(mfsdp_cuda_kernels->quantize(k.ctx, w + 2, MFSDP_QUANT_INT8, 4, x, MFSDP_F32, 8, 1) ==
            MFSDP_ERR_INVALID_ARGUMENT, "misaligned piece refused");
  CHECK(mfsdp_cuda_kernels->quantize(k.ctx, w, MFSDP_QUANT_INT8, 4, ints, MFSDP_I32, 8, 1) == MFSDP_ERR_UNSUPPORTED,
        "integer source refused");
  CHECK_OK(mfsdp_cuda_kernels->quantize(k.ctx, w, MFSDP_QUANT_INT8, 4, x, MFSDP_F32, 8, 1));
  cudaStreamSynchronize(k.stream);
  float y[8] = {0};
  mfsdp_quant_item bad[2] = {{w, 0, 0, 4}, {w, 6, 4, 4}};
  CHECK(mfsdp_cuda_kernels->dequantize_pack(k.ctx, y, MFSDP_F32, bad, 2, MFSDP_QUANT_INT8, 4, 8, 1.0, 0) ==
            MFSDP_ERR_INVALID_ARGUMENT, "an item past its piece refused");
  CHECK(mfsdp_cuda_kernels->dequantize(k.ctx, x, MFSDP_I16, w, MFSDP_QUANT_INT8, 4, 8, 1.0, 0) == MFSDP_ERR_UNSUPPORTED,
        "into int16 refused");
  cudaStreamSynchronize(k.stream);
  CHECK(y[0] == 0 && y[3] == 0, "a refused copy-out launched nothing");
  mfsdp_cuda_set_stream(k.ctx, NULL);
  cudaStreamDestroy(k.stream);
}

/* ------------------------------------------------------------------------------------------ */
/* the NCCL rig: emulated device memory, the native transport, the CUDA kernels */

typedef struct emu_world {
  int n;
  ncclUniqueId ids[2];
  double timeout_s;
  const mfsdp_nccl_hooks* hooks; /* NULL: none */
  int defer;                     /* each rank's current stream is deferred (emu_stream_defer) */
  int stream_delay_us;           /* each operation on a rank's current stream starts this much later */
  int lane_delay_us;             /* ... on the transports' lanes */
  pthread_barrier_t start;       /* the ranks make their transports together: the set-up's timeout
                                    counts from there, not from when each thread got a core */
} emu_world;

typedef struct emu_rank {
  cudaStream_t stream; /* the rank's "torch current stream" */
  void* kernels_ctx;
  mfsdp_nccl* nccl;
} emu_rank;

/* Device memory as torch's caching allocator gives it: allocation at once, freeing ordered
 * after the work already queued on the current stream. */
static mfsdp_status dev_create(void* ctx, int64_t numel, int32_t dtype, mfsdp_buffer* out) {
  MFSDP_CHECK(heap_memory_ops.create(ctx, numel, dtype, out));
  out->device = 0;
  return MFSDP_OK;
}

static void stream_free(void* mem) { free(mem); }

static mfsdp_status dev_release(void* ctx, mfsdp_buffer* buf) {
  emu_rank* r = ctx;
  heap_block* b = buf->handle;
  if (b->mem) emu_stream_host_fn(r->stream, stream_free, b->mem);
  b->mem = NULL;
  buf->data = NULL;
  return MFSDP_OK;
}

static void dev_destroy(void* ctx, mfsdp_buffer* buf) {
  dev_release(ctx, buf);
  free(buf->handle);
  buf->handle = NULL;
}

static mfsdp_memory_ops dev_memory_ops; /* heap ops with the two above; filled in main */

static int g_defer_streams = 0; /* worlds made while set defer their ranks' current streams */

static void* emu_world_create(int n) {
  emu_world* w = calloc(1, sizeof *w);
  w->n = n;
  w->timeout_s = 30.0;
  w->defer = g_defer_streams;
  pthread_barrier_init(&w->start, NULL, (unsigned)n);
  ncclGetUniqueId(&w->ids[0]);
  ncclGetUniqueId(&w->ids[1]);
  return w;
}

static void emu_world_destroy(void* world) {
  emu_world* w = world;
  pthread_barrier_destroy(&w->start);
  free(w);
}

/* Rank `rank` of `world` on device `device`. */
static int emu_rank_setup_on(emu_world* w, int rank, int device, mfsdp_backend* be, void** state) {
  emu_rank* r = calloc(1, sizeof *r);
  /* One device per rank, with torch's current stream on it; the thread's current device stays
   * 0, as on a rank that never called torch.cuda.set_device: the engine must not depend on it. */
  cudaSetDevice(device);
  emu_set_stream_delay_us(w->stream_delay_us);
  cudaStreamCreateWithPriority(&r->stream, cudaStreamNonBlocking, 0);
  emu_set_stream_delay_us(0);
  if (w->defer) emu_stream_defer(r->stream, 1);
  cudaSetDevice(0);
  if (mfsdp_cuda_kernel_context(device, &r->kernels_ctx) != MFSDP_OK) return -1;
  mfsdp_cuda_set_stream(r->kernels_ctx, r->stream);
  *state = r;
  pthread_barrier_wait(&w->start);
  emu_set_stream_delay_us(w->lane_delay_us); /* the lanes the transport makes now */
  mfsdp_status made = mfsdp_nccl_create(w->ids, rank, w->n, device, w->timeout_s, w->hooks, &r->nccl);
  emu_set_stream_delay_us(0);
  if (made != MFSDP_OK) return -1;
  int current = -1;
  cudaGetDevice(&current);
  CHECK(current == 0, "creating the transport left device %d current (the caller's was 0)", current);
  *be = (mfsdp_backend){&dev_memory_ops, r, &mfsdp_nccl_ops, r->nccl, mfsdp_cuda_kernels, r->kernels_ctx};
  return 0;
}

static int emu_rank_setup(void* world, int rank, mfsdp_backend* be, void** state) {
  return emu_rank_setup_on(world, rank, rank, be, state);
}

static void emu_rank_sync(void* state) { cudaStreamSynchronize(((emu_rank*)state)->stream); }

/* Every rank tears down at the same point: the collective close, then the local destroy
 * (which only aborts what close could not end). */
static void emu_rank_teardown(void* state) {
  emu_rank* r = state;
  if (r == NULL) return;
  cudaStreamSynchronize(r->stream);
  if (r->nccl) mfsdp_nccl_close(r->nccl); /* fails fast after a failure; the destroy below still frees */
  mfsdp_nccl_destroy(r->nccl);
  mfsdp_cuda_set_stream(r->kernels_ctx, NULL);
  cudaStreamDestroy(r->stream);
  free(r);
}

static const pipe_rig nccl_rig = {"emulated NCCL + CUDA kernels", emu_world_create, emu_world_destroy,
                                  emu_rank_setup, emu_rank_sync, emu_rank_teardown, NULL};

/* ------------------------------------------------------------------------------------------ */
/* a unit of several buckets: its gathers go out as one NCCL group */

enum { UNIT_BUCKETS = 3, UNIT_ROWS = 10, UNIT_COLS = 6 };

typedef struct unit_thread {
  emu_world* world;
  int rank;
} unit_thread;

static void* unit_worker(void* arg) {
  unit_thread* t = arg;
  int W = t->world->n, r = t->rank;
  mfsdp_param_info info = {UNIT_ROWS * UNIT_COLS, UNIT_COLS, MFSDP_F32, 0, 1, 0};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(&info, 1, W, 0, 16, &plan));
  mfsdp_bucket_plan* bp = &plan.buckets[0];
  const int dtypes[UNIT_BUCKETS] = {MFSDP_F32, MFSDP_BF16, MFSDP_F64};
  mfsdp_bucket_spec specs[UNIT_BUCKETS];
  for (int b = 0; b < UNIT_BUCKETS; ++b)
    specs[b] = (mfsdp_bucket_spec){bp->layout, r, dtypes[b], dtypes[b], dtypes[b], dtypes[b], 1, 0,
                                   MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_backend be;
  void* dev = NULL;
  mfsdp_pipeline* p = NULL;
  if (emu_rank_setup(t->world, r, &be, &dev) != 0) {
    CHECK(0, "setup: %s", mfsdp_last_error());
    goto out;
  }
  mfsdp_pipeline_config cfg = {W, r, 1.0 / W, MFSDP_REDUCE_SUM, 1 << 20, 0};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, specs, UNIT_BUCKETS, &p));
  if (p == NULL) goto done;
  float* v = malloc(UNIT_ROWS * UNIT_COLS * sizeof *v);
  for (int b = 0; b < UNIT_BUCKETS; ++b) {
    for (int j = 0; j < UNIT_ROWS * UNIT_COLS; ++j) v[j] = (float)(b * 100 + j);
    CHECK_OK(mfsdp_pipeline_init_begin(p, b, 0));
    CHECK_OK(mfsdp_pipeline_set_item(p, b, 0, v, MFSDP_F32, UNIT_ROWS * UNIT_COLS));
    CHECK_OK(mfsdp_pipeline_init_end(p, b));
    emu_rank_sync(dev);
  }
  free(v);
  int32_t ids[UNIT_BUCKETS] = {0, 1, 2};
  for (int round = 0; round < 3; ++round) { /* gather, use, release: as a unit's forward does */
    CHECK_OK(mfsdp_pipeline_unshard(p, ids, UNIT_BUCKETS));
    CHECK_OK(mfsdp_pipeline_wait_unshard(p, ids, UNIT_BUCKETS));
    /* the consumer reads on its stream right after the wait, with no host sync in between */
    double* seen = calloc(UNIT_BUCKETS * UNIT_ROWS * UNIT_COLS, sizeof *seen);
    for (int b = 0; b < UNIT_BUCKETS; ++b) {
      const mfsdp_buffer* w = mfsdp_pipeline_buffer(p, b, MFSDP_BUF_WEIGHT);
      CHECK_OK(mfsdp_cuda_kernels->copy(be.kernels_ctx, seen + b * UNIT_ROWS * UNIT_COLS, MFSDP_F64, w->data,
                                        dtypes[b], UNIT_ROWS * UNIT_COLS, 1.0));
    }
    CHECK_OK(mfsdp_pipeline_reshard(p, ids, UNIT_BUCKETS));
    emu_rank_sync(dev);
    int wrong = 0;
    for (int b = 0; b < UNIT_BUCKETS; ++b)
      for (int j = 0; j < UNIT_ROWS * UNIT_COLS; ++j) wrong += seen[b * UNIT_ROWS * UNIT_COLS + j] != b * 100 + j;
    CHECK(wrong == 0, "world %d rank %d round %d: %d weights of the grouped gather wrong", W, r, round, wrong);
    free(seen);
  }
done:
  if (p) emu_rank_sync(dev);
  mfsdp_pipeline_destroy(p);
  emu_rank_teardown(dev);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* HFSDP on native NCCL: 2 replicas x 2 shards, each rank with its own communicators inside the
 * replica and across replicas ([Note: optimizer sharded across replicas] in replicas.c). Run
 * in several timings (hf_modes), each legal in CUDA: as it comes; with every rank's current
 * stream deferred until its host synchronizes, so that a host touching memory its stream has
 * yet to use fails on every run, whatever the machine's load; and deferred with one kind of
 * stream slowed by 1 ms an operation, so that a collective ordered after another (inside vs.
 * across the replicas) or after the producer's work by timing rather than by an event reads
 * stale values on (nearly) every run instead of now and then. */

enum { HF_OUTER = 2, HF_INNER = 2, HF_ROWS = 7, HF_COLS = 3, HF_STEPS = 2, HF_MICRO = 3 };

typedef struct hf_mode {
  const char* name;
  int param_dtype;     /* of the compute weights; main weights, gradients, communication: float32 */
  int defer;           /* every rank's current stream deferred (emu_stream_defer) */
  int stream_delay_us; /* each operation on a rank's current stream starts this much later */
  int inner_delay_us;  /* ... on the lanes inside the replica */
  int outer_delay_us;  /* ... on the lanes across the replicas */
  int jitter_us;       /* every stream operation starts up to this much later (emu_set_jitter_us) */
} hf_mode;

typedef struct hfsdp_thread {
  const hf_mode* mode;
  emu_world* inner; /* this rank's replica */
  emu_world* outer; /* its twins in the other replicas */
  int o, i;
} hfsdp_thread;

static double hf_grad(int rank, int mb, int64_t j) { return 0.5 * (rank + 1) - 0.25 * mb + 1e-2 * j; }
static double hf_init(int64_t j) { return 1.0 - 0.05 * j; }

static void* hfsdp_worker(void* arg) {
  hfsdp_thread* t = arg;
  const hf_mode* m = t->mode;
  int W = HF_OUTER * HF_INNER, rank = t->o * HF_INNER + t->i, n = HF_ROWS * HF_COLS, pdt = m->param_dtype;
  mfsdp_param_info info = {n, HF_COLS, pdt, 0, 1, 0};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(&info, 1, W, 0, 16, &plan));
  mfsdp_bucket_spec spec = {plan.buckets[0].layout, rank, pdt, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0,
                            MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_backend be;
  void* dev = NULL;
  mfsdp_pipeline* p = NULL;
  mfsdp_nccl* across = NULL;
  if (emu_rank_setup_on(t->inner, t->i, rank, &be, &dev) != 0) {
    CHECK(0, "setup: %s", mfsdp_last_error());
    goto out;
  }
  pthread_barrier_wait(&t->outer->start);
  emu_set_stream_delay_us(t->outer->lane_delay_us);
  CHECK_OK(mfsdp_nccl_create(t->outer->ids, t->o, HF_OUTER, rank, t->outer->timeout_s, NULL, &across));
  emu_set_stream_delay_us(0);
  if (across == NULL) goto done;
  be.outer = &mfsdp_nccl_ops;
  be.outer_ctx = across;
  mfsdp_pipeline_config cfg = {HF_INNER, t->i, 1.0 / W, MFSDP_REDUCE_SUM, 1 << 20, 0, HF_OUTER, 1};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto done;
  float* v = malloc((size_t)n * sizeof *v);
  for (int j = 0; j < n; ++j) v[j] = (float)hf_init(j);
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, 0));
  CHECK_OK(mfsdp_pipeline_set_item(p, 0, 0, v, MFSDP_F32, n));
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  emu_rank_sync(dev); /* set_item's copy reads v on the stream, and v takes the gradients below */
  int32_t b0 = 0;
  for (int step = 0; step < HF_STEPS; ++step) {
    CHECK_OK(mfsdp_pipeline_zero_grads(p));
    for (int mb = 0; mb < HF_MICRO; ++mb) { /* the outer reduce-scatter on the last backward only */
      CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
      CHECK_OK(mfsdp_pipeline_wait_unshard(p, &b0, 1));
      CHECK_OK(mfsdp_pipeline_reshard(p, &b0, 1));
      CHECK_OK(mfsdp_pipeline_begin_backward(p, mb == HF_MICRO - 1));
      for (int j = 0; j < n; ++j) v[j] = (float)hf_grad(rank, mb, j);
      CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, 0, v, MFSDP_F32, n, NULL));
      CHECK_OK(mfsdp_pipeline_end_backward(p));
      emu_rank_sync(dev); /* v is reused: its packing must have run */
    }
    CHECK_OK(mfsdp_pipeline_sync_grads(p));
    emu_rank_sync(dev);
    int32_t where, gwhere;
    int64_t off, goff, len, first, count;
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, 0, MFSDP_BUF_MAIN_SHARD, &where, &off, &len));
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, 0, MFSDP_BUF_OPT_GRAD, &gwhere, &goff, &len));
    mfsdp_piece_of(n, plan.buckets[0].layout.pieces[0], rank, &first, &count);
    float* w = mfsdp_pipeline_buffer(p, 0, where)->data;
    const float* g = mfsdp_pipeline_buffer(p, 0, gwhere)->data;
    int wrong = 0;
    for (int64_t j = 0; j < len; ++j) {
      double want = 0;
      for (int mb = 0; mb < HF_MICRO; ++mb)
        for (int r = 0; r < W; ++r) want += hf_grad(r, mb, first + j) / W;
      wrong += fabs(g[goff + j] - want) > 1e-5 * (fabs(want) + 1);
      w[off + j] -= 0.5f * g[goff + j]; /* the optimizer, on this rank's piece only */
    }
    CHECK(wrong == 0, "HFSDP on NCCL (%s), rank %d step %d: %d main gradients wrong", m->name, rank, step, wrong);
    CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
  }
  CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, &b0, 1));
  emu_rank_sync(dev);
  const void* full = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT)->data;
  double tol = pdt == MFSDP_F32 ? 1e-4 : 2e-2; /* bf16: the main weights rounded on install */
  int wrong = 0;
  for (int j = 0; j < n; ++j) {
    double step_grad = 0, init[1];
    for (int mb = 0; mb < HF_MICRO; ++mb)
      for (int r = 0; r < W; ++r) step_grad += hf_grad(r, mb, j) / W;
    store_from_double(init, pdt, 0, hf_init(j)); /* the main weights start from the compute weights */
    double want = load_as_double(init, pdt, 0) - 0.5 * HF_STEPS * step_grad;
    wrong += fabs(load_as_double(full, pdt, j) - want) > tol * (fabs(want) + 1);
  }
  CHECK(wrong == 0, "HFSDP on NCCL (%s), rank %d: %d full weights wrong after the replicas' gathers", m->name, rank,
        wrong);
  mfsdp_comm_stats st;
  mfsdp_pipeline_stats(p, -1, &st);
  CHECK(st.outer_reduce_scatters == HF_STEPS && st.outer_all_gathers == HF_STEPS && st.outer_all_reduces == 0,
        "HFSDP on NCCL: %lld reduce-scatters and %lld all-gathers across replicas, expected %d each",
        (long long)st.outer_reduce_scatters, (long long)st.outer_all_gathers, HF_STEPS);
  free(v);
done:
  if (p) emu_rank_sync(dev);
  mfsdp_pipeline_destroy(p);
  if (across) {
    mfsdp_nccl_close(across);
    mfsdp_nccl_destroy(across);
  }
  emu_rank_teardown(dev);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

static void run_hfsdp(const hf_mode* m) {
  emu_world* inner[HF_OUTER];
  emu_world* outer[HF_INNER];
  for (int o = 0; o < HF_OUTER; ++o) {
    inner[o] = emu_world_create(HF_INNER);
    inner[o]->defer = m->defer;
    inner[o]->stream_delay_us = m->stream_delay_us;
    inner[o]->lane_delay_us = m->inner_delay_us;
  }
  for (int i = 0; i < HF_INNER; ++i) {
    outer[i] = emu_world_create(HF_OUTER);
    outer[i]->lane_delay_us = m->outer_delay_us;
  }
  emu_set_jitter_us(m->jitter_us);
  pthread_t threads[HF_OUTER * HF_INNER];
  hfsdp_thread args[HF_OUTER * HF_INNER];
  for (int o = 0; o < HF_OUTER; ++o)
    for (int i = 0; i < HF_INNER; ++i) {
      args[o * HF_INNER + i] = (hfsdp_thread){m, inner[o], outer[i], o, i};
      pthread_create(&threads[o * HF_INNER + i], NULL, hfsdp_worker, &args[o * HF_INNER + i]);
    }
  for (int r = 0; r < HF_OUTER * HF_INNER; ++r) pthread_join(threads[r], NULL);
  emu_set_jitter_us(0);
  for (int o = 0; o < HF_OUTER; ++o) emu_world_destroy(inner[o]);
  for (int i = 0; i < HF_INNER; ++i) emu_world_destroy(outer[i]);
}

static void test_hfsdp(void) {
  const int F = MFSDP_F32, B = MFSDP_BF16;
  const hf_mode modes[] = {
      /* name, param dtype, defer, current streams' delay, inner lanes' delay, outer lanes' delay, jitter */
      {"as it comes", F, 0, 0, 0, 0, 0},
      {"streams deferred", F, 1, 0, 0, 0, 0},
      {"streams deferred, lanes across replicas slow", F, 1, 0, 0, 1000, 0},
      {"streams deferred, lanes inside replicas slow", F, 1, 0, 1000, 0, 0},
      {"jitter", F, 0, 0, 0, 0, 300},
      {"bf16 compute fp32 main, streams deferred, lanes across replicas slow", B, 1, 0, 0, 1000, 0},
      {"bf16 compute fp32 main, streams deferred, lanes inside replicas slow", B, 1, 0, 1000, 0, 0},
      {"bf16 compute fp32 main, streams deferred and slow", B, 1, 1000, 0, 0, 0},
  };
  for (size_t k = 0; k < sizeof modes / sizeof modes[0]; ++k) run_hfsdp(&modes[k]);
}

static void test_grouped_unit(void) {
  for (int n = 2; n <= 4; n += 2) {
    long before = emu_nccl_grouped_collectives();
    emu_world* w = emu_world_create(n);
    pthread_t threads[4];
    unit_thread args[4];
    for (int r = 0; r < n; ++r) {
      args[r] = (unit_thread){w, r};
      pthread_create(&threads[r], NULL, unit_worker, &args[r]);
    }
    for (int r = 0; r < n; ++r) pthread_join(threads[r], NULL);
    emu_world_destroy(w);
    long grouped = emu_nccl_grouped_collectives() - before;
    CHECK(grouped == 3L * UNIT_BUCKETS * n, "world %d: %ld gathers launched in groups, expected %d", n, grouped,
          3 * UNIT_BUCKETS * n);
  }
}


/* ------------------------------------------------------------------------------------------ */
/* teardown and blocking: what must never hang */

/* One all-gather every rank joins: the communicators connect (NCCL does at first use). */
static void warm_up(emu_rank* r, const mfsdp_buffer* full, const mfsdp_buffer* shard) {
  mfsdp_work* w = NULL;
  CHECK_OK(mfsdp_nccl_ops.all_gather(r->nccl, full, shard, &w));
  CHECK_OK(mfsdp_nccl_ops.wait(r->nccl, w));
  emu_rank_sync(r);
}

/* Runs fn(arg) on a thread; 1 if it returned within `seconds`. If not, the caller must make it
 * return (release what it waits for) and then join `*thread`. */
typedef struct timed_call {
  void (*fn)(void*);
  void* arg;
  _Atomic int done;
} timed_call;

static void* timed_main(void* p) {
  timed_call* c = p;
  c->fn(c->arg);
  c->done = 1;
  return NULL;
}

static int returns_within(timed_call* c, double seconds, pthread_t* thread) {
  c->done = 0;
  pthread_create(thread, NULL, timed_main, c);
  for (double waited = 0; waited < seconds && !c->done; waited += 0.01) nap(0.01);
  if (!c->done) return 0;
  pthread_join(*thread, NULL);
  return 1;
}

/* Two ranks, each a thread running its part of a scenario in turn (see the tests below). */
typedef struct duo {
  emu_world* world;
  emu_rank* rank[2];
  float* full[2];
  mfsdp_buffer fb[2], sb[2];
  _Atomic int step; /* rank 1 waits for rank 0 to reach a step */
  mfsdp_status seen[2];
  double took[2];
} duo;

static void duo_setup(duo* d, int n_connect, double timeout_s) {
  memset(d, 0, sizeof *d);
  d->world = emu_world_create(2);
  d->world->timeout_s = timeout_s;
  for (int r = 0; r < 2; ++r) {
    d->full[r] = calloc(64, sizeof(float));
    d->fb[r] = (mfsdp_buffer){d->full[r], 64, MFSDP_F32, r, NULL};
    d->sb[r] = (mfsdp_buffer){d->full[r] + 32 * r, 32, MFSDP_F32, r, NULL};
  }
  (void)n_connect;
}

static void duo_free(duo* d) {
  for (int r = 0; r < 2; ++r) free(d->full[r]);
  emu_world_destroy(d->world);
}

static double seconds_since(const struct timespec* a) {
  struct timespec b;
  clock_gettime(CLOCK_MONOTONIC, &b);
  return (double)(b.tv_sec - a->tv_sec) + 1e-9 * (double)(b.tv_nsec - a->tv_nsec);
}

static void wait_step(duo* d, int step) {
  while (d->step < step) nap(0.005);
}

typedef struct duo_rank {
  duo* d;
  int rank;
  void (*body)(duo* d, int rank);
} duo_rank;

static void* duo_main(void* p) {
  duo_rank* a = p;
  mfsdp_backend be;
  void* state = NULL;
  CHECK(emu_rank_setup(a->d->world, a->rank, &be, &state) == 0, "setup: %s", mfsdp_last_error());
  a->d->rank[a->rank] = state;
  a->body(a->d, a->rank);
  return NULL;
}

static void run_duo(duo* d, void (*body)(duo*, int)) {
  pthread_t threads[2];
  duo_rank args[2] = {{d, 0, body}, {d, 1, body}};
  for (int r = 0; r < 2; ++r) pthread_create(&threads[r], NULL, duo_main, &args[r]);
  for (int r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
}

/* Item: a peer that dies before the communicators connected. NCCL connects at a communicator's
 * first collective and waits for the peers there; the engine must still raise within the
 * timeout (and never hold the lock the watchdog aborts under while NCCL waits). */
static void issue_gather(void* arg) {
  duo* d = arg;
  struct timespec a;
  clock_gettime(CLOCK_MONOTONIC, &a);
  mfsdp_work* w = NULL;
  d->seen[0] = mfsdp_nccl_ops.all_gather(d->rank[0]->nccl, &d->fb[0], &d->sb[0], &w);
  if (d->seen[0] == MFSDP_OK) d->seen[0] = mfsdp_nccl_ops.wait(d->rank[0]->nccl, w);
  d->took[0] = seconds_since(&a);
}

static void dead_peer_at_connect(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  if (rank == 0) {
    timed_call call = {issue_gather, d, 0};
    pthread_t th;
    int returned = returns_within(&call, 5.0, &th);
    CHECK(returned, "a collective whose peer never connected held the engine for 5 s (timeout 0.5 s)");
    d->step = 1; /* the peer shows up now: lets a blocked call finish */
    if (!returned) pthread_join(th, NULL);
    CHECK(d->seen[0] == MFSDP_ERR_TIMEOUT, "a peer that never connected -> %s: %s", mfsdp_status_name(d->seen[0]),
          mfsdp_last_error());
    CHECK(!returned || d->took[0] < 3.0, "raised after %.2f s (timeout 0.5 s)", d->took[0]);
    printf("test_emu: a collective whose peer never connected raised %s after %.2f s (timeout 0.5 s)\n",
           mfsdp_status_name(d->seen[0]), d->took[0]);
    d->step = 2;
  } else {
    wait_step(d, 1);
    mfsdp_work* w = NULL;
    if (mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[1], &d->sb[1], &w) == MFSDP_OK) mfsdp_nccl_ops.discard(r->nccl, w);
    wait_step(d, 2);
  }
  emu_rank_teardown(r);
}

static void test_dead_peer_at_connect(void) {
  duo d;
  duo_setup(&d, 0, 0.5);
  run_duo(&d, dead_peer_at_connect);
  duo_free(&d);
}

/* Item: a transport dropped while a collective is in flight (garbage collection of a model in a
 * reference cycle happens at different moments on different ranks). Destroying the
 * communicators waits for that collective, which needs the peer: it must abort instead. */
static void drop_transport(void* arg) { /* what NcclTransport's dealloc does */
  emu_rank* r = arg;
  mfsdp_nccl_destroy(r->nccl);
  r->nccl = NULL;
}

static void destroy_in_flight(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  warm_up(r, &d->fb[rank], &d->sb[rank]);
  if (rank == 0) {
    mfsdp_work* w = NULL;
    CHECK_OK(mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[0], &d->sb[0], &w)); /* rank 1 joins late, or never */
    mfsdp_nccl_ops.discard(r->nccl, w);
    long aborts = emu_nccl_aborts();
    timed_call call = {drop_transport, r, 0};
    pthread_t th;
    int returned = returns_within(&call, 3.0, &th);
    CHECK(returned, "dropping a transport with a collective in flight hung for 3 s (ncclCommDestroy waits for peers)");
    d->step = 1;
    if (!returned) pthread_join(th, NULL);
    CHECK(emu_nccl_aborts() - aborts >= 2, "dropped without close: its communicators are aborted, not destroyed");
    d->step = 2;
    emu_rank_teardown(r);
  } else {
    wait_step(d, 1);
    mfsdp_work* w = NULL;
    mfsdp_status s = mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[1], &d->sb[1], &w);
    if (s == MFSDP_OK) s = mfsdp_nccl_ops.wait(r->nccl, w);
    emu_rank_sync(r);
    wait_step(d, 2);
    emu_rank_teardown(r);
  }
}

static void test_destroy_in_flight(void) {
  duo d;
  duo_setup(&d, 1, 30.0);
  run_duo(&d, destroy_in_flight);
  duo_free(&d);
}

/* Item: the watchdog aborting the communicators while a group is open. A collective the peer
 * never joins goes stale while rank 0 sits between group_start and group_end; the group's end
 * must report the timeout and touch no aborted communicator. */
static void abort_inside_group(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  warm_up(r, &d->fb[rank], &d->sb[rank]);
  if (rank == 0) {
    mfsdp_work *stale = NULL, *grouped = NULL;
    CHECK_OK(mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[0], &d->sb[0], &stale)); /* never joined */
    mfsdp_status s = mfsdp_nccl_ops.group_start(r->nccl);
    if (s == MFSDP_OK) {
      mfsdp_status g = mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[0], &d->sb[0], &grouped);
      nap(1.0); /* the watchdog aborts meanwhile (timeout 0.3 s) */
      s = mfsdp_nccl_ops.group_end(r->nccl);
      if (s == MFSDP_OK) s = g;
      if (grouped) {
        mfsdp_status ws = mfsdp_nccl_ops.wait(r->nccl, grouped);
        if (s == MFSDP_OK) s = ws;
      }
    }
    CHECK(s == MFSDP_ERR_TIMEOUT, "a group the watchdog aborted -> %s: %s", mfsdp_status_name(s), mfsdp_last_error());
    mfsdp_nccl_ops.discard(r->nccl, stale);
    d->step = 1;
  } else {
    wait_step(d, 1);
  }
  emu_rank_teardown(r);
}

static void test_abort_inside_group(void) {
  duo d;
  duo_setup(&d, 1, 0.3);
  run_duo(&d, abort_inside_group);
  duo_free(&d);
}

/* Item: a pipeline destroyed while its gather is in flight. Its buffers go back to the
 * allocator on the consumer stream (stream-ordered frees, as torch's caching allocator): that
 * stream must first wait for the collective, or NCCL writes into freed memory (an
 * AddressSanitizer error here). */
static void pipeline_destroy_in_flight(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  mfsdp_param_info info = {UNIT_ROWS * UNIT_COLS, UNIT_COLS, MFSDP_F32, 0, 1, 0};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(&info, 1, 2, 0, 16, &plan));
  mfsdp_bucket_plan* bp = &plan.buckets[0];
  mfsdp_bucket_spec spec = {bp->layout, rank, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0,
                            MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_backend be = {&dev_memory_ops, r, &mfsdp_nccl_ops, r->nccl, mfsdp_cuda_kernels, r->kernels_ctx};
  mfsdp_pipeline_config cfg = {2, rank, 0.5, MFSDP_REDUCE_SUM, 1 << 20, 0};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  float v[UNIT_ROWS * UNIT_COLS] = {0};
  int32_t id = 0;
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, 0));
  CHECK_OK(mfsdp_pipeline_set_item(p, 0, 0, v, MFSDP_F32, UNIT_ROWS * UNIT_COLS));
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  CHECK_OK(mfsdp_pipeline_unshard(p, &id, 1)); /* connects */
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, &id, 1));
  CHECK_OK(mfsdp_pipeline_reshard(p, &id, 1));
  emu_rank_sync(r);
  if (rank == 1) nap(0.3); /* the peer comes late to the next gather */
  CHECK_OK(mfsdp_pipeline_unshard(p, &id, 1));
  mfsdp_pipeline_destroy(p); /* rank 0: the gather has not run yet */
  emu_rank_sync(r);
  emu_rank_teardown(r);
  mfsdp_plan_free(&plan);
}

static void test_pipeline_destroy_in_flight(void) {
  duo d;
  duo_setup(&d, 0, 30.0);
  run_duo(&d, pipeline_destroy_in_flight);
  duo_free(&d);
}

/* Item: the explicit, collective end. Every rank closes: the communicators are finalized and
 * destroyed, none aborted, and the transport refuses further collectives. */
static void close_together(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  warm_up(r, &d->fb[rank], &d->sb[rank]);
  long destroys = emu_nccl_destroys(), aborts = emu_nccl_aborts();
  CHECK_OK(mfsdp_nccl_close(r->nccl));
  mfsdp_work* w = NULL;
  CHECK(mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[rank], &d->sb[rank], &w) == MFSDP_ERR_INVALID_STATE && w == NULL,
        "a collective after close is refused: %s", mfsdp_last_error());
  d->step++;
  while (d->step < 2) nap(0.005); /* both closed before the counts are read */
  CHECK(emu_nccl_destroys() - destroys >= 2 && emu_nccl_aborts() == aborts,
        "closed: %ld communicators destroyed, %ld aborted", emu_nccl_destroys() - destroys, emu_nccl_aborts() - aborts);
  mfsdp_nccl_destroy(r->nccl);
  r->nccl = NULL;
  d->step++;
  while (d->step < 4) nap(0.005);
  emu_rank_teardown(r);
}

/* ... and a rank whose peer never closes gets the timeout, not a hang. */
static void close_alone(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  warm_up(r, &d->fb[rank], &d->sb[rank]);
  if (rank == 0) {
    struct timespec a;
    clock_gettime(CLOCK_MONOTONIC, &a);
    mfsdp_status s = mfsdp_nccl_close(r->nccl);
    double took = seconds_since(&a);
    CHECK(s == MFSDP_ERR_TIMEOUT && took < 3.0, "close without the peer -> %s after %.2f s (timeout 0.5 s): %s",
          mfsdp_status_name(s), took, mfsdp_last_error());
    d->step = 1;
  } else {
    wait_step(d, 1);
  }
  emu_rank_teardown(r);
}

static void test_close(void) {
  duo d;
  duo_setup(&d, 1, 30.0);
  run_duo(&d, close_together);
  duo_free(&d);
  duo_setup(&d, 1, 0.5);
  run_duo(&d, close_alone);
  duo_free(&d);
}

/* Waiting for NCCL lets others run (the glue releases the GIL there) and stops on Ctrl-C. */
typedef struct hook_state {
  _Atomic int begins, ends, polls;
} hook_state;
static void* hook_begin(void* arg) {
  ((hook_state*)arg)->begins++;
  return arg;
}
static void hook_end(void* arg, void* token) {
  CHECK(token == arg, "block_end gets block_begin's token");
  ((hook_state*)arg)->ends++;
}
static int hook_interrupted(void* arg) { return ++((hook_state*)arg)->polls > 150; /* ~0.1 s in */ }

static void interrupted_wait(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  if (rank == 0) {
    issue_gather(d); /* the peer never connects; the timeout is 30 s */
    CHECK(d->seen[0] == MFSDP_ERR_COMM && strstr(mfsdp_last_error(), "interrupted") && d->took[0] < 3.0,
          "Ctrl-C while NCCL connects -> %s after %.2f s: %s", mfsdp_status_name(d->seen[0]), d->took[0],
          mfsdp_last_error());
    d->step = 1;
  } else {
    wait_step(d, 1);
  }
  emu_rank_teardown(r);
}

static void test_interrupt(void) {
  hook_state hs = {0, 0, 0};
  mfsdp_nccl_hooks hooks = {hook_begin, hook_end, hook_interrupted, &hs};
  duo d;
  duo_setup(&d, 0, 30.0);
  d.world->hooks = &hooks;
  run_duo(&d, interrupted_wait);
  CHECK(hs.begins >= 1 && hs.begins == hs.ends, "the wait was bracketed by the hooks (%d begins, %d ends)", hs.begins,
        hs.ends);
  duo_free(&d);
}

/* ------------------------------------------------------------------------------------------ */
/* the watchdog: rank 1 never joins rank 0's all-gather */

typedef struct stall_thread {
  emu_world* world;
  int rank;
} stall_thread;

static _Atomic int g_rank0_aborted = 0;

static void* stall_worker(void* arg) {
  stall_thread* t = arg;
  mfsdp_backend be;
  void* state = NULL;
  CHECK(emu_rank_setup(t->world, t->rank, &be, &state) == 0, "setup: %s", mfsdp_last_error());
  emu_rank* r = state;
  float* full = calloc(64, sizeof *full);
  float* shard = full + 32 * t->rank;
  mfsdp_buffer fb = {full, 64, MFSDP_F32, t->rank, NULL}, sb = {shard, 32, MFSDP_F32, t->rank, NULL};
  mfsdp_work* w = NULL;
  warm_up(r, &fb, &sb); /* connected: what stalls below is a launched collective */
  if (t->rank == 0) {
    CHECK_OK(mfsdp_nccl_ops.all_gather(r->nccl, &fb, &sb, &w)); /* issued; the peer never comes */
    CHECK_OK(mfsdp_nccl_ops.wait(r->nccl, w));                  /* orders the stream, does not block */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    mfsdp_status s = MFSDP_OK;
    while (s == MFSDP_OK) { /* what a training loop sees: its next collective is refused */
      nap(0.05);
      mfsdp_work* w2 = NULL;
      s = mfsdp_nccl_ops.all_gather(r->nccl, &fb, &sb, &w2);
      if (s == MFSDP_OK) mfsdp_nccl_ops.discard(r->nccl, w2);
      clock_gettime(CLOCK_MONOTONIC, &b);
      if ((double)(b.tv_sec - a.tv_sec) > 10.0) break;
    }
    double waited = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    CHECK(s == MFSDP_ERR_TIMEOUT, "stalled collective -> %s: %s", mfsdp_status_name(s), mfsdp_last_error());
    CHECK(strstr(mfsdp_last_error(), "within the timeout") && strstr(mfsdp_last_error(), "nccl_watch.c:"),
          "timeout message names the cause and file:line: %s", mfsdp_last_error());
    CHECK(waited > 0.2 && waited < 5.0, "timeout 0.3 s raised after %.2f s", waited);
    CHECK(mfsdp_nccl_failure(r->nccl) != NULL, "failure reason kept");
    printf("test_emu: a collective the peer never joined raised MFSDP_ERR_TIMEOUT after %.2f s (timeout 0.3 s)\n",
           waited);
    g_rank0_aborted = 1;
  } else {
    while (!g_rank0_aborted) nap(0.01);
    /* the peer aborted: this rank's collective cannot complete, NCCL reports a remote error
     * (at once, or at a later call) */
    mfsdp_status s = mfsdp_nccl_ops.all_gather(r->nccl, &fb, &sb, &w);
    if (s == MFSDP_OK) s = mfsdp_nccl_ops.wait(r->nccl, w);
    for (int i = 0; i < 100 && s == MFSDP_OK; ++i) {
      nap(0.02);
      mfsdp_work* w2 = NULL;
      s = mfsdp_nccl_ops.all_gather(r->nccl, &fb, &sb, &w2);
      if (s == MFSDP_OK) mfsdp_nccl_ops.discard(r->nccl, w2);
    }
    CHECK(s == MFSDP_ERR_NCCL && strstr(mfsdp_last_error(), "remote"), "peer of an aborted rank -> %s: %s",
          mfsdp_status_name(s), mfsdp_last_error());
  }
  emu_rank_sync(r); /* the broken collectives ended: nothing waits forever */
  emu_rank_teardown(r);
  free(full);
  return NULL;
}

static void test_watchdog(void) {
  emu_world* w = emu_world_create(2);
  w->timeout_s = 0.3;
  pthread_t threads[2];
  stall_thread args[2] = {{w, 0}, {w, 1}};
  for (int r = 0; r < 2; ++r) pthread_create(&threads[r], NULL, stall_worker, &args[r]);
  for (int r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
  emu_world_destroy(w);
}

/* ------------------------------------------------------------------------------------------ */

/* `test_emu [scenario]` runs one scenario (emulator, kernels, quant, pipeline, quant-pipeline, grouped, hfsdp,
 * watchdog, connect, destroy, group-abort, pipeline-destroy, close, interrupt); no argument runs them all. */
static int wanted(int argc, char** argv, const char* name) { return argc < 2 || strcmp(argv[1], name) == 0; }

int main(int argc, char** argv) {
  dev_memory_ops = heap_memory_ops;
  dev_memory_ops.create = dev_create;
  dev_memory_ops.release = dev_release;
  dev_memory_ops.destroy = dev_destroy;
  int streams_before = emu_streams_alive();
  if (wanted(argc, argv, "emulator")) test_emulator();
  if (wanted(argc, argv, "kernels")) test_kernels();
  if (wanted(argc, argv, "quant")) test_quant_kernels();
  long before = emu_nccl_collectives();
  if (wanted(argc, argv, "pipeline")) {
    run_pipeline_cases(&nccl_rig, 4, 0);
    run_pipeline_cases(&nccl_rig, 1, 1); /* world 1 with collectives, as tests/test_cuda.py runs on one GPU */
    /* these two with a flag tail: the used-parameter flags written on the device (the fill kernel)
     * and reduced with the gradients ([Note: used-flag tail] in csrc/comm/reduce.c) */
    pipeline_cases_tail = 3;
    emu_set_jitter_us(300); /* again with streams starting work at random moments */
    run_pipeline_cases(&nccl_rig, 4, 0);
    emu_set_jitter_us(0);
    g_defer_streams = 1; /* and with every rank's stream as far behind its host as CUDA allows */
    run_pipeline_cases(&nccl_rig, 4, 0);
    g_defer_streams = 0;
    pipeline_cases_tail = 0;
    CHECK(emu_nccl_premul_reductions() > 0, "no_shard / ZeRO-1 float32 reductions pre-multiply inside NCCL");
  }
  if (wanted(argc, argv, "quant-pipeline")) { /* the quantized wires through the native transport */
    run_quantized_cases(&nccl_rig, 4, 0);
    run_quantized_cases(&nccl_rig, 1, 1);
    g_defer_streams = 1;
    pipeline_cases_tail = 3; /* ZeRO-2/3's quantized gradients carry the used-parameter flags */
    run_quantized_cases(&nccl_rig, 4, 0);
    pipeline_cases_tail = 0;
    g_defer_streams = 0;
  }
  if (wanted(argc, argv, "grouped")) test_grouped_unit();
  if (wanted(argc, argv, "hfsdp")) test_hfsdp();
  long collectives = emu_nccl_collectives() - before;
  CHECK(emu_nccl_live_ops() == 0, "%d pre-multiply operators never destroyed", emu_nccl_live_ops());
  if (wanted(argc, argv, "watchdog")) test_watchdog();
  if (wanted(argc, argv, "connect")) test_dead_peer_at_connect();
  if (wanted(argc, argv, "destroy")) test_destroy_in_flight();
  if (wanted(argc, argv, "group-abort")) test_abort_inside_group();
  if (wanted(argc, argv, "pipeline-destroy")) test_pipeline_destroy_in_flight();
  if (wanted(argc, argv, "close")) test_close();
  if (wanted(argc, argv, "interrupt")) test_interrupt();
  CHECK(emu_streams_alive() == streams_before, "%d streams left alive", emu_streams_alive() - streams_before);
  if (test_failures) {
    fprintf(stderr, "test_emu: %d checks failed\n", test_failures);
    return test_failures > 100 ? 100 : test_failures;
  }
  printf("test_emu: all %ld checks passed (%ld NCCL collectives through the native transport, %ld pre-multiplied)\n",
         (long)test_checks, collectives, emu_nccl_premul_reductions());
  return 0;
}
