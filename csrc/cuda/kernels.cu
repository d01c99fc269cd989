/* kernels.cu: the CUDA kernel table (mfsdp_cuda_kernels, see mfsdp_cuda.h), the kernel context
 * of each device, and the C entry points, apart from the kernels they list. The files, from the
 * floor up:
 *   kernels_internal.cuh  what they share: element types, one rounding path ([Note: no FMA]),
 *                         launch geometry, the kernel context, the dtype dispatch
 *   kernels_cast.cu       copy / accumulate / scale / fill, count_nonfinite, the one-launch
 *                         bucket pack ([Note: pack table])
 *   kernels_quant.cu      quantize, dequantize(-pack) of the quantized wire format
 *   kernels.cu            the table, the contexts, the C entry points
 *
 * Same arithmetic as kernels_cpu.c: loads widen to float (double when either side is double),
 * one rounding on store, through the shared conversions of mfsdp_dtype.h, so CPU and GPU round
 * identically. One dispatch point (dispatch_pair, kernels_internal.cuh) instantiates a kernel per
 * (dst, src) dtype pair. Launches go to the stream in the kernel context (torch's current
 * stream, set by the glue), with the context's device made current for the call (and the
 * caller's given back): a rank's current device need not be its tensors' device. */
#include "kernels_internal.cuh"

namespace cuda_kernels {
namespace {

constexpr int kMaxDevices = 64;
cuda_ctx g_ctx[kMaxDevices];
std::mutex g_ctx_lock;

const mfsdp_kernel_ops cuda_ops = {op_copy, op_accumulate, op_scale,      op_fill_zero,      op_count_nonfinite,
                                   op_pack, op_quantize,   op_dequantize, op_dequantize_pack, op_fill,
                                   op_to_host, op_host_wait, op_host_mark, op_host_wait_mark, op_drop_mark};

}  // namespace
}  // namespace cuda_kernels

using namespace cuda_kernels;

extern "C" {

const mfsdp_kernel_ops* const mfsdp_cuda_kernels = &cuda_ops;

mfsdp_status mfsdp_cuda_kernel_context(int device, void** out) {
  *out = nullptr;
  if (device < 0 || device >= kMaxDevices)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "CUDA device %d (this build handles 0..%d)", device, kMaxDevices - 1);
  std::lock_guard<std::mutex> g(g_ctx_lock);
  cuda_ctx* c = &g_ctx[device];
  if (c->counter == nullptr) { /* first use of this device */
    c->device = device;
    DeviceGuard guard(c);
    MFSDP_CHECK(guard.enter());
    if (cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      c->sms = 80;
    }
    CUDA_CHECK(cudaMalloc(&c->counter, sizeof *c->counter));
  }
  *out = c;
  return MFSDP_OK;
}

void mfsdp_cuda_set_stream(void* ctx, void* stream) {
  if (ctx) static_cast<cuda_ctx*>(ctx)->stream = static_cast<cudaStream_t>(stream);
}

void* mfsdp_cuda_get_stream(void* ctx) { return ctx ? static_cast<cuda_ctx*>(ctx)->stream : nullptr; }

mfsdp_status mfsdp_cuda_copy(void* ctx, void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n, double alpha) {
  return op_copy(ctx, dst, dst_dtype, src, src_dtype, n, alpha);
}

mfsdp_status mfsdp_cuda_accumulate(void* ctx, void* dst, int dst_dtype, const void* src, int src_dtype, int64_t n,
                                   double alpha) {
  return op_accumulate(ctx, dst, dst_dtype, src, src_dtype, n, alpha);
}

}  // extern "C"
