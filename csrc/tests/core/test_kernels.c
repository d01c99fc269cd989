/* test_kernels.c (a part of test_core, whose runner is csrc/tests/test_core.c): the bf16 and fp16
 * conversions against an independent reference, and the CPU cast kernels over every pair of
 * floating types. */
#include <math.h>

#include "../../core/mfsdp_kernels.h"
#include "../harness.h"
#include "core_tests.h"

/* conversions against an independent reference: nearest representable value by binary search
 * over the sorted table of finite values, ties to the even encoding. */

typedef struct format_table {
  double values[0x8000]; /* positive finite values by encoding */
  int count;             /* encodings 0 .. count-1 are finite */
  double overflow;       /* the value one step past the largest finite one (rounds to Inf) */
} format_table;

static void build_table(format_table* t, int is_bf16) {
  t->count = is_bf16 ? 0x7f80 : 0x7c00;
  for (int h = 0; h < t->count; ++h)
    t->values[h] = is_bf16 ? mfsdp_bf16_to_f32((uint16_t)h) : mfsdp_f16_to_f32((uint16_t)h);
  t->overflow = is_bf16 ? ldexp(1.0, 128) : 65536.0;
}

static uint16_t reference_round(const format_table* t, float x, int is_bf16) {
  uint32_t bits = mfsdp_f32_bits(x);
  uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
  double a = fabs((double)x);
  if (isinf(x)) return sign | (is_bf16 ? 0x7f80 : 0x7c00);
  int lo = 0, hi = t->count - 1; /* largest encoding with value <= a */
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (t->values[mid] <= a) lo = mid; else hi = mid - 1;
  }
  double below = t->values[lo];
  double above = lo + 1 < t->count ? t->values[lo + 1] : t->overflow;
  int pick;
  if (a - below < above - a) pick = lo;
  else if (a - below > above - a) pick = lo + 1;
  else pick = (lo % 2 == 0) ? lo : lo + 1; /* tie: even encoding */
  if (pick >= t->count) return sign | (is_bf16 ? 0x7f80 : 0x7c00);
  return sign | (uint16_t)pick;
}

static int is_nan16(uint16_t h, int is_bf16) {
  return is_bf16 ? ((h & 0x7f80u) == 0x7f80u && (h & 0x7fu)) : ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu));
}

void test_conversions(void) {
  static format_table bf, hf;
  build_table(&bf, 1);
  build_table(&hf, 0);
  int bad_bf = 0, bad_hf = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) { /* every 16-bit value survives a round trip */
    uint16_t b = mfsdp_f32_to_bf16(mfsdp_bf16_to_f32((uint16_t)h));
    uint16_t f = mfsdp_f32_to_f16(mfsdp_f16_to_f32((uint16_t)h));
    bad_bf += is_nan16((uint16_t)h, 1) ? !is_nan16(b, 1) : b != h;
    bad_hf += is_nan16((uint16_t)h, 0) ? !is_nan16(f, 0) : f != h;
  }
  CHECK(bad_bf == 0, "%d bf16 values do not round-trip", bad_bf);
  CHECK(bad_hf == 0, "%d fp16 values do not round-trip", bad_hf);

  uint64_t rng = 42;
  int wrong_bf = 0, wrong_hf = 0;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t bits = (uint32_t)rng_next(&rng);
    if (i % 4 == 1) bits = (bits & 0x807fffffu) | ((uint32_t)rng_range(&rng, 96, 145) << 23); /* near f16 range */
    if (i % 4 == 2) bits = (bits & 0xffff0000u) | 0x8000u;                                    /* bf16 ties */
    if (i % 4 == 3) bits = (bits & 0x807fe000u) | 0x1000u | ((uint32_t)rng_range(&rng, 100, 142) << 23); /* f16 ties */
    float x = mfsdp_bits_f32(bits);
    if (isnan(x)) {
      wrong_bf += !is_nan16(mfsdp_f32_to_bf16(x), 1);
      wrong_hf += !is_nan16(mfsdp_f32_to_f16(x), 0);
      continue;
    }
    wrong_bf += mfsdp_f32_to_bf16(x) != reference_round(&bf, x, 1);
    wrong_hf += mfsdp_f32_to_f16(x) != reference_round(&hf, x, 0);
  }
  CHECK(wrong_bf == 0, "%d float32->bfloat16 results differ from round-to-nearest-even", wrong_bf);
  CHECK(wrong_hf == 0, "%d float32->float16 results differ from round-to-nearest-even", wrong_hf);
  /* named cases */
  CHECK(mfsdp_f32_to_bf16(1.00390625f) == 0x3f80, "tie rounds to even (down)");
  CHECK(mfsdp_f32_to_bf16(1.01171875f) == 0x3f82, "tie rounds to even (up)");
  CHECK(mfsdp_f32_to_f16(65519.0f) == 0x7bff && mfsdp_f32_to_f16(65520.0f) == 0x7c00, "fp16 overflow edge");
  CHECK(mfsdp_f32_to_f16(5.9604645e-8f) == 0x0001, "smallest fp16 subnormal");
  CHECK(mfsdp_f32_to_f16(2.9802322e-8f) == 0x0000, "half the smallest subnormal ties to zero");
  CHECK(mfsdp_f32_to_f16(-INFINITY) == 0xfc00 && mfsdp_f32_to_bf16(-INFINITY) == 0xff80, "-Inf kept");
}
/* ------------------------------------------------------------------------------------------ */
/* kernels: every pair of floating types, against the scalar formula in the pair's wide type */

static void expect_kernel_pair(int dt, int st, double alpha, int accumulate) {
  enum { N = 1031 };
  uint64_t rng = (uint64_t)(dt * 16 + st + 1);
  double src[N], dst[N], ref[N], out[N]; /* storage large enough for any dtype */
  fill_test_values(src, st, N, &rng);
  fill_test_values(dst, dt, N, &rng);
  memcpy(out, dst, sizeof dst);
  int wide = dt == MFSDP_F64 || st == MFSDP_F64;
  for (int64_t i = 0; i < N; ++i) {
    double s = load_as_double(src, st, i), d = load_as_double(dst, dt, i), v;
    if (wide) {
      v = accumulate ? d + alpha * s : (alpha == 1.0 ? s : alpha * s);
      store_from_double(ref, dt, i, v);
    } else {
      float fs = (float)s, fd = (float)d, fa = (float)alpha;
      float fv = accumulate ? fd + (alpha == 1.0 ? fs : fa * fs) : (alpha == 1.0 ? fs : fa * fs);
      store_from_double(ref, dt, i, fv);
    }
  }
  mfsdp_status s = accumulate ? mfsdp_cpu_accumulate(out, dt, src, st, N, alpha)
                              : mfsdp_cpu_copy(out, dt, src, st, N, alpha);
  CHECK(s == MFSDP_OK, "kernel %s<-%s failed", mfsdp_dtype_name(dt), mfsdp_dtype_name(st));
  int64_t wrong = count_differences(out, ref, dt, N);
  CHECK(wrong == 0, "%s %s<-%s alpha %g: %lld elements differ", accumulate ? "accumulate" : "copy",
        mfsdp_dtype_name(dt), mfsdp_dtype_name(st), alpha, (long long)wrong);
}

void test_kernels(void) {
  for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt)
    for (int st = 0; st < MFSDP_NUM_FLOAT_DTYPES; ++st)
      for (int acc = 0; acc < 2; ++acc) {
        expect_kernel_pair(dt, st, 1.0, acc);
        expect_kernel_pair(dt, st, 0.25, acc);
        expect_kernel_pair(dt, st, 1.0 / 3.0, acc);
      }
  float x[5] = {1.0f, NAN, 2.0f, -INFINITY, 3.0f};
  int64_t count = -1;
  CHECK_OK(mfsdp_cpu_count_nonfinite(x, MFSDP_F32, 5, &count));
  CHECK(count == 2, "count_nonfinite found %lld", (long long)count);
  uint16_t h[3] = {0x3c00, 0x7e00, 0xfc00};
  CHECK_OK(mfsdp_cpu_count_nonfinite(h, MFSDP_F16, 3, &count));
  CHECK(count == 2, "fp16 count_nonfinite found %lld", (long long)count);
  CHECK_OK(mfsdp_cpu_scale(x, MFSDP_F32, 1, 4.0));
  CHECK(x[0] == 4.0f, "scale");
  int32_t ints[2] = {1, 2};
  CHECK(mfsdp_cpu_copy(x, MFSDP_F32, ints, MFSDP_I32, 2, 1.0) == MFSDP_ERR_UNSUPPORTED, "int -> float refused");
  CHECK(mfsdp_cpu_copy(NULL, MFSDP_F32, x, MFSDP_F32, 2, 1.0) == MFSDP_ERR_INVALID_ARGUMENT, "null refused");
  CHECK(strstr(mfsdp_last_error(), "kernels_cpu.c:") != NULL, "error names file:line: %s", mfsdp_last_error());
}
