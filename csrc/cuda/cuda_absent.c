/* cuda_absent.c: the CUDA entry points of a CPU-only build (see mfsdp_cuda.h). */
#include "mfsdp_cuda.h"

#include "../python/glue.h"

const mfsdp_kernel_ops* const mfsdp_cuda_kernels = NULL;

void* mfsdp_cuda_kernel_context(int device) {
  (void)device;
  return NULL;
}

int mfsdp_register_nccl(PyObject* module, module_state* st) {
  (void)module;
  st->nccl_transport_type = NULL;
  return 0;
}
