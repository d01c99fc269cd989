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
/* Kernel context for a device: launches go to torch's current stream on it. */
void* mfsdp_cuda_kernel_context(int device);

#ifdef __cplusplus
}
#endif
#endif
