/* wire.c: quantized communication: the wires of a bucket that carry block-quantized pieces
 * instead of its dtype's bytes, in the format of [Note: quantized wire format]
 * (core/mfsdp_quant.h): the all-gather of weights, the gradient exchange, and under HFSDP the
 * all-gather of the updated weights across the replicas.
 *
 * [Note: quantized communication]
 * A bucket's spec says which wires are quantized (mfsdp_wire_spec: int8, fp8_e4m3 or int4, blocks
 * of B elements). A wire quantizes exactly what it would otherwise send: one piece per rank, its
 * shard as one flat run of elements (blocks cross parameter boundaries; the last block is short
 * when B does not divide the shard, so the layout asks nothing of B beyond the format's own
 * rules: B >= 1, even for int4). Payload and scales of a piece are one byte run, so a
 * collective still moves everything at once: one collective per bucket, W pieces.
 * Only the bytes on the wire are quantized. Main weights, main gradients and optimizer state
 * never are, so the error does not accumulate in the training state.
 * - Weights (all-gather): each gather quantizes this rank's shard afresh from its most precise
 *   copy (the main weights when they cover the shard, else the compute-dtype shard) and every
 *   rank dequantizes all W pieces into the full compute weights, its own rows included. A rank
 *   does not keep its exact rows: the ranks must compute with one and the same model, else
 *   the gradients they reduce are of W different functions. So a gather overwrites this rank's
 *   rows of the full weights, and main weights that lived there get storage of their own:
 *   ZeRO-1/2 (main weights otherwise inside WEIGHT) and ZeRO-3 with a quantized gather across
 *   replicas keep a MAIN_SHARD (shard elements in the main dtype, the memory this costs).
 *   Error: in the compute weights of the passes that use this gather, never in the main weights.
 * - Gradients (reduction as an exchange, [Note: exchange reduction] in reduce.c): every rank
 *   quantizes its W pieces once (from the gradients, pre-scaled, in the main gradient dtype),
 *   one all-to-all of wire pieces, and every rank dequantizes the W pieces of its own slice and
 *   adds them into its main gradient in rank order, each addition computed in float32 (float64
 *   for float64 gradients) and rounded once into the main gradient, which must be float32 or
 *   float64: no partial sum is ever held in low precision and every contribution is quantized
 *   exactly once. no_shard and ZeRO-1 reduce the local sum over microbatches once per step (one
 *   quantization per rank and step); ZeRO-2/3 reduce each backward (each microbatch's gradients
 *   are quantized once: the errors of m microbatches add, independent, as m sums of rounding
 *   errors). no_shard then all-gathers the reduced blocks in the gradient dtype, unquantized,
 *   so every rank holds the same sum (only the exchange half of its all-reduce is quantized).
 * - HFSDP weights across replicas: the updated sub-shard is quantized from the main weights and
 *   every replica dequantizes all sub-shards (its own too) into the node-level weight shard;
 *   a quantized gather inside the replica then quantizes those values again (the errors add).
 * Error of one element x of a block whose absmax is a (scale s = a / qmax; the exact bounds and
 * their proofs are in [Note: quantized wire format]):
 *   int8      |x' - x| <= s * (1/2 + 2^-17), about a / 254
 *   int4      |x' - x| <= s * (1/2 + 2^-21), about a / 14
 *   fp8_e4m3  |x' - x| <= |x| / 16 (|x| >= 2^-6 s), <= s * 2^-10 * (1 + 2^-16) below
 * then the rounding into the destination (half an ulp of a bf16 compute weight). A reduced
 * gradient sum_r x_r (times 1/W when the collective averages) carries the sum of its W
 * contributions' errors, each bounded by its own block's scale, plus one float32 rounding per
 * addition. A NaN or Inf anywhere in a block makes the whole block NaN where it lands: loud,
 * never a silently finite value (report_nan_in_param_grad counts it).
 * Counters: quantized collectives count in quantized_<kind> (mfsdp_pipeline.h), in wire bytes. */
#include "pipeline_internal.h"

static mfsdp_status check_wire(int32_t wire, int64_t block, const char* what, int32_t i) {
  if (wire == MFSDP_WIRE_PLAIN) return MFSDP_OK;
  int mode = wire - 1;
  if (!mfsdp_quant_mode_valid(mode))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: unknown quantization %d for the %s", i, wire, what);
  if (!mfsdp_quant_format_valid(mode, block))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: %s %s in blocks of %lld elements (blocks must be >= 1%s)",
                      i, what, mfsdp_quant_mode_name(mode), (long long)block,
                      mode == MFSDP_QUANT_INT4 ? " and even: two int4 codes share a byte" : "");
  return MFSDP_OK;
}

/* The spec's quantized wires, refused with the reason (before anything is built). */
mfsdp_status pl_wire_check(const mfsdp_pipeline_config* cfg, const mfsdp_backend* be, const mfsdp_bucket_spec* s,
                           int32_t i) {
  const mfsdp_wire_spec* w = &s->wire;
  if (w->block < 0)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: quantization blocks of %lld elements", i,
                      (long long)w->block);
  int64_t block = w->block > 0 ? w->block : MFSDP_QUANT_DEFAULT_BLOCK;
  MFSDP_CHECK(check_wire(w->weights, block, "weights", i));
  MFSDP_CHECK(check_wire(w->grads, block, "gradients", i));
  MFSDP_CHECK(check_wire(w->outer_weights, block, "weights across replicas", i));
  if (w->grads != MFSDP_WIRE_PLAIN && s->grad_mode != MFSDP_GRAD_NONE) {
    if (s->grad_dtype != MFSDP_F32 && s->grad_dtype != MFSDP_F64)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT,
                        "bucket %d: quantized gradients are summed in the main gradient dtype, which must be float32 "
                        "or float64, not %s", i, mfsdp_dtype_name(s->grad_dtype));
    if (s->comm_dtype != s->grad_dtype)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT,
                        "bucket %d: quantized gradients are staged in the main gradient dtype (%s), not the "
                        "communication dtype %s", i, mfsdp_dtype_name(s->grad_dtype), mfsdp_dtype_name(s->comm_dtype));
    if (be->transport->all_to_all == NULL)
      return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "bucket %d: quantized gradients need an all-to-all, which the %s "
                        "transport does not have", i, be->transport->name);
  }
  if (w->outer_weights != MFSDP_WIRE_PLAIN && !(cfg->outer_sharded && cfg->outer_world > 1))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT,
                      "bucket %d: weights quantized across replicas need HFSDP (main weights sharded over the replicas)",
                      i);
  return MFSDP_OK;
}

/* Which of the bucket's wires carry quantized pieces: those requested that really cross a wire
 * (a bucket that is never gathered, or reduces on one rank, communicates nothing), for floating
 * weights (integer buffers travel as they are). After pl_set_geometry. */
void pl_wire_setup(const mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_bucket_spec* s = &bk->spec;
  const mfsdp_wire_spec* w = &s->wire;
  int floating = mfsdp_dtype_is_float(s->param_dtype);
  bk->q_block = w->block > 0 ? w->block : MFSDP_QUANT_DEFAULT_BLOCK;
  bk->q_weights = bk->q_grads = bk->q_outer = -1;
  if (w->weights != MFSDP_WIRE_PLAIN && floating && bk->gathered && pl_communicates(p, bk)) {
    bk->q_weights = (int8_t)(w->weights - 1);
    bk->q_gather_piece = mfsdp_quant_wire_bytes(bk->q_weights, bk->shard_size, bk->q_block);
  }
  if (w->grads != MFSDP_WIRE_PLAIN && s->grad_mode != MFSDP_GRAD_NONE && p->cfg.dp_world > 1 &&
      (s->grad_mode == MFSDP_GRAD_ALL_REDUCE || bk->shards > 1)) {
    bk->q_grads = (int8_t)(w->grads - 1);
    bk->q_grad_n = s->grad_mode == MFSDP_GRAD_ALL_REDUCE ? pl_exchange_block(p, bk) : bk->shard_size;
    bk->q_grad_piece = mfsdp_quant_wire_bytes(bk->q_grads, bk->q_grad_n, bk->q_block);
  }
  if (w->outer_weights != MFSDP_WIRE_PLAIN && floating && bk->subs > 1) {
    bk->q_outer = (int8_t)(w->outer_weights - 1);
    bk->q_outer_piece = mfsdp_quant_wire_bytes(bk->q_outer, bk->sub_size, bk->q_block);
  }
}

/* ---- the all-gather of weights ---- */

/* This rank's most precise copy of its collective shard: the main weights when they have storage
 * of their own and cover it (not under HFSDP, where they are one sub-shard of it), else the
 * compute-dtype shard (which then has its own storage, or holds the main weights). */
static const mfsdp_buffer* gather_source(const bucket* bk) {
  return pl_own_main(bk) && bk->subs == 1 ? &bk->buf[MFSDP_BUF_MAIN_SHARD] : &bk->buf[MFSDP_BUF_WEIGHT_SHARD];
}

mfsdp_status pl_wire_start_gather(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_buffer* src = gather_source(bk);
  MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_GATHER_WIRE));
  MFSDP_CHECK(p->be.kernels->quantize(p->be.kernels_ctx, bk->buf[MFSDP_BUF_GATHER_WIRE_SHARD].data, bk->q_weights,
                                      bk->q_block, src->data, src->dtype, bk->shard_size, 1));
  bk->wstate = MFSDP_W_GATHERING;
  mfsdp_status st = p->be.transport->all_gather(p->be.transport_ctx, &bk->buf[MFSDP_BUF_GATHER_WIRE],
                                                &bk->buf[MFSDP_BUF_GATHER_WIRE_SHARD], &bk->gather_work);
  if (st != MFSDP_OK) return pl_comm_failed(p, st);
  pl_count(bk, PL_COMM_quantized_all_gather, bk->buf[MFSDP_BUF_GATHER_WIRE].numel);
  return MFSDP_OK;
}

/* Ranges of pieces collected into chunks: one dequantize_pack call per chunk. */
typedef struct qpacker {
  mfsdp_pipeline* p;
  void* dst;
  int32_t dst_dtype, mode;
  int64_t block, piece_n;
  int32_t n;
  mfsdp_quant_item items[PACK_CHUNK];
} qpacker;

static mfsdp_status qpacker_flush(qpacker* k) {
  if (k->n == 0) return MFSDP_OK;
  mfsdp_status st = k->p->be.kernels->dequantize_pack(k->p->be.kernels_ctx, k->dst, k->dst_dtype, k->items, k->n,
                                                      k->mode, k->block, k->piece_n, 1.0, 0);
  k->n = 0;
  return st;
}

static mfsdp_status qpacker_add(qpacker* k, const void* wire, int64_t src_offset, int64_t dst_offset, int64_t n) {
  if (n == 0) return MFSDP_OK;
  if (k->n == PACK_CHUNK) MFSDP_CHECK(qpacker_flush(k));
  k->items[k->n++] = (mfsdp_quant_item){wire, src_offset, dst_offset, n};
  return MFSDP_OK;
}

/* The gather landed: every holder's rows, this rank's own too, dequantized from their pieces
 * straight into the parameter-major full weights (the copy-out of weights.c, fused). Owner r's
 * sub-shard is in piece r % shards at (r / shards) * sub_size ([Note: bucket geometry]). */
mfsdp_status pl_wire_finish_gather(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_WEIGHT));
  const uint8_t* wire = bk->buf[MFSDP_BUF_GATHER_WIRE].data;
  qpacker k = {p, bk->buf[MFSDP_BUF_WEIGHT].data, bk->spec.param_dtype, bk->q_weights, bk->q_block, bk->shard_size,
               0, {{0}}};
  for (int32_t i = 0; i < bk->spec.layout.n_items; ++i)
    for (int32_t r = 0; r < bk->holders; ++r) {
      mfsdp_runs ru; /* one run per block of an item sharded on an inner dim ([Note: chunked layout]) */
      pl_runs(bk, i, r, &ru);
      for (int64_t j = 0; j < ru.count; ++j)
        MFSDP_CHECK(qpacker_add(&k, wire + (r % bk->shards) * bk->q_gather_piece,
                                (int64_t)(r / bk->shards) * bk->sub_size + bk->shard_offsets[i] + j * ru.len,
                                bk->param_offsets[i] + ru.first + j * ru.stride, ru.len));
    }
  MFSDP_CHECK(qpacker_flush(&k));
  return pl_release(p, bk, MFSDP_BUF_GATHER_WIRE);
}

/* ---- the gradient exchange ---- */

/* Quantizes the W pieces of `full` (this rank's pre-scaled gradients, rank-major, in the main
 * gradient dtype) and exchanges them: EXCHANGE receives every rank's piece of this rank's slice.
 * The caller materialised EXCHANGE. */
mfsdp_status pl_wire_exchange(mfsdp_pipeline* p, bucket* bk, const mfsdp_buffer* full, mfsdp_work** work) {
  MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_GRAD_WIRE));
  MFSDP_CHECK(p->be.kernels->quantize(p->be.kernels_ctx, bk->buf[MFSDP_BUF_GRAD_WIRE].data, bk->q_grads, bk->q_block,
                                      full->data, full->dtype, bk->q_grad_n, p->cfg.dp_world));
  return p->be.transport->all_to_all(p->be.transport_ctx, &bk->buf[MFSDP_BUF_EXCHANGE], &bk->buf[MFSDP_BUF_GRAD_WIRE],
                                     work);
}

/* The exchange completed: elements [0, n) of every rank's piece, dequantized and multiplied by
 * alpha, added into dst (main gradient dtype) in rank order, each addition rounded once. */
mfsdp_status pl_wire_sum(mfsdp_pipeline* p, bucket* bk, void* dst, int64_t n, double alpha) {
  const uint8_t* wire = bk->buf[MFSDP_BUF_EXCHANGE].data;
  for (int32_t r = 0; r < p->cfg.dp_world; ++r) { /* one call per rank: the ranges share dst */
    mfsdp_quant_item piece = {wire + r * bk->q_grad_piece, 0, 0, n};
    MFSDP_CHECK(p->be.kernels->dequantize_pack(p->be.kernels_ctx, dst, bk->spec.grad_dtype, &piece, 1, bk->q_grads,
                                               bk->q_block, bk->q_grad_n, alpha, 1));
  }
  return pl_release(p, bk, MFSDP_BUF_GRAD_WIRE);
}

/* ---- HFSDP: the all-gather of the updated weights across the replicas ---- */

/* After the optimizer step: this rank's sub-shard quantized from its main weights (storage of
 * their own, pl_create_buffers) and gathered across the replicas; pl_wire_outer_land lands it. */
mfsdp_status pl_wire_outer_gather(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_buffer* main = &bk->buf[MFSDP_BUF_MAIN_SHARD];
  MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_OUTER_WIRE));
  MFSDP_CHECK(p->be.kernels->quantize(p->be.kernels_ctx, bk->buf[MFSDP_BUF_OUTER_WIRE_SUB].data, bk->q_outer,
                                      bk->q_block, main->data, main->dtype, bk->sub_size, 1));
  mfsdp_status st = p->be.outer->all_gather(p->be.outer_ctx, &bk->buf[MFSDP_BUF_OUTER_WIRE],
                                            &bk->buf[MFSDP_BUF_OUTER_WIRE_SUB], &bk->outer_work);
  if (st != MFSDP_OK) return pl_comm_failed(p, st);
  bk->outer_gathering = 1;
  pl_count(bk, PL_COMM_outer_quantized_all_gather, bk->buf[MFSDP_BUF_OUTER_WIRE].numel);
  return MFSDP_OK;
}

/* The replicas' gather completed: every sub-shard, this rank's own too, dequantized into the
 * node-level weight shard (compute dtype), so every replica holds the same values. */
mfsdp_status pl_wire_outer_land(mfsdp_pipeline* p, bucket* bk) {
  const uint8_t* wire = bk->buf[MFSDP_BUF_OUTER_WIRE].data;
  qpacker k = {p, bk->buf[MFSDP_BUF_WEIGHT_SHARD].data, bk->spec.param_dtype, bk->q_outer, bk->q_block, bk->sub_size,
               0, {{0}}};
  for (int32_t o = 0; o < bk->subs; ++o)
    MFSDP_CHECK(qpacker_add(&k, wire + o * bk->q_outer_piece, 0, (int64_t)o * bk->sub_size, bk->sub_size));
  MFSDP_CHECK(qpacker_flush(&k));
  return pl_release(p, bk, MFSDP_BUF_OUTER_WIRE);
}
