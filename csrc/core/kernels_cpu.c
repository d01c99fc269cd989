/* kernels_cpu.c: CPU kernels over host memory (see mfsdp_kernels.h).
 *
 * The one dtype dispatch point is the pair of tables built below from MFSDP_FOR_FLOAT: every
 * (destination, source) pair gets its own loop, specialised at compile time so that the
 * compiler can vectorise it. Loads widen to the pair's compute type (float, or double when
 * either side is float64); stores round once. Build with -ffp-contract=off: a fused
 * multiply-add would round differently from torch's separate multiply and add. */
#include <math.h>
#include <string.h>

#include "mfsdp_kernels.h"

#define LOAD_F32(p, i) (((const float*)(p))[i])
#define LOAD_F64(p, i) (((const double*)(p))[i])
#define LOAD_BF16(p, i) mfsdp_bf16_to_f32(((const uint16_t*)(p))[i])
#define LOAD_F16(p, i) mfsdp_f16_to_f32(((const uint16_t*)(p))[i])

#define STORE_F32(p, i, v) (((float*)(p))[i] = (float)(v))
#define STORE_F64(p, i, v) (((double*)(p))[i] = (double)(v))
#define STORE_BF16(p, i, v) (((uint16_t*)(p))[i] = mfsdp_f32_to_bf16((float)(v)))
#define STORE_F16(p, i, v) (((uint16_t*)(p))[i] = mfsdp_f32_to_f16((float)(v)))

#define ACC_F32 float
#define ACC_BF16 float
#define ACC_F16 float
#define ACC_F64 double

typedef void (*binary_kernel)(void* dst, const void* src, int64_t n, double alpha);

/* The wider of the two compute types: float unless one side is double. */
#define PAIR_ACC(D, S) __typeof__((ACC_##D)0 + (ACC_##S)0)

#define DEFINE_PAIR(D, S)                                                             \
  static void copy_##D##_##S(void* dst, const void* src, int64_t n, double alpha) {   \
    typedef PAIR_ACC(D, S) acc_t;                                                      \
    if (alpha == 1.0) {                                                                \
      for (int64_t i = 0; i < n; ++i) STORE_##D(dst, i, (acc_t)LOAD_##S(src, i));      \
    } else {                                                                           \
      const acc_t a = (acc_t)alpha;                                                    \
      for (int64_t i = 0; i < n; ++i) STORE_##D(dst, i, a * (acc_t)LOAD_##S(src, i));  \
    }                                                                                  \
  }                                                                                    \
  static void accumulate_##D##_##S(void* dst, const void* src, int64_t n, double alpha) { \
    typedef PAIR_ACC(D, S) acc_t;                                                      \
    if (alpha == 1.0) {                                                                \
      for (int64_t i = 0; i < n; ++i)                                                  \
        STORE_##D(dst, i, (acc_t)LOAD_##D(dst, i) + (acc_t)LOAD_##S(src, i));          \
    } else {                                                                           \
      const acc_t a = (acc_t)alpha;                                                    \
      for (int64_t i = 0; i < n; ++i)                                                  \
        STORE_##D(dst, i, (acc_t)LOAD_##D(dst, i) + a * (acc_t)LOAD_##S(src, i));      \
    }                                                                                  \
  }

/* Order must match mfsdp_dtype: F32, BF16, F16, F64. */
#define MFSDP_FOR_FLOAT(X, ARG) X(ARG, F32) X(ARG, BF16) X(ARG, F16) X(ARG, F64)
#define DEFINE_ROW(D) MFSDP_FOR_FLOAT(DEFINE_PAIR_ARGS, D)
#define DEFINE_PAIR_ARGS(D, S) DEFINE_PAIR(D, S)
DEFINE_ROW(F32)
DEFINE_ROW(BF16)
DEFINE_ROW(F16)
DEFINE_ROW(F64)

#define COPY_ENTRY(D, S) copy_##D##_##S,
#define ACC_ENTRY(D, S) accumulate_##D##_##S,
static const binary_kernel copy_table[MFSDP_NUM_FLOAT_DTYPES][MFSDP_NUM_FLOAT_DTYPES] = {
    {MFSDP_FOR_FLOAT(COPY_ENTRY, F32)},
    {MFSDP_FOR_FLOAT(COPY_ENTRY, BF16)},
    {MFSDP_FOR_FLOAT(COPY_ENTRY, F16)},
    {MFSDP_FOR_FLOAT(COPY_ENTRY, F64)},
};
static const binary_kernel accumulate_table[MFSDP_NUM_FLOAT_DTYPES][MFSDP_NUM_FLOAT_DTYPES] = {
    {MFSDP_FOR_FLOAT(ACC_ENTRY, F32)},
    {MFSDP_FOR_FLOAT(ACC_ENTRY, BF16)},
    {MFSDP_FOR_FLOAT(ACC_ENTRY, F16)},
    {MFSDP_FOR_FLOAT(ACC_ENTRY, F64)},
};

static mfsdp_status check_args(const void* a, const void* b, int64_t n) {
  if (n < 0) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "negative element count %lld", (long long)n);
  if (n > 0 && (a == NULL || b == NULL))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "null buffer for %lld elements (released storage?)",
                      (long long)n);
  return MFSDP_OK;
}

mfsdp_status mfsdp_cpu_copy(void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n, double alpha) {
  MFSDP_CHECK(check_args(dst, src, n));
  if (n == 0) return MFSDP_OK;
  if (dst_dtype == src_dtype && alpha == 1.0 && mfsdp_dtype_valid(dst_dtype)) {
    if (dst != src) memmove(dst, src, (size_t)(n * mfsdp_dtype_size(dst_dtype)));
    return MFSDP_OK;
  }
  if (!mfsdp_dtype_is_float(dst_dtype) || !mfsdp_dtype_is_float(src_dtype))
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "cannot cast %s to %s (scale %g): only floating types convert",
                      mfsdp_dtype_name(src_dtype), mfsdp_dtype_name(dst_dtype), alpha);
  copy_table[dst_dtype][src_dtype](dst, src, n, alpha);
  return MFSDP_OK;
}

mfsdp_status mfsdp_cpu_accumulate(void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n,
                                  double alpha) {
  MFSDP_CHECK(check_args(dst, src, n));
  if (!mfsdp_dtype_is_float(dst_dtype) || !mfsdp_dtype_is_float(src_dtype))
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "cannot accumulate %s into %s: only floating types add",
                      mfsdp_dtype_name(src_dtype), mfsdp_dtype_name(dst_dtype));
  if (n > 0) accumulate_table[dst_dtype][src_dtype](dst, src, n, alpha);
  return MFSDP_OK;
}

mfsdp_status mfsdp_cpu_scale(void* x, int dtype, int64_t n, double alpha) {
  MFSDP_CHECK(check_args(x, x, n));
  if (!mfsdp_dtype_is_float(dtype))
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "cannot scale %s", mfsdp_dtype_name(dtype));
  if (alpha != 1.0 && n > 0) copy_table[dtype][dtype](x, x, n, alpha);
  return MFSDP_OK;
}

mfsdp_status mfsdp_cpu_fill_zero(void* x, int dtype, int64_t n) {
  MFSDP_CHECK(check_args(x, x, n));
  if (!mfsdp_dtype_valid(dtype)) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bad dtype %d", dtype);
  if (n > 0) memset(x, 0, (size_t)(n * mfsdp_dtype_size(dtype)));
  return MFSDP_OK;
}

mfsdp_status mfsdp_cpu_count_nonfinite(const void* x, int dtype, int64_t n, int64_t* count) {
  MFSDP_CHECK(check_args(x, count, n));
  int64_t bad = 0;
  switch (dtype) {
    case MFSDP_F32:
      for (int64_t i = 0; i < n; ++i) bad += !isfinite(LOAD_F32(x, i));
      break;
    case MFSDP_F64:
      for (int64_t i = 0; i < n; ++i) bad += !isfinite(LOAD_F64(x, i));
      break;
    case MFSDP_BF16: /* exponent bits all ones */
      for (int64_t i = 0; i < n; ++i) bad += (((const uint16_t*)x)[i] & 0x7f80u) == 0x7f80u;
      break;
    case MFSDP_F16:
      for (int64_t i = 0; i < n; ++i) bad += (((const uint16_t*)x)[i] & 0x7c00u) == 0x7c00u;
      break;
    default:
      break; /* integer types are always finite */
  }
  *count = bad;
  return MFSDP_OK;
}

mfsdp_status mfsdp_cpu_fill(void* x, int dtype, int64_t n, double value) {
  double chunk[64];
  for (int i = 0; i < 64; ++i) chunk[i] = value;
  int64_t elem = mfsdp_dtype_size(dtype);
  for (int64_t done = 0; done < n; done += 64) /* as copy stores a float64 source: one rounding */
    MFSDP_CHECK(mfsdp_cpu_copy((char*)x + done * elem, dtype, chunk, MFSDP_F64, n - done < 64 ? n - done : 64, 1.0));
  return MFSDP_OK;
}

mfsdp_status mfsdp_cpu_pack(void* dst_base, int dst_dtype, const mfsdp_pack_item* items, int32_t n_items, double alpha,
                            int accumulate) {
  int64_t elem = mfsdp_dtype_size(dst_dtype);
  for (int32_t i = 0; i < n_items; ++i) {
    void* dst = (char*)dst_base + items[i].dst_offset * elem;
    MFSDP_CHECK(accumulate ? mfsdp_cpu_accumulate(dst, dst_dtype, items[i].src, items[i].src_dtype, items[i].n, alpha)
                           : mfsdp_cpu_copy(dst, dst_dtype, items[i].src, items[i].src_dtype, items[i].n, alpha));
  }
  return MFSDP_OK;
}
