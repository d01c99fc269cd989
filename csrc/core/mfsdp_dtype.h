/* mfsdp_dtype.h: element types of the engine and the scalar conversions behind every cast.
 *
 * The conversions are header-only and marked MFSDP_HD so the CPU kernels (kernels_cpu.c) and
 * the CUDA kernels (csrc/cuda/kernels.cu) round identically. Narrowing casts round to nearest
 * even, keep Inf, and keep NaN a NaN (torch itself is not consistent about NaN payloads: its
 * vectorised bf16 path writes 0xFFFF, its scalar path 0x7FC0). float64 -> bf16/fp16 rounds
 * through float32 exactly as torch's `.to()` does, so every non-NaN result is bit-identical. */
#ifndef MFSDP_DTYPE_H
#define MFSDP_DTYPE_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MFSDP_HD __host__ __device__ __forceinline__
#else
#define MFSDP_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Floating types come first: the kernels' dispatch tables index them directly. */
typedef enum mfsdp_dtype {
  MFSDP_F32 = 0,
  MFSDP_BF16 = 1,
  MFSDP_F16 = 2,
  MFSDP_F64 = 3,
  MFSDP_NUM_FLOAT_DTYPES = 4,
  /* Opaque element types: copied and communicated, never cast or summed. */
  MFSDP_U8 = 4,
  MFSDP_I8 = 5,
  MFSDP_I16 = 6,
  MFSDP_I32 = 7,
  MFSDP_I64 = 8,
  MFSDP_BOOL = 9,
  MFSDP_NUM_DTYPES = 10
} mfsdp_dtype;

static inline int mfsdp_dtype_valid(int dtype) { return dtype >= 0 && dtype < MFSDP_NUM_DTYPES; }
static inline int mfsdp_dtype_is_float(int dtype) { return dtype >= 0 && dtype < MFSDP_NUM_FLOAT_DTYPES; }

static inline int64_t mfsdp_dtype_size(int dtype) {
  static const int64_t sizes[MFSDP_NUM_DTYPES] = {4, 2, 2, 8, 1, 1, 2, 4, 8, 1};
  return mfsdp_dtype_valid(dtype) ? sizes[dtype] : 0;
}

static inline const char* mfsdp_dtype_name(int dtype) {
  static const char* names[MFSDP_NUM_DTYPES] = {"float32", "bfloat16", "float16", "float64", "uint8",
                                                 "int8",    "int16",    "int32",   "int64",   "bool"};
  return mfsdp_dtype_valid(dtype) ? names[dtype] : "invalid";
}

/* Significand bits (with the implicit one): what a cast to this type keeps. */
static inline int mfsdp_dtype_precision(int dtype) {
  static const int bits[MFSDP_NUM_DTYPES] = {24, 8, 11, 53, 8, 7, 15, 31, 63, 1};
  return mfsdp_dtype_valid(dtype) ? bits[dtype] : 0;
}

MFSDP_HD uint32_t mfsdp_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

MFSDP_HD float mfsdp_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

MFSDP_HD float mfsdp_bf16_to_f32(uint16_t h) { return mfsdp_bits_f32((uint32_t)h << 16); }

MFSDP_HD uint16_t mfsdp_f32_to_bf16(float f) {
  uint32_t u = mfsdp_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN, sign kept */
  u += 0x7fffu + ((u >> 16) & 1u);                                             /* round to nearest even */
  return (uint16_t)(u >> 16);
}

MFSDP_HD float mfsdp_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return mfsdp_bits_f32(sign | 0x7f800000u | (mant << 13)); /* Inf / NaN */
  if (exp != 0) return mfsdp_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return mfsdp_bits_f32(sign);
  uint32_t e = 113u; /* subnormal: normalise the mantissa */
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    e--;
  }
  return mfsdp_bits_f32(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

MFSDP_HD uint16_t mfsdp_f32_to_f16(float f) {
  uint32_t u = mfsdp_f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); /* quiet NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                       /* >= 65520 -> Inf */
  if (a >= 0x38800000u) {                                                          /* normal */
    uint32_t r = a - 0x38000000u + 0xfffu + ((a >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
  }
  uint32_t e = a >> 23; /* subnormal or zero: round(value / 2^-24) */
  if (e < 102u) return (uint16_t)sign;
  uint32_t m = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - e;
  uint32_t q = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) q++;
  return (uint16_t)(sign | q);
}

#ifdef __cplusplus
}
#endif
#endif
