/* kernels_quant.cu: the quantized entries of the table (see kernels.cu for the map): quantize,
 * dequantize and dequantize_pack.
 *
 * Quantized pieces ([Note: quantized wire format] in core/mfsdp_quant.h) use the codecs of
 * mfsdp_quant.h, shared with the CPU kernels, whose device arithmetic is __fdiv_rn / __fmul_rn /
 * __fadd_rn for the reason of [Note: no FMA] (kernels_internal.cuh). quantize_kernel gives each
 * block of the format to one thread (absmax, scale, codes; the thread of a piece's last block
 * writes its padding): blocks are independent and int4 blocks never share a byte, so no thread
 * waits for another, and all the pieces of a call are one launch. The dequantize is the pack
 * path: one launch per table of items (QuantTable, the same __grid_constant__ scheme as [Note:
 * pack table] in kernels_cast.cu, 32 bytes an item), each thread decoding groups of kVec
 * elements into one 16-byte store where the destination allows, then Pair<DT, float32>: a
 * dequantized value is exactly a float32 source. */
#include "kernels_internal.cuh"

namespace cuda_kernels {
namespace {

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

}  // namespace

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

/* A gather's copy-out: one launch per table of items (see [Note: pack table] in kernels_cast.cu). */
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
}  // namespace cuda_kernels
