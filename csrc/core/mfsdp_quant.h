/* mfsdp_quant.h: quantized communication: the wire format of one rank's piece, the scalar
 * codecs every quantize / dequantize kernel is built from, and the CPU kernels.
 *
 * The codecs are header-only and marked MFSDP_HD, as the casts of mfsdp_dtype.h are, so the CPU
 * kernels (quant_cpu.c) and the CUDA kernels (csrc/cuda/kernels.cu) encode and decode
 * identically, bit for bit. The kernels are entries of mfsdp_kernel_ops (mfsdp_kernels.h).
 *
 * [Note: quantized wire format]
 * A piece of n elements is quantized in blocks of B elements (B >= 1; even for int4; default
 * MFSDP_QUANT_DEFAULT_BLOCK): block j holds elements [j*B, min(n, (j+1)*B)), nb = ceil(n/B)
 * blocks. Odd tails: the last block is short when B does not divide n (also n < B, n = 1); its
 * scale is the absmax of its own elements and nothing is padded with values, so every size
 * quantizes the same way. Payload and scales are one byte buffer, so both travel in the same
 * collective; a piece's byte size depends only on (mode, n, B), so every rank's piece has the
 * same size (mfsdp_quant_wire_bytes) and W pieces lie back to back in a gather or all-to-all.
 *   bytes [0, P)             payload, element order. int8: one two's-complement byte per
 *                            element; fp8_e4m3: one e4m3fn byte; int4: two per byte, element
 *                            2k in the low nibble of byte k and 2k+1 in the high nibble (two's
 *                            complement nibbles). P = n, or ceil(n/2) for int4 (when n is odd
 *                            the last high nibble is 0; blocks never share a byte, B is even).
 *   bytes [P, C)             zero, up to C = P rounded up to 16 (mfsdp_quant_scales_offset)
 *   bytes [C, C + 4*nb)      the nb block scales, float32, block order
 *   bytes [C + 4*nb, total)  zero, up to total = mfsdp_quant_wire_bytes, a multiple of 16
 * A piece must start 4-byte aligned (the scales are read as float32; the kernels refuse other
 * pieces); pieces of a 16-byte aligned buffer are all 16-byte aligned. Padding is always
 * written, so the bytes on the wire are a function of the input.
 *
 * Quantize. Elements are read as float32 first (a float64 source rounds to nearest even, as the
 * cast kernels do; one beyond float32's range becomes Inf, and its block non-finite: the scales
 * are float32 anyway). A block's absmax a gives its scale s = a / qmax, one float32 division
 * rounded to nearest even, with qmax = 127 (int8), 448 (fp8_e4m3, its largest finite value), 7
 * (int4); s is raised to FLT_MIN (2^-126) when it would be smaller, so that a block of
 * subnormals never divides by a scale that lost its precision, or by zero. Each element x of
 * the block is coded as: int8 and int4, the integer nearest to the exact quotient x / s, ties
 * to even (a float32 division, corrected by the exact float64 residual x - code * s when its
 * rounding crossed a half), saturated to [-qmax, qmax] (symmetric: -128 and -8 are never
 * written); fp8_e4m3, the e4m3fn value nearest to the float32 quotient v = x / s, ties to
 * even, saturating to +-448 (e4m3fn has no Inf; its NaN code 0x7f/0xff is never written).
 * Dequantize. Element i of block j is the float32 product code(i) * s_j, rounded once. That
 * float32 value then behaves exactly as a float32 source of the copy / accumulate kernels:
 * alpha * value written, or dst + alpha * value added, computed in float32 (float64 when the
 * destination is float64) and rounded once into the destination dtype. A dequantize is
 * therefore bit-identical to decoding into a float32 buffer and running `copy`/`accumulate`
 * from it, on every device.
 * Special blocks.
 *   - Zero block (every element +-0): s = 0, codes 0, no division; it dequantizes to exact
 *     +0 (the sign of a zero is not kept).
 *   - Non-finite block (a NaN, +Inf or -Inf anywhere in it): s = NaN (0x7fc00000), codes 0;
 *     every element of the block dequantizes to NaN (0 * NaN), and so does an accumulate into
 *     it. The error is loud, never a silently finite value; the block's neighbours are not
 *     affected. (An Inf is not kept as an Inf: its block mates would become NaN or Inf anyway,
 *     and report_nan_in_param_grad counts both.)
 * Error per element of a finite block, against the exact source value x (in units of the
 * block's stored scale s, i.e. its quantization step for int8/int4):
 *   - int8, int4: |x - code * s| <= s / 2 exactly: half a step. Saturation adds nothing (the
 *     absmax is at most qmax * s * (1 + 2^-24), rounding of s). The dequantized value, the
 *     float32 code * s, adds its own rounding, 2^-24 of |code * s| <= qmax * s: so
 *     |x - deq| <= s * (1/2 + 2^-17) for int8, s * (1/2 + 2^-21) for int4.
 *   - fp8_e4m3: |x - deq| <= 2^-4 * |x| when |v| >= 2^-6 (the normal range of e4m3: 3
 *     mantissa bits, half an ulp is at most 2^-4 relative, in fact 1/17 at most), and
 *     <= s * 2^-10 * (1 + 2^-16) below it (subnormal e4m3 steps of 2^-9 * s; the 2^-16 covers
 *     the float32 quotient and product). Saturation adds nothing: only rounding of s can push
 *     |v| past 448, by at most 448 * 2^-23.
 *   - then the destination's own rounding: half an ulp of a bfloat16 / float16 result (a
 *     float16 destination overflows to Inf past 65504 as any cast does); float64 adds nothing;
 *     a float64 source adds its rounding to float32 (2^-24 relative).
 * The C tests (csrc/tests/test_core.c) check these bounds against a float64 reference and print
 * the measured maxima. */
#ifndef MFSDP_QUANT_H
#define MFSDP_QUANT_H

#include <stdint.h>

#include "mfsdp_dtype.h"
#include "mfsdp_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mfsdp_quant_mode {
  MFSDP_QUANT_INT8 = 0,     /* symmetric, absmax / 127 */
  MFSDP_QUANT_FP8_E4M3 = 1, /* e4m3fn, absmax scaled to 448, saturating */
  MFSDP_QUANT_INT4 = 2,     /* symmetric, absmax / 7, two per byte */
  MFSDP_NUM_QUANT_MODES = 3
} mfsdp_quant_mode;

#define MFSDP_QUANT_DEFAULT_BLOCK 128
#define MFSDP_QUANT_ALIGN 16 /* the payload and scale sections start at multiples of this */

static inline int mfsdp_quant_mode_valid(int mode) { return mode >= 0 && mode < MFSDP_NUM_QUANT_MODES; }

static inline const char* mfsdp_quant_mode_name(int mode) {
  static const char* names[MFSDP_NUM_QUANT_MODES] = {"int8", "fp8_e4m3", "int4"};
  return mfsdp_quant_mode_valid(mode) ? names[mode] : "invalid";
}

/* The sizes of [Note: quantized wire format]; -1 for a format mfsdp_quant_check refuses. */
static inline int64_t mfsdp_quant_round_up(int64_t bytes) {
  return (bytes + MFSDP_QUANT_ALIGN - 1) / MFSDP_QUANT_ALIGN * MFSDP_QUANT_ALIGN;
}
static inline int mfsdp_quant_format_valid(int mode, int64_t block) {
  return mfsdp_quant_mode_valid(mode) && block >= 1 && (mode != MFSDP_QUANT_INT4 || block % 2 == 0);
}
static inline int64_t mfsdp_quant_blocks(int64_t n, int64_t block) {
  return n < 0 || block < 1 ? -1 : (n + block - 1) / block;
}
static inline int64_t mfsdp_quant_payload_bytes(int mode, int64_t n) {
  if (!mfsdp_quant_mode_valid(mode) || n < 0) return -1;
  return mode == MFSDP_QUANT_INT4 ? (n + 1) / 2 : n;
}
static inline int64_t mfsdp_quant_scales_offset(int mode, int64_t n) {
  int64_t p = mfsdp_quant_payload_bytes(mode, n);
  return p < 0 ? -1 : mfsdp_quant_round_up(p);
}
static inline int64_t mfsdp_quant_wire_bytes(int mode, int64_t n, int64_t block) {
  if (!mfsdp_quant_format_valid(mode, block) || n < 0) return -1;
  return mfsdp_quant_round_up(mfsdp_quant_scales_offset(mode, n) + 4 * mfsdp_quant_blocks(n, block));
}

/* One range of a dequantize-with-copy-out (a gather's copy-out into parameter-major weights):
 * elements [src_offset, src_offset + n) of the piece starting at `wire` go to
 * dst_base + dst_offset (in destination elements). Every piece of one call has the call's
 * piece_n elements and format. Does not own `wire`. */
typedef struct mfsdp_quant_item {
  const void* wire;
  int64_t src_offset;
  int64_t dst_offset;
  int64_t n;
} mfsdp_quant_item;

/* Argument checks shared by the CPU and CUDA kernels (same refusals on every device):
 * MFSDP_ERR_INVALID_ARGUMENT for a bad format, count, null or misaligned piece, or an item
 * outside its piece; MFSDP_ERR_UNSUPPORTED for a non-floating dtype. */
mfsdp_status mfsdp_quant_check_quantize(const void* wire, int mode, int64_t block, const void* src, int src_dtype,
                                        int64_t n, int32_t pieces);
mfsdp_status mfsdp_quant_check_pack(const void* dst_base, int dst_dtype, const mfsdp_quant_item* items,
                                    int32_t n_items, int mode, int64_t block, int64_t piece_n);

/* CPU kernels (the table entries of mfsdp_cpu_kernels; see mfsdp_kernel_ops). */
mfsdp_status mfsdp_cpu_quantize(void* wire, int mode, int64_t block, const void* src, int src_dtype, int64_t n,
                                int32_t pieces);
mfsdp_status mfsdp_cpu_dequantize(void* dst, int dst_dtype, const void* wire, int mode, int64_t block, int64_t n,
                                  double alpha, int accumulate);
mfsdp_status mfsdp_cpu_dequantize_pack(void* dst_base, int dst_dtype, const mfsdp_quant_item* items, int32_t n_items,
                                       int mode, int64_t block, int64_t piece_n, double alpha, int accumulate);

/* ---- scalar codecs, shared by the CPU and CUDA kernels ----
 * Division, multiply and add are rounded separately on the GPU too (see [Note: no FMA] in
 * csrc/cuda/kernels_internal.cuh): the device intrinsics are never contracted or approximated, and the
 * CPU code is built with -ffp-contract=off. */
#if defined(__CUDA_ARCH__)
#define MFSDP_QDIV(a, b) __fdiv_rn((a), (b))
#define MFSDP_QMUL(a, b) __fmul_rn((a), (b))
#define MFSDP_QADD(a, b) __fadd_rn((a), (b))
#define MFSDP_QDMUL(a, b) __dmul_rn((a), (b))
#define MFSDP_QDADD(a, b) __dadd_rn((a), (b))
#else
#define MFSDP_QDIV(a, b) ((a) / (b))
#define MFSDP_QMUL(a, b) ((a) * (b))
#define MFSDP_QADD(a, b) ((a) + (b))
#define MFSDP_QDMUL(a, b) ((a) * (b))
#define MFSDP_QDADD(a, b) ((a) + (b))
#endif

/* The largest code magnitude: a block's absmax maps to it. */
MFSDP_HD float mfsdp_quant_qmax(int mode) {
  return mode == MFSDP_QUANT_INT8 ? 127.0f : mode == MFSDP_QUANT_FP8_E4M3 ? 448.0f : 7.0f;
}

/* |x| orders like these unsigned integers, and NaN and +-Inf are exactly those >= 0x7f800000:
 * a block's absmax and its non-finite test are one integer max. */
MFSDP_HD uint32_t mfsdp_quant_abs_bits(float x) { return mfsdp_f32_bits(x) & 0x7fffffffu; }

/* A block's scale from the largest mfsdp_quant_abs_bits of its elements (0 for an empty
 * block): NaN when non-finite, 0 for a zero block, else absmax / qmax, at least FLT_MIN. */
MFSDP_HD float mfsdp_quant_scale(int mode, uint32_t absmax_bits) {
  if (absmax_bits >= 0x7f800000u) return mfsdp_bits_f32(0x7fc00000u);
  if (absmax_bits == 0u) return 0.0f;
  float s = MFSDP_QDIV(mfsdp_bits_f32(absmax_bits), mfsdp_quant_qmax(mode));
  return mfsdp_f32_bits(s) < 0x00800000u ? mfsdp_bits_f32(0x00800000u) : s;
}

/* v rounded to an integer, ties to even, for |v| <= 2^22: adding 1.5 * 2^23 leaves no
 * fraction bits, so the add itself rounds (in the default rounding mode, nearest even). */
MFSDP_HD float mfsdp_quant_rint(float v) { return MFSDP_QADD(MFSDP_QADD(v, 12582912.0f), -12582912.0f); }

/* cond ? a : b as masks: gcc vectorises the CPU loops around it (not those around a chain of
 * ternaries). */
MFSDP_HD uint32_t mfsdp_quant_select(int cond, uint32_t a, uint32_t b) {
  uint32_t mask = 0u - (uint32_t)(cond != 0);
  return (a & mask) | (b & ~mask);
}

/* e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no Inf; 0x7f/0xff NaN) of a
 * non-NaN v: nearest, ties to even, saturating to +-448. Both roundings are computed and one
 * selected, without branches. */
MFSDP_HD uint8_t mfsdp_f32_to_e4m3(float v) {
  uint32_t u = mfsdp_f32_bits(v);
  uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7fffffffu;
  /* below 2^-6: subnormal steps of 2^-9, the code is round(|v| * 2^9), 0..8 (8 is 2^-6, code 0x08) */
  uint32_t sub =
      (uint32_t)(int32_t)mfsdp_quant_rint(MFSDP_QMUL(mfsdp_bits_f32(a < 0x3c800000u ? a : 0x3c800000u), 512.0f));
  /* normal: keep 3 mantissa bits, nearest even (< 448 never rounds past 448); unused below 2^-6 */
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  uint32_t normal = ((((r >> 23) - 120u) << 3) | ((r >> 20) & 7u)) & 0x7fu;
  uint32_t code = mfsdp_quant_select(a < 0x3c800000u, sub, normal);
  return (uint8_t)(sign | mfsdp_quant_select(a >= 0x43e00000u, 0x7eu, code));
}

/* The exact value of an e4m3fn code (its NaN, 0x7f/0xff, is a quiet NaN). */
MFSDP_HD float mfsdp_e4m3_to_f32(uint32_t c) {
  uint32_t mag = c & 0x7fu;
  uint32_t normal = (mag << 20) + (120u << 23);                               /* exponent e - 7 + 127 */
  uint32_t sub = mfsdp_f32_bits(MFSDP_QMUL((float)(int32_t)(mag & 7u), 0.001953125f)); /* m * 2^-9 */
  uint32_t bits = mfsdp_quant_select(mag == 0x7fu, 0x7fc00000u, mfsdp_quant_select(mag < 8u, sub, normal));
  return mfsdp_bits_f32(((c & 0x80u) << 24) | bits);
}

/* The code of x in a finite, non-zero block of scale s: a byte (int8, e4m3) or a nibble in the
 * low 4 bits (int4). */
MFSDP_HD uint32_t mfsdp_quant_encode(int mode, float x, float s) {
  float v = MFSDP_QDIV(x, s);
  if (mode == MFSDP_QUANT_FP8_E4M3) return mfsdp_f32_to_e4m3(v);
  float q = mfsdp_quant_rint(v);
  /* v is the quotient rounded to float32, which can move it across a half; the residual
   * x - q * s is exact in float64 (q * s has at most 32 significant bits, and x is within a few
   * binades of it unless q = 0), so one step corrects q to the integer nearest to the exact
   * quotient. An exact tie k + 1/2 is a float32, so v is exact there and the rounding above
   * already chose the even neighbour: only a strict crossing needs the step. (Written as float
   * selects, which gcc vectorises.) */
  double r = MFSDP_QDADD((double)x, -MFSDP_QDMUL((double)q, (double)s));
  double half = MFSDP_QDMUL(0.5, (double)s);
  q = MFSDP_QADD(q, MFSDP_QADD(r > half ? 1.0f : 0.0f, r < -half ? -1.0f : 0.0f));
  float qmax = mfsdp_quant_qmax(mode);
  q = q > qmax ? qmax : q < -qmax ? -qmax : q;
  return (uint32_t)(int32_t)q & (mode == MFSDP_QUANT_INT8 ? 0xffu : 0x0fu);
}

/* The exact value of a code (byte, or nibble in the low 4 bits). */
MFSDP_HD float mfsdp_quant_code_value(int mode, uint32_t code) {
  if (mode == MFSDP_QUANT_FP8_E4M3) return mfsdp_e4m3_to_f32(code);
  if (mode == MFSDP_QUANT_INT8) return (float)((int32_t)(code ^ 0x80u) - 0x80);
  return (float)((int32_t)((code & 0x0fu) ^ 0x08u) - 0x08);
}

/* The code of element i of a payload. */
MFSDP_HD uint32_t mfsdp_quant_code_at(int mode, const uint8_t* payload, int64_t i) {
  if (mode != MFSDP_QUANT_INT4) return payload[i];
  return (uint32_t)(payload[i >> 1] >> ((i & 1) * 4)) & 0x0fu;
}

/* Element i of a piece, dequantized to float32 with its block's scale s. */
MFSDP_HD float mfsdp_quant_decode(int mode, const uint8_t* payload, int64_t i, float s) {
  return MFSDP_QMUL(mfsdp_quant_code_value(mode, mfsdp_quant_code_at(mode, payload, i)), s);
}

#ifdef __cplusplus
}
#endif
#endif
