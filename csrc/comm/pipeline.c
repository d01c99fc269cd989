/* pipeline.c: a pipeline's life cycle (create, destroy), its queries and knobs (see
 * mfsdp_pipeline.h for the API, pipeline_internal.h for the state).
 *
 * The pipeline is cut by concern, around the one set of structs in pipeline_internal.h. The
 * files form a stack, listed here from the floor up: each calls only files listed before it
 * (tests/test_c_structure.py checks that no C files call each other in a circle):
 *   guards.c     the guards every entry point and collective goes through (health, bucket ids,
 *                waiting for a work) and the comm counters
 *   geometry.c   a bucket's shape, and the collectives it implies (communicates, exchanges)
 *   buffers.c    the buffer table of a bucket: storages and views, materialise/release, packing
 *   wire.c       quantized communication: the wires that carry block-quantized pieces
 *   replicas.c   hybrid sharding: the collectives across replicas (HSDP and HFSDP)
 *   reduce.c     the reduction queue: launch in the shared order, complete, exchange reduction
 *   weights.c    loading weights (init, set_item, set_local), gathers, reshard, installing
 *                the optimizer's weights
 *   backward.c   the backward protocol (begin, grad_ready, seal, end) and gradient sync/zero
 *   trainable.c  which items train, changed at run time; gradient buffers created and freed
 *   pipeline.c   create/destroy, queries, knobs (hold, prescale, comm dtype, order), drain */
#include "pipeline_internal.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* creation */

static mfsdp_status check_spec(const mfsdp_pipeline_config* cfg, const mfsdp_bucket_spec* s, int32_t i) {
  const mfsdp_bucket_layout* l = &s->layout;
  if (l->world < 1 || s->shard_rank < 0 || s->shard_rank >= l->world || l->n_items < 0)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: %d shards, rank %d, %d items", i, l->world,
                      s->shard_rank, l->n_items);
  int32_t pieces = cfg->dp_world * (cfg->outer_sharded && cfg->outer_world > 1 ? cfg->outer_world : 1);
  if (l->world != 1 && l->world != pieces)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: %d shards but %d data-parallel ranks shard it", i,
                      l->world, pieces);
  if (l->world > 1 && pieces > cfg->dp_world &&
      (!s->weights_sharded || (s->grad_mode != MFSDP_GRAD_NONE && s->grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE)))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT,
                      "bucket %d: sharding across replicas (HFSDP) needs sharded weights and gradients (ZeRO-3)", i);
  mfsdp_status st = mfsdp_layout_validate(l, NULL);
  if (st != MFSDP_OK) return MFSDP_FAIL(st, "bucket %d: %s", i, mfsdp_last_error());
  if (!mfsdp_dtype_valid(s->param_dtype) || s->grad_mode < MFSDP_GRAD_NONE ||
      s->grad_mode > MFSDP_GRAD_SCATTER_ACCUMULATE || (s->frozen != 0 && s->frozen != 1) ||
      (s->sum_in_comm_dtype != 0 && s->sum_in_comm_dtype != 1) || (s->offload != 0 && s->offload != 1))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT,
                      "bucket %d: bad dtype, grad mode, frozen, sum_in_comm_dtype or offload flag", i);
  if (s->grad_mode != MFSDP_GRAD_NONE &&
      (!mfsdp_dtype_is_float(s->main_dtype) || !mfsdp_dtype_is_float(s->grad_dtype) ||
       !mfsdp_dtype_is_float(s->comm_dtype) || !mfsdp_dtype_is_float(s->param_dtype)))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: gradients need floating dtypes", i);
  if (s->weights_sharded && l->world == 1 && !cfg->force_comm)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: sharded weights need more than one shard", i);
  if (l->world > 1 && !s->weights_sharded && !s->weights_regather)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: %d shards but its weights are never gathered", i,
                      l->world);
  if ((s->grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE || s->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE) &&
      l->world != pieces)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: reduce-scatter needs one shard per rank", i);
  return MFSDP_OK;
}

static int64_t* copy_i64(const int64_t* src, int32_t n) {
  int64_t* out = malloc((size_t)(n ? n : 1) * sizeof *out);
  if (out && n) memcpy(out, src, (size_t)n * sizeof *out);
  return out;
}

mfsdp_status mfsdp_pipeline_create(const mfsdp_pipeline_config* cfg, const mfsdp_backend* be,
                                   const mfsdp_bucket_spec* specs, int32_t n, mfsdp_pipeline** out) {
  *out = NULL;
  if (cfg->dp_world < 1 || cfg->dp_rank < 0 || cfg->dp_rank >= cfg->dp_world || n < 0 ||
      (cfg->reduce_op != MFSDP_REDUCE_SUM && cfg->reduce_op != MFSDP_REDUCE_AVG))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bad pipeline config (world %d, %d buckets)", cfg->dp_world, n);
  if (!be->memory || !be->transport || !be->kernels)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "backend lacks memory, transport or kernels");
  if (cfg->outer_world > 1 && be->outer == NULL)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "%d replicas but no transport across them", cfg->outer_world);
  for (int32_t i = 0; i < n; ++i) {
    MFSDP_CHECK(check_spec(cfg, &specs[i], i));
    MFSDP_CHECK(pl_wire_check(cfg, be, &specs[i], i));
  }

  mfsdp_pipeline* p = calloc(1, sizeof *p);
  if (p == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "pipeline");
  p->cfg = *cfg;
  p->be = *be;
  p->n = n;
  p->b = calloc((size_t)(n ? n : 1), sizeof *p->b);
  p->queue = malloc((size_t)(n ? n : 1) * sizeof *p->queue);
  p->order = malloc((size_t)(n ? n : 1) * sizeof *p->order);
  mfsdp_status st = MFSDP_OK;
  if (p->b == NULL || p->queue == NULL || p->order == NULL) {
    st = MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "%d buckets", n);
    goto fail;
  }
  for (int32_t i = 0; i < n; ++i) {
    bucket* bk = &p->b[i];
    const mfsdp_bucket_layout* l = &specs[i].layout;
    int32_t items = l->n_items;
    bk->spec = specs[i];
    bk->numels = copy_i64(l->numels, items);
    bk->pieces = copy_i64(l->pieces, items);
    bk->param_offsets = copy_i64(l->param_offsets, items);
    bk->shard_offsets = copy_i64(l->shard_offsets, items);
    bk->outers = malloc((size_t)(items ? items : 1) * sizeof *bk->outers);
    for (int32_t k = 0; bk->outers && k < items; ++k) bk->outers[k] = mfsdp_layout_outer(l, k);
    bk->ready = calloc((size_t)(items ? items : 1), 1);
    bk->pending = calloc((size_t)(items ? items : 1), sizeof *bk->pending);
    bk->trainable = calloc((size_t)(items ? items : 1), 1);
    bk->used = calloc((size_t)(items ? items : 1), 1);
    if (!bk->numels || !bk->pieces || !bk->param_offsets || !bk->shard_offsets || !bk->outers || !bk->ready ||
        !bk->pending || !bk->trainable || !bk->used) {
      st = MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "bucket %d tables", i);
      goto fail;
    }
    bk->spec.layout.numels = bk->numels;
    bk->spec.layout.pieces = bk->pieces;
    bk->spec.layout.param_offsets = bk->param_offsets;
    bk->spec.layout.shard_offsets = bk->shard_offsets;
    bk->spec.layout.outers = bk->outers;
    pl_set_geometry(bk, cfg);
    pl_wire_setup(p, bk);
    /* [Note: used-flag tail] in reduce.c: a tail of 3 per item; a quantized gradient wire only
     * when its blocks never mix flags and gradients (the tail and every sub-shard on block
     * boundaries) and the flags are exactly 0 or 1 at each launch (ZeRO-2/3: a fresh bucket; the
     * persistent sums of no_shard/ZeRO-1 would put a rebased flag next to a larger one, which a
     * coarse block could round to 0) */
    int quant_ok = bk->q_grads < 0 || (specs[i].grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE &&
                                       l->tail_offset % bk->q_block == 0 && bk->sub_size % bk->q_block == 0);
    bk->flags = (int8_t)(items > 0 && specs[i].grad_mode != MFSDP_GRAD_NONE && l->tail >= MFSDP_FLAG_TAIL * (int64_t)items &&
                         quant_ok);
    if (specs[i].grad_mode != MFSDP_GRAD_NONE && !specs[i].frozen) { /* [Note: requires_grad changes] */
      memset(bk->trainable, 1, (size_t)items);
      bk->n_trainable = items;
    }
    for (int k = 0; k < MFSDP_BUF_COUNT; ++k) bk->storage[k] = -1;
    MFSDP_CHECK_GOTO(pl_compute_holes(bk), st, fail);
    MFSDP_CHECK_GOTO(pl_create_buffers(p, bk), st, fail);
    bk->wstate = specs[i].weights_sharded ? MFSDP_W_EMPTY : MFSDP_W_READY;
    bk->gstate = MFSDP_G_CLEAN;
    p->order[i] = n - 1 - i; /* until the caller sets one: later buckets first */
    bk->prescale = cfg->grad_prescale;
  }
  *out = p;
  return MFSDP_OK;
fail:
  mfsdp_pipeline_destroy(p);
  return st;
}

void mfsdp_pipeline_destroy(mfsdp_pipeline* p) {
  if (p == NULL) return;
  for (int32_t i = 0; p->b && i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->gather_work) p->be.transport->discard(p->be.transport_ctx, bk->gather_work);
    if (bk->reduce_work) p->be.transport->discard(p->be.transport_ctx, bk->reduce_work);
    if (bk->outer_work) p->be.outer->discard(p->be.outer_ctx, bk->outer_work);
    if (bk->landed) p->be.kernels->drop_mark(p->be.kernels_ctx, bk->landed);
    /* A view that reuses its storage's handle is dropped once, with the storage: decide before
     * destroying anything, since destroy clears the handle it drops. */
    int8_t shared[MFSDP_BUF_COUNT] = {0};
    for (int k = 0; k < MFSDP_BUF_COUNT; ++k)
      for (int j = 0; j < k; ++j)
        if (bk->present[k] && bk->present[j] && bk->buf[j].handle == bk->buf[k].handle) shared[k] = 1;
    for (int k = 0; k < MFSDP_BUF_COUNT; ++k) {
      void* ctx;
      if (bk->present[k] && !shared[k]) pl_memory_of(p, bk, k, &ctx)->destroy(ctx, &bk->buf[k]);
    }
    free(bk->numels);
    free(bk->pieces);
    free(bk->param_offsets);
    free(bk->shard_offsets);
    free(bk->outers);
    free(bk->ready);
    free(bk->trainable);
    free(bk->used);
    for (int32_t k = 0; bk->pending && k < bk->n_pending; ++k)
      if (bk->pending[k].handle) p->be.memory->drop(p->be.memory_ctx, bk->pending[k].handle);
    free(bk->pending);
    free(bk->holes);
  }
  free(p->b);
  free(p->queue);
  free(p->order);
  free(p);
}

/* ------------------------------------------------------------------------------------------ */
/* queries */

void mfsdp_pipeline_stats(const mfsdp_pipeline* p, int32_t b, mfsdp_comm_stats* out) {
  memset(out, 0, sizeof *out);
  for (int32_t i = 0; i < p->n; ++i) {
    if (b >= 0 && i != b) continue;
    const mfsdp_comm_stats* s = &p->b[i].stats;
#define ADD_(kind)            \
  out->kind##s += s->kind##s; \
  out->kind##_bytes += s->kind##_bytes;
    MFSDP_COMM_COUNTERS(ADD_)
#undef ADD_
  }
}

int32_t mfsdp_pipeline_num_buckets(const mfsdp_pipeline* p) { return p->n; }

const mfsdp_buffer* mfsdp_pipeline_buffer(const mfsdp_pipeline* p, int32_t bucket_id, int32_t kind) {
  if (bucket_id < 0 || bucket_id >= p->n || kind < 0 || kind >= MFSDP_BUF_COUNT) return NULL;
  return p->b[bucket_id].present[kind] ? &p->b[bucket_id].buf[kind] : NULL;
}

int32_t mfsdp_pipeline_weight_state(const mfsdp_pipeline* p, int32_t b) { return p->b[b].wstate; }

int32_t mfsdp_pipeline_grad_state(const mfsdp_pipeline* p, int32_t b) { return p->b[b].gstate; }

const char* mfsdp_pipeline_broken(const mfsdp_pipeline* p) { return p->broken; }

int32_t mfsdp_pipeline_comm_dtype(const mfsdp_pipeline* p, int32_t bucket_id) {
  return p->b[bucket_id].spec.comm_dtype;
}

mfsdp_status mfsdp_pipeline_local_piece(const mfsdp_pipeline* p, int32_t b, int32_t item, int32_t kind,
                                        int32_t* where, int64_t* offset, int64_t* n) {
  if (b < 0 || b >= p->n) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d out of range [0, %d)", b, p->n);
  const bucket* bk = &p->b[b];
  if (item < 0 || item >= bk->spec.layout.n_items)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d has no item %d", b, item);
  if (kind != MFSDP_BUF_MAIN_SHARD && kind != MFSDP_BUF_OPT_GRAD && kind != MFSDP_BUF_GRAD_SHARD &&
      kind != MFSDP_BUF_WEIGHT_SHARD)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "local_piece: buffer kind %d is not a shard", kind);
  mfsdp_runs ru;
  pl_runs(bk, item, bk->spec.shard_rank, &ru);
  *n = ru.count * ru.len;
  if (kind == MFSDP_BUF_MAIN_SHARD && pl_main_in_weight(bk)) { /* one run: see pl_create_buffers */
    *where = MFSDP_BUF_WEIGHT;
    *offset = bk->param_offsets[item] + ru.first;
  } else if (!bk->present[kind]) {
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d has no buffer of kind %d", b, kind);
  } else { /* HFSDP: this rank's sub-shard inside the collective shard */
    int whole = kind == MFSDP_BUF_WEIGHT_SHARD || kind == MFSDP_BUF_GRAD_SHARD;
    *where = kind;
    *offset = bk->shard_offsets[item] + (whole ? bk->sub_start : 0);
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_flag_tail(const mfsdp_pipeline* p, int32_t b, int64_t* offset, int32_t* n,
                                      int32_t* every_rank) {
  if (b < 0 || b >= p->n) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d out of range [0, %d)", b, p->n);
  const bucket* bk = &p->b[b];
  int carries = bk->flags && bk->has_grads;
  *every_rank = !bk->flags_local;
  *offset = carries ? bk->sub_start + pl_tail_of(bk) : 0;
  *n = carries ? bk->spec.layout.n_items : 0;
  return MFSDP_OK;
}

/* x[i] > 0 for a float of `dtype` (sign clear, not zero; the flags are never NaN). */
static int positive(const uint8_t* x, int dtype, int64_t i) {
  switch (dtype) {
    case MFSDP_F32: {
      uint32_t v;
      memcpy(&v, x + 4 * i, 4);
      return !(v >> 31) && (v & 0x7fffffffu) != 0;
    }
    case MFSDP_F64: {
      uint64_t v;
      memcpy(&v, x + 8 * i, 8);
      return !(v >> 63) && (v & 0x7fffffffffffffffull) != 0;
    }
    default: { /* bf16, f16 */
      uint16_t v;
      memcpy(&v, x + 2 * i, 2);
      return !(v >> 15) && (v & 0x7fffu) != 0;
    }
  }
}

mfsdp_status mfsdp_pipeline_read_flags(mfsdp_pipeline* p, int32_t b, uint8_t* used, uint8_t* split, int32_t* n) {
  int64_t offset;
  int32_t every_rank;
  MFSDP_CHECK(pl_check_bucket(p, b));
  MFSDP_CHECK(mfsdp_pipeline_flag_tail(p, b, &offset, n, &every_rank));
  if (*n == 0) return MFSDP_OK;
  const mfsdp_buffer* g = &p->b[b].buf[MFSDP_BUF_GRAD_SHARD];
  int64_t size = mfsdp_dtype_size(g->dtype), count = MFSDP_FLAG_TAIL * (int64_t)*n;
  uint8_t* host = malloc((size_t)(count * size));
  if (!host) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "%lld bytes for bucket %d's flags", (long long)(count * size), b);
  mfsdp_status st = p->be.kernels->to_host(p->be.kernels_ctx, host, pl_at(g, offset), count * size);
  for (int32_t i = 0; st == MFSDP_OK && i < *n; ++i) {
    used[i] = (uint8_t)positive(host, g->dtype, i);
    split[i] = (uint8_t)(every_rank && positive(host, g->dtype, *n + i) && positive(host, g->dtype, 2 * *n + i));
  }
  free(host);
  return st;
}

mfsdp_status mfsdp_pipeline_count_nonfinite_grad(mfsdp_pipeline* p, int32_t b, int32_t item, int64_t* count) {
  MFSDP_CHECK(pl_check_bucket(p, b));
  bucket* bk = &p->b[b];
  *count = 0;
  if (!bk->has_grads || item < 0 || item >= bk->spec.layout.n_items)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d item %d has no gradient", b, item);
  int64_t n = pl_piece_size(bk, item, bk->spec.shard_rank);
  if (n == 0) return MFSDP_OK;
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD_SHARD];
  return p->be.kernels->count_nonfinite(p->be.kernels_ctx, pl_at(g, bk->sub_start + bk->shard_offsets[item]),
                                        g->dtype, n, count);
}

/* ------------------------------------------------------------------------------------------ */
/* knobs */

mfsdp_status mfsdp_pipeline_set_reduce_order(mfsdp_pipeline* p, const int32_t* order, int32_t n) {
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "the reduction order cannot change inside a backward");
  if (n != p->n) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "reduction order of %d buckets, expected %d", n, p->n);
  char* seen = calloc((size_t)(n ? n : 1), 1);
  if (seen == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "order check");
  for (int32_t i = 0; i < n; ++i) {
    if (order[i] < 0 || order[i] >= n || seen[order[i]]) {
      free(seen);
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "reduction order is not a permutation of the %d buckets", n);
    }
    seen[order[i]] = 1;
  }
  free(seen);
  memcpy(p->order, order, (size_t)n * sizeof *order);
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_hold(mfsdp_pipeline* p, const int32_t* ids, int32_t n, int hold) {
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "gradient sync cannot change inside a backward pass");
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(pl_check_bucket(p, ids[i]));
  for (int32_t i = 0; i < n; ++i) p->b[ids[i]].hold = (int8_t)!!hold;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_outer_hold(mfsdp_pipeline* p, const int32_t* ids, int32_t n, int hold) {
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "gradient sync cannot change inside a backward pass");
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(pl_check_bucket(p, ids[i]));
  for (int32_t i = 0; i < n; ++i) p->b[ids[i]].outer_hold = (int8_t)!!hold;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_prescale(mfsdp_pipeline* p, const int32_t* ids, int32_t n, double prescale) {
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "gradient scaling cannot change inside a backward");
  if (!(prescale > 0.0))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "gradient pre-scale %g is not positive", prescale);
  for (int32_t i = 0; i < n; ++i) {
    MFSDP_CHECK(pl_check_bucket(p, ids[i]));
    const bucket* bk = &p->b[ids[i]];
    /* gradients already scaled: a new scale would mix two; the same one is a no-op */
    if (bk->prescale != prescale && (bk->gstate == MFSDP_G_REDUCED || bk->held_grads))
      return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d holds gradients scaled the old way: zero them first",
                        ids[i]);
  }
  for (int32_t i = 0; i < n; ++i) p->b[ids[i]].prescale = prescale;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_comm_dtype(mfsdp_pipeline* p, int32_t dtype) {
  MFSDP_CHECK(pl_healthy(p));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "communication dtype changed inside a backward pass");
  MFSDP_CHECK(pl_complete_all(p));
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->spec.grad_mode == MFSDP_GRAD_NONE) continue;
    int32_t dt = dtype >= 0 ? dtype : bk->spec.grad_dtype;
    if (!mfsdp_dtype_is_float(dt))
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "communication dtype %s is not floating", mfsdp_dtype_name(dt));
    if (bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE && bk->gstate != MFSDP_G_CLEAN)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d still holds unreduced gradients", i);
    if (bk->spec.wire.grads != MFSDP_WIRE_PLAIN && dt != bk->spec.comm_dtype)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT,
                        "bucket %d communicates its gradients quantized (%s, staged in %s): its communication dtype "
                        "cannot change to %s", i, mfsdp_quant_mode_name(bk->spec.wire.grads - 1),
                        mfsdp_dtype_name(bk->spec.comm_dtype), mfsdp_dtype_name(dt));
  }
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->spec.grad_mode == MFSDP_GRAD_NONE) continue;
    int32_t dt = dtype >= 0 ? dtype : bk->spec.grad_dtype;
    if (dt == bk->spec.comm_dtype) continue;
    if (!bk->has_grads) { /* frozen: its buffers get the new dtype when an item starts training */
      bk->spec.comm_dtype = dt;
      continue;
    }
    pl_drop_comm_buffers(p, bk);
    bk->spec.comm_dtype = dt;
    MFSDP_CHECK(pl_create_comm_buffers(p, bk));
    MFSDP_CHECK(pl_release_temporaries(p, bk));
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_drain(mfsdp_pipeline* p) {
  MFSDP_CHECK(pl_healthy(p));
  /* Inside a backward its gradients are not all reported: ending it here left those that were in
   * the buckets' pending tables, which the next backward then added to its own and appended its
   * arrivals past (csrc/tests/core/test_misuse.c). */
  if (p->in_backward)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "drain inside a backward pass: wait for the collectives after the "
                                               "backward (synchronize_gradient_reduce / synchronize_param_gather)");
  MFSDP_CHECK(pl_complete_all(p));
  MFSDP_CHECK(pl_complete_outer(p, 1));
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->wstate == MFSDP_W_GATHERING) MFSDP_CHECK(pl_finish_gather(p, bk));
  }
  return MFSDP_OK;
}

