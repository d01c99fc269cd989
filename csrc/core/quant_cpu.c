/* quant_cpu.c: the quantized wire format's CPU kernels and the argument checks every device
 * shares (see [Note: quantized wire format] in mfsdp_quant.h).
 *
 * No dtype dispatch of its own: sources are read as float32 through the cast kernels of
 * kernels_cpu.c (a float32 source in place), and dequantized values reach their destination
 * through its copy / accumulate kernels from a float32 buffer on the stack. That is the
 * definition of the format's arithmetic, so it holds by construction here. Build with
 * -ffp-contract=off, as kernels_cpu.c. */
#include <string.h>

#include "mfsdp_kernels.h"
#include "mfsdp_quant.h"

/* Elements converted to or decoded into float32 at a time, on the stack. Even, so that int4
 * pieces of a chunk start on a byte. */
#define CHUNK 1024

static mfsdp_status check_format(int mode, int64_t block) {
  if (!mfsdp_quant_mode_valid(mode)) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "unknown quantization mode %d", mode);
  if (block < 1 || (mode == MFSDP_QUANT_INT4 && block % 2 != 0))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "%s blocks of %lld elements (must be >= 1%s)",
                      mfsdp_quant_mode_name(mode), (long long)block, mode == MFSDP_QUANT_INT4 ? " and even" : "");
  return MFSDP_OK;
}

static mfsdp_status check_piece(const void* wire, int64_t n) {
  if (n > 0 && wire == NULL) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "null wire piece for %lld elements", (long long)n);
  if (((uintptr_t)wire & 3u) != 0)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "wire piece %p is not 4-byte aligned (its float32 scales)", wire);
  return MFSDP_OK;
}

mfsdp_status mfsdp_quant_check_quantize(const void* wire, int mode, int64_t block, const void* src, int src_dtype,
                                        int64_t n, int32_t pieces) {
  MFSDP_CHECK(check_format(mode, block));
  if (n < 0 || pieces < 0)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "%d pieces of %lld elements", pieces, (long long)n);
  if (!mfsdp_dtype_is_float(src_dtype))
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "cannot quantize %s: only floating types", mfsdp_dtype_name(src_dtype));
  if (n == 0 || pieces == 0) return MFSDP_OK;
  if (src == NULL) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "null source for %lld elements", (long long)n);
  return check_piece(wire, n);
}

mfsdp_status mfsdp_quant_check_pack(const void* dst_base, int dst_dtype, const mfsdp_quant_item* items,
                                    int32_t n_items, int mode, int64_t block, int64_t piece_n) {
  MFSDP_CHECK(check_format(mode, block));
  if (!mfsdp_dtype_is_float(dst_dtype))
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "cannot dequantize into %s: only floating types",
                      mfsdp_dtype_name(dst_dtype));
  if (n_items < 0 || piece_n < 0 || (n_items > 0 && items == NULL))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "%d items of pieces of %lld elements", n_items, (long long)piece_n);
  for (int32_t i = 0; i < n_items; ++i) {
    const mfsdp_quant_item* it = &items[i];
    if (it->n < 0 || it->src_offset < 0 || it->dst_offset < 0 || it->src_offset > piece_n - it->n)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT,
                        "item %d: elements [%lld, +%lld) of a piece of %lld, to offset %lld", i,
                        (long long)it->src_offset, (long long)it->n, (long long)piece_n, (long long)it->dst_offset);
    if (it->n == 0) continue;
    if (dst_base == NULL)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "null destination for %lld elements (released storage?)",
                        (long long)it->n);
    MFSDP_CHECK(check_piece(it->wire, it->n));
  }
  return MFSDP_OK;
}

/* ---- quantize ---- */

/* Largest mfsdp_quant_abs_bits of x[0, m). */
static uint32_t absmax_bits(const float* x, int64_t m) {
  uint32_t a = 0;
  for (int64_t i = 0; i < m; ++i) {
    uint32_t b = mfsdp_quant_abs_bits(x[i]);
    a = b > a ? b : a;
  }
  return a;
}

/* Codes of elements [first, first + m) of a piece, values x[0, m), scale s, into the payload.
 * For int4, first is even (blocks and chunks start on a byte). */
static void write_codes(int mode, uint8_t* payload, int64_t first, const float* x, int64_t m, float s) {
  if (!(s > 0.0f)) { /* zero block (s = 0) or non-finite (NaN): codes 0 */
    if (mode == MFSDP_QUANT_INT4) memset(payload + first / 2, 0, (size_t)((m + 1) / 2));
    else memset(payload + first, 0, (size_t)m);
    return;
  }
  switch (mode) {
    case MFSDP_QUANT_INT8:
      for (int64_t i = 0; i < m; ++i) payload[first + i] = (uint8_t)mfsdp_quant_encode(MFSDP_QUANT_INT8, x[i], s);
      break;
    case MFSDP_QUANT_FP8_E4M3:
      for (int64_t i = 0; i < m; ++i) payload[first + i] = (uint8_t)mfsdp_quant_encode(MFSDP_QUANT_FP8_E4M3, x[i], s);
      break;
    default: { /* int4: pairs, the odd last element of a piece with a zero high nibble */
      uint8_t* out = payload + first / 2;
      for (int64_t k = 0; k < m / 2; ++k)
        out[k] = (uint8_t)(mfsdp_quant_encode(MFSDP_QUANT_INT4, x[2 * k], s) |
                           mfsdp_quant_encode(MFSDP_QUANT_INT4, x[2 * k + 1], s) << 4);
      if (m % 2) out[m / 2] = (uint8_t)mfsdp_quant_encode(MFSDP_QUANT_INT4, x[m - 1], s);
      break;
    }
  }
}

/* Elements [first, first + m) of src as float32: in place for a float32 source, else cast into
 * tmp by the cast kernels (float64 rounds to nearest even). */
static const float* as_f32(const void* src, int src_dtype, int64_t first, int64_t m, float* tmp) {
  if (src_dtype == MFSDP_F32) return (const float*)src + first;
  mfsdp_cpu_copy(tmp, MFSDP_F32, (const char*)src + first * mfsdp_dtype_size(src_dtype), src_dtype, m, 1.0);
  return tmp; /* cannot fail: arguments checked by the caller */
}

static void quantize_piece(uint8_t* wire, int mode, int64_t block, const void* src, int st, int64_t n) {
  int64_t payload = mfsdp_quant_payload_bytes(mode, n), scales_at = mfsdp_quant_scales_offset(mode, n);
  int64_t nb = mfsdp_quant_blocks(n, block), total = mfsdp_quant_wire_bytes(mode, n, block);
  float* scales = (float*)(void*)(wire + scales_at);
  memset(wire + payload, 0, (size_t)(scales_at - payload));
  memset(wire + scales_at + 4 * nb, 0, (size_t)(total - scales_at - 4 * nb));
  float tmp[CHUNK];
  if (block <= CHUNK) { /* whole blocks per chunk: each element read (and cast) once */
    int64_t per = CHUNK / block * block;
    for (int64_t first = 0; first < n; first += per) {
      int64_t m = n - first < per ? n - first : per;
      const float* x = as_f32(src, st, first, m, tmp);
      for (int64_t b = 0; b < m; b += block) {
        int64_t len = m - b < block ? m - b : block;
        float s = mfsdp_quant_scale(mode, absmax_bits(x + b, len));
        scales[(first + b) / block] = s;
        write_codes(mode, wire, first + b, x + b, len, s);
      }
    }
    return;
  }
  for (int64_t j = 0; j < nb; ++j) { /* blocks larger than a chunk: absmax pass, then codes pass */
    int64_t start = j * block, len = n - start < block ? n - start : block;
    uint32_t a = 0;
    for (int64_t k = 0; k < len; k += CHUNK) {
      int64_t m = len - k < CHUNK ? len - k : CHUNK;
      uint32_t c = absmax_bits(as_f32(src, st, start + k, m, tmp), m);
      a = c > a ? c : a;
    }
    float s = scales[j] = mfsdp_quant_scale(mode, a);
    for (int64_t k = 0; k < len; k += CHUNK) {
      int64_t m = len - k < CHUNK ? len - k : CHUNK;
      write_codes(mode, wire, start + k, as_f32(src, st, start + k, m, tmp), m, s);
    }
  }
}

mfsdp_status mfsdp_cpu_quantize(void* wire, int mode, int64_t block, const void* src, int src_dtype, int64_t n,
                                int32_t pieces) {
  MFSDP_CHECK(mfsdp_quant_check_quantize(wire, mode, block, src, src_dtype, n, pieces));
  if (n == 0) return MFSDP_OK;
  int64_t bytes = mfsdp_quant_wire_bytes(mode, n, block), elem = mfsdp_dtype_size(src_dtype);
  for (int32_t p = 0; p < pieces; ++p)
    quantize_piece((uint8_t*)wire + p * bytes, mode, block, (const char*)src + p * n * elem, src_dtype, n);
  return MFSDP_OK;
}

/* ---- dequantize ---- */

/* Elements [first, first + m) of a piece into out[0, m), as float32. */
static void decode(int mode, const uint8_t* payload, const float* scales, int64_t block, int64_t first, int64_t m,
                   float* out) {
  for (int64_t i = 0; i < m;) { /* one block's run at a time: one scale */
    int64_t e = first + i, j = e / block, run = (j + 1) * block - e;
    if (run > m - i) run = m - i;
    float s = scales[j];
    switch (mode) {
      case MFSDP_QUANT_INT8:
        for (int64_t k = 0; k < run; ++k) out[i + k] = mfsdp_quant_decode(MFSDP_QUANT_INT8, payload, e + k, s);
        break;
      case MFSDP_QUANT_FP8_E4M3:
        for (int64_t k = 0; k < run; ++k) out[i + k] = mfsdp_quant_decode(MFSDP_QUANT_FP8_E4M3, payload, e + k, s);
        break;
      default: { /* int4: an odd first element alone, then whole bytes, then an odd last one */
        float* o = out + i;
        int64_t k = 0;
        if (e % 2) o[k++] = mfsdp_quant_decode(MFSDP_QUANT_INT4, payload, e, s);
        const uint8_t* bytes = payload + (e + k) / 2;
        int64_t pairs = (run - k) / 2;
        for (int64_t p = 0; p < pairs; ++p) {
          o[k + 2 * p] = MFSDP_QMUL(mfsdp_quant_code_value(MFSDP_QUANT_INT4, bytes[p] & 0x0fu), s);
          o[k + 2 * p + 1] = MFSDP_QMUL(mfsdp_quant_code_value(MFSDP_QUANT_INT4, (uint32_t)bytes[p] >> 4), s);
        }
        k += 2 * pairs;
        if (k < run) o[k] = mfsdp_quant_decode(MFSDP_QUANT_INT4, payload, e + k, s);
        break;
      }
    }
    i += run;
  }
}

/* Elements [first, first + n) of one piece of piece_n elements into dst (dst_dtype). */
static void dequantize_range(void* dst, int dst_dtype, const uint8_t* wire, int mode, int64_t block, int64_t piece_n,
                             int64_t first, int64_t n, double alpha, int accumulate) {
  const float* scales = (const float*)(const void*)(wire + mfsdp_quant_scales_offset(mode, piece_n));
  int64_t elem = mfsdp_dtype_size(dst_dtype);
  float tmp[CHUNK];
  for (int64_t done = 0; done < n; done += CHUNK) {
    int64_t m = n - done < CHUNK ? n - done : CHUNK;
    decode(mode, wire, scales, block, first + done, m, tmp);
    void* d = (char*)dst + done * elem; /* the cast kernels cannot fail here: arguments checked */
    if (accumulate) mfsdp_cpu_accumulate(d, dst_dtype, tmp, MFSDP_F32, m, alpha);
    else mfsdp_cpu_copy(d, dst_dtype, tmp, MFSDP_F32, m, alpha);
  }
}

mfsdp_status mfsdp_cpu_dequantize_pack(void* dst_base, int dst_dtype, const mfsdp_quant_item* items, int32_t n_items,
                                       int mode, int64_t block, int64_t piece_n, double alpha, int accumulate) {
  /* every item is checked before any is written: a refused call changes nothing */
  MFSDP_CHECK(mfsdp_quant_check_pack(dst_base, dst_dtype, items, n_items, mode, block, piece_n));
  int64_t elem = mfsdp_dtype_size(dst_dtype);
  for (int32_t i = 0; i < n_items; ++i)
    if (items[i].n > 0)
      dequantize_range((char*)dst_base + items[i].dst_offset * elem, dst_dtype, items[i].wire, mode, block, piece_n,
                       items[i].src_offset, items[i].n, alpha, accumulate);
  return MFSDP_OK;
}

mfsdp_status mfsdp_cpu_dequantize(void* dst, int dst_dtype, const void* wire, int mode, int64_t block, int64_t n,
                                  double alpha, int accumulate) {
  mfsdp_quant_item whole = {wire, 0, 0, n};
  return mfsdp_cpu_dequantize_pack(dst, dst_dtype, &whole, 1, mode, block, n, alpha, accumulate);
}
