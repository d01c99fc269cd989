/* test_quant.c (a part of test_emu, whose runner is csrc/tests/test_emu.c): the CUDA quantization
 * kernels against the CPU ones, bit for bit. */
#include <math.h>

#include "cuda_tests.h"

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

void test_quant_kernels(void) {
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
