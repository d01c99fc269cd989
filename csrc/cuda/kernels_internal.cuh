/* kernels_internal.cuh: what the CUDA kernel files share (the map is at the top of kernels.cu):
 * the element types and their one rounding path, the launch geometry, the kernel context and
 * the guard that makes its device current, the one dtype dispatch point, and the table's
 * entries, each defined in the file of its kernels. Not installed. No kernel launch here: the
 * emulator rewrites the launches of the .cu files (csrc/tests/emu/host_kernels.py).
 *
 * [Note: no FMA]
 * out + alpha * in must round twice, as the CPU kernels (built with -ffp-contract=off) and
 * torch do: nvcc would contract it into one fused multiply-add (one rounding), up to 1 ulp off
 * when alpha is not a power of two. The arithmetic goes through __fmul_rn/__fadd_rn, which
 * nvcc never contracts; `make cuda-check` checks the PTX has no fma. */
#ifndef MFSDP_CUDA_KERNELS_INTERNAL_CUH
#define MFSDP_CUDA_KERNELS_INTERNAL_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include <mutex>
#include <type_traits>

#include "../core/mfsdp_dtype.h"
#include "../core/mfsdp_quant.h"
#include "mfsdp_cuda.h"

/* The table's entries cross files with hidden visibility: the extension exports none of them. */
#if defined(__GNUC__)
#define KERNELS_INTERNAL __attribute__((visibility("hidden")))
#else
#define KERNELS_INTERNAL
#endif

namespace cuda_kernels {

template <int DT>
struct Elem;
template <>
struct Elem<MFSDP_F32> {
  using T = float;
  using Acc = float;
  static __device__ __forceinline__ float load(T v) { return v; }
  static __device__ __forceinline__ T store(float v) { return v; }
};
template <>
struct Elem<MFSDP_F64> {
  using T = double;
  using Acc = double;
  static __device__ __forceinline__ double load(T v) { return v; }
  static __device__ __forceinline__ T store(double v) { return v; }
};
template <>
struct Elem<MFSDP_BF16> {
  using T = uint16_t;
  using Acc = float;
  static __device__ __forceinline__ float load(T v) { return mfsdp_bf16_to_f32(v); }
  static __device__ __forceinline__ T store(float v) { return mfsdp_f32_to_bf16(v); }
};
template <>
struct Elem<MFSDP_F16> {
  using T = uint16_t;
  using Acc = float;
  static __device__ __forceinline__ float load(T v) { return mfsdp_f16_to_f32(v); }
  static __device__ __forceinline__ T store(float v) { return mfsdp_f32_to_f16(v); }
};

constexpr int kVec = 8;  // elements per thread per iteration: 16 bytes of a 2-byte type
constexpr int kThreads = 256;

/* Multiply and add rounded separately, never fused (see [Note: no FMA]). */
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <int DT, int ST>
struct Pair {
  using D = Elem<DT>;
  using S = Elem<ST>;
  using Acc = typename std::conditional<sizeof(typename D::Acc) >= sizeof(typename S::Acc), typename D::Acc,
                                        typename S::Acc>::type;
  /* out = alpha * in (copy) or out + alpha * in (accumulate), in Acc, then rounded into D. */
  static __device__ __forceinline__ typename D::T apply(typename D::T out, typename S::T in, Acc alpha, bool accumulate,
                                                       bool scaled) {
    Acc v = static_cast<Acc>(S::load(in));
    if (scaled) v = mul_rn(alpha, v);
    if (accumulate) v = add_rn(static_cast<Acc>(D::load(out)), v);
    return D::store(v);
  }
};

template <typename T>
struct alignas(16) Chunk {
  T v[kVec];
};

__host__ __device__ __forceinline__ bool aligned16(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b)) & 15) == 0;
}

/* Runs of up to this many items launch with a small table, cheaper to launch ([Note: pack table]
 * in kernels_cast.cu). */
constexpr int kSmallTable = 32;

inline mfsdp_status cuda_fail(cudaError_t e, const char* file, int line, const char* what) {
  return mfsdp_set_error(MFSDP_ERR_CUDA, file, line, what, "%s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
}

#define CUDA_CHECK(call)                                                           \
  do {                                                                             \
    cudaError_t e_ = (call);                                                       \
    if (e_ != cudaSuccess) return cuda_fail(e_, __FILE__, __LINE__, #call);        \
  } while (0)

/* One per device ordinal, made once and kept for the process; the stream is set by the glue
 * before engine calls. */
struct cuda_ctx {
  int device;
  int sms;
  cudaStream_t stream;
  unsigned long long* counter; /* count_nonfinite's result: device memory allocated with the context */
  std::mutex counter_lock;     /* one count at a time per device */
};

/* Makes the context's device current for one entry point and gives the caller's back. */
class DeviceGuard {
 public:
  explicit DeviceGuard(const cuda_ctx* c) : device_(c->device) {}
  mfsdp_status enter() {
    CUDA_CHECK(cudaGetDevice(&saved_));
    if (saved_ != device_) CUDA_CHECK(cudaSetDevice(device_));
    return MFSDP_OK;
  }
  ~DeviceGuard() {
    if (saved_ >= 0 && saved_ != device_) cudaSetDevice(saved_);
  }

 private:
  int device_;
  int saved_ = -1;
};

inline int blocks_for(const cuda_ctx* c, int64_t work) {
  int64_t want = (work + kThreads - 1) / kThreads;
  int64_t cap = static_cast<int64_t>(c->sms > 0 ? c->sms : 80) * 8;
  if (want < 1) want = 1;
  return static_cast<int>(want < cap ? want : cap);
}

/* The one dtype dispatch point: calls f.template run<DT>() for a floating dtype. */
template <typename F>
mfsdp_status dispatch_float(int dt, F&& f) {
  switch (dt) {
    case MFSDP_F32: return f.template run<MFSDP_F32>();
    case MFSDP_BF16: return f.template run<MFSDP_BF16>();
    case MFSDP_F16: return f.template run<MFSDP_F16>();
    case MFSDP_F64: return f.template run<MFSDP_F64>();
    default: break;
  }
  return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "no CUDA kernel for %s", mfsdp_dtype_name(dt));
}

/* (dst, src) pairs through it: calls f.template run<DT, ST>(). */
template <typename F, int DT>
struct WithDst {
  F& f;
  template <int ST>
  mfsdp_status run() { return f.template run<DT, ST>(); }
};
template <typename F>
struct PairOf {
  F& f;
  int st;
  template <int DT>
  mfsdp_status run() { return dispatch_float(st, WithDst<F, DT>{f}); }
};
template <typename F>
mfsdp_status dispatch_pair(int dt, int st, F&& f) {
  if (!mfsdp_dtype_is_float(dt) || !mfsdp_dtype_is_float(st))
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "no CUDA kernel for %s <- %s", mfsdp_dtype_name(dt), mfsdp_dtype_name(st));
  return dispatch_float(dt, PairOf<typename std::remove_reference<F>::type>{f, st});
}

inline mfsdp_status check(const void* a, const void* b, int64_t n) {
  if (n < 0) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "negative element count %lld", (long long)n);
  if (n > 0 && (!a || !b)) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "null device buffer for %lld elements", (long long)n);
  return MFSDP_OK;
}

/* The table's entries (mfsdp_kernel_ops), by the file that defines them. */

/* kernels_cast.cu */
KERNELS_INTERNAL mfsdp_status op_copy(void* ctx, void* dst, int dt, const void* src, int st, int64_t n, double alpha);
KERNELS_INTERNAL mfsdp_status op_accumulate(void* ctx, void* dst, int dt, const void* src, int st, int64_t n,
                                            double alpha);
KERNELS_INTERNAL mfsdp_status op_scale(void* ctx, void* x, int dt, int64_t n, double alpha);
KERNELS_INTERNAL mfsdp_status op_fill_zero(void* ctx, void* x, int dt, int64_t n);
KERNELS_INTERNAL mfsdp_status op_fill(void* ctx, void* x, int dt, int64_t n, double value);
KERNELS_INTERNAL mfsdp_status op_count_nonfinite(void* ctx, const void* x, int dt, int64_t n, int64_t* count);
KERNELS_INTERNAL mfsdp_status op_to_host(void* ctx, void* host_dst, const void* src, int64_t bytes);
KERNELS_INTERNAL mfsdp_status op_host_wait(void* ctx);
KERNELS_INTERNAL mfsdp_status op_host_mark(void* ctx, void** mark);
KERNELS_INTERNAL mfsdp_status op_host_wait_mark(void* ctx, void* mark);
KERNELS_INTERNAL void op_drop_mark(void* ctx, void* mark);
KERNELS_INTERNAL mfsdp_status op_pack(void* ctx, void* dst, int dt, const mfsdp_pack_item* items, int32_t n,
                                      double alpha, int accumulate);

/* kernels_quant.cu */
KERNELS_INTERNAL mfsdp_status op_quantize(void* ctx, void* wire, int mode, int64_t block, const void* src, int st,
                                          int64_t n, int32_t pieces);
KERNELS_INTERNAL mfsdp_status op_dequantize_pack(void* ctx, void* dst, int dt, const mfsdp_quant_item* items,
                                                 int32_t n_items, int mode, int64_t block, int64_t piece_n,
                                                 double alpha, int accumulate);
KERNELS_INTERNAL mfsdp_status op_dequantize(void* ctx, void* dst, int dt, const void* wire, int mode, int64_t block,
                                            int64_t n, double alpha, int accumulate);

}  // namespace cuda_kernels

#endif
