/* cuda_absent.c: the CUDA entry points of a CPU-only build (see mfsdp_cuda.h): no kernel
 * table, so the engine refuses CUDA devices with a clear message. */
#include "mfsdp_cuda.h"

const mfsdp_kernel_ops* const mfsdp_cuda_kernels = NULL;

void* mfsdp_cuda_kernel_context(int device) {
  (void)device;
  return NULL;
}
