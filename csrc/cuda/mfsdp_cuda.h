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

/* NULL when built without CUDA. */
extern const mfsdp_kernel_ops* const mfsdp_cuda_kernels;
/* Kernel context for a device (NULL without CUDA). */
void* mfsdp_cuda_kernel_context(int device);

#ifdef MFSDP_WITH_CUDA
/* Launches of a context go to this stream: torch's current stream, set by the glue per call. */
void mfsdp_cuda_set_stream(void* ctx, void* stream);
void* mfsdp_cuda_get_stream(void* ctx);
/* One launch packing (or accumulating) many tensors into a bucket: item i's numels[i]
 * elements of srcs[i] go to dst_base + offsets[i]. All three tables live in device memory. */
mfsdp_status mfsdp_cuda_pack(void* ctx, void* dst_base, int dst_dtype, const void* const* srcs_device,
                             const int64_t* offsets_device, const int64_t* numels_device, int32_t n_items,
                             int64_t max_numel, int src_dtype, double alpha, int accumulate);
mfsdp_status mfsdp_cuda_copy(void* ctx, void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n,
                             double alpha);
mfsdp_status mfsdp_cuda_accumulate(void* ctx, void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n,
                                   double alpha);
#endif

#ifdef __cplusplus
}
#endif
#endif
