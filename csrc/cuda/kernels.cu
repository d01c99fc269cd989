/* kernels.cu: the engine's element-wise kernels over device memory (see mfsdp_kernels.h).
 *
 * Same arithmetic as kernels_cpu.c: loads widen to float (double when either side is double),
 * one rounding on store, through the shared conversions of mfsdp_dtype.h, so CPU and GPU round
 * identically. One dispatch point (dispatch_pair below) instantiates a kernel per (dst, src)
 * dtype pair. Kernels read and write 16 bytes per access where both pointers allow it (bucket
 * shards are 16-byte aligned by the layout), with a scalar path for the rest, over a grid-stride
 * loop sized to the device. Launches go to the stream in the kernel context (torch's current
 * stream, set by the glue), with the context's device made current for the call (and the
 * caller's given back): a rank's current device need not be its tensors' device.
 *
 * [Note: pack table]
 * A bucket's many parameters are packed by one launch per run of items of one source dtype
 * (more launches past the capacity of one table). The item table (sources, offsets, sizes: 24
 * bytes an item) travels as a kernel parameter (__grid_constant__: read in place, never
 * copied per thread), up to 1280 items in 30 KB (CUDA >= 12.1 takes 32 KB of parameters on
 * sm_70+); runs of up to 32 items use a 768-byte table, cheaper to launch. Nothing is
 * allocated or uploaded per launch: no memory outside torch's caching allocator that could
 * run out while torch holds the GPU, no pageable copy that stalls the host, and a launch a
 * CUDA graph can capture.
 *
 * [Note: no FMA]
 * out + alpha * in must round twice, as the CPU kernels (built with -ffp-contract=off) and
 * torch do: nvcc would contract it into one fused multiply-add (one rounding), up to 1 ulp off
 * when alpha is not a power of two. The arithmetic goes through __fmul_rn/__fadd_rn, which
 * nvcc never contracts; `make cuda-check` checks the PTX has no fma.
 *
 * Quantized pieces ([Note: quantized wire format] in core/mfsdp_quant.h) use the codecs of
 * mfsdp_quant.h, shared with the CPU kernels, whose device arithmetic is __fdiv_rn / __fmul_rn /
 * __fadd_rn for the same reason. quantize_kernel gives each block of the format to one thread
 * (absmax, scale, codes; the thread of a piece's last block writes its padding): blocks are
 * independent and int4 blocks never share a byte, so no thread waits for another, and all the
 * pieces of a call are one launch. The dequantize is the pack path: one launch per table of
 * items (QuantTable, the same __grid_constant__ scheme as [Note: pack table], 32 bytes an
 * item), each thread decoding groups of kVec elements into one 16-byte store where the
 * destination allows, then Pair<DT, float32>: a dequantized value is exactly a float32 source. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include <mutex>
#include <type_traits>

#include "../core/mfsdp_dtype.h"
#include "../core/mfsdp_quant.h"
#include "mfsdp_cuda.h"

namespace {

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

/* d[i] = op(d[i], s[i]) over n elements, this block's share of a grid of `blocks` blocks
 * (block `block`): 16-byte chunks where both pointers allow, then a scalar tail. The body of
 * every element-wise kernel. */
template <int DT, int ST>
__device__ __forceinline__ void binary_span(typename Pair<DT, ST>::D::T* __restrict__ d,
                                            const typename Pair<DT, ST>::S::T* __restrict__ s, int64_t n,
                                            double alpha, bool accumulate, int64_t block, int64_t blocks) {
  using P = Pair<DT, ST>;
  using DTy = typename P::D::T;
  using STy = typename P::S::T;
  const typename P::Acc a = static_cast<typename P::Acc>(alpha);
  const bool scaled = alpha != 1.0;
  const int64_t stride = blocks * blockDim.x;
  const int64_t first = block * blockDim.x + threadIdx.x;
  const int64_t body = aligned16(d, s) ? n / kVec : 0;
  for (int64_t c = first; c < body; c += stride) {
    Chunk<STy> in = reinterpret_cast<const Chunk<STy>*>(s)[c];
    Chunk<DTy> out;
    if (accumulate) out = reinterpret_cast<const Chunk<DTy>*>(d)[c];
#pragma unroll
    for (int k = 0; k < kVec; ++k) out.v[k] = P::apply(out.v[k], in.v[k], a, accumulate, scaled);
    reinterpret_cast<Chunk<DTy>*>(d)[c] = out;
  }
  for (int64_t i = body * kVec + first; i < n; i += stride) d[i] = P::apply(accumulate ? d[i] : DTy(), s[i], a, accumulate, scaled);
}

template <int DT, int ST>
__global__ void __launch_bounds__(kThreads) binary_kernel(void* __restrict__ dst, const void* __restrict__ src,
                                                          int64_t n, double alpha, bool accumulate) {
  binary_span<DT, ST>(static_cast<typename Pair<DT, ST>::D::T*>(dst), static_cast<const typename Pair<DT, ST>::S::T*>(src),
                      n, alpha, accumulate, blockIdx.x, gridDim.x);
}

/* x[i] = value as the copy kernel stores a float64 source (Pair<DT, F64>: one rounding path, the
 * CPU's); grid-stride, scalar: it fills a few flags ([Note: flag tail] in core/mfsdp_layout.h). */
template <int DT>
__global__ void __launch_bounds__(kThreads) fill_kernel(void* __restrict__ x, int64_t n, double value) {
  using P = Pair<DT, MFSDP_F64>;
  const typename P::D::T v = P::apply(typename P::D::T(), value, 1.0, false, false);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    static_cast<typename P::D::T*>(x)[i] = v;
}

/* A launch's share of a pack: item i's numels[i] elements of srcs[i] go to dst + offsets[i]
 * (see [Note: pack table]). */
template <int N>
struct PackTable {
  const void* srcs[N];
  int64_t offsets[N];
  int64_t numels[N];
};
constexpr int kSmallTable = 32;
constexpr int kLargeTable = 1280;
static_assert(sizeof(PackTable<kLargeTable>) + 64 <= 32764, "a pack table must fit in the kernel parameters");

/* One launch over a table of items: blockIdx.y is the item, x strides over its elements, each
 * item vectorised on its own (whether it is depends on its own addresses). */
template <int DT, int ST, int N>
__global__ void __launch_bounds__(kThreads) pack_kernel(void* __restrict__ dst_base,
                                                        const __grid_constant__ PackTable<N> table, double alpha,
                                                        bool accumulate) {
  using P = Pair<DT, ST>;
  const int item = blockIdx.y;
  binary_span<DT, ST>(static_cast<typename P::D::T*>(dst_base) + table.offsets[item],
                      static_cast<const typename P::S::T*>(table.srcs[item]), table.numels[item], alpha, accumulate,
                      blockIdx.x, gridDim.x);
}

template <int DT>
__global__ void count_nonfinite_kernel(const void* __restrict__ x, int64_t n, unsigned long long* count) {
  using E = Elem<DT>;
  const typename E::T* v = static_cast<const typename E::T*>(x);
  unsigned long long local = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    double f = static_cast<double>(E::load(v[i]));
    local += !(f - f == 0.0);  // NaN and Inf fail this
  }
  if (local) atomicAdd(count, local);
}

/* ---- quantized pieces ([Note: quantized wire format] in core/mfsdp_quant.h) ---- */

/* Element i of a source as float32: a float64 rounds to nearest even, as the cast kernels do. */
template <int ST>
__device__ __forceinline__ float load_f32(const typename Elem<ST>::T* s, int64_t i) {
  return static_cast<float>(Elem<ST>::load(s[i]));
}

/* Block g of the launch (piece g / blocks_per_piece) per thread: its absmax, its scale, its
 * codes; the thread of a piece's last block also zeroes the piece's padding. */
template <int ST, int MODE>
__global__ void __launch_bounds__(kThreads) quantize_kernel(uint8_t* __restrict__ wire, const void* __restrict__ src,
                                                            int64_t n, int64_t block, int64_t blocks_per_piece,
                                                            int64_t total_blocks, int64_t piece_bytes,
                                                            int64_t payload_bytes, int64_t scales_at) {
  using S = Elem<ST>;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < total_blocks;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = g / blocks_per_piece, j = g - p * blocks_per_piece;
    const int64_t first = j * block, len = n - first < block ? n - first : block;
    const typename S::T* x = static_cast<const typename S::T*>(src) + p * n + first;
    uint8_t* piece = wire + p * piece_bytes;
    uint32_t amax = 0;
    for (int64_t k = 0; k < len; ++k) {
      uint32_t b = mfsdp_quant_abs_bits(load_f32<ST>(x, k));
      amax = b > amax ? b : amax;
    }
    const float s = mfsdp_quant_scale(MODE, amax);
    reinterpret_cast<float*>(piece + scales_at)[j] = s;
    const bool coded = s > 0.0f; /* zero (s = 0) and non-finite (NaN) blocks: codes 0 */
    if (MODE == MFSDP_QUANT_INT4) {
      for (int64_t k = 0; k < len; k += 2) {
        uint32_t lo = coded ? mfsdp_quant_encode(MODE, load_f32<ST>(x, k), s) : 0u;
        uint32_t hi = coded && k + 1 < len ? mfsdp_quant_encode(MODE, load_f32<ST>(x, k + 1), s) : 0u;
        piece[(first + k) / 2] = static_cast<uint8_t>(lo | hi << 4);
      }
    } else {
      for (int64_t k = 0; k < len; ++k)
        piece[first + k] = coded ? static_cast<uint8_t>(mfsdp_quant_encode(MODE, load_f32<ST>(x, k), s)) : 0;
    }
    if (j == blocks_per_piece - 1) {
      for (int64_t b = payload_bytes; b < scales_at; ++b) piece[b] = 0;
      for (int64_t b = scales_at + 4 * blocks_per_piece; b < piece_bytes; ++b) piece[b] = 0;
    }
  }
}

/* A launch's share of a dequantize-with-copy-out: item i's numels[i] elements, from element
 * src_offsets[i] of the piece at wires[i], go to dst + dst_offsets[i]. */
template <int N>
struct QuantTable {
  const uint8_t* wires[N];
  int64_t src_offsets[N];
  int64_t dst_offsets[N];
  int64_t numels[N];
};
constexpr int kLargeQuantTable = 960;
static_assert(sizeof(QuantTable<kLargeQuantTable>) + 64 <= 32764, "a quant table must fit in the kernel parameters");

/* d[i] = op(d[i], value of element first + i) over n elements of one piece, this block's
 * share of a grid of `blocks`: groups of kVec elements per thread (one scale lookup per group,
 * one 16-byte load / store where d allows), then a scalar tail. */
template <int DT, int MODE>
__device__ __forceinline__ void dequant_span(typename Elem<DT>::T* __restrict__ d, const uint8_t* __restrict__ piece,
                                             const float* __restrict__ scales, int64_t first, int64_t n,
                                             int64_t block, double alpha, bool accumulate, int64_t blk,
                                             int64_t blocks) {
  using P = Pair<DT, MFSDP_F32>;
  using DTy = typename P::D::T;
  const typename P::Acc a = static_cast<typename P::Acc>(alpha);
  const bool scaled = alpha != 1.0;
  const int64_t stride = blocks * blockDim.x, me = blk * blockDim.x + threadIdx.x;
  const int64_t groups = n / kVec;
  const bool vec = (reinterpret_cast<uintptr_t>(d) & 15) == 0;
  for (int64_t c = me; c < groups; c += stride) {
    const int64_t e = first + c * kVec;
    int64_t j = e / block, r = e - j * block;
    float s = scales[j];
    Chunk<DTy> out = {};
    if (accumulate) {
      if (vec) out = reinterpret_cast<const Chunk<DTy>*>(d)[c];
      else
        for (int k = 0; k < kVec; ++k) out.v[k] = d[c * kVec + k];
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (r == block) { /* the group crosses into the next block */
        s = scales[++j];
        r = 0;
      }
      out.v[k] = P::apply(out.v[k], mfsdp_quant_decode(MODE, piece, e + k, s), a, accumulate, scaled);
      ++r;
    }
    if (vec) reinterpret_cast<Chunk<DTy>*>(d)[c] = out;
    else
      for (int k = 0; k < kVec; ++k) d[c * kVec + k] = out.v[k];
  }
  for (int64_t i = groups * kVec + me; i < n; i += stride) {
    const float s = scales[(first + i) / block];
    d[i] = P::apply(accumulate ? d[i] : DTy(), mfsdp_quant_decode(MODE, piece, first + i, s), a, accumulate, scaled);
  }
}

/* One launch over a table of items: blockIdx.y is the item (as pack_kernel). */
template <int DT, int MODE, int N>
__global__ void __launch_bounds__(kThreads) dequant_pack_kernel(void* __restrict__ dst_base,
                                                                const __grid_constant__ QuantTable<N> table,
                                                                int64_t block, int64_t scales_at, double alpha,
                                                                bool accumulate) {
  const int item = blockIdx.y;
  const uint8_t* piece = table.wires[item];
  dequant_span<DT, MODE>(static_cast<typename Elem<DT>::T*>(dst_base) + table.dst_offsets[item], piece,
                         reinterpret_cast<const float*>(piece + scales_at), table.src_offsets[item],
                         table.numels[item], block, alpha, accumulate, blockIdx.x, gridDim.x);
}

mfsdp_status cuda_fail(cudaError_t e, const char* file, int line, const char* what) {
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

constexpr int kMaxDevices = 64;
cuda_ctx g_ctx[kMaxDevices];
std::mutex g_ctx_lock;

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

int blocks_for(const cuda_ctx* c, int64_t work) {
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

struct BinaryLaunch {
  cuda_ctx* c;
  void* dst;
  const void* src;
  int64_t n;
  double alpha;
  bool accumulate;
  template <int D, int S>
  mfsdp_status run() {
    bool vec = aligned16(dst, src);
    int blocks = blocks_for(c, vec ? (n + kVec - 1) / kVec : n);
    binary_kernel<D, S><<<blocks, kThreads, 0, c->stream>>>(dst, src, n, alpha, accumulate);
    CUDA_CHECK(cudaGetLastError());
    return MFSDP_OK;
  }
};

struct FillLaunch {
  cuda_ctx* c;
  void* x;
  int64_t n;
  double value;
  template <int D>
  mfsdp_status run() {
    fill_kernel<D><<<blocks_for(c, n), kThreads, 0, c->stream>>>(x, n, value);
    CUDA_CHECK(cudaGetLastError());
    return MFSDP_OK;
  }
};

/* Launches items [0, n) of a run of one source dtype, a table's worth at a time. */
struct PackLaunch {
  cuda_ctx* c;
  void* dst;
  const mfsdp_pack_item* items;
  int32_t n;
  double alpha;
  bool accumulate;
  template <int N, int D, int S>
  mfsdp_status launch(const mfsdp_pack_item* part, int32_t m) {
    PackTable<N> table;
    int64_t max_numel = 0;
    for (int32_t i = 0; i < m; ++i) {
      table.srcs[i] = part[i].src;
      table.offsets[i] = part[i].dst_offset;
      table.numels[i] = part[i].n;
      if (part[i].n > max_numel) max_numel = part[i].n;
    }
    if (max_numel == 0) return MFSDP_OK;
    dim3 grid(blocks_for(c, (max_numel + kVec - 1) / kVec), m);
    pack_kernel<D, S, N><<<grid, kThreads, 0, c->stream>>>(dst, table, alpha, accumulate);
    CUDA_CHECK(cudaGetLastError());
    return MFSDP_OK;
  }
  template <int D, int S>
  mfsdp_status run() {
    for (int32_t first = 0; first < n; first += kLargeTable) {
      int32_t m = n - first < kLargeTable ? n - first : kLargeTable;
      mfsdp_status st = m <= kSmallTable ? launch<kSmallTable, D, S>(items + first, m)
                                         : launch<kLargeTable, D, S>(items + first, m);
      if (st != MFSDP_OK) return st;
    }
    return MFSDP_OK;
  }
};

/* All pieces of a quantize, one launch (a thread per block of the format). */
struct QuantizeLaunch {
  cuda_ctx* c;
  uint8_t* wire;
  const void* src;
  int mode;
  int64_t block, n;
  int32_t pieces;
  template <int S, int MODE>
  mfsdp_status go() {
    int64_t per = mfsdp_quant_blocks(n, block), total = per * pieces;
    quantize_kernel<S, MODE><<<blocks_for(c, total), kThreads, 0, c->stream>>>(
        wire, src, n, block, per, total, mfsdp_quant_wire_bytes(MODE, n, block), mfsdp_quant_payload_bytes(MODE, n),
        mfsdp_quant_scales_offset(MODE, n));
    CUDA_CHECK(cudaGetLastError());
    return MFSDP_OK;
  }
  template <int S>
  mfsdp_status run() {
    switch (mode) {
      case MFSDP_QUANT_INT8: return go<S, MFSDP_QUANT_INT8>();
      case MFSDP_QUANT_FP8_E4M3: return go<S, MFSDP_QUANT_FP8_E4M3>();
      default: return go<S, MFSDP_QUANT_INT4>();
    }
  }
};

/* Items [0, n) of a dequantize-with-copy-out, a table's worth at a time. */
struct DequantPackLaunch {
  cuda_ctx* c;
  void* dst;
  const mfsdp_quant_item* items;
  int32_t n;
  int mode;
  int64_t block, piece_n;
  double alpha;
  bool accumulate;
  template <int N, int D, int MODE>
  mfsdp_status launch(const mfsdp_quant_item* part, int32_t m) {
    QuantTable<N> table;
    int64_t max_numel = 0;
    for (int32_t i = 0; i < m; ++i) {
      table.wires[i] = static_cast<const uint8_t*>(part[i].wire);
      table.src_offsets[i] = part[i].src_offset;
      table.dst_offsets[i] = part[i].dst_offset;
      table.numels[i] = part[i].n;
      if (part[i].n > max_numel) max_numel = part[i].n;
    }
    if (max_numel == 0) return MFSDP_OK;
    dim3 grid(blocks_for(c, (max_numel + kVec - 1) / kVec), m);
    dequant_pack_kernel<D, MODE, N><<<grid, kThreads, 0, c->stream>>>(dst, table, block,
                                                                      mfsdp_quant_scales_offset(MODE, piece_n), alpha,
                                                                      accumulate);
    CUDA_CHECK(cudaGetLastError());
    return MFSDP_OK;
  }
  template <int D, int MODE>
  mfsdp_status tables() {
    for (int32_t first = 0; first < n; first += kLargeQuantTable) {
      int32_t m = n - first < kLargeQuantTable ? n - first : kLargeQuantTable;
      mfsdp_status st = m <= kSmallTable ? launch<kSmallTable, D, MODE>(items + first, m)
                                         : launch<kLargeQuantTable, D, MODE>(items + first, m);
      if (st != MFSDP_OK) return st;
    }
    return MFSDP_OK;
  }
  template <int D>
  mfsdp_status run() {
    switch (mode) {
      case MFSDP_QUANT_INT8: return tables<D, MFSDP_QUANT_INT8>();
      case MFSDP_QUANT_FP8_E4M3: return tables<D, MFSDP_QUANT_FP8_E4M3>();
      default: return tables<D, MFSDP_QUANT_INT4>();
    }
  }
};

mfsdp_status check(const void* a, const void* b, int64_t n) {
  if (n < 0) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "negative element count %lld", (long long)n);
  if (n > 0 && (!a || !b)) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "null device buffer for %lld elements", (long long)n);
  return MFSDP_OK;
}

mfsdp_status op_copy(void* ctx, void* dst, int dt, const void* src, int st, int64_t n, double alpha) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  MFSDP_CHECK(check(dst, src, n));
  if (n == 0) return MFSDP_OK;
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  if (dt == st && alpha == 1.0 && mfsdp_dtype_valid(dt)) {
    if (dst != src) CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)(n * mfsdp_dtype_size(dt)), cudaMemcpyDeviceToDevice, c->stream));
    return MFSDP_OK;
  }
  return dispatch_pair(dt, st, BinaryLaunch{c, dst, src, n, alpha, false});
}

mfsdp_status op_accumulate(void* ctx, void* dst, int dt, const void* src, int st, int64_t n, double alpha) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  MFSDP_CHECK(check(dst, src, n));
  if (n == 0) return MFSDP_OK;
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  return dispatch_pair(dt, st, BinaryLaunch{c, dst, src, n, alpha, true});
}

mfsdp_status op_scale(void* ctx, void* x, int dt, int64_t n, double alpha) {
  if (alpha == 1.0 || n == 0) return MFSDP_OK;
  return op_copy(ctx, x, dt, x, dt, n, alpha);
}

mfsdp_status op_fill_zero(void* ctx, void* x, int dt, int64_t n) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  MFSDP_CHECK(check(x, x, n));
  if (n == 0) return MFSDP_OK;
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  CUDA_CHECK(cudaMemsetAsync(x, 0, (size_t)(n * mfsdp_dtype_size(dt)), c->stream));
  return MFSDP_OK;
}

mfsdp_status op_fill(void* ctx, void* x, int dt, int64_t n, double value) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  MFSDP_CHECK(check(x, x, n));
  if (n == 0) return MFSDP_OK;
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  return dispatch_float(dt, FillLaunch{c, x, n, value});
}

mfsdp_status op_count_nonfinite(void* ctx, const void* x, int dt, int64_t n, int64_t* count) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  MFSDP_CHECK(check(x, count, n));
  *count = 0;
  if (n == 0 || !mfsdp_dtype_is_float(dt)) return MFSDP_OK;
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  std::lock_guard<std::mutex> one_at_a_time(c->counter_lock);
  unsigned long long* dev = c->counter;
  unsigned long long host = 0;
  CUDA_CHECK(cudaMemsetAsync(dev, 0, sizeof *dev, c->stream));
  int blocks = blocks_for(c, n);
  switch (dt) {
    case MFSDP_F32: count_nonfinite_kernel<MFSDP_F32><<<blocks, kThreads, 0, c->stream>>>(x, n, dev); break;
    case MFSDP_BF16: count_nonfinite_kernel<MFSDP_BF16><<<blocks, kThreads, 0, c->stream>>>(x, n, dev); break;
    case MFSDP_F16: count_nonfinite_kernel<MFSDP_F16><<<blocks, kThreads, 0, c->stream>>>(x, n, dev); break;
    default: count_nonfinite_kernel<MFSDP_F64><<<blocks, kThreads, 0, c->stream>>>(x, n, dev); break;
  }
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpyAsync(&host, dev, sizeof host, cudaMemcpyDeviceToHost, c->stream));
  CUDA_CHECK(cudaStreamSynchronize(c->stream));
  *count = (int64_t)host;
  return MFSDP_OK;
}

/* A bucket's gradients: one launch per run of one source dtype (see [Note: pack table]). */
mfsdp_status op_pack(void* ctx, void* dst, int dt, const mfsdp_pack_item* items, int32_t n, double alpha,
                     int accumulate) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  if (n < 0 || (n > 0 && (dst == nullptr || items == nullptr)))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "pack of %d items into %p", n, dst);
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(check(dst, items[i].src, items[i].n));
  if (n == 0) return MFSDP_OK;
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  for (int32_t first = 0; first < n;) {
    int32_t last = first;
    while (last < n && items[last].src_dtype == items[first].src_dtype) ++last;
    MFSDP_CHECK(dispatch_pair(dt, items[first].src_dtype,
                              PackLaunch{c, dst, items + first, last - first, alpha, accumulate != 0}));
    first = last;
  }
  return MFSDP_OK;
}

/* The same argument checks as the CPU kernels (mfsdp_quant.h), so a call is refused alike on
 * every device. */
mfsdp_status op_quantize(void* ctx, void* wire, int mode, int64_t block, const void* src, int st, int64_t n,
                         int32_t pieces) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  MFSDP_CHECK(mfsdp_quant_check_quantize(wire, mode, block, src, st, n, pieces));
  if (n == 0 || pieces == 0) return MFSDP_OK;
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  return dispatch_float(st, QuantizeLaunch{c, static_cast<uint8_t*>(wire), src, mode, block, n, pieces});
}

/* A gather's copy-out: one launch per table of items (see [Note: pack table]). */
mfsdp_status op_dequantize_pack(void* ctx, void* dst, int dt, const mfsdp_quant_item* items, int32_t n_items, int mode,
                                int64_t block, int64_t piece_n, double alpha, int accumulate) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  MFSDP_CHECK(mfsdp_quant_check_pack(dst, dt, items, n_items, mode, block, piece_n));
  if (n_items == 0) return MFSDP_OK;
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  return dispatch_float(dt, DequantPackLaunch{c, dst, items, n_items, mode, block, piece_n, alpha, accumulate != 0});
}

mfsdp_status op_dequantize(void* ctx, void* dst, int dt, const void* wire, int mode, int64_t block, int64_t n,
                           double alpha, int accumulate) {
  mfsdp_quant_item whole = {wire, 0, 0, n};
  return op_dequantize_pack(ctx, dst, dt, &whole, 1, mode, block, n, alpha, accumulate);
}

const mfsdp_kernel_ops cuda_ops = {op_copy, op_accumulate, op_scale,      op_fill_zero,      op_count_nonfinite,
                                   op_pack, op_quantize,   op_dequantize, op_dequantize_pack, op_fill};

}  // namespace

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
