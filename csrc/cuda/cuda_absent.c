/* cuda_absent.c: the CUDA entry points of a CPU-only build (see mfsdp_cuda.h): no kernel
 * table, so the engine refuses CUDA devices with a clear message. */
#include "mfsdp_cuda.h"

const mfsdp_kernel_ops* const mfsdp_cuda_kernels = NULL;

mfsdp_status mfsdp_cuda_kernel_context(int device, void** ctx) {
  *ctx = NULL;
  return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "CUDA device %d: megatron_fsdp_c was built without CUDA", device);
}
