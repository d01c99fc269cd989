/* mfsdp_cuda.h: the CUDA half of the engine, as seen from C.
 *
 * Builds with CUDA (MFSDP_WITH_CUDA) provide the kernel table of csrc/cuda/kernels.cu and the
 * NCCL transport; CPU-only builds link cuda_absent.c, where the table is NULL and the engine
 * refuses CUDA devices with a clear message. */
#ifndef MFSDP_CUDA_H
#define MFSDP_CUDA_H

#include "../core/mfsdp_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* NULL when built without CUDA. Its quantized entries (quantize, dequantize, dequantize_pack)
 * write and read the format of [Note: quantized wire format] (core/mfsdp_quant.h) bit for bit
 * as the CPU table does. */
extern const mfsdp_kernel_ops* const mfsdp_cuda_kernels;
/* The kernel context of a device, made on first use (it holds a few bytes of device memory for
 * count_nonfinite) and kept for the process. MFSDP_ERR_UNSUPPORTED without CUDA. */
mfsdp_status mfsdp_cuda_kernel_context(int device, void** ctx);

#ifdef MFSDP_WITH_CUDA
/* Launches of a context go to this stream: torch's current stream, set by the glue per call.
 * Every entry point makes the context's device current for the call and restores the caller's. */
void mfsdp_cuda_set_stream(void* ctx, void* stream);
void* mfsdp_cuda_get_stream(void* ctx);
mfsdp_status mfsdp_cuda_copy(void* ctx, void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n,
                             double alpha);
mfsdp_status mfsdp_cuda_accumulate(void* ctx, void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n,
                                   double alpha);
#endif

#ifdef __cplusplus
}
#endif
#endif
