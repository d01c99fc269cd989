/* test_kernels.c (a part of test_emu, whose runner is csrc/tests/test_emu.c): the CUDA cast
 * kernels against the CPU ones, bit for bit. */
#include <math.h>

#include "cuda_tests.h"

/* kernels: the CUDA table against the CPU one, bit for bit */

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

void test_kernels(void) {
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
