/* test_core.c: the C engine without Python: conversions, kernels, the quantized wire format,
 * layout and the pipeline (on a thread transport at world sizes 1-4). Built with
 * AddressSanitizer and UndefinedBehaviorSanitizer by `make ctest`. Exit status = number of
 * failed checks (capped). */
#include <float.h>
#include <math.h>

#include "../core/mfsdp_kernels.h"
#include "harness.h"
#include "pipeline_cases.h"

/* ------------------------------------------------------------------------------------------ */
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

static void test_conversions(void) {
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

static void test_kernels(void) {
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

/* ------------------------------------------------------------------------------------------ */
/* quantized wire format ([Note: quantized wire format] in core/mfsdp_quant.h), against its
 * definition and a float64 reference */

/* e4m3fn's non-negative finite values by code (0 .. 126), from the format's definition. */
static double e4m3_value(int code) {
  int e = code >> 3, m = code & 7;
  return e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
}

/* Nearest e4m3fn code of v (not NaN), ties to the even code, saturating to +-448. */
static int e4m3_reference(double v) {
  int sign = signbit(v) ? 0x80 : 0;
  double a = fabs(v);
  if (a >= 448.0) return sign | 0x7e;
  int lo = 0, hi = 126; /* largest code with value <= a: below 126 here */
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (e4m3_value(mid) <= a) lo = mid; else hi = mid - 1;
  }
  double below = e4m3_value(lo), above = e4m3_value(lo + 1);
  int pick = a - below < above - a ? lo : a - below > above - a ? lo + 1 : (lo % 2 == 0 ? lo : lo + 1);
  return sign | pick;
}

static void test_e4m3(void) {
  int wrong = 0;
  for (int c = 0; c < 256; ++c) {
    float f = mfsdp_e4m3_to_f32((uint32_t)c);
    if ((c & 0x7f) == 0x7f) { /* e4m3fn's NaN */
      wrong += !isnan(f);
      continue;
    }
    double want = (c & 0x80 ? -1.0 : 1.0) * e4m3_value(c & 0x7f);
    wrong += (double)f != want || !signbit(f) != !(c & 0x80);
    wrong += mfsdp_f32_to_e4m3(f) != c; /* every value encodes to its own code */
  }
  CHECK(wrong == 0, "%d e4m3 codes decode or re-encode wrongly", wrong);
  int ties = 0;
  for (int c = 0; c < 126; ++c) { /* midpoints (5 significant bits: exact in float32) go to the even code */
    float mid = (float)((e4m3_value(c) + e4m3_value(c + 1)) / 2);
    int even = c % 2 == 0 ? c : c + 1;
    ties += mfsdp_f32_to_e4m3(mid) != even || mfsdp_f32_to_e4m3(-mid) != (0x80 | even);
  }
  CHECK(ties == 0, "%d e4m3 ties do not round to the even code", ties);
  uint64_t rng = 7;
  int off = 0;
  for (int i = 0; i < 1000000; ++i) { /* random float32s from 2^-14 to 2^9: subnormals to saturation */
    uint32_t bits = ((uint32_t)rng_next(&rng) & 0x807fffffu) | ((uint32_t)rng_range(&rng, 113, 136) << 23);
    if (i % 8 == 1) bits &= 0xfff00000u | ((uint32_t)1 << 19); /* ties of 3 mantissa bits */
    float v = mfsdp_bits_f32(bits);
    off += mfsdp_f32_to_e4m3(v) != e4m3_reference(v);
  }
  CHECK(off == 0, "%d float32 -> e4m3 results differ from nearest-even saturating", off);
  CHECK(mfsdp_f32_to_e4m3(470.0f) == 0x7e && mfsdp_f32_to_e4m3(464.0f) == 0x7e, "saturates where RNE gives 480");
  CHECK(mfsdp_f32_to_e4m3(1e30f) == 0x7e && mfsdp_f32_to_e4m3(-1e30f) == 0xfe, "saturates, sign kept");
  CHECK(mfsdp_f32_to_e4m3(ldexpf(1, -10)) == 0x00 && mfsdp_f32_to_e4m3(ldexpf(3, -10)) == 0x02,
        "subnormal ties to even");
  CHECK(mfsdp_f32_to_e4m3(ldexpf(15, -10)) == 0x08, "the largest subnormal rounds up to 2^-6");
}

/* Measured round-trip errors (finite blocks; float32 / float64 destinations). */
typedef struct quant_stats {
  double code_steps[MFSDP_NUM_QUANT_MODES]; /* max |x - code * s| / s, exact: int8, int4 (no saturation) */
  double int_steps[MFSDP_NUM_QUANT_MODES];  /* max |x - deq| / s: int8, int4 */
  double fp8_relative;                     /* max |x - deq| / |x| where |x / s| >= 2^-6 */
  double fp8_sub_steps;                    /* max |x - deq| / s below it */
  int64_t corrected;                       /* int codes that are not the float32 quotient's nearest */
  int64_t elements;
} quant_stats;

static int is_int_mode(int mode) { return mode != MFSDP_QUANT_FP8_E4M3; }

/* The source element as float32: what the format quantizes. */
static float source_f32(const void* src, int st, int64_t i) { return (float)load_as_double(src, st, i); }

/* One piece against the format's definition: scales (bit for bit), codes (bit for bit against
 * the exact quotient for int8 / int4: the nearest integer, ties to even; against the float32
 * quotient's nearest e4m3 value for fp8), zero padding. Returns the number of violations. */
static int64_t check_wire(int mode, int64_t block, const void* src, int st, int64_t n, const uint8_t* wire,
                          quant_stats* stats) {
  int64_t bad = 0, P = mfsdp_quant_payload_bytes(mode, n), C = mfsdp_quant_scales_offset(mode, n);
  int64_t nb = mfsdp_quant_blocks(n, block), W = mfsdp_quant_wire_bytes(mode, n, block);
  for (int64_t b = P; b < C; ++b) bad += wire[b] != 0;
  for (int64_t b = C + 4 * nb; b < W; ++b) bad += wire[b] != 0;
  if (mode == MFSDP_QUANT_INT4 && n % 2) bad += (wire[n / 2] >> 4) != 0;
  float qmax = mode == MFSDP_QUANT_INT8 ? 127.0f : mode == MFSDP_QUANT_INT4 ? 7.0f : 448.0f;
  for (int64_t j = 0; j < nb; ++j) {
    int64_t first = j * block, len = n - first < block ? n - first : block;
    double absmax = 0;
    int finite = 1;
    for (int64_t i = first; i < first + len; ++i) {
      float x = source_f32(src, st, i);
      finite &= isfinite(x) != 0;
      absmax = fmax(absmax, fabs((double)x));
    }
    float want = !finite ? mfsdp_bits_f32(0x7fc00000u) : absmax == 0 ? 0.0f : (float)absmax / qmax;
    if (finite && absmax > 0 && want < FLT_MIN) want = FLT_MIN;
    float s;
    memcpy(&s, wire + C + 4 * j, 4);
    bad += mfsdp_f32_bits(s) != mfsdp_f32_bits(want);
    for (int64_t i = first; i < first + len; ++i) {
      uint32_t code = mode == MFSDP_QUANT_INT4 ? (wire[i / 2] >> (i % 2 * 4)) & 15u : wire[i];
      if (!(want > 0)) { /* zero and non-finite blocks: codes 0 */
        bad += code != 0;
        continue;
      }
      float x = source_f32(src, st, i), v = x / want;
      if (mode == MFSDP_QUANT_FP8_E4M3) {
        bad += code != (uint32_t)e4m3_reference(v);
        continue;
      }
      /* the integer nearest to the exact quotient, ties to even: x - q * s is exact in float64 */
      double q = mode == MFSDP_QUANT_INT8 ? (double)(int8_t)code : (double)((int)code - (code >= 8 ? 16 : 0));
      double r = (double)x - q * (double)want, half = 0.5 * (double)want;
      if (fabs((double)x) > qmax * (double)want) { /* past the saturation point */
        bad += q != (x > 0 ? qmax : -qmax);
        continue;
      }
      bad += fabs(r) > half || (fabs(r) == half && fmod(q, 2.0) != 0.0);
      stats->corrected += q != nearbyint((double)v); /* the float32 quotient's rounding crossed a half */
      stats->code_steps[mode] = fmax(stats->code_steps[mode], fabs(r) / (double)want);
    }
  }
  return bad;
}

/* dst (dt) <- alpha * d, or dst + alpha * d, for a float32 source value d: the kernels' formula
 * (as expect_kernel_pair states it). */
static void kernel_formula(void* ref, int dt, int64_t i, double old, float d, double alpha, int accumulate) {
  if (dt == MFSDP_F64) {
    store_from_double(ref, dt, i, accumulate ? old + alpha * d : alpha == 1.0 ? d : alpha * d);
  } else {
    float fa = (float)alpha, fd = (float)old;
    float v = alpha == 1.0 ? d : fa * d;
    store_from_double(ref, dt, i, accumulate ? fd + v : v);
  }
}

/* Dequantizes a piece into dt by mfsdp_cpu_dequantize (copy and accumulate, alpha 1, 1/3,
 * 0.25) and checks every result bit for bit against the definition (code * s in float32, then
 * the kernels' formula), and the plain copy against the float64 source within the bound of the
 * Note. Returns the number of violations. */
static int64_t check_dequantize(int mode, int64_t block, const void* src, int st, int64_t n, const uint8_t* wire, int dt,
                                quant_stats* stats) {
  int64_t bad = 0, C = mfsdp_quant_scales_offset(mode, n);
  size_t bytes = (size_t)(n + 1) * 8;
  char* old = malloc(bytes);
  char* out = malloc(bytes);
  char* ref = malloc(bytes);
  uint64_t rng = (uint64_t)(n * 31 + dt);
  fill_test_values(old, dt, n, &rng);
  const double alphas[3] = {1.0, 1.0 / 3.0, 0.25};
  for (int acc = 0; acc < 2; ++acc)
    for (int a = 0; a < 3; ++a) {
      memcpy(out, old, bytes);
      memcpy(ref, old, bytes);
      mfsdp_status s = mfsdp_cpu_dequantize(out, dt, wire, mode, block, n, alphas[a], acc);
      bad += s != MFSDP_OK;
      for (int64_t i = 0; i < n; ++i) {
        float scale;
        memcpy(&scale, wire + C + 4 * (i / block), 4);
        uint32_t code = mode == MFSDP_QUANT_INT4 ? (wire[i / 2] >> (i % 2 * 4)) & 15u : wire[i];
        double value = mode == MFSDP_QUANT_FP8_E4M3 ? (code & 0x80 ? -1 : 1) * e4m3_value(code & 0x7f)
                       : mode == MFSDP_QUANT_INT8   ? (double)(int8_t)code
                                                    : (double)((int)code - (code >= 8 ? 16 : 0));
        float d = (float)value * scale;
        kernel_formula(ref, dt, i, load_as_double(old, dt, i), d, alphas[a], acc);
      }
      int64_t wrong = count_differences(out, ref, dt, n);
      CHECK(wrong == 0, "dequantize %s into %s (block %lld, n %lld, alpha %g, accumulate %d): %lld elements differ "
            "from code * scale", mfsdp_quant_mode_name(mode), mfsdp_dtype_name(dt), (long long)block, (long long)n,
            alphas[a], acc, (long long)wrong);
      bad += wrong;
      if (acc || a) continue;
      for (int64_t i = 0; i < n; ++i) { /* the round trip, against the float64 source */
        float scale;
        memcpy(&scale, wire + C + 4 * (i / block), 4);
        double x = load_as_double(src, st, i), xf = source_f32(src, st, i), y = load_as_double(out, dt, i);
        if (isnan(scale)) { /* a non-finite block dequantizes to NaN */
          bad += !isnan(y);
          continue;
        }
        if (scale == 0) { /* a zero block to exact +0 */
          bad += y != 0 || signbit(y);
          continue;
        }
        double err = fabs(y - x), s = scale, bound;
        if (is_int_mode(mode)) bound = s * (0.5 + ldexp(1, mode == MFSDP_QUANT_INT8 ? -17 : -21));
        else bound = fmax(ldexp(fabs(xf), -4), ldexp(s, -10)) * (1 + ldexp(1, -16));
        bound += fabs(x - xf) + ldexp(1, -149);
        if (dt == MFSDP_BF16) bound += ldexp(fabs(y), -8) + ldexp(1, -134);
        if (dt == MFSDP_F16) bound += ldexp(fabs(y), -11) + ldexp(1, -25);
        if (err > bound) {
          if (bad < 8)
            fprintf(stderr, "  %s %s->%s block %lld: x=%.9g deq=%.9g scale=%.9g err=%.3g > %.3g\n",
                    mfsdp_quant_mode_name(mode), mfsdp_dtype_name(st), mfsdp_dtype_name(dt), (long long)(i / block), x,
                    y, s, err, bound);
          bad++;
        }
        if (dt != MFSDP_F32 && dt != MFSDP_F64) continue;
        stats->elements++;
        double e = fabs(y - xf);
        if (is_int_mode(mode)) stats->int_steps[mode] = fmax(stats->int_steps[mode], e / s);
        else if (fabs(xf) / s >= ldexp(1, -6)) stats->fp8_relative = fmax(stats->fp8_relative, e / fabs(xf));
        else stats->fp8_sub_steps = fmax(stats->fp8_sub_steps, e / s);
      }
    }
  free(old);
  free(out);
  free(ref);
  return bad;
}

/* Every mode x source dtype x destination dtype x (n, block), odd tails included. */
static void test_quant_round_trip(void) {
  const int64_t shapes[][2] = {{1, 128},  {7, 128},  {128, 128}, {129, 128}, {300, 128}, {1000, 100},
                               {1001, 32}, {257, 2}, {64, 64},   {5000, 4100}, {3001, 1}};
  quant_stats stats = {{0}, {0}, 0, 0, 0, 0};
  for (int mode = 0; mode < MFSDP_NUM_QUANT_MODES; ++mode)
    for (size_t z = 0; z < sizeof shapes / sizeof shapes[0]; ++z) {
      int64_t n = shapes[z][0], block = shapes[z][1];
      if (mode == MFSDP_QUANT_INT4 && block % 2) block += 1;
      for (int st = 0; st < MFSDP_NUM_FLOAT_DTYPES; ++st) {
        uint64_t rng = (uint64_t)(mode * 1000 + z * 10 + st);
        char* src = malloc((size_t)n * 8);
        fill_quant_values(src, st, n, block, &rng, 1);
        int64_t W = mfsdp_quant_wire_bytes(mode, n, block);
        uint8_t* wire = malloc((size_t)W);
        memset(wire, 0xa5, (size_t)W); /* the padding must be written */
        CHECK_OK(mfsdp_cpu_quantize(wire, mode, block, src, st, n, 1));
        int64_t bad = check_wire(mode, block, src, st, n, wire, &stats);
        CHECK(bad == 0, "quantize %s from %s, n %lld, block %lld: %lld violations of the format",
              mfsdp_quant_mode_name(mode), mfsdp_dtype_name(st), (long long)n, (long long)block, (long long)bad);
        for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt) {
          bad = check_dequantize(mode, block, src, st, n, wire, dt, &stats);
          CHECK(bad == 0, "round trip %s %s -> %s, n %lld, block %lld: %lld violations", mfsdp_quant_mode_name(mode),
                mfsdp_dtype_name(st), mfsdp_dtype_name(dt), (long long)n, (long long)block, (long long)bad);
        }
        free(src);
        free(wire);
      }
    }
  printf("test_core: quantization round trip over %lld elements, max error: int8 %.7f steps, int4 %.7f steps "
         "(codes alone: %.7f, %.7f; %lld codes corrected past the float32 quotient), fp8_e4m3 %.6f relative "
         "(2^-4 = 0.0625) and %.6f steps below 2^-6 * scale (2^-10 = %.6f)\n",
         (long long)stats.elements, stats.int_steps[MFSDP_QUANT_INT8], stats.int_steps[MFSDP_QUANT_INT4],
         stats.code_steps[MFSDP_QUANT_INT8], stats.code_steps[MFSDP_QUANT_INT4], (long long)stats.corrected,
         stats.fp8_relative, stats.fp8_sub_steps, ldexp(1, -10));
  CHECK(stats.corrected > 0, "no input exercised the correction of a float32 quotient that crossed a half");
  CHECK(stats.int_steps[MFSDP_QUANT_INT8] > 0.45 && stats.int_steps[MFSDP_QUANT_INT4] > 0.45 &&
        stats.fp8_relative > 0.05, "the round trips came near their bounds (the inputs exercise them)");
}

/* Named cases: ties, saturation, NaN / Inf, zero and subnormal blocks, sizes. */
static void test_quant_cases(void) {
  /* wire sizes: payload, zero up to 16, scales, zero up to 16 */
  CHECK(mfsdp_quant_wire_bytes(MFSDP_QUANT_INT8, 1, 128) == 32, "int8 n=1: 16 + 16");
  CHECK(mfsdp_quant_wire_bytes(MFSDP_QUANT_FP8_E4M3, 300, 128) == 320, "fp8 n=300: 304 + 12 -> 320");
  CHECK(mfsdp_quant_wire_bytes(MFSDP_QUANT_INT4, 5, 4) == 32 && mfsdp_quant_scales_offset(MFSDP_QUANT_INT4, 5) == 16,
        "int4 n=5: 3 bytes, scales at 16");
  CHECK(mfsdp_quant_wire_bytes(MFSDP_QUANT_INT4, 1 << 20, 128) == (1 << 19) + 4 * 8192, "int4 1M elements");
  CHECK(mfsdp_quant_wire_bytes(MFSDP_QUANT_INT8, 0, 128) == 0, "an empty piece has no bytes");
  CHECK(mfsdp_quant_wire_bytes(MFSDP_QUANT_INT4, 8, 3) == -1 && mfsdp_quant_wire_bytes(MFSDP_QUANT_INT8, 8, 0) == -1 &&
        mfsdp_quant_wire_bytes(7, 8, 128) == -1, "bad formats have no size");

  /* ties round to even, on exact scales (absmax = qmax: s = 1) */
  float ints[10] = {127, 2.5f, 3.5f, -2.5f, -3.5f, 0.5f, -0.5f, 1.5f, 126.5f, -126.5f};
  uint8_t wire[64];
  CHECK_OK(mfsdp_cpu_quantize(wire, MFSDP_QUANT_INT8, 10, ints, MFSDP_F32, 10, 1));
  const int8_t want8[10] = {127, 2, 4, -2, -4, 0, 0, 2, 126, -126};
  CHECK(memcmp(wire, want8, 10) == 0, "int8 ties to even");
  float nib[8] = {7, 2.5f, 3.5f, -0.5f, 6.5f, -6.5f, 1.5f, -7};
  CHECK_OK(mfsdp_cpu_quantize(wire, MFSDP_QUANT_INT4, 8, nib, MFSDP_F32, 8, 1));
  const uint8_t want4[4] = {0x27, 0x04, 0xa6, 0x92}; /* (7, 2) (4, 0) (6, -6) (2, -7), low nibble first */
  CHECK(memcmp(wire, want4, 4) == 0, "int4 ties to even: %02x %02x %02x %02x", wire[0], wire[1], wire[2], wire[3]);
  float e4[6] = {448, 1.0625f, 1.1875f, -1.0625f, ldexpf(3, -10), ldexpf(1, -10)};
  CHECK_OK(mfsdp_cpu_quantize(wire, MFSDP_QUANT_FP8_E4M3, 6, e4, MFSDP_F32, 6, 1));
  const uint8_t wante[6] = {0x7e, 0x38, 0x3a, 0xb8, 0x02, 0x00};
  CHECK(memcmp(wire, wante, 6) == 0, "e4m3 ties to even");

  /* saturation: the absmax element codes to +-qmax exactly, whatever the rounding of its scale,
   * and no code passes it (fp8 never writes its NaN code) */
  uint64_t rng = 3;
  int over = 0;
  for (int t = 0; t < 20000; ++t) {
    float x[4];
    for (int i = 0; i < 4; ++i) x[i] = (float)((2 * rng_uniform(&rng) - 1) * ldexp(1, (int)rng_range(&rng, -100, 100)));
    int top = 0;
    for (int i = 1; i < 4; ++i) top = fabsf(x[i]) > fabsf(x[top]) ? i : top;
    for (int mode = 0; mode < MFSDP_NUM_QUANT_MODES; ++mode) {
      CHECK_OK(mfsdp_cpu_quantize(wire, mode, 4, x, MFSDP_F32, 4, 1));
      for (int i = 0; i < 4; ++i) {
        uint32_t c = mode == MFSDP_QUANT_INT4 ? (wire[i / 2] >> (i % 2 * 4)) & 15u : wire[i];
        float v = mfsdp_quant_code_value(mode, c);
        float qmax = mfsdp_quant_qmax(mode);
        over += isnan(v) || fabsf(v) > qmax || (i == top && fabsf(v) != qmax);
      }
    }
  }
  CHECK(over == 0, "%d codes past the saturation bound, or an absmax not at it", over);

  /* NaN / Inf make their block (only) NaN; zero blocks are exact +0; subnormal blocks keep
   * their error bound (scale raised to FLT_MIN); a float64 beyond float32 is non-finite */
  for (int mode = 0; mode < MFSDP_NUM_QUANT_MODES; ++mode)
    for (int st = 0; st < MFSDP_NUM_FLOAT_DTYPES; ++st) {
      const double v[14] = {1, -2, 3, 0.5, 1, NAN, 2, 3, -INFINITY, 4, 0.0, -0.0, 1e-40, -3e-39};
      char src[14 * 8];
      for (int i = 0; i < 14; ++i) store_from_double(src, st, i, v[i]);
      /* blocks of 4: finite | NaN | -Inf | zero + subnormals (short tail of 2 after the zeros) */
      const double v2[14] = {1, -2, 3, 0.5, 1, NAN, 2, 3, -INFINITY, 4, 0.0, -0.0, 0.0, -0.0};
      char zsrc[14 * 8];
      for (int i = 0; i < 14; ++i) store_from_double(zsrc, st, i, v2[i]);
      uint8_t w[64];
      float out[14], acc[14];
      CHECK_OK(mfsdp_cpu_quantize(w, mode, 4, zsrc, st, 14, 1));
      CHECK_OK(mfsdp_cpu_dequantize(out, MFSDP_F32, w, mode, 4, 14, 1.0, 0));
      for (int i = 0; i < 14; ++i) acc[i] = 10.0f;
      CHECK_OK(mfsdp_cpu_dequantize(acc, MFSDP_F32, w, mode, 4, 14, 1.0, 1));
      int bad = 0;
      for (int i = 0; i < 4; ++i) bad += isnan(out[i]) || fabsf(out[i] - (float)v2[i]) > 0.3f;
      for (int i = 4; i < 12; ++i) bad += !isnan(out[i]) || !isnan(acc[i]);
      for (int i = 12; i < 14; ++i) bad += out[i] != 0 || signbit(out[i]) || acc[i] != 10.0f;
      int64_t C = mfsdp_quant_scales_offset(mode, 14);
      uint32_t s[4];
      memcpy(s, w + C, sizeof s);
      bad += s[1] != 0x7fc00000u || s[2] != 0x7fc00000u || s[3] != 0;
      CHECK(bad == 0, "%s from %s: NaN/Inf/zero blocks wrong (%d)", mfsdp_quant_mode_name(mode), mfsdp_dtype_name(st),
            bad);
      if (st != MFSDP_F32 && st != MFSDP_F64) continue;
      CHECK_OK(mfsdp_cpu_quantize(w, mode, 2, src + 12 * mfsdp_dtype_size(st), st, 2, 1)); /* subnormals only */
      memcpy(s, w + mfsdp_quant_scales_offset(mode, 2), 4);
      CHECK_OK(mfsdp_cpu_dequantize(out, MFSDP_F32, w, mode, 2, 2, 1.0, 0));
      CHECK(s[0] == 0x00800000u && fabs(out[1] - (-3e-39)) <= ldexp(1, -127), "%s subnormal block: scale %08x, %g",
            mfsdp_quant_mode_name(mode), s[0], out[1]);
    }
  double huge[3] = {1.0, 1e300, 2.0};
  float back[3];
  CHECK_OK(mfsdp_cpu_quantize(wire, MFSDP_QUANT_INT8, 2, huge, MFSDP_F64, 3, 1));
  CHECK_OK(mfsdp_cpu_dequantize(back, MFSDP_F32, wire, MFSDP_QUANT_INT8, 2, 3, 1.0, 0));
  CHECK(isnan(back[0]) && isnan(back[1]) && fabsf(back[2] - 2.0f) <= 1.0f / 127, "a float64 past float32's range is non-finite");
}

/* Several pieces in one quantize call, and a dequantize-with-copy-out of ranges of them (a
 * gather's copy-out), against the per-piece calls. */
static void test_quant_pieces(void) {
  enum { PIECES = 3, N = 1001 };
  for (int mode = 0; mode < MFSDP_NUM_QUANT_MODES; ++mode)
    for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt) {
      int64_t block = 64, W = mfsdp_quant_wire_bytes(mode, N, block);
      uint64_t rng = (uint64_t)(mode * 4 + dt + 100);
      uint16_t src[PIECES * N];
      fill_quant_values(src, MFSDP_BF16, PIECES * N, block, &rng, 1);
      uint8_t* all = malloc((size_t)(PIECES * W));
      uint8_t* one = malloc((size_t)(PIECES * W));
      CHECK_OK(mfsdp_cpu_quantize(all, mode, block, src, MFSDP_BF16, N, PIECES));
      for (int p = 0; p < PIECES; ++p) CHECK_OK(mfsdp_cpu_quantize(one + p * W, mode, block, src + p * N, MFSDP_BF16, N, 1));
      CHECK(memcmp(all, one, (size_t)(PIECES * W)) == 0, "%s: %d pieces in one call differ from one at a time",
            mfsdp_quant_mode_name(mode), PIECES);
      /* copy-out: every piece cut into ranges (odd offsets, mid-block, mid-byte, empty), put in
       * a shuffled order with holes between them */
      mfsdp_quant_item items[PIECES * 5];
      int n_items = 0;
      int64_t dst_at = 3;
      const int64_t cuts[6] = {0, 1, 64, 333, 333, N};
      for (int k = 0; k < 5; ++k)
        for (int p = PIECES - 1; p >= 0; --p) {
          items[n_items++] = (mfsdp_quant_item){all + p * W, cuts[k], dst_at, cuts[k + 1] - cuts[k]};
          dst_at += cuts[k + 1] - cuts[k] + 2;
        }
      size_t bytes = (size_t)(dst_at + 4) * 8;
      char* got = malloc(bytes);
      char* want = malloc(bytes);
      fill_test_values(got, dt, dst_at + 4, &rng);
      for (int acc = 0; acc < 2; ++acc) {
        memcpy(want, got, bytes);
        CHECK_OK(mfsdp_cpu_dequantize_pack(got, dt, items, n_items, mode, block, N, 1.0 / 3.0, acc));
        for (int i = 0; i < n_items; ++i) { /* the whole piece in float32, then the cast kernels */
          float whole[N];
          CHECK_OK(mfsdp_cpu_dequantize(whole, MFSDP_F32, items[i].wire, mode, block, N, 1.0, 0));
          void* d = want + items[i].dst_offset * mfsdp_dtype_size(dt);
          CHECK_OK(acc ? mfsdp_cpu_accumulate(d, dt, whole + items[i].src_offset, MFSDP_F32, items[i].n, 1.0 / 3.0)
                       : mfsdp_cpu_copy(d, dt, whole + items[i].src_offset, MFSDP_F32, items[i].n, 1.0 / 3.0));
        }
        int64_t wrong = count_differences(got, want, dt, dst_at + 4);
        CHECK(wrong == 0, "dequantize_pack %s into %s accumulate %d: %lld elements differ", mfsdp_quant_mode_name(mode),
              mfsdp_dtype_name(dt), acc, (long long)wrong);
      }
      free(all);
      free(one);
      free(got);
      free(want);
    }
}

/* Refusals: clear statuses naming the file, and a refused pack writes nothing. */
static void test_quant_refusals(void) {
  float x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, y[8] = {0};
  uint8_t w[64] __attribute__((aligned(16)));
  int32_t ints[8] = {0};
  CHECK(mfsdp_cpu_quantize(w, 9, 128, x, MFSDP_F32, 8, 1) == MFSDP_ERR_INVALID_ARGUMENT, "unknown mode");
  CHECK(strstr(mfsdp_last_error(), "quant_cpu.c:") != NULL, "error names file:line: %s", mfsdp_last_error());
  CHECK(mfsdp_cpu_quantize(w, MFSDP_QUANT_INT4, 3, x, MFSDP_F32, 8, 1) == MFSDP_ERR_INVALID_ARGUMENT, "int4 odd block");
  CHECK(mfsdp_cpu_quantize(w, MFSDP_QUANT_INT8, 0, x, MFSDP_F32, 8, 1) == MFSDP_ERR_INVALID_ARGUMENT, "block 0");
  CHECK(mfsdp_cpu_quantize(w, MFSDP_QUANT_INT8, 4, x, MFSDP_F32, -1, 1) == MFSDP_ERR_INVALID_ARGUMENT, "negative n");
  CHECK(mfsdp_cpu_quantize(w, MFSDP_QUANT_INT8, 4, ints, MFSDP_I32, 8, 1) == MFSDP_ERR_UNSUPPORTED, "integer source");
  CHECK(mfsdp_cpu_quantize(w + 2, MFSDP_QUANT_INT8, 4, x, MFSDP_F32, 8, 1) == MFSDP_ERR_INVALID_ARGUMENT,
        "a piece not 4-byte aligned");
  CHECK(mfsdp_cpu_quantize(NULL, MFSDP_QUANT_INT8, 4, x, MFSDP_F32, 8, 1) == MFSDP_ERR_INVALID_ARGUMENT, "null wire");
  CHECK_OK(mfsdp_cpu_quantize(NULL, MFSDP_QUANT_INT8, 4, NULL, MFSDP_F32, 0, 1)); /* nothing to do */
  CHECK_OK(mfsdp_cpu_quantize(w, MFSDP_QUANT_INT8, 4, x, MFSDP_F32, 8, 1));
  CHECK(mfsdp_cpu_dequantize(y, MFSDP_I32, w, MFSDP_QUANT_INT8, 4, 8, 1.0, 0) == MFSDP_ERR_UNSUPPORTED, "into int32");
  mfsdp_quant_item items[2] = {{w, 0, 0, 4}, {w, 6, 4, 4}}; /* the second runs past the piece of 8 */
  CHECK(mfsdp_cpu_dequantize_pack(y, MFSDP_F32, items, 2, MFSDP_QUANT_INT8, 4, 8, 1.0, 0) == MFSDP_ERR_INVALID_ARGUMENT,
        "an item past its piece");
  CHECK(y[0] == 0 && y[3] == 0, "a refused pack wrote nothing");
  items[1] = (mfsdp_quant_item){w, 4, -1, 4};
  CHECK(mfsdp_cpu_dequantize_pack(y, MFSDP_F32, items, 2, MFSDP_QUANT_INT8, 4, 8, 1.0, 0) == MFSDP_ERR_INVALID_ARGUMENT,
        "a negative destination offset");
  CHECK(mfsdp_cpu_dequantize(NULL, MFSDP_F32, w, MFSDP_QUANT_INT8, 4, 8, 1.0, 0) == MFSDP_ERR_INVALID_ARGUMENT,
        "null destination");
  /* the CPU kernel table carries the same entries */
  float z[8];
  CHECK_OK(mfsdp_cpu_dequantize(z, MFSDP_F32, w, MFSDP_QUANT_INT8, 4, 8, 1.0, 0));
  CHECK_OK(mfsdp_cpu_kernels.dequantize(NULL, y, MFSDP_F32, w, MFSDP_QUANT_INT8, 4, 8, 1.0, 0));
  CHECK(memcmp(y, z, sizeof y) == 0 && fabsf(y[7] - 8.0f) < 8.0f / 127, "table dequantize: %g %g", y[0], y[7]);
}

static void test_quant(void) {
  test_e4m3();
  test_quant_cases();
  test_quant_round_trip();
  test_quant_pieces();
  test_quant_refusals();
}

/* ------------------------------------------------------------------------------------------ */
/* layout */

/* Rank r's piece of a (outer, rows, row) tensor sharded on dim 1 as torch makes it:
 * torch.chunk(w, world, dim=1)[r].contiguous(), as the item's element indices, in order. */
static int64_t chunk_reference(int64_t outer, int64_t rows, int64_t row, int world, int r, int64_t* out) {
  int64_t c = (rows + world - 1) / world, lo = r * c < rows ? r * c : rows, hi = lo + c < rows ? lo + c : rows, n = 0;
  for (int64_t b = 0; b < outer; ++b)
    for (int64_t q = lo; q < hi; ++q)
      for (int64_t e = 0; e < row; ++e) out[n++] = (b * rows + q) * row + e;
  return n;
}

/* [Note: chunked layout]'s blocks: a parameter sharded on a dim other than 0. */
static void test_chunked_layout(void) {
  /* mfsdp_piece_runs against torch.chunk along dim 1, even and uneven, rows fewer than ranks */
  static const int64_t shapes[][3] = {{3, 4, 2}, {2, 6, 3}, {8, 1, 1}, {5, 7, 1}, {1, 9, 4}, {4, 2, 5}};
  int64_t want[512];
  for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; ++k)
    for (int world = 1; world <= 4; ++world) {
      int64_t outer = shapes[k][0], rows = shapes[k][1], row = shapes[k][2], numel = outer * rows * row;
      int64_t piece = outer * ((rows + world - 1) / world) * row;
      for (int r = 0; r < world; ++r) {
        int64_t n = chunk_reference(outer, rows, row, world, r, want), wrong = 0;
        mfsdp_runs ru;
        mfsdp_piece_runs(numel, piece, outer, r, &ru);
        CHECK(ru.count * ru.len == n && ru.count * ru.len <= piece,
              "shape (%lld, %lld, %lld) world %d rank %d: %lld x %lld elements, torch.chunk has %lld", (long long)outer,
              (long long)rows, (long long)row, world, r, (long long)ru.count, (long long)ru.len, (long long)n);
        for (int64_t q = 0; q < ru.count && ru.count * ru.len == n; ++q)
          for (int64_t e = 0; e < ru.len; ++e) wrong += ru.first + q * ru.stride + e != want[q * ru.len + e];
        CHECK(wrong == 0, "shape (%lld, %lld, %lld) world %d rank %d: %lld elements out of torch.chunk's order",
              (long long)outer, (long long)rows, (long long)row, world, r, (long long)wrong);
        if (outer == 1) { /* one block: mfsdp_piece_of's one run */
          int64_t first, len;
          mfsdp_piece_of(numel, piece, r, &first, &len);
          CHECK(ru.count * ru.len == len && (len == 0 || ru.first == first), "outer 1 is mfsdp_piece_of");
        }
      }
    }

  /* the planner: blocked pieces, a blocked item alone is never an in-place gather, validation */
  mfsdp_param_info params[] = {
      {24, 2, MFSDP_F32, 0, 1, 0, 3}, /* (3, 4, 2) on dim 1 */
      {16, 4, MFSDP_F32, 0, 1, 0, 1}, /* (4, 4) on dim 0 */
      {16, 1, MFSDP_F32, 1, 1, 0, 4}, /* (4, 4) on dim 1, alone in unit 1: evenly split, not identity */
  };
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(params, 3, 2, 0, 16, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, params, 3));
  CHECK(plan.n_buckets == 2, "two units, two buckets (%d)", plan.n_buckets);
  const mfsdp_bucket_layout* L = &plan.buckets[0].layout;
  CHECK(mfsdp_layout_outer(L, 0) == 3 && mfsdp_layout_outer(L, 1) == 1, "outers kept per item");
  CHECK(L->pieces[0] == 3 * 2 * 2, "(3, 4, 2) over 2 on dim 1: 3 blocks of 2 rows of 2, got %lld",
        (long long)L->pieces[0]);
  CHECK(!mfsdp_layout_is_identity(&plan.buckets[1].layout), "a blocked item alone still needs a copy-out");
  CHECK_OK(mfsdp_layout_validate(L, plan.buckets[0].row_sizes));
  int64_t saved = ((int64_t*)L->outers)[0];
  ((int64_t*)L->outers)[0] = 5; /* 24 elements are not 5 blocks */
  CHECK(mfsdp_layout_validate(L, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "blocks that do not divide the item refused");
  ((int64_t*)L->outers)[0] = 0;
  CHECK(mfsdp_layout_validate(L, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "0 blocks refused");
  ((int64_t*)L->outers)[0] = 2; /* divides, but the plan was made for 3 */
  CHECK(mfsdp_plan_validate(&plan, params, 3) == MFSDP_ERR_INVALID_STATE, "a plan whose blocks differ refused");
  ((int64_t*)L->outers)[0] = saved;
  mfsdp_plan_free(&plan);
  mfsdp_param_info ragged = {24, 2, MFSDP_F32, 0, 1, 0, 5};
  CHECK(mfsdp_plan_build(&ragged, 1, 2, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "24 is not 5 blocks of rows of 2");
  mfsdp_param_info negative = {24, 2, MFSDP_F32, 0, 1, 0, -1};
  CHECK(mfsdp_plan_build(&negative, 1, 2, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "negative blocks refused");
}

/* [Note: flag tail]: a tail per floating bucket, in every shard, disjoint from every item's rows in
 * both layouts; integer buckets get none; a tailed one-item bucket is no identity layout. */
static void test_flag_tail_layout(const mfsdp_param_info* block, int n, const mfsdp_param_info* mixed) {
  mfsdp_plan plain, plan;
  CHECK_OK(mfsdp_plan_build(block, n, 4, 0, 16, &plain));
  CHECK_OK(mfsdp_plan_build_tailed(block, n, 4, 0, 16, 3, 0, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, block, n));
  const mfsdp_bucket_layout *P = &plain.buckets[0].layout, *L = &plan.buckets[0].layout;
  CHECK(L->tail == 3 * n && L->tail_offset % 4 == 0, "3 elements per item, aligned (%lld at %lld)", (long long)L->tail,
        (long long)L->tail_offset);
  CHECK(L->tail_offset >= P->shard_size - 3 && L->shard_size >= L->tail_offset + L->tail && L->shard_size % 4 == 0,
        "after the last piece, inside the aligned shard");
  for (int i = 0; i < n; ++i)
    CHECK(L->shard_offsets[i] == P->shard_offsets[i] && L->param_offsets[i] == P->param_offsets[i] &&
              L->pieces[i] == P->pieces[i],
          "item %d keeps its place in both layouts", i);
  CHECK(L->weight_size == P->weight_size, "the parameter-major weights do not grow when sharded");
  mfsdp_plan_free(&plain);
  mfsdp_plan_free(&plan);

  mfsdp_param_info with_int[9];
  memcpy(with_int, mixed, 8 * sizeof *with_int);
  with_int[8] = (mfsdp_param_info){6, 1, MFSDP_I64, -1, 0, 0, 1};
  CHECK_OK(mfsdp_plan_build_tailed(with_int, 9, 4, 0, 16, 2, 0, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, with_int, 9));
  int identity = 0;
  for (int b = 0; b < plan.n_buckets; ++b) {
    const mfsdp_bucket_layout* l = &plan.buckets[b].layout;
    int floating = mfsdp_dtype_is_float(plan.buckets[b].dtype);
    CHECK(l->tail == (floating ? 2 * l->n_items : 0), "bucket %d: a tail iff floating (%lld)", b, (long long)l->tail);
    if (l->world == 1 && floating)
      CHECK(l->tail_offset + l->tail <= l->weight_size && l->shard_size == l->weight_size,
            "unsharded: the tail after the last item, one layout");
    identity += l->world > 1 && mfsdp_layout_is_identity(l);
  }
  CHECK(identity == 0, "no tailed sharded bucket gathers in place (%d)", identity);
  /* a layout whose tail overlaps an item's rows is refused */
  mfsdp_bucket_layout bad = plan.buckets[0].layout;
  bad.tail_offset = bad.shard_offsets[0];
  bad.tail = 1;
  CHECK(mfsdp_layout_validate(&bad, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "a tail over an item refused");
  bad.tail_offset = bad.shard_size;
  CHECK(mfsdp_layout_validate(&bad, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "a tail past the shard refused");
  mfsdp_plan_free(&plan);
  CHECK(mfsdp_plan_build_tailed(block, n, 4, 0, 16, -1, 0, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "negative tail refused");
  /* aligned to a quantization block of 7: the tail and the shard's end on multiples of 7 (and of 4) */
  CHECK_OK(mfsdp_plan_build_tailed(block, n, 4, 0, 16, 3, 7, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, block, n));
  L = &plan.buckets[0].layout;
  CHECK(L->tail_offset % 28 == 0 && L->shard_size % 28 == 0 && L->tail_offset >= L->shard_offsets[n - 1] + L->pieces[n - 1],
        "tail at %lld, shard of %lld: multiples of 28 after the last piece", (long long)L->tail_offset,
        (long long)L->shard_size);
  mfsdp_plan_free(&plan);
}

static void test_layout(void) {
  /* A transformer block (d = 48) at world 4: one bucket; each rank holds torch.chunk rows. */
  mfsdp_param_info block[] = {
      {48, 1, MFSDP_F32, 0, 1, 0},      {48, 1, MFSDP_F32, 0, 1, 0},      /* ln */
      {144 * 48, 48, MFSDP_F32, 0, 1, 0}, {48 * 48, 48, MFSDP_F32, 0, 1, 0}, /* qkv, proj */
      {192 * 48, 48, MFSDP_F32, 0, 1, 0}, {192, 1, MFSDP_F32, 0, 1, 0},    /* fc */
      {48 * 192, 192, MFSDP_F32, 0, 1, 0}, {45, 1, MFSDP_F32, 0, 1, 0},    /* out, an odd bias */
  };
  int n = (int)(sizeof block / sizeof block[0]);
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(block, n, 4, 0, 16, &plan));
  CHECK(plan.n_buckets == 1, "one bucket for one unit, got %d", plan.n_buckets);
  CHECK_OK(mfsdp_plan_validate(&plan, block, n));
  const mfsdp_bucket_layout* L = &plan.buckets[0].layout;
  for (int i = 0; i < n; ++i) CHECK(plan.buckets[0].params[i] == i, "items keep registration order");
  CHECK(L->pieces[2] == 36 * 48, "144 rows over 4 ranks: pieces of 36 rows, got %lld", (long long)L->pieces[2]);
  CHECK(L->pieces[7] == 12, "45 rows over 4: torch.chunk gives 12, got %lld", (long long)L->pieces[7]);
  int64_t first, len;
  mfsdp_piece_of(L->numels[7], L->pieces[7], 3, &first, &len);
  CHECK(first == 36 && len == 9, "rank 3 holds rows 36..44 of 45 (%lld, +%lld)", (long long)first, (long long)len);
  CHECK(L->shard_size % 4 == 0 && L->weight_size % 4 == 0, "16-byte aligned sizes");
  CHECK(!mfsdp_layout_is_identity(L), "a block has two distinct layouts");
  mfsdp_plan_free(&plan);

  /* Keys split groups; a param with fewer rows than ranks leaves empty pieces; numel 0 is fine;
   * one evenly split parameter needs no copy-out. */
  mfsdp_param_info mixed[] = {
      {10, 5, MFSDP_F32, -1, 1, 0}, {6, 3, MFSDP_F32, -1, 1, 0}, {4, 1, MFSDP_BF16, -1, 1, 0},
      {8, 4, MFSDP_F32, -1, 0, 0},  {3, 1, MFSDP_F32, 0, 1, 0},  {0, 1, MFSDP_F32, 0, 1, 0},
      {7, 1, MFSDP_F32, -1, 1, 1},  {64, 4, MFSDP_F32, 1, 1, 0},
  };
  CHECK_OK(mfsdp_plan_build(mixed, 8, 4, 0, 16, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, mixed, 8));
  int empty_pieces = 0, identity = 0;
  for (int b = 0; b < plan.n_buckets; ++b) {
    const mfsdp_bucket_layout* l = &plan.buckets[b].layout;
    if (plan.buckets[b].replicated) CHECK(l->world == 1 && mfsdp_layout_is_identity(l), "replicated: not sharded");
    identity += l->world > 1 && mfsdp_layout_is_identity(l);
    for (int i = 0; i < l->n_items; ++i)
      for (int r = 0; r < l->world; ++r) {
        mfsdp_piece_of(l->numels[i], l->pieces[i], r, &first, &len);
        empty_pieces += len == 0;
      }
  }
  CHECK(empty_pieces > 0, "small parameters leave some ranks empty");
  CHECK(identity == 1, "the 16 x 4 parameter alone in unit 1 gathers in place (%d)", identity);
  mfsdp_plan_free(&plan);

  /* The size cap splits parameters outside units, never a unit. */
  mfsdp_param_info many[6];
  for (int i = 0; i < 6; ++i) many[i] = (mfsdp_param_info){100, 1, MFSDP_F32, i < 3 ? -1 : 0, 1, 0};
  CHECK_OK(mfsdp_plan_build(many, 6, 2, 150, 16, &plan));
  CHECK(plan.n_buckets == 4, "3 capped root buckets + 1 unit bucket, got %d", plan.n_buckets);
  mfsdp_plan_free(&plan);

  mfsdp_param_info bad = {10, 3, MFSDP_F32, 0, 1, 0};
  CHECK(mfsdp_plan_build(&bad, 1, 2, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "10 is not whole rows of 3");
  CHECK(mfsdp_plan_build(block, n, 0, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "world 0 refused");
  test_flag_tail_layout(block, n, mixed);
  test_chunked_layout();
}

/* ------------------------------------------------------------------------------------------ */
/* graphs that differ across ranks (see [Note: collective order] in reduce.c) */

#define DIV_UNITS 3
#define DIV_WORLD 4 /* worlds 1 to this */

typedef struct divergent_thread {
  loop_world* world;
  int world_size, rank, grad_mode, sync;
  int disagree; /* rank 1 freezes item 1 of unit 2 (the others train it) */
} divergent_thread;

/* Rank r's gradient of item i of unit u, or 0 when rank r did not use it: unit 1 is skipped
 * (sealed) by rank 0, item 1 of unit 2 is unused on rank 2, unit 0's item 0 on every rank. */
static int div_used(int r, int u, int i) { return !(r == 0 && u == 1) && !(r == 2 && u == 2 && i == 1) && !(u == 0 && i == 0); }
static double div_grad(int r, int u, int i, int64_t j) { return div_used(r, u, i) ? (r + 1) * 0.5 + u + 0.01 * i + 1e-4 * j : 0; }

static void* divergent_worker(void* arg) {
  divergent_thread* t = arg;
  int W = t->world_size, r = t->rank;
  mfsdp_param_info infos[DIV_UNITS * 2];
  for (int u = 0; u < DIV_UNITS; ++u) { /* two items per unit, sizes differing by unit */
    infos[2 * u] = (mfsdp_param_info){(u + 2) * 4 * 5, 5, MFSDP_F32, u, 1, 0};
    infos[2 * u + 1] = (mfsdp_param_info){(u + 1) * 3, 1, MFSDP_F32, u, 1, 0};
  }
  int shard_world = t->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 1 : W;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build_tailed(infos, DIV_UNITS * 2, shard_world, 0, 16, 3, 0, &plan)); /* [Note: flag tail] */
  mfsdp_bucket_spec specs[DIV_UNITS];
  for (int b = 0; b < DIV_UNITS; ++b)
    specs[b] = (mfsdp_bucket_spec){plan.buckets[b].layout, shard_world > 1 ? r : 0, MFSDP_F32, MFSDP_F32, MFSDP_F32,
                                   MFSDP_F32, 0, shard_world > 1, t->grad_mode};
  loop_rank lr = {t->world, r};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &lr, &mfsdp_cpu_kernels, NULL};
  mfsdp_pipeline_config cfg = {W, r, 1.0, MFSDP_REDUCE_SUM, 1, 0}; /* a one-byte queue: every launch completes */
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, specs, DIV_UNITS, &p));
  if (p == NULL) goto out;
  float* grads[DIV_UNITS][2] = {{0}};
  int frozen_item = -1; /* unit 2's item holding parameter 2 * 2 + 1 */
  for (int q = 0; q < plan.buckets[2].layout.n_items; ++q)
    if (plan.buckets[2].params[q] == 5) frozen_item = q;
  if (t->disagree && r == 1) CHECK_OK(mfsdp_pipeline_set_trainable(p, 2, &frozen_item, 1, 0));
  CHECK_OK(mfsdp_pipeline_begin_backward(p, t->sync));
  if (r == 0) {
    int32_t skipped[1] = {1};
    CHECK_OK(mfsdp_pipeline_seal(p, skipped, 1));
  }
  for (int k = 0; k < DIV_UNITS * 2; ++k) { /* each rank its own arrival order */
    int n_slots = DIV_UNITS * 2;
    int slot = r % 2 ? (n_slots - 1 - k + r) % n_slots : (k + 2 * r) % n_slots, u = slot / 2, i = slot % 2;
    if (!div_used(r, u, i) || (t->disagree && r == 1 && slot == 5)) continue;
    int64_t n = infos[slot].numel;
    float* g = grads[u][i] = malloc((size_t)n * sizeof *g);
    for (int64_t j = 0; j < n; ++j) g[j] = (float)div_grad(r, u, i, j);
    int item = -1;
    for (int q = 0; q < plan.buckets[u].layout.n_items; ++q)
      if (plan.buckets[u].params[q] == slot) item = q;
    CHECK_OK(mfsdp_pipeline_grad_ready(p, u, item, g, MFSDP_F32, n, NULL));
  }
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  int wrong = 0;
  for (int u = 0; u < DIV_UNITS; ++u)
    for (int q = 0; q < plan.buckets[u].layout.n_items; ++q) {
      int slot = plan.buckets[u].params[q], i = slot % 2;
      int32_t where;
      int64_t off, first, n;
      CHECK_OK(mfsdp_pipeline_local_piece(p, u, q, MFSDP_BUF_OPT_GRAD, &where, &off, &n));
      mfsdp_piece_of(infos[slot].numel, plan.buckets[u].layout.pieces[q], specs[u].shard_rank, &first, &n);
      const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, u, where);
      for (int64_t j = first; j < first + n; ++j) {
        double want = 0;
        for (int k = 0; k < W; ++k) want += t->disagree && k == 1 && slot == 5 ? 0 : div_grad(k, u, i, j);
        wrong += fabs(load_as_double(og->data, MFSDP_F32, off + j - first) - want) > 1e-4 * (fabs(want) + 1);
      }
    }
  CHECK(wrong == 0, "grad mode %d sync %d rank %d: %d reduced gradients wrong", t->grad_mode, t->sync, r, wrong);
  /* [Note: used-flag tail]: the reductions brought every rank the same flags: used iff some rank
   * used the item, trainable disagreement only where rank 1 froze one */
  for (int u = 0; u < DIV_UNITS; ++u) {
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, u, &off, &n, &every));
    CHECK(n == plan.buckets[u].layout.n_items && every, "bucket %d carries its %d items' flags (%d), every rank's",
          u, plan.buckets[u].layout.n_items, n);
    const mfsdp_buffer* gs = mfsdp_pipeline_buffer(p, u, MFSDP_BUF_GRAD_SHARD);
    for (int q = 0; q < n; ++q) {
      int slot = plan.buckets[u].params[q], i = slot % 2, anywhere = 0;
      for (int k = 0; k < W; ++k) anywhere |= div_used(k, u, i) && !(t->disagree && k == 1 && slot == 5);
      double used = load_as_double(gs->data, MFSDP_F32, off + q);
      double trains = load_as_double(gs->data, MFSDP_F32, off + n + q);
      double frozen = load_as_double(gs->data, MFSDP_F32, off + 2 * n + q);
      CHECK((used > 0) == anywhere && used >= 0, "mode %d rank %d unit %d item %d: used flag %g, used anywhere %d",
            t->grad_mode, r, u, q, used, anywhere);
      int split = t->disagree && slot == 5;
      CHECK(trains > 0 && (frozen > 0) == split, "mode %d rank %d unit %d item %d: trains %g frozen %g (split %d)",
            t->grad_mode, r, u, q, trains, frozen, split);
    }
  }
  /* zeroed gradients take their used flags along (unit 2: used by rank 0 at least) */
  int32_t first = 0;
  CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 2, &first, 1));
  {
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, 2, &off, &n, &every));
    const mfsdp_buffer* gs = mfsdp_pipeline_buffer(p, 2, MFSDP_BUF_GRAD_SHARD);
    CHECK(load_as_double(gs->data, MFSDP_F32, off) == 0.0 && load_as_double(gs->data, MFSDP_F32, off + 1) > 0,
          "zero_item_grads clears its item's used flag only");
  }
  mfsdp_pipeline_destroy(p);
  for (int u = 0; u < DIV_UNITS; ++u) {
    free(grads[u][0]);
    free(grads[u][1]);
  }
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

/* Ranks deliver gradients in different orders, skip a whole unit (sealed) or single parameters:
 * every collective still matches across ranks (the thread transport compares them) and the
 * reduced gradients are the sums of what each rank used. */
static void test_rank_divergent_graphs(void) {
  const int modes[5][3] = {{MFSDP_GRAD_SCATTER_ACCUMULATE, 0, 0}, {MFSDP_GRAD_SCATTER_IN_PLACE, 1, 0},
                           {MFSDP_GRAD_ALL_REDUCE, 1, 0}, {MFSDP_GRAD_SCATTER_ACCUMULATE, 1, 1},
                           {MFSDP_GRAD_ALL_REDUCE, 1, 1}};
  for (int w = 1; w <= DIV_WORLD; ++w)
    for (int m = 0; m < 5; ++m) {
      if (modes[m][2] && w < 2) continue; /* a disagreement needs two ranks */
      loop_world world;
      loop_world_init(&world, w);
      pthread_t threads[DIV_WORLD];
      divergent_thread args[DIV_WORLD];
      for (int r = 0; r < w; ++r) {
        args[r] = (divergent_thread){&world, w, r, modes[m][0], modes[m][1], modes[m][2]};
        pthread_create(&threads[r], NULL, divergent_worker, &args[r]);
      }
      for (int r = 0; r < w; ++r) pthread_join(threads[r], NULL);
      CHECK(world.mismatches == 0, "world %d grad mode %d: %d collectives differed across ranks", w, modes[m][0],
            world.mismatches);
      loop_world_destroy(&world);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* narrow sums ([Note: exchange reduction] in reduce.c): bf16 gradients of 1 (rank 0) and 2^-9
 * (ranks 1, 2) sum to 1 + 2^-8. The exchange reduction of a reduce-scatter sums them in float32
 * (1.00390625); with `sum_in_comm_dtype` the collective's bf16 sum is kept, which rounds it to 1
 * (ties to even). */

#define NARROW_WORLD 3

typedef struct narrow_thread {
  loop_world* world;
  int rank, grad_mode, narrow;
} narrow_thread;

static void* narrow_worker(void* arg) {
  narrow_thread* t = arg;
  int W = NARROW_WORLD, sharded = t->grad_mode != MFSDP_GRAD_ALL_REDUCE;
  mfsdp_param_info info = {6 * 4, 4, MFSDP_F32, 0, 1, 0};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(&info, 1, sharded ? W : 1, 0, 16, &plan));
  const mfsdp_bucket_layout* L = &plan.buckets[0].layout;
  mfsdp_bucket_spec spec = {*L, sharded ? t->rank : 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_BF16,
                            t->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE, t->grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE,
                            t->grad_mode};
  spec.sum_in_comm_dtype = t->narrow;
  loop_rank lr = {t->world, t->rank};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &lr, &mfsdp_cpu_kernels, NULL};
  mfsdp_pipeline_config cfg = {W, t->rank, 1.0, MFSDP_REDUCE_SUM, 1 << 20, 0};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto out;
  float* g = malloc((size_t)L->numels[0] * sizeof *g);
  for (int64_t j = 0; j < L->numels[0]; ++j) g[j] = t->rank == 0 ? 1.0f : ldexpf(1.0f, -9);
  CHECK_OK(mfsdp_pipeline_begin_backward(p, 1));
  CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, 0, g, MFSDP_F32, L->numels[0], NULL));
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  free(g);
  int32_t where;
  int64_t off, n;
  CHECK_OK(mfsdp_pipeline_local_piece(p, 0, 0, MFSDP_BUF_OPT_GRAD, &where, &off, &n));
  const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, 0, where);
  /* the all-reduce form rounds its sum to the comm dtype either way (gather_exchanged), and this
   * transport sums exactly: both give 1 there, the check is that the flag changes nothing else */
  double want = t->narrow || !sharded ? 1.0 : 1.0 + ldexp(1.0, -8);
  int wrong = 0;
  for (int64_t k = 0; k < n; ++k) wrong += load_as_double(og->data, MFSDP_F32, off + k) != want;
  CHECK(n > 0 && wrong == 0, "grad mode %d, sum_in_comm_dtype %d, rank %d: %d of %lld reduced gradients are not %.9g",
        t->grad_mode, t->narrow, t->rank, wrong, (long long)n, want);
  mfsdp_pipeline_destroy(p);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

static void test_narrow_sums(void) {
  const int modes[3] = {MFSDP_GRAD_SCATTER_ACCUMULATE, MFSDP_GRAD_SCATTER_IN_PLACE, MFSDP_GRAD_ALL_REDUCE};
  for (int m = 0; m < 3; ++m)
    for (int narrow = 0; narrow <= 1; ++narrow) {
      loop_world world;
      loop_world_init(&world, NARROW_WORLD);
      pthread_t threads[NARROW_WORLD];
      narrow_thread args[NARROW_WORLD];
      for (int r = 0; r < NARROW_WORLD; ++r) {
        args[r] = (narrow_thread){&world, r, modes[m], narrow};
        pthread_create(&threads[r], NULL, narrow_worker, &args[r]);
      }
      for (int r = 0; r < NARROW_WORLD; ++r) pthread_join(threads[r], NULL);
      loop_world_destroy(&world);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* hybrid sharding (see [Note: hybrid sharding] in replicas.c): 2 replicas x 2 shards; HFSDP
 * ([Note: optimizer sharded across replicas]): the same, main weights and gradients in 4 pieces */

#define HY_INNER 2
#define HY_OUTER 2

typedef struct hybrid_thread {
  loop_world* inner;  /* this rank's replica */
  loop_world* outer;  /* the ranks holding the same shard in every replica */
  int inner_rank, outer_rank, grad_mode, backwards, sync_each;
  int outer_hold; /* sync each backward inside the replica, across replicas on the last one only */
  int hfsdp;      /* ZeRO-3 buckets whose main weights and gradients are sharded across replicas too */
} hybrid_thread;

/* Parameter 1 is used by the last rank of the last replica in the first backward only: its used
 * flag must cross the replicas ([Note: used-flag tail] in csrc/comm/reduce.c). */
static int hy_used(int rank, int mb, int item) { return item == 0 || (rank == HY_INNER * HY_OUTER - 1 && mb == 0); }
static double hy_grad(int rank, int mb, int item, int64_t j) {
  return hy_used(rank, mb, item) ? 0.25 * (rank + 1) + 0.5 * mb - 0.1 * item + 1e-3 * j : 0;
}
static double hy_weight(int item, int64_t j) { return item - 0.01 * j; }

static void* hybrid_worker(void* arg) {
  hybrid_thread* t = arg;
  int rank = t->outer_rank * HY_INNER + t->inner_rank, W = HY_INNER * HY_OUTER;
  mfsdp_param_info infos[2] = {{6 * 4, 4, MFSDP_F32, 0, 1, 0}, {5, 1, MFSDP_F32, 0, 1, 0}};
  int shard_world = t->hfsdp ? W : t->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 1 : HY_INNER;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build_tailed(infos, 2, shard_world, 0, 16, 3, 0, &plan)); /* [Note: flag tail] */
  const mfsdp_bucket_layout* L = &plan.buckets[0].layout;
  mfsdp_bucket_spec spec = {*L, t->hfsdp ? rank : shard_world > 1 ? t->inner_rank : 0, MFSDP_F32, MFSDP_F32, MFSDP_F32,
                            MFSDP_F32, t->hfsdp, shard_world > 1 && !t->hfsdp, t->grad_mode};
  loop_rank in = {t->inner, t->inner_rank}, out = {t->outer, t->outer_rank};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &in, &mfsdp_cpu_kernels, NULL,
                      &loop_transport_ops, &out};
  mfsdp_pipeline_config cfg = {HY_INNER, t->inner_rank, 1.0 / W, MFSDP_REDUCE_SUM, 1 << 20, 0, HY_OUTER, t->hfsdp};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto out;
  if (t->hfsdp) { /* known weights, so that the optimizer's update can be checked after the replicas' gather */
    CHECK_OK(mfsdp_pipeline_init_begin(p, 0, 0));
    for (int i = 0; i < L->n_items; ++i) {
      float* w = malloc((size_t)L->numels[i] * sizeof *w);
      for (int64_t j = 0; j < L->numels[i]; ++j) w[j] = (float)hy_weight(plan.buckets[0].params[i], j);
      CHECK_OK(mfsdp_pipeline_set_item(p, 0, i, w, MFSDP_F32, L->numels[i]));
      free(w);
    }
    CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  }
  int all_items[2] = {0, 1}, bucket0 = 0;
  /* two steps (the second after zeroing every item, as set_to_none does) of several backwards:
   * the first ones without sync (unless sync_each), or without the outer reduction (outer_hold) */
  for (int step = 0; step < 2; ++step) {
  if (step > 0) CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 0, all_items, L->n_items));
  for (int mb = 0; mb < t->backwards; ++mb) {
    int last = mb == t->backwards - 1, sync = t->sync_each || t->outer_hold || last;
    if (t->outer_hold) CHECK_OK(mfsdp_pipeline_set_outer_hold(p, &bucket0, 1, !last));
    CHECK_OK(mfsdp_pipeline_begin_backward(p, sync));
    float* g[2] = {NULL, NULL};
    for (int i = 1; i >= 0; --i) {
      if (!hy_used(rank, mb, plan.buckets[0].params[i])) continue;
      g[i] = malloc((size_t)L->numels[i] * sizeof *g[i]);
      for (int64_t j = 0; j < L->numels[i]; ++j) g[i][j] = (float)hy_grad(rank, mb, plan.buckets[0].params[i], j);
      CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, i, g[i], MFSDP_F32, L->numels[i], NULL));
    }
    CHECK_OK(mfsdp_pipeline_end_backward(p));
    free(g[0]);
    free(g[1]);
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, 0, &off, &n, &every)); /* every rank's once across the replicas */
    int crossed = sync && !t->outer_hold ? 1 : last;
    if (t->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE || sync)
      CHECK(n == 2 && every == crossed, "hybrid mode %d (HFSDP %d) rank %d backward %d: %d flags, every rank's %d",
            t->grad_mode, t->hfsdp, rank, mb, n, every);
  }
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  int wrong = 0;
  for (int i = 0; i < L->n_items; ++i) {
    int32_t where;
    int64_t off, first, n;
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_OPT_GRAD, &where, &off, &n));
    mfsdp_piece_of(L->numels[i], L->pieces[i], spec.shard_rank, &first, &n);
    const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, 0, where);
    for (int64_t j = first; j < first + n; ++j) {
      double want = 0;
      for (int mb = 0; mb < t->backwards; ++mb)
        for (int r = 0; r < W; ++r) want += hy_grad(r, mb, plan.buckets[0].params[i], j) / W;
      double got = load_as_double(og->data, MFSDP_F32, off + j - first);
      if (fabs(got - want) > 1e-5 * (fabs(want) + 1) && wrong++ < 2)
        fprintf(stderr, "  hybrid mode %d rank %d item %d elem %lld: got %g want %g\n", t->grad_mode, rank, i,
                (long long)j, got, want);
    }
  }
  { /* every rank: both parameters used somewhere in this step, and trained everywhere */
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, 0, &off, &n, &every));
    const float* gs = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_GRAD_SHARD)->data;
    CHECK(n == 2 && every && gs[off] > 0 && gs[off + 1] > 0 && gs[off + 2] > 0 && gs[off + 3] > 0 && gs[off + 4] == 0 &&
              gs[off + 5] == 0,
          "hybrid mode %d (HFSDP %d) rank %d step %d: flags %g %g / %g %g / %g %g", t->grad_mode, t->hfsdp, rank, step,
          n ? gs[off] : -1, n ? gs[off + 1] : -1, n ? gs[off + 2] : -1, n ? gs[off + 3] : -1, n ? gs[off + 4] : -1,
          n ? gs[off + 5] : -1);
  }
  mfsdp_comm_stats st;
  mfsdp_pipeline_stats(p, -1, &st);
  int syncs = (step + 1) * (t->sync_each ? t->backwards : 1);
  CHECK(wrong == 0, "hybrid grad mode %d, %d backwards (sync each %d, outer hold %d), step %d, rank %d: %d gradients "
        "wrong", t->grad_mode, t->backwards, t->sync_each, t->outer_hold, step, rank, wrong);
  int64_t outer_reductions = t->hfsdp ? st.outer_reduce_scatters : st.outer_all_reduces;
  CHECK(outer_reductions == syncs && (t->hfsdp ? st.outer_all_reduces : st.outer_reduce_scatters) == 0,
        "hybrid grad mode %d (HFSDP %d): %lld reductions across replicas, expected %d (one per syncing backward)",
        t->grad_mode, t->hfsdp, (long long)outer_reductions, syncs);
  if (t->hfsdp) { /* an SGD step on this rank's piece, then every rank's full weights must carry every update */
    for (int i = 0; i < L->n_items; ++i) {
      int32_t where, gwhere;
      int64_t off, goff, first, n;
      CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_MAIN_SHARD, &where, &off, &n));
      CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_OPT_GRAD, &gwhere, &goff, &n));
      float* w = mfsdp_pipeline_buffer(p, 0, where)->data;
      const float* g = mfsdp_pipeline_buffer(p, 0, gwhere)->data;
      for (int64_t j = 0; j < n; ++j) w[off + j] -= 0.5f * g[goff + j];
      (void)first;
    }
    CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
    /* the first step's gather across replicas is left in flight: zeroing does not wait for it,
     * the next backward's reduction across replicas does (same communicator, one at a time) */
    CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 0, all_items, L->n_items));
    if (step == 0) continue;
    CHECK_OK(mfsdp_pipeline_unshard(p, &bucket0, 1));
    CHECK_OK(mfsdp_pipeline_wait_unshard(p, &bucket0, 1));
    const mfsdp_buffer* full = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT);
    int bad = 0;
    for (int i = 0; i < L->n_items; ++i)
      for (int64_t j = 0; j < L->numels[i]; ++j) {
        double want = 0;
        for (int mb = 0; mb < t->backwards; ++mb)
          for (int r = 0; r < W; ++r) want += hy_grad(r, mb, plan.buckets[0].params[i], j) / W;
        want = hy_weight(plan.buckets[0].params[i], j) - 0.5 * (step + 1) * want;
        double got = load_as_double(full->data, MFSDP_F32, L->param_offsets[i] + j);
        if (fabs(got - want) > 1e-5 * (fabs(want) + 1) && bad++ < 2)
          fprintf(stderr, "  HFSDP rank %d step %d item %d elem %lld: weight %g want %g\n", rank, step, i, (long long)j,
                  got, want);
      }
    CHECK(bad == 0, "HFSDP rank %d step %d: %d weights wrong after the replicas' gather", rank, step, bad);
    mfsdp_pipeline_stats(p, -1, &st);
    CHECK(st.outer_all_gathers == step + 1, "HFSDP: %lld gathers across replicas after %d steps",
          (long long)st.outer_all_gathers, step + 1);
    CHECK_OK(mfsdp_pipeline_reshard(p, &bucket0, 1));
  }
  }
  mfsdp_pipeline_destroy(p);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

static void test_hybrid_sharding(void) {
  const int modes[4] = {MFSDP_GRAD_SCATTER_ACCUMULATE, MFSDP_GRAD_SCATTER_IN_PLACE, MFSDP_GRAD_ALL_REDUCE,
                        MFSDP_GRAD_SCATTER_ACCUMULATE};
  for (int m = 0; m < 4; ++m) /* the last: HFSDP */
    for (int backwards = 1; backwards <= 3; backwards += 2)
      for (int sync_each = 0; sync_each <= 2; ++sync_each) { /* 2: outer hold */
        loop_world inner[HY_OUTER], outer[HY_INNER];
        for (int o = 0; o < HY_OUTER; ++o) loop_world_init(&inner[o], HY_INNER);
        for (int i = 0; i < HY_INNER; ++i) loop_world_init(&outer[i], HY_OUTER);
        pthread_t threads[HY_INNER * HY_OUTER];
        hybrid_thread args[HY_INNER * HY_OUTER];
        for (int o = 0; o < HY_OUTER; ++o)
          for (int i = 0; i < HY_INNER; ++i) {
            args[o * HY_INNER + i] = (hybrid_thread){&inner[o], &outer[i], i, o, modes[m], backwards, sync_each == 1,
                                                     sync_each == 2, m == 3};
            pthread_create(&threads[o * HY_INNER + i], NULL, hybrid_worker, &args[o * HY_INNER + i]);
          }
        for (int r = 0; r < HY_INNER * HY_OUTER; ++r) pthread_join(threads[r], NULL);
        for (int o = 0; o < HY_OUTER; ++o) loop_world_destroy(&inner[o]);
        for (int i = 0; i < HY_INNER; ++i) loop_world_destroy(&outer[i]);
      }
}

/* HFSDP with the weights' gather across replicas quantized (and the gather inside the replica
 * plain or quantized too): after an update, every rank's full weights must be exactly the
 * dequantized sub-shards of the replicas' gather, spread by the inner gather (quantized again
 * when it is). See [Note: quantized communication] in csrc/comm/wire.c. */
typedef struct hq_thread {
  loop_world *inner, *outer;
  int inner_rank, outer_rank, param_dtype, outer_mode, inner_mode;
} hq_thread;

static double hq_main(int param_dtype, int item, int64_t j) { /* main weight after init and +1 */
  unsigned char t[8];
  store_from_double(t, param_dtype, 0, (float)hy_weight(item, j));
  return (float)(load_as_double(t, param_dtype, 0) + 1.0);
}

static void* hfsdp_quant_worker(void* arg) {
  hq_thread* t = arg;
  int rank = t->outer_rank * HY_INNER + t->inner_rank, W = HY_INNER * HY_OUTER, pdt = t->param_dtype;
  const int64_t block = 6;
  mfsdp_param_info infos[3] = {{6 * 4, 4, pdt, 0, 1, 0}, {5, 1, pdt, 0, 1, 0}, {9 * 3, 3, pdt, 0, 1, 0}};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(infos, 3, W, 0, 16, &plan));
  const mfsdp_bucket_plan* bp = &plan.buckets[0];
  const mfsdp_bucket_layout* L = &bp->layout;
  mfsdp_bucket_spec spec = {*L, rank, pdt, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0, MFSDP_GRAD_SCATTER_ACCUMULATE,
                            {t->inner_mode >= 0 ? MFSDP_WIRE_QUANT(t->inner_mode) : MFSDP_WIRE_PLAIN, MFSDP_WIRE_PLAIN,
                             MFSDP_WIRE_QUANT(t->outer_mode), block}};
  loop_rank in = {t->inner, t->inner_rank}, out = {t->outer, t->outer_rank};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &in, &mfsdp_cpu_kernels, NULL,
                      &loop_transport_ops, &out};
  mfsdp_pipeline_config cfg = {HY_INNER, t->inner_rank, 1.0 / W, MFSDP_REDUCE_SUM, 1 << 20, 0, HY_OUTER, 1};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto out;
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, 0));
  for (int i = 0; i < L->n_items; ++i) {
    float* w = malloc((size_t)L->numels[i] * sizeof *w);
    for (int64_t j = 0; j < L->numels[i]; ++j) w[j] = (float)hy_weight(bp->params[i], j);
    CHECK_OK(mfsdp_pipeline_set_item(p, 0, i, w, MFSDP_F32, L->numels[i]));
    free(w);
  }
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  for (int i = 0; i < L->n_items; ++i) { /* the optimizer: +1 on this rank's sub-shard */
    int32_t where;
    int64_t off, n;
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_MAIN_SHARD, &where, &off, &n));
    CHECK(where == MFSDP_BUF_MAIN_SHARD, "quantized gathers across replicas keep main weights of their own");
    float* m = mfsdp_pipeline_buffer(p, 0, where)->data;
    for (int64_t k = 0; k < n; ++k) m[off + k] += 1.0f;
  }
  CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
  int32_t b0 = 0;
  CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, &b0, 1));
  /* the reference: inner rank i's collective shard = its twins' sub-shards, each dequantized
   * from the replicas' wire; then the inner gather (quantized again, or plain) */
  int64_t Sv = L->shard_size, S = HY_OUTER * Sv, psz = mfsdp_dtype_size(pdt);
  float* sub = calloc((size_t)Sv, sizeof *sub);
  char* shard = calloc((size_t)S, (size_t)psz);
  char* spread = calloc((size_t)S, (size_t)psz);
  uint8_t* wire = malloc((size_t)(mfsdp_quant_wire_bytes(MFSDP_QUANT_FP8_E4M3, S, block) + 64));
  char* want = calloc((size_t)L->weight_size, (size_t)psz);
  for (int i = 0; i < HY_INNER; ++i) {
    for (int o = 0; o < HY_OUTER; ++o) {
      int v = o * HY_INNER + i;
      memset(sub, 0, (size_t)Sv * sizeof *sub);
      for (int it = 0; it < L->n_items; ++it) {
        int64_t first, n;
        mfsdp_piece_of(L->numels[it], L->pieces[it], v, &first, &n);
        for (int64_t k = 0; k < n; ++k) sub[L->shard_offsets[it] + k] = (float)hq_main(pdt, bp->params[it], first + k);
      }
      CHECK_OK(mfsdp_cpu_quantize(wire, t->outer_mode, block, sub, MFSDP_F32, Sv, 1));
      CHECK_OK(mfsdp_cpu_dequantize(shard + o * Sv * psz, pdt, wire, t->outer_mode, block, Sv, 1.0, 0));
    }
    if (t->inner_mode >= 0) {
      CHECK_OK(mfsdp_cpu_quantize(wire, t->inner_mode, block, shard, pdt, S, 1));
      CHECK_OK(mfsdp_cpu_dequantize(spread, pdt, wire, t->inner_mode, block, S, 1.0, 0));
    } else {
      memcpy(spread, shard, (size_t)(S * psz));
    }
    for (int o = 0; o < HY_OUTER; ++o)
      for (int it = 0; it < L->n_items; ++it) {
        int64_t first, n;
        mfsdp_piece_of(L->numels[it], L->pieces[it], o * HY_INNER + i, &first, &n);
        if (n > 0)
          memcpy(want + (L->param_offsets[it] + first) * psz, spread + (o * Sv + L->shard_offsets[it]) * psz,
                 (size_t)(n * psz));
      }
  }
  const mfsdp_buffer* full = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT);
  int64_t wrong = 0;
  for (int it = 0; it < L->n_items; ++it)
    wrong += count_differences((char*)full->data + L->param_offsets[it] * psz, want + L->param_offsets[it] * psz, pdt,
                               L->numels[it]);
  if (wrong && rank == 0)
    for (int k = 0; k < 6; ++k)
      fprintf(stderr, "  elem %d got %g want %g\n", k, load_as_double(full->data, pdt, k), load_as_double(want, pdt, k));
  CHECK(wrong == 0, "HFSDP quantized across replicas (%s, inside %s, %s) rank %d: %lld weights differ",
        mfsdp_quant_mode_name(t->outer_mode), t->inner_mode >= 0 ? mfsdp_quant_mode_name(t->inner_mode) : "plain",
        mfsdp_dtype_name(pdt), rank, (long long)wrong);
  mfsdp_comm_stats st;
  mfsdp_pipeline_stats(p, -1, &st);
  CHECK(st.outer_quantized_all_gathers == 1 && st.outer_all_gathers == 0 &&
            st.outer_quantized_all_gather_bytes == HY_OUTER * mfsdp_quant_wire_bytes(t->outer_mode, Sv, block) &&
            st.quantized_all_gathers == (t->inner_mode >= 0) && st.all_gathers == (t->inner_mode < 0),
        "HFSDP quantized: %lld/%lld gathers across replicas (%lld bytes), %lld/%lld inside", (long long)st.outer_all_gathers,
        (long long)st.outer_quantized_all_gathers, (long long)st.outer_quantized_all_gather_bytes,
        (long long)st.all_gathers, (long long)st.quantized_all_gathers);
  free(sub);
  free(shard);
  free(spread);
  free(wire);
  free(want);
  mfsdp_pipeline_destroy(p);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

static void test_hfsdp_quantized(void) {
  const int combos[4][3] = {{MFSDP_F32, MFSDP_QUANT_INT8, -1},
                            {MFSDP_BF16, MFSDP_QUANT_INT4, -1},
                            {MFSDP_F32, MFSDP_QUANT_FP8_E4M3, MFSDP_QUANT_INT8},
                            {MFSDP_BF16, MFSDP_QUANT_INT8, MFSDP_QUANT_FP8_E4M3}};
  for (int c = 0; c < 4; ++c) {
    loop_world inner[HY_OUTER], outer[HY_INNER];
    for (int o = 0; o < HY_OUTER; ++o) loop_world_init(&inner[o], HY_INNER);
    for (int i = 0; i < HY_INNER; ++i) loop_world_init(&outer[i], HY_OUTER);
    pthread_t threads[HY_INNER * HY_OUTER];
    hq_thread args[HY_INNER * HY_OUTER];
    for (int o = 0; o < HY_OUTER; ++o)
      for (int i = 0; i < HY_INNER; ++i) {
        args[o * HY_INNER + i] = (hq_thread){&inner[o], &outer[i], i, o, combos[c][0], combos[c][1], combos[c][2]};
        pthread_create(&threads[o * HY_INNER + i], NULL, hfsdp_quant_worker, &args[o * HY_INNER + i]);
      }
    for (int r = 0; r < HY_INNER * HY_OUTER; ++r) pthread_join(threads[r], NULL);
    for (int o = 0; o < HY_OUTER; ++o) loop_world_destroy(&inner[o]);
    for (int i = 0; i < HY_INNER; ++i) loop_world_destroy(&outer[i]);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* requires_grad changed at run time ([Note: requires_grad changes] in trainable.c): bucket 0 is
 * created trainable, bucket 1 frozen (no gradient memory); bucket 1 starts training while item 1
 * of bucket 0 stops (its reduced gradient is kept), then bucket 1 is frozen again and its
 * gradient memory released. Worlds 1-4, ZeRO-3, ZeRO-1 and no_shard. */

#define RG_BUCKETS 2
#define RG_ITEMS 2

typedef struct trainable_thread {
  loop_world* world;
  int rank, grad_mode;
} trainable_thread;

static double rg_grad(int rank, int step, int b, int i, int64_t j) {
  return 0.5 * (rank + 1) + 0.1 * step + b + 0.01 * i + 1e-4 * (double)j;
}

/* Rank `t->rank`'s backward of `step`: the gradients of the (bucket, item) pairs in `used`,
 * bucket 1's first (the shared order launches later buckets first). */
static void rg_backward(mfsdp_pipeline* p, const mfsdp_plan* plan, int mode, int world, int rank, int step, int sync,
                        const int used[RG_BUCKETS][RG_ITEMS]) {
  float* grads[RG_BUCKETS][RG_ITEMS] = {{0}};
  mfsdp_comm_stats before, after;
  mfsdp_pipeline_stats(p, 0, &before);
  CHECK_OK(mfsdp_pipeline_begin_backward(p, sync));
  for (int b = RG_BUCKETS - 1; b >= 0; --b)
    for (int i = 0; i < RG_ITEMS; ++i) {
      int64_t n = plan->buckets[b].layout.numels[i];
      float* g = grads[b][i] = malloc((size_t)n * sizeof *g);
      for (int64_t j = 0; j < n; ++j) g[j] = (float)rg_grad(rank, step, b, i, j);
      mfsdp_status st = mfsdp_pipeline_grad_ready(p, b, i, g, MFSDP_F32, n, NULL);
      if (used[b][i])
        CHECK(st == MFSDP_OK, "step %d bucket %d item %d: %s", step, b, i, mfsdp_last_error());
      else
        CHECK(st == MFSDP_ERR_INVALID_STATE && strstr(mfsdp_last_error(), "frozen"),
              "step %d: a frozen item's gradient is refused (bucket %d item %d: %s)", step, b, i, mfsdp_status_name(st));
    }
  mfsdp_pipeline_stats(p, 0, &after);
  if (used[0][0] && !used[0][1] && (sync || mode == MFSDP_GRAD_SCATTER_ACCUMULATE) && world > 1)
    CHECK(after.reduce_scatters + after.all_reduces > before.reduce_scatters + before.all_reduces,
          "mode %d step %d: bucket 0 reduced once its one trainable item arrived, before the end", mode, step);
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  for (int b = 0; b < RG_BUCKETS; ++b)
    for (int i = 0; i < RG_ITEMS; ++i) free(grads[b][i]);
}

/* Item i of bucket b after the sync: `want_step` steps' reduced gradient (-1: zero). */
static int rg_wrong(mfsdp_pipeline* p, const mfsdp_plan* plan, const mfsdp_bucket_spec* specs, int W, int b, int i,
                    int want_step) {
  int32_t where;
  int64_t off, first, n;
  const mfsdp_bucket_layout* L = &plan->buckets[b].layout;
  CHECK_OK(mfsdp_pipeline_local_piece(p, b, i, MFSDP_BUF_OPT_GRAD, &where, &off, &n));
  mfsdp_piece_of(L->numels[i], L->pieces[i], specs[b].shard_rank, &first, &n);
  const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, b, where);
  int wrong = 0;
  for (int64_t j = first; j < first + n; ++j) {
    double want = 0;
    for (int r = 0; want_step >= 0 && r < W; ++r) want += rg_grad(r, want_step, b, i, j) / W;
    double got = load_as_double(og->data, MFSDP_F32, off + j - first);
    if (fabs(got - want) > 1e-5 * (fabs(want) + 1) && wrong++ < 2)
      fprintf(stderr, "  mode %d bucket %d item %d elem %lld: got %g want %g\n", specs[b].grad_mode, b, i,
              (long long)j, got, want);
  }
  return wrong;
}

static void* trainable_worker(void* arg) {
  trainable_thread* t = arg;
  int W = t->world->n, r = t->rank, mode = t->grad_mode;
  mfsdp_param_info infos[RG_BUCKETS * RG_ITEMS];
  for (int b = 0; b < RG_BUCKETS; ++b) { /* bucket b: items of unit b */
    infos[2 * b] = (mfsdp_param_info){(b + 3) * 4, 4, MFSDP_F32, b, 1, 0};
    infos[2 * b + 1] = (mfsdp_param_info){5 + b, 1, MFSDP_F32, b, 1, 0};
  }
  int shard_world = mode == MFSDP_GRAD_ALL_REDUCE ? 1 : W;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(infos, RG_BUCKETS * RG_ITEMS, shard_world, 0, 16, &plan));
  mfsdp_bucket_spec specs[RG_BUCKETS];
  int sharded = mode == MFSDP_GRAD_SCATTER_ACCUMULATE && W > 1;
  for (int b = 0; b < RG_BUCKETS; ++b) {
    specs[b] = (mfsdp_bucket_spec){plan.buckets[b].layout, shard_world > 1 ? r : 0, MFSDP_F32, MFSDP_F32, MFSDP_F32,
                                   MFSDP_F32, sharded, shard_world > 1 && !sharded, mode};
    specs[b].frozen = b == 1;
  }
  loop_rank lr = {t->world, r};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &lr, &mfsdp_cpu_kernels, NULL};
  mfsdp_pipeline_config cfg = {W, r, 1.0 / W, MFSDP_REDUCE_SUM, 1, 0}; /* a one-byte queue: every launch completes */
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, specs, RG_BUCKETS, &p));
  if (p == NULL) goto out;
  CHECK(mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_GRAD_SHARD) == NULL && mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_GRAD) == NULL,
        "mode %d: a bucket created frozen has no gradient memory", mode);
  mfsdp_comm_stats st1;
  int sync = 1, items01[2] = {0, 1}, item1[1] = {1}, item0[1] = {0};

  /* step 0: bucket 0 trains, bucket 1 is frozen */
  const int step0[RG_BUCKETS][RG_ITEMS] = {{1, 1}, {0, 0}};
  rg_backward(p, &plan, mode, W, r, 0, sync, step0);
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  CHECK(rg_wrong(p, &plan, specs, W, 0, 0, 0) + rg_wrong(p, &plan, specs, W, 0, 1, 0) == 0, "mode %d rank %d step 0", mode, r);
  mfsdp_pipeline_stats(p, 1, &st1);
  CHECK(st1.reduce_scatters + st1.all_reduces == 0, "mode %d: the frozen bucket reduced nothing", mode);

  /* bucket 1 starts training, item 1 of bucket 0 stops and keeps its gradient (not zeroed) */
  CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 0, item0, 1));
  CHECK(mfsdp_pipeline_set_trainable(p, 0, items01, 2, 1) == MFSDP_OK, "setting a set flag is a no-op");
  CHECK_OK(mfsdp_pipeline_set_trainable(p, 1, items01, 2, 1));
  CHECK_OK(mfsdp_pipeline_set_trainable(p, 0, item1, 1, 0));
  CHECK(mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_OPT_GRAD) != NULL && rg_wrong(p, &plan, specs, W, 1, 0, -1) == 0,
        "mode %d: gradient buffers created zero at the first trainable item", mode);
  const int step1[RG_BUCKETS][RG_ITEMS] = {{1, 0}, {1, 1}};
  rg_backward(p, &plan, mode, W, r, 1, sync, step1);
  CHECK(mfsdp_pipeline_set_trainable(p, 1, item0, 1, 0) == MFSDP_OK, "flags may change between backwards");
  CHECK_OK(mfsdp_pipeline_set_trainable(p, 1, item0, 1, 1));
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  int wrong = rg_wrong(p, &plan, specs, W, 0, 0, 1) + rg_wrong(p, &plan, specs, W, 0, 1, 0) + rg_wrong(p, &plan, specs, W, 1, 0, 1) +
              rg_wrong(p, &plan, specs, W, 1, 1, 1);
  CHECK(wrong == 0, "mode %d rank %d step 1: %d gradients wrong (the frozen item must keep step 0's)", mode, r, wrong);

  /* bucket 1 frozen again: it reduces no more and keeps its gradients (as DDP keeps a frozen
   * parameter's .grad) until they are dropped, then its memory goes; bucket 0's stays */
  CHECK_OK(mfsdp_pipeline_set_trainable(p, 1, items01, 2, 0));
  CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 0, item0, 1));
  const int step2[RG_BUCKETS][RG_ITEMS] = {{1, 0}, {0, 0}};
  mfsdp_pipeline_stats(p, 1, &st1);
  rg_backward(p, &plan, mode, W, r, 2, sync, step2);
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  mfsdp_comm_stats st2;
  mfsdp_pipeline_stats(p, 1, &st2);
  CHECK(st2.reduce_scatters + st2.all_reduces == st1.reduce_scatters + st1.all_reduces,
        "mode %d: a bucket frozen again reduces no more", mode);
  wrong = rg_wrong(p, &plan, specs, W, 0, 0, 2) + rg_wrong(p, &plan, specs, W, 1, 0, 1) +
          rg_wrong(p, &plan, specs, W, 1, 1, 1);
  CHECK(wrong == 0, "mode %d rank %d step 2: %d gradients wrong (bucket 1 must keep step 1's)", mode, r, wrong);
  CHECK(mfsdp_pipeline_release_grads(p, &(int32_t){0}, 1) == MFSDP_ERR_INVALID_STATE, "a training bucket keeps its gradients");
  CHECK_OK(mfsdp_pipeline_zero_grads(p));
  CHECK_OK(mfsdp_pipeline_release_grads(p, &(int32_t){1}, 1));
  CHECK(mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_GRAD_SHARD) == NULL && mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_OPT_GRAD) == NULL,
        "mode %d: released", mode);
  CHECK_OK(mfsdp_pipeline_release_grads(p, &(int32_t){1}, 1)); /* nothing left: a no-op */

  /* misuse: inside a backward; a dtype that cannot train; local sums not yet reduced */
  CHECK_OK(mfsdp_pipeline_begin_backward(p, 0));
  CHECK(mfsdp_pipeline_set_trainable(p, 1, item0, 1, 1) == MFSDP_ERR_INVALID_STATE, "refused inside a backward");
  CHECK(mfsdp_pipeline_release_grads(p, &(int32_t){1}, 1) == MFSDP_ERR_INVALID_STATE, "refused inside a backward");
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  CHECK(mfsdp_pipeline_set_trainable(p, 0, (int32_t[]){2}, 1, 1) == MFSDP_ERR_INVALID_ARGUMENT, "no such item");
  if (mode != MFSDP_GRAD_SCATTER_ACCUMULATE) { /* a backward without sync leaves a local sum */
    CHECK_OK(mfsdp_pipeline_zero_grads(p));
    const int local[RG_BUCKETS][RG_ITEMS] = {{1, 0}, {0, 0}};
    rg_backward(p, &plan, mode, W, r, 3, 0, local);
    CHECK_OK(mfsdp_pipeline_set_trainable(p, 0, item0, 1, 0));
    CHECK(mfsdp_pipeline_release_grads(p, &(int32_t){0}, 1) == MFSDP_ERR_INVALID_STATE &&
              strstr(mfsdp_last_error(), "not yet reduced"),
          "mode %d: local gradients not yet reduced are not released", mode);
  }
  mfsdp_pipeline_destroy(p);
  mfsdp_bucket_spec never = specs[1];
  never.grad_mode = MFSDP_GRAD_NONE;
  never.weights_regather = shard_world > 1; /* an integer-like bucket: weights only */
  never.weights_sharded = 0;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &never, 1, &p));
  if (p) {
    CHECK(mfsdp_pipeline_set_trainable(p, 0, item0, 1, 1) == MFSDP_ERR_INVALID_ARGUMENT, "grad mode NONE never trains");
    mfsdp_pipeline_destroy(p);
  }
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

static void test_requires_grad_changes(void) {
  const int modes[3] = {MFSDP_GRAD_SCATTER_ACCUMULATE, MFSDP_GRAD_SCATTER_IN_PLACE, MFSDP_GRAD_ALL_REDUCE};
  for (int world = 1; world <= 4; ++world)
    for (int m = 0; m < 3; ++m) {
      loop_world w;
      loop_world_init(&w, world);
      pthread_t threads[4];
      trainable_thread args[4];
      for (int r = 0; r < world; ++r) {
        args[r] = (trainable_thread){&w, r, modes[m]};
        pthread_create(&threads[r], NULL, trainable_worker, &args[r]);
      }
      for (int r = 0; r < world; ++r) pthread_join(threads[r], NULL);
      CHECK(w.mismatches == 0, "mode %d world %d: %d collectives differed across ranks", modes[m], world, w.mismatches);
      loop_world_destroy(&w);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* pipeline misuse (the cases at world sizes 1-4 are in pipeline_cases.c) */

static void test_pipeline_misuse(void) {
  mfsdp_pipeline_config cfg = {2, 0, 0.5, MFSDP_REDUCE_SUM, 1 << 20, 0};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, NULL, &mfsdp_cpu_kernels, NULL};
  int64_t offsets[1] = {0}, numels[1] = {8}, pieces[1] = {4}, small[1] = {1};
  mfsdp_bucket_layout too_small = {2, 1, numels, small, offsets, offsets, 8, 2}; /* pieces cannot cover 8 */
  mfsdp_bucket_spec bad = {too_small, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0,
                           MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_pipeline* p = NULL;
  CHECK(mfsdp_pipeline_create(&cfg, &be, &bad, 1, &p) == MFSDP_ERR_INVALID_ARGUMENT && p == NULL,
        "pieces that do not cover the item refused");
  mfsdp_bucket_layout never_gathered = {2, 1, numels, pieces, offsets, offsets, 8, 4};
  bad = (mfsdp_bucket_spec){never_gathered, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 0, 0,
                            MFSDP_GRAD_SCATTER_ACCUMULATE};
  CHECK(mfsdp_pipeline_create(&cfg, &be, &bad, 1, &p) == MFSDP_ERR_INVALID_ARGUMENT && p == NULL,
        "sharded weights that are never gathered refused");
  mfsdp_bucket_layout whole = {1, 1, numels, numels, offsets, offsets, 8, 8};
  mfsdp_bucket_spec ok = {whole, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 0, 0, MFSDP_GRAD_ALL_REDUCE};
  cfg.dp_world = 1;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &ok, 1, &p));
  float g[8] = {0};
  CHECK(mfsdp_pipeline_grad_ready(p, 0, 0, g, MFSDP_F32, 8, NULL) == MFSDP_ERR_INVALID_STATE, "grad outside backward");
  CHECK(mfsdp_pipeline_end_backward(p) == MFSDP_ERR_INVALID_STATE, "end without begin");
  CHECK_OK(mfsdp_pipeline_begin_backward(p, 1));
  CHECK(mfsdp_pipeline_grad_ready(p, 0, 0, g, MFSDP_F32, 7, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "wrong numel");
  CHECK(mfsdp_pipeline_grad_ready(p, 3, 0, g, MFSDP_F32, 8, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "bad bucket");
  CHECK(mfsdp_pipeline_sync_grads(p) == MFSDP_ERR_INVALID_STATE, "sync inside backward");
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  mfsdp_pipeline_destroy(p);

  /* quantized wires ([Note: quantized communication] in csrc/comm/wire.c): refused with the reason */
  cfg.dp_world = 2;
  mfsdp_bucket_layout halves = {2, 1, numels, pieces, offsets, offsets, 8, 4};
  mfsdp_bucket_spec q = {halves, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0, MFSDP_GRAD_SCATTER_ACCUMULATE,
                         {MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), MFSDP_WIRE_QUANT(MFSDP_QUANT_INT4), 0, 0}};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &q, 1, &p)); /* the default block */
  mfsdp_pipeline_destroy(p);
  p = NULL;
  struct {
    const char* what;
    mfsdp_wire_spec wire;
    int grad_dtype, comm_dtype;
    const char* says;
  } refused[] = {
      {"unknown mode", {7, 0, 0, 16}, MFSDP_F32, MFSDP_F32, "unknown quantization"},
      {"int4 odd block", {0, MFSDP_WIRE_QUANT(MFSDP_QUANT_INT4), 0, 33}, MFSDP_F32, MFSDP_F32, "and even"},
      {"negative block", {MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), 0, 0, -2}, MFSDP_F32, MFSDP_F32, "blocks of -2"},
      {"bf16 main gradients", {0, MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), 0, 0}, MFSDP_BF16, MFSDP_BF16,
       "must be float32 or float64"},
      {"comm dtype", {0, MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), 0, 0}, MFSDP_F32, MFSDP_BF16, "staged in"},
      {"outer without HFSDP", {0, 0, MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), 0}, MFSDP_F32, MFSDP_F32, "need HFSDP"},
  };
  for (size_t k = 0; k < sizeof refused / sizeof refused[0]; ++k) {
    mfsdp_bucket_spec bad_q = q;
    bad_q.wire = refused[k].wire;
    bad_q.grad_dtype = refused[k].grad_dtype;
    bad_q.comm_dtype = refused[k].comm_dtype;
    bad_q.main_dtype = MFSDP_F32;
    mfsdp_status s = mfsdp_pipeline_create(&cfg, &be, &bad_q, 1, &p);
    CHECK(s == MFSDP_ERR_INVALID_ARGUMENT && p == NULL && strstr(mfsdp_last_error(), refused[k].says),
          "%s refused: %s", refused[k].what, mfsdp_last_error());
  }
  mfsdp_transport_ops no_a2a = loop_transport_ops;
  no_a2a.all_to_all = NULL;
  mfsdp_backend be_no_a2a = be;
  be_no_a2a.transport = &no_a2a;
  CHECK(mfsdp_pipeline_create(&cfg, &be_no_a2a, &q, 1, &p) == MFSDP_ERR_UNSUPPORTED && p == NULL &&
            strstr(mfsdp_last_error(), "need an all-to-all"),
        "quantized gradients on a transport without an all-to-all refused: %s", mfsdp_last_error());
}

int main(void) {
  test_conversions();
  test_kernels();
  test_quant();
  test_layout();
  test_rank_divergent_graphs();
  test_narrow_sums();
  test_hybrid_sharding();
  test_requires_grad_changes();
  run_pipeline_cases(&loop_rig, 4, 0);
  run_quantized_cases(&loop_rig, 4, 0);
  pipeline_cases_tail = 3; /* [Note: flag tail]: a reserved tail changes no result */
  run_pipeline_cases(&loop_rig, 4, 0);
  run_quantized_cases(&loop_rig, 4, 0);
  pipeline_cases_tail = 0;
  test_hfsdp_quantized();
  test_pipeline_misuse();
  if (test_failures) {
    fprintf(stderr, "test_core: %d checks failed\n", test_failures);
    return test_failures > 100 ? 100 : test_failures;
  }
  printf("test_core: all %ld checks passed\n", (long)test_checks);
  return 0;
}
