/* mfsdp_kernels.h: the element-wise kernels the pipeline runs over bucket memory.
 *
 * One table of operations per device kind: mfsdp_cpu_kernels here, the CUDA table in
 * csrc/cuda/mfsdp_cuda.h. All arithmetic happens in float32, or float64 when either operand
 * is float64, and is rounded once into the destination type: a low-precision gradient added
 * into a high-precision main gradient is upcast first, never summed in the low type. */
#ifndef MFSDP_KERNELS_H
#define MFSDP_KERNELS_H

#include <stdint.h>

#include "mfsdp_dtype.h"
#include "mfsdp_quant.h"
#include "mfsdp_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One tensor of a multi-tensor pack: n elements of src (src_dtype) go to dst_base + dst_offset. */
typedef struct mfsdp_pack_item {
  const void* src;
  int32_t src_dtype;
  int64_t dst_offset;
  int64_t n;
} mfsdp_pack_item;

typedef struct mfsdp_kernel_ops {
  /* dst[i] = alpha * src[i], cast to dst_dtype (alpha == 1: a plain cast copy). */
  mfsdp_status (*copy)(void* ctx, void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n,
                       double alpha);
  /* dst[i] = dst[i] + alpha * src[i], computed in the wider type, rounded once. */
  mfsdp_status (*accumulate)(void* ctx, void* dst, int dst_dtype, const void* src, int src_dtype,
                             int64_t n, double alpha);
  /* x[i] *= alpha */
  mfsdp_status (*scale)(void* ctx, void* x, int dtype, int64_t n, double alpha);
  mfsdp_status (*fill_zero)(void* ctx, void* x, int dtype, int64_t n);
  /* *count = number of NaN/Inf elements (synchronous). */
  mfsdp_status (*count_nonfinite)(void* ctx, const void* x, int dtype, int64_t n, int64_t* count);
  /* Many tensors into one buffer in one call (one launch on a GPU): copy with alpha, or add. */
  mfsdp_status (*pack)(void* ctx, void* dst_base, int dst_dtype, const mfsdp_pack_item* items, int32_t n_items,
                       double alpha, int accumulate);
  /* Quantized communication, in the format of [Note: quantized wire format] (mfsdp_quant.h):
   * `pieces` pieces of n elements each, source piece p at element p * n, quantized into wire
   * piece p at byte p * mfsdp_quant_wire_bytes(mode, n, block) (an all-to-all's W pieces in one
   * call; one launch on a GPU). */
  mfsdp_status (*quantize)(void* ctx, void* wire, int mode, int64_t block, const void* src, int src_dtype, int64_t n,
                           int32_t pieces);
  /* One piece of n elements dequantized into dst: copy (alpha * value) or accumulate
   * (dst + alpha * value), exactly as `copy`/`accumulate` from a float32 source. */
  mfsdp_status (*dequantize)(void* ctx, void* dst, int dst_dtype, const void* wire, int mode, int64_t block, int64_t n,
                             double alpha, int accumulate);
  /* Ranges of pieces (each of piece_n elements) into one buffer in one call (one launch on a
   * GPU): a gather's copy-out into parameter-major weights. Destinations must not overlap. */
  mfsdp_status (*dequantize_pack)(void* ctx, void* dst_base, int dst_dtype, const mfsdp_quant_item* items,
                                  int32_t n_items, int mode, int64_t block, int64_t piece_n, double alpha,
                                  int accumulate);
  /* x[i] = value, stored as `copy` stores a float64 source (the pipeline's only way to put a
   * constant in device memory: the used-parameter flags, [Note: flag tail] in mfsdp_layout.h). */
  mfsdp_status (*fill)(void* ctx, void* x, int dtype, int64_t n, double value);
  /* `bytes` of device memory into host memory, synchronous: after everything queued before it
   * (one device-to-host copy on a GPU; the pipeline's only read of device memory: the used-
   * parameter flags it decodes, mfsdp_pipeline_read_flags). */
  mfsdp_status (*to_host)(void* ctx, void* host_dst, const void* src, int64_t bytes);
  /* The host waits until everything queued before it has run (the current stream's work on a
   * GPU; nothing to wait for on the CPU): offloaded buckets' host memory is then the host's
   * ([Note: offloaded buckets] in csrc/comm/buffers.c). */
  mfsdp_status (*host_wait)(void* ctx);
  /* A mark after everything queued so far, for the host to wait for later, from any thread, while
   * more work is queued behind it (a CUDA event, made at the first mark into *mark and recorded
   * again by each later one; on the CPU, where every kernel has run when it returns, none: *mark
   * stays NULL). One bucket's gradients landing in host memory, waited for by the thread that
   * steps them ([Note: a bucket's gradients before the sync] in csrc/comm/backward.c). */
  mfsdp_status (*host_mark)(void* ctx, void** mark);
  /* The host waits until the latest record of `mark` has passed (NULL: nothing to wait for).
   * Touches nothing but the mark, so it may run beside the engine's other calls. */
  mfsdp_status (*host_wait_mark)(void* ctx, void* mark);
  void (*drop_mark)(void* ctx, void* mark);
} mfsdp_kernel_ops;

/* The CPU table (cpu_table.c): the kernels below and the quantized ones of mfsdp_quant.h. */
extern const mfsdp_kernel_ops mfsdp_cpu_kernels;

mfsdp_status mfsdp_cpu_copy(void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n, double alpha);
mfsdp_status mfsdp_cpu_accumulate(void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n,
                                  double alpha);
mfsdp_status mfsdp_cpu_scale(void* x, int dtype, int64_t n, double alpha);
mfsdp_status mfsdp_cpu_fill_zero(void* x, int dtype, int64_t n);
mfsdp_status mfsdp_cpu_fill(void* x, int dtype, int64_t n, double value);
mfsdp_status mfsdp_cpu_count_nonfinite(const void* x, int dtype, int64_t n, int64_t* count);
mfsdp_status mfsdp_cpu_pack(void* dst_base, int dst_dtype, const mfsdp_pack_item* items, int32_t n_items, double alpha,
                            int accumulate);

#ifdef __cplusplus
}
#endif
#endif
