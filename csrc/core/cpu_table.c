/* cpu_table.c: the CPU kernel table (mfsdp_cpu_kernels, see mfsdp_kernels.h), apart from the
 * kernels it lists: the casts and packs of kernels_cpu.c and the quantized entries of
 * quant_cpu.c, each entry the kernel without the context argument (host memory needs none). */
#include "mfsdp_kernels.h"

#include <string.h>

static mfsdp_status op_copy(void* ctx, void* dst, int dt, const void* src, int st, int64_t n, double a) {
  (void)ctx;
  return mfsdp_cpu_copy(dst, dt, src, st, n, a);
}
static mfsdp_status op_accumulate(void* ctx, void* dst, int dt, const void* src, int st, int64_t n, double a) {
  (void)ctx;
  return mfsdp_cpu_accumulate(dst, dt, src, st, n, a);
}
static mfsdp_status op_scale(void* ctx, void* x, int dt, int64_t n, double a) {
  (void)ctx;
  return mfsdp_cpu_scale(x, dt, n, a);
}
static mfsdp_status op_fill_zero(void* ctx, void* x, int dt, int64_t n) {
  (void)ctx;
  return mfsdp_cpu_fill_zero(x, dt, n);
}
static mfsdp_status op_count_nonfinite(void* ctx, const void* x, int dt, int64_t n, int64_t* count) {
  (void)ctx;
  return mfsdp_cpu_count_nonfinite(x, dt, n, count);
}

static mfsdp_status op_fill(void* ctx, void* x, int dt, int64_t n, double value) {
  (void)ctx;
  return mfsdp_cpu_fill(x, dt, n, value);
}

static mfsdp_status op_pack(void* ctx, void* dst, int dt, const mfsdp_pack_item* items, int32_t n, double alpha,
                            int accumulate) {
  (void)ctx;
  return mfsdp_cpu_pack(dst, dt, items, n, alpha, accumulate);
}

static mfsdp_status op_quantize(void* ctx, void* wire, int mode, int64_t block, const void* src, int st, int64_t n,
                                int32_t pieces) {
  (void)ctx;
  return mfsdp_cpu_quantize(wire, mode, block, src, st, n, pieces);
}

static mfsdp_status op_dequantize(void* ctx, void* dst, int dt, const void* wire, int mode, int64_t block, int64_t n,
                                  double alpha, int accumulate) {
  (void)ctx;
  return mfsdp_cpu_dequantize(dst, dt, wire, mode, block, n, alpha, accumulate);
}

static mfsdp_status op_dequantize_pack(void* ctx, void* dst, int dt, const mfsdp_quant_item* items, int32_t n_items,
                                       int mode, int64_t block, int64_t piece_n, double alpha, int accumulate) {
  (void)ctx;
  return mfsdp_cpu_dequantize_pack(dst, dt, items, n_items, mode, block, piece_n, alpha, accumulate);
}

static mfsdp_status op_to_host(void* ctx, void* host_dst, const void* src, int64_t bytes) {
  (void)ctx;
  if (bytes > 0 && (!host_dst || !src)) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "null buffer for %lld bytes",
                                                          (long long)bytes);
  if (bytes > 0) memcpy(host_dst, src, (size_t)bytes);
  return MFSDP_OK;
}

static mfsdp_status op_host_wait(void* ctx) { /* every kernel above has run when it returns */
  (void)ctx;
  return MFSDP_OK;
}

static mfsdp_status op_host_mark(void* ctx, void** mark) { /* nothing queued: nothing to mark */
  (void)ctx;
  *mark = NULL;
  return MFSDP_OK;
}

static mfsdp_status op_host_wait_mark(void* ctx, void* mark) {
  (void)ctx;
  (void)mark;
  return MFSDP_OK;
}

static void op_drop_mark(void* ctx, void* mark) {
  (void)ctx;
  (void)mark;
}

const mfsdp_kernel_ops mfsdp_cpu_kernels = {op_copy,     op_accumulate, op_scale,      op_fill_zero,      op_count_nonfinite,
                                            op_pack,     op_quantize,   op_dequantize, op_dequantize_pack, op_fill,
                                            op_to_host,  op_host_wait,  op_host_mark,  op_host_wait_mark, op_drop_mark};
