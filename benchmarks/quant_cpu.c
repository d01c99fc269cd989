/* quant_cpu.c: CPU throughput of the quantized wire format's kernels (csrc/core/quant_cpu.c),
 * one thread, against memcpy and the float32 -> bfloat16 cast kernel on the same buffers.
 *
 *     make bench-quant          # N=16M float32 elements, blocks of 128; `bench-quant ARGS="n block"`
 *
 * GB/s = (bytes read + bytes written) / median time of 5 calls. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../csrc/core/mfsdp_kernels.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int by_value(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

typedef enum { MEMCPY, CAST, QUANTIZE, DEQUANTIZE, ACCUMULATE } op_kind;

static double median_seconds(op_kind op, int mode, int64_t block, float* x, float* y, uint16_t* h, uint8_t* wire,
                             int64_t n) {
  double t[5];
  for (int r = 0; r < 6; ++r) { /* the first call warms the pages and is dropped */
    double t0 = now();
    mfsdp_status s = MFSDP_OK;
    switch (op) {
      case MEMCPY: memcpy(y, x, (size_t)n * sizeof *x); break;
      case CAST: s = mfsdp_cpu_copy(h, MFSDP_BF16, x, MFSDP_F32, n, 1.0); break;
      case QUANTIZE: s = mfsdp_cpu_quantize(wire, mode, block, x, MFSDP_F32, n, 1); break;
      case DEQUANTIZE: s = mfsdp_cpu_dequantize(y, MFSDP_F32, wire, mode, block, n, 1.0, 0); break;
      case ACCUMULATE: s = mfsdp_cpu_dequantize(y, MFSDP_F32, wire, mode, block, n, 1.0, 1); break;
    }
    if (s != MFSDP_OK) {
      fprintf(stderr, "quant_cpu: %s\n", mfsdp_last_error());
      exit(1);
    }
    if (r) t[r - 1] = now() - t0;
  }
  qsort(t, 5, sizeof t[0], by_value);
  return t[2];
}

static void report(const char* what, double seconds, double bytes, int64_t n) {
  printf("%-34s %8.2f ms %7.2f GB/s %6.2f ns/element\n", what, 1e3 * seconds, bytes / seconds / 1e9,
         1e9 * seconds / (double)n);
}

int main(int argc, char** argv) {
  int64_t n = argc > 1 ? atoll(argv[1]) : 16 << 20, block = argc > 2 ? atoll(argv[2]) : MFSDP_QUANT_DEFAULT_BLOCK;
  float* x = malloc((size_t)n * sizeof *x);
  float* y = malloc((size_t)n * sizeof *y);
  uint16_t* h = malloc((size_t)n * sizeof *h);
  uint8_t* wire = malloc((size_t)mfsdp_quant_wire_bytes(MFSDP_QUANT_INT8, n, block));
  uint64_t s = 1;
  for (int64_t i = 0; i < n; ++i) { /* values of a few magnitudes, as gradients have */
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x[i] = (float)((double)(s >> 11) / 9007199254740992.0 - 0.5) * (float)(1 << (i / 4096 % 8));
  }
  printf("%lld float32 elements (%.0f MB), blocks of %lld, one thread\n", (long long)n, 4e-6 * (double)n,
         (long long)block);
  double f32 = 4.0 * (double)n;
  report("memcpy float32", median_seconds(MEMCPY, 0, block, x, y, h, wire, n), 2 * f32, n);
  report("cast float32 -> bfloat16", median_seconds(CAST, 0, block, x, y, h, wire, n), 1.5 * f32, n);
  for (int mode = 0; mode < MFSDP_NUM_QUANT_MODES; ++mode) {
    double w = (double)mfsdp_quant_wire_bytes(mode, n, block);
    char what[64];
    snprintf(what, sizeof what, "quantize float32 -> %s", mfsdp_quant_mode_name(mode));
    report(what, median_seconds(QUANTIZE, mode, block, x, y, h, wire, n), f32 + w, n);
    snprintf(what, sizeof what, "dequantize %s -> float32", mfsdp_quant_mode_name(mode));
    report(what, median_seconds(DEQUANTIZE, mode, block, x, y, h, wire, n), w + f32, n);
    snprintf(what, sizeof what, "dequantize %s += float32", mfsdp_quant_mode_name(mode));
    report(what, median_seconds(ACCUMULATE, mode, block, x, y, h, wire, n), w + 2 * f32, n);
  }
  free(x);
  free(y);
  free(h);
  free(wire);
  return 0;
}
