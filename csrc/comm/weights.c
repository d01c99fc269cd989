/* weights.c: weights in and out of the buckets: loading (init_begin, set_item, set_local,
 * init_end), gathers (unshard, wait_unshard), reshard, and installing the optimizer's main
 * weights.
 *
 * [Note: cast on gather]
 * When the main weights are wider than the compute weights (bf16 model, fp32 main) and the
 * bucket is gathered (ZeRO-1/2/3 over several ranks), the only persistent copy of a rank's rows
 * is the main shard. Each gather casts it into this rank's slice of the freshly materialised
 * gather buffer and all-gathers in place, so no compute-dtype shard is kept between passes:
 * under ZeRO-3 that is 2 bytes a parameter / world less than keeping one, the same held memory
 * as FSDP2, for one cast of shard_size elements per gather. */
#include "pipeline_internal.h"

static mfsdp_status zero_buffer(mfsdp_pipeline* p, bucket* bk, int kind) {
  const mfsdp_buffer* b = &bk->buf[kind];
  return p->be.kernels->fill_zero(p->be.kernels_ctx, b->data, b->dtype, b->numel);
}

/* This rank's rows of every item, from the parameter-major `src` (e.g. WEIGHT) into `dst`
 * (cast to dst_dtype): its whole collective shard (shard_size elements: the sub-shards of its
 * inner rank's twins) when `whole`, else its own sub-shard only (sub_size elements; the same
 * without HFSDP).
 * Padding of dst is left as it is. */
static mfsdp_status pack_own_rows(mfsdp_pipeline* p, bucket* bk, void* dst, int32_t dst_dtype, const mfsdp_buffer* src,
                                  int whole) {
  packer k = {p, dst, dst_dtype, 1.0, 0, 0, {{0}}};
  for (int32_t o = whole ? 0 : bk->own_sub; o < (whole ? bk->subs : bk->own_sub + 1); ++o) {
    int32_t r = o * bk->shards + bk->own_shard;
    int64_t base = whole ? (int64_t)o * bk->sub_size : 0;
    for (int32_t i = 0; i < bk->spec.layout.n_items; ++i) {
      mfsdp_runs ru;
      pl_runs(bk, i, r, &ru);
      for (int64_t j = 0; j < ru.count; ++j)
        MFSDP_CHECK(pl_packer_add(&k, pl_at(src, bk->param_offsets[i] + ru.first + j * ru.stride), src->dtype,
                                  base + bk->shard_offsets[i] + j * ru.len, ru.len));
    }
  }
  return pl_packer_flush(&k);
}

/* See [Note: cast on gather]. */
static int casts_on_gather(const bucket* bk) {
  return bk->gathered && pl_own_main(bk) && bk->storage[MFSDP_BUF_WEIGHT_SHARD] != MFSDP_BUF_WEIGHT_SHARD;
}

/* Two ways in (pl_init_mode). Full (direct = 0): the full weights are materialised, items are
 * copied into them and init_end derives shard and main weights from them. Direct (direct = 1,
 * for meta-device models materialised one module at a time): each item's own rows go straight
 * to the shard and main weights, so no full bucket ever exists; ZeRO-3 buckets stay EMPTY. */
mfsdp_status mfsdp_pipeline_init_begin(mfsdp_pipeline* p, int32_t b, int direct) {
  MFSDP_CHECK(pl_healthy(p));
  MFSDP_CHECK(pl_check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (bk->init != PL_INIT_NONE) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: init_begin twice", b);
  if (bk->wstate == MFSDP_W_GATHERING) MFSDP_CHECK(pl_finish_gather(p, bk));
  MFSDP_CHECK(pl_complete_outer_of(p, bk)); /* HFSDP: a replicas' gather must not land on the loaded values */
  if (!direct || !bk->spec.weights_sharded) {
    MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_WEIGHT));
    MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_WEIGHT));
  }
  if (direct) { /* the shards receive rows item by item: their padding must be zero */
    if (bk->storage[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD)
      MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_WEIGHT_SHARD));
    if (pl_own_main(bk)) MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_MAIN_SHARD));
  }
  bk->init = direct ? PL_INIT_DIRECT : PL_INIT_FULL;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_item(mfsdp_pipeline* p, int32_t b, int32_t item, const void* src, int32_t src_dtype,
                                     int64_t numel) {
  MFSDP_CHECK(pl_check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (bk->init == PL_INIT_NONE)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: set_item outside init_begin/init_end", b);
  if (item < 0 || item >= bk->spec.layout.n_items || numel != bk->numels[item])
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d item %d: %lld elements given, %lld expected", b, item,
                      (long long)numel,
                      item >= 0 && item < bk->spec.layout.n_items ? (long long)bk->numels[item] : -1LL);
  const mfsdp_kernel_ops* k = p->be.kernels;
  if (bk->init == PL_INIT_FULL || !bk->spec.weights_sharded)
    MFSDP_CHECK(k->copy(p->be.kernels_ctx, pl_at(&bk->buf[MFSDP_BUF_WEIGHT], bk->param_offsets[item]),
                        bk->spec.param_dtype, src, src_dtype, numel, 1.0));
  if (bk->init == PL_INIT_FULL) return MFSDP_OK;
  /* direct: this rank's rows of the item, into the persistent shard buffers (an own WEIGHT_SHARD
   * takes its whole collective shard: under HFSDP the rows of its replicas' twins too) */
  int64_t to = bk->shard_offsets[item], width = mfsdp_dtype_size(src_dtype);
  mfsdp_runs ru;
  if (bk->storage[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD)
    for (int32_t o = 0; o < bk->subs; ++o) {
      pl_runs(bk, item, o * bk->shards + bk->own_shard, &ru);
      for (int64_t j = 0; j < ru.count; ++j)
        MFSDP_CHECK(k->copy(p->be.kernels_ctx,
                            pl_at(&bk->buf[MFSDP_BUF_WEIGHT_SHARD], (int64_t)o * bk->sub_size + to + j * ru.len),
                            bk->spec.param_dtype, (const char*)src + (ru.first + j * ru.stride) * width, src_dtype,
                            ru.len, 1.0));
    }
  pl_runs(bk, item, bk->spec.shard_rank, &ru);
  for (int64_t j = 0; j < ru.count && pl_own_main(bk); ++j)
    MFSDP_CHECK(k->copy(p->be.kernels_ctx, pl_at(&bk->buf[MFSDP_BUF_MAIN_SHARD], to + j * ru.len), bk->spec.main_dtype,
                        (const char*)src + (ru.first + j * ru.stride) * width, src_dtype, ru.len, 1.0));
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_local(mfsdp_pipeline* p, int32_t b, int32_t item, const void* src, int32_t src_dtype,
                                      int64_t numel) {
  MFSDP_CHECK(pl_check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (bk->init != PL_INIT_DIRECT)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: set_local outside init_begin(direct)/init_end", b);
  if (item < 0 || item >= bk->spec.layout.n_items)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d has no item %d", b, item);
  mfsdp_runs ru;
  pl_runs(bk, item, bk->spec.shard_rank, &ru);
  int64_t n = ru.count * ru.len;
  if (numel != n)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT,
                      "bucket %d item %d: %lld local elements given, this rank holds %lld", b, item, (long long)numel,
                      (long long)n);
  if (n == 0) return MFSDP_OK;
  const mfsdp_kernel_ops* k = p->be.kernels;
  int64_t to = bk->shard_offsets[item];
  if (bk->storage[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD) /* HFSDP: the replicas' gather brings the rest */
    MFSDP_CHECK(k->copy(p->be.kernels_ctx, pl_at(&bk->buf[MFSDP_BUF_WEIGHT_SHARD], bk->sub_start + to),
                        bk->spec.param_dtype, src, src_dtype, n, 1.0));
  if (pl_own_main(bk))
    MFSDP_CHECK(k->copy(p->be.kernels_ctx, pl_at(&bk->buf[MFSDP_BUF_MAIN_SHARD], to), bk->spec.main_dtype, src,
                        src_dtype, n, 1.0));
  if (!bk->spec.weights_sharded) /* persistent full weights: this rank's rows (a gather brings the rest) */
    for (int64_t j = 0; j < ru.count; ++j)
      MFSDP_CHECK(k->copy(p->be.kernels_ctx,
                          pl_at(&bk->buf[MFSDP_BUF_WEIGHT], bk->param_offsets[item] + ru.first + j * ru.stride),
                          bk->spec.param_dtype, (const char*)src + j * ru.len * mfsdp_dtype_size(src_dtype), src_dtype,
                          ru.len, 1.0));
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_init_end(mfsdp_pipeline* p, int32_t b) {
  MFSDP_CHECK(pl_check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (bk->init == PL_INIT_NONE) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: init_end without init_begin", b);
  if (bk->init == PL_INIT_FULL) { /* derive the shards from the full weights; padding zero */
    const mfsdp_buffer* w = &bk->buf[MFSDP_BUF_WEIGHT];
    if (bk->storage[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD) {
      MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_WEIGHT_SHARD));
      MFSDP_CHECK(pack_own_rows(p, bk, bk->buf[MFSDP_BUF_WEIGHT_SHARD].data, bk->spec.param_dtype, w, 1));
    }
    if (pl_own_main(bk)) {
      MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_MAIN_SHARD));
      MFSDP_CHECK(pack_own_rows(p, bk, bk->buf[MFSDP_BUF_MAIN_SHARD].data, bk->spec.main_dtype, w, 0));
    }
  }
  bk->init = PL_INIT_NONE;
  if (bk->spec.weights_sharded) {
    MFSDP_CHECK(pl_release(p, bk, MFSDP_BUF_WEIGHT));
    bk->wstate = MFSDP_W_EMPTY;
  } else {
    bk->wstate = MFSDP_W_READY;
  }
  return MFSDP_OK;
}

/* This rank's slice of the gather buffer (WEIGHT_SHARD) from wherever its rows live. */
static mfsdp_status fill_own_slice(mfsdp_pipeline* p, bucket* bk) {
  void* slice = bk->buf[MFSDP_BUF_WEIGHT_SHARD].data;
  if (casts_on_gather(bk)) /* see [Note: cast on gather] */
    return p->be.kernels->copy(p->be.kernels_ctx, slice, bk->spec.param_dtype, bk->buf[MFSDP_BUF_MAIN_SHARD].data,
                               bk->spec.main_dtype, bk->shard_size, 1.0);
  if (pl_main_in_weight(bk)) return pack_own_rows(p, bk, slice, bk->spec.param_dtype, &bk->buf[MFSDP_BUF_WEIGHT], 1);
  return MFSDP_OK; /* an own WEIGHT_SHARD, or the slice already is this rank's part of WEIGHT */
}

static mfsdp_status start_gather(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(pl_complete_outer_of(p, bk)); /* HFSDP: the replicas' gather of this step's weights */
  if (bk->q_weights >= 0) return pl_wire_start_gather(p, bk); /* [Note: quantized communication] */
  MFSDP_CHECK(pl_materialize(p, bk, bk->gather_kind));
  MFSDP_CHECK(fill_own_slice(p, bk));
  bk->wstate = MFSDP_W_GATHERING;
  if (!pl_communicates(p, bk)) {
    if (bk->storage[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD) /* one inner rank (HFSDP 4x1): a copy */
      MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, pl_at(&bk->buf[bk->gather_kind], bk->shard_start),
                                      bk->spec.param_dtype, bk->buf[MFSDP_BUF_WEIGHT_SHARD].data, bk->spec.param_dtype,
                                      bk->shard_size, 1.0));
    return MFSDP_OK;
  }
  mfsdp_status st = p->be.transport->all_gather(p->be.transport_ctx, &bk->buf[bk->gather_kind],
                                                &bk->buf[MFSDP_BUF_WEIGHT_SHARD], &bk->gather_work);
  if (st != MFSDP_OK) return pl_comm_failed(p, st);
  pl_count(bk, PL_COMM_all_gather, bk->full_size * mfsdp_dtype_size(bk->spec.param_dtype));
  return MFSDP_OK;
}

/* Rank-major gather -> parameter-major full weights (see [Note: chunked layout]). Under
 * ZeRO-1/2 with the main weights inside WEIGHT, this rank's own rows are already in place. */
static mfsdp_status copy_out(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GATHER];
  packer k = {p, bk->buf[MFSDP_BUF_WEIGHT].data, bk->spec.param_dtype, 1.0, 0, 0, {{0}}};
  int32_t skip = pl_main_in_weight(bk) ? bk->spec.shard_rank : -1;
  for (int32_t i = 0; i < bk->spec.layout.n_items; ++i)
    for (int32_t r = 0; r < bk->holders; ++r) {
      if (r == skip) continue;
      mfsdp_runs ru;
      pl_runs(bk, i, r, &ru);
      for (int64_t j = 0; j < ru.count; ++j)
        MFSDP_CHECK(pl_packer_add(&k, pl_at(g, pl_slot_of(bk, r) + bk->shard_offsets[i] + j * ru.len), g->dtype,
                                  bk->param_offsets[i] + ru.first + j * ru.stride, ru.len));
    }
  return pl_packer_flush(&k);
}

/* The gather has been issued: wait for it and copy it out; full weights usable after this. */
mfsdp_status pl_finish_gather(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(pl_wait_work(p, &bk->gather_work));
  if (bk->q_weights >= 0) {
    MFSDP_CHECK(pl_wire_finish_gather(p, bk));
  } else if (bk->gather_kind == MFSDP_BUF_GATHER) {
    MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_WEIGHT));
    MFSDP_CHECK(copy_out(p, bk));
    MFSDP_CHECK(pl_release(p, bk, MFSDP_BUF_GATHER));
  }
  bk->wstate = MFSDP_W_READY;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_unshard(mfsdp_pipeline* p, const int32_t* ids, int32_t n) {
  MFSDP_CHECK(pl_healthy(p));
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(pl_check_bucket(p, ids[i]));
  /* A unit's gathers go out as one group (one NCCL launch for all its buckets). */
  const mfsdp_transport_ops* t = p->be.transport;
  int group = n > 1 && t->group_start != NULL;
  if (group) MFSDP_CHECK(pl_comm_failed(p, t->group_start(p->be.transport_ctx)));
  mfsdp_status st = MFSDP_OK;
  for (int32_t i = 0; i < n && st == MFSDP_OK; ++i) {
    bucket* bk = &p->b[ids[i]];
    if (bk->wstate == MFSDP_W_EMPTY || bk->wstate == MFSDP_W_STALE) st = start_gather(p, bk);
  }
  if (group) { /* always closed, even after an error: NCCL groups must balance */
    mfsdp_status end = t->group_end(p->be.transport_ctx);
    if (st == MFSDP_OK && end != MFSDP_OK) st = pl_comm_failed(p, end);
  }
  return st;
}

mfsdp_status mfsdp_pipeline_wait_unshard(mfsdp_pipeline* p, const int32_t* ids, int32_t n) {
  MFSDP_CHECK(pl_healthy(p));
  for (int32_t i = 0; i < n; ++i) {
    MFSDP_CHECK(pl_check_bucket(p, ids[i]));
    bucket* bk = &p->b[ids[i]];
    if (bk->wstate == MFSDP_W_GATHERING) {
      MFSDP_CHECK(pl_finish_gather(p, bk));
    } else if (bk->wstate != MFSDP_W_READY) {
      return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: waited for weights that were never gathered", ids[i]);
    }
  }
  return MFSDP_OK;
}

/* Drops an in-flight gather's result (its values are about to be released or are stale). */
static mfsdp_status abandon_gather(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(pl_wait_work(p, &bk->gather_work));
  MFSDP_CHECK(pl_release(p, bk, MFSDP_BUF_GATHER_WIRE));
  return pl_release(p, bk, MFSDP_BUF_GATHER);
}

/* [Note: kept full weights]
 * A ZeRO-3 bucket releases its full weights (WEIGHT) when resharded, and the next unshard
 * allocates them again: the memory may come back at another address. A bucket set to keep them
 * (mfsdp_pipeline_set_keep_weights; FSDP2's set_keep_unsharded_storage, for CUDA graph capture,
 * which replays kernels on fixed addresses) leaves WEIGHT allocated and marks it STALE instead:
 * its values no longer count (the main shard may change before the next gather), and the next
 * unshard gathers into the same memory (pl_materialize keeps a present buffer), so every view of
 * the compute parameters keeps its data pointer. Only WEIGHT is kept; the rank-major GATHER
 * staging of a non-identity bucket stays temporary, as the parameters never view it. Turning
 * the setting off releases the kept weights of the buckets that are resharded (STALE) at once. */
static mfsdp_status reshard_bucket(mfsdp_pipeline* p, bucket* bk) {
  if (!bk->spec.weights_sharded || bk->wstate == MFSDP_W_EMPTY) return MFSDP_OK;
  if (bk->wstate == MFSDP_W_GATHERING) MFSDP_CHECK(abandon_gather(p, bk));
  if (bk->keep_weights) {
    bk->wstate = MFSDP_W_STALE;
    return MFSDP_OK;
  }
  MFSDP_CHECK(pl_release(p, bk, MFSDP_BUF_WEIGHT));
  bk->wstate = MFSDP_W_EMPTY;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_reshard(mfsdp_pipeline* p, const int32_t* ids, int32_t n) {
  MFSDP_CHECK(pl_healthy(p));
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(pl_check_bucket(p, ids[i]));
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(reshard_bucket(p, &p->b[ids[i]]));
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_keep_weights(mfsdp_pipeline* p, const int32_t* ids, int32_t n, int keep) {
  MFSDP_CHECK(pl_healthy(p));
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(pl_check_bucket(p, ids[i]));
  for (int32_t i = 0; i < n; ++i) {
    bucket* bk = &p->b[ids[i]];
    bk->keep_weights = (int8_t)!!keep;
    if (!keep && bk->spec.weights_sharded && bk->wstate == MFSDP_W_STALE) MFSDP_CHECK(reshard_bucket(p, bk));
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_install_main_weights(mfsdp_pipeline* p, int include_frozen) {
  MFSDP_CHECK(pl_healthy(p));
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (!bk->has_grads && !include_frozen) continue; /* no .grad: no optimizer changed it */
    if (!bk->gathered) { /* the shard is the whole bucket: main -> compute weights now */
      if (pl_own_main(bk))
        MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, bk->buf[MFSDP_BUF_WEIGHT_SHARD].data, bk->spec.param_dtype,
                                        bk->buf[MFSDP_BUF_MAIN_SHARD].data, bk->spec.main_dtype, bk->shard_size, 1.0));
      continue;
    }
    if (bk->wstate == MFSDP_W_GATHERING) { /* carries the old values: drop it */
      if (bk->spec.weights_sharded) {
        MFSDP_CHECK(reshard_bucket(p, bk));
      } else {
        MFSDP_CHECK(abandon_gather(p, bk));
        bk->wstate = MFSDP_W_STALE;
      }
    }
    if (bk->wstate != MFSDP_W_EMPTY) bk->wstate = MFSDP_W_STALE; /* the next unshard spreads the new values */
    if (bk->subs > 1) /* the replicas' sub-shards first ([Note: optimizer sharded across replicas]) */
      MFSDP_CHECK(pl_launch_outer_gather(p, bk));
  }
  return MFSDP_OK;
}

