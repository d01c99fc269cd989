/* test_quant.c (a part of test_core, whose runner is csrc/tests/test_core.c): the quantized wire
 * format and its CPU kernels, against its definition and a float64 reference. */
#include <float.h>
#include <math.h>

#include "../../core/mfsdp_kernels.h"
#include "../harness.h"
#include "core_tests.h"

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

void test_quant(void) {
  test_e4m3();
  test_quant_cases();
  test_quant_round_trip();
  test_quant_pieces();
  test_quant_refusals();
}
