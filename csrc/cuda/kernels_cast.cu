/* kernels_cast.cu: the element-wise kernels of the table (see kernels.cu for the map): copy (a
 * cast, with a scale), accumulate, scale, fill, count_nonfinite, and the one-launch bucket pack.
 * They read and write 16 bytes per access where both pointers allow it (bucket shards are
 * 16-byte aligned by the layout), with a scalar path for the rest, over a grid-stride loop sized
 * to the device.
 *
 * [Note: pack table]
 * A bucket's many parameters are packed by one launch per run of items of one source dtype
 * (more launches past the capacity of one table). The item table (sources, offsets, sizes: 24
 * bytes an item) travels as a kernel parameter (__grid_constant__: read in place, never
 * copied per thread), up to 1280 items in 30 KB (CUDA >= 12.1 takes 32 KB of parameters on
 * sm_70+); runs of up to 32 items use a 768-byte table, cheaper to launch. Nothing is
 * allocated or uploaded per launch: no memory outside torch's caching allocator that could
 * run out while torch holds the GPU, no pageable copy that stalls the host, and a launch a
 * CUDA graph can capture. */
#include "kernels_internal.cuh"

namespace cuda_kernels {
namespace {

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

}  // namespace

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

/* A small synchronous read, in stream order (mfsdp_kernel_ops.to_host): the used-parameter flags. */
mfsdp_status op_to_host(void* ctx, void* host_dst, const void* src, int64_t bytes) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  MFSDP_CHECK(check(host_dst, src, bytes));
  if (bytes == 0) return MFSDP_OK;
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  CUDA_CHECK(cudaMemcpyAsync(host_dst, src, (size_t)bytes, cudaMemcpyDeviceToHost, c->stream));
  CUDA_CHECK(cudaStreamSynchronize(c->stream));
  return MFSDP_OK;
}

/* The host waits for the stream (mfsdp_kernel_ops.host_wait): offloaded buckets' host memory,
 * which kernels queued on it read and write in place, is the host's again. */
mfsdp_status op_host_wait(void* ctx) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  CUDA_CHECK(cudaStreamSynchronize(c->stream));
  return MFSDP_OK;
}

/* A mark on the stream (mfsdp_kernel_ops.host_mark): an event of the context's device, made at
 * the first mark and recorded again by each later one; the host waits for it with
 * op_host_wait_mark, from any thread, while the stream runs on. */
mfsdp_status op_host_mark(void* ctx, void** mark) {
  cuda_ctx* c = static_cast<cuda_ctx*>(ctx);
  if (mark == nullptr) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "host_mark without a place for the mark");
  DeviceGuard guard(c);
  MFSDP_CHECK(guard.enter());
  if (*mark == nullptr) {
    cudaEvent_t e;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    *mark = e;
  }
  CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(*mark), c->stream));
  return MFSDP_OK;
}

/* The host waits for a mark's latest record: a wait on one event, which needs no current device
 * and leaves the stream free for the work queued behind it. */
mfsdp_status op_host_wait_mark(void* ctx, void* mark) {
  (void)ctx;
  if (mark != nullptr) CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(mark)));
  return MFSDP_OK;
}

void op_drop_mark(void* ctx, void* mark) {
  (void)ctx;
  if (mark != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(mark));
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

}  // namespace cuda_kernels
