/* backward.c: the backward protocol (begin_backward, grad_ready, seal, end_backward) and the
 * gradient sync and zeroing around the optimizer step.
 *
 * [Note: one pack per bucket]
 * Gradients arrive one parameter at a time. Rather than one copy (one kernel launch on a GPU)
 * per parameter, the pipeline keeps each gradient alive (memory ops retain/drop) until its
 * bucket is complete, then packs them all with one `pack` call: scaled copies into the
 * temporary comm bucket (ZeRO-2/3) or adds into the persistent local sum (no_shard/ZeRO-1).
 * Each gradient goes in as one pack item per rank, straight to its rank-major place (see
 * [Note: chunked layout] in core/mfsdp_layout.h). Buckets left incomplete are packed at the
 * end of backward. The copy-out of a gather into the full weights is one pack as well.
 *
 * [Note: held gradients]
 * A ZeRO-2/3 bucket put on hold (mfsdp_pipeline_set_hold, FSDP2's
 * set_requires_gradient_sync(False): its `hold`) is not reduced in a backward: its
 * gradients are added, unscaled, into its full gradient buffer, which stays allocated (one full
 * copy of the bucket's gradients, as DDP holds) and is marked `held_grads`. The next
 * backward off hold adds its own gradients unscaled too, scales the sum once and
 * reduce-scatters it, which clears the mark: the local sum over microbatches is formed exactly
 * as DDP forms it. While the mark is set, the pre-scale cannot change (set_prescale refuses)
 * and zero_grads discards the sums with the buffer. */
#include "pipeline_internal.h"

#include <string.h>

mfsdp_status mfsdp_pipeline_begin_backward(mfsdp_pipeline* p, int sync) {
  MFSDP_CHECK(pl_healthy(p));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "begin_backward inside a backward");
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    bk->n_ready = 0;
    bk->launched = 0;
    bk->complete = 0;
    if (bk->spec.layout.n_items) memset(bk->ready, 0, (size_t)bk->spec.layout.n_items);
  }
  p->in_backward = 1;
  p->sync = !!sync;
  p->next = 0;
  return MFSDP_OK;
}

/* Packs the bucket's pending gradients, each as one piece per rank straight to its rank-major
 * place (see [Note: one pack per bucket]). */
static mfsdp_status flush_pending(mfsdp_pipeline* p, bucket* bk) {
  if (bk->n_pending == 0) return MFSDP_OK;
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
  int accumulate = bk->spec.grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE;
  double alpha = accumulate ? 1.0 : bk->prescale;
  if (!accumulate && (bk->hold || bk->held_grads)) { /* [Note: held gradients]: unscaled local sums */
    if (!bk->held_grads) {
      MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_GRAD));
      MFSDP_CHECK(p->be.kernels->fill_zero(p->be.kernels_ctx, g->data, g->dtype, bk->full_size));
      bk->held_grads = 1;
    }
    accumulate = 1;
    alpha = 1.0;
  } else if (!accumulate) {
    if (bk->gstate == MFSDP_G_CLEAN) {
      MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_GRAD));
      MFSDP_CHECK(pl_zero_holes(p, bk));
    }
  } else {
    int32_t id = (int32_t)(bk - p->b);
    if (bk->gstate == MFSDP_G_REDUCING) MFSDP_CHECK(pl_complete_until(p, id));
    if (bk->gstate == MFSDP_G_REDUCED) MFSDP_CHECK(pl_rebase(p, bk));
  }
  packer k = {p, g->data, g->dtype, alpha, accumulate, 0, {{0}}};
  mfsdp_status st = MFSDP_OK;
  for (int32_t j = 0; j < bk->n_pending && st == MFSDP_OK; ++j) {
    const pending_grad* pg = &bk->pending[j];
    int64_t width = mfsdp_dtype_size(pg->dtype);
    for (int32_t r = 0; r < bk->holders && st == MFSDP_OK; ++r) {
      mfsdp_runs ru;
      pl_runs(bk, pg->item, r, &ru);
      for (int64_t q = 0; q < ru.count && st == MFSDP_OK; ++q)
        st = pl_packer_add(&k, (const char*)pg->src + (ru.first + q * ru.stride) * width, pg->dtype,
                           pl_slot_of(bk, r) + bk->shard_offsets[pg->item] + q * ru.len, ru.len);
    }
  }
  if (st == MFSDP_OK) st = pl_packer_flush(&k);
  for (int32_t j = 0; j < bk->n_pending; ++j) {
    if (bk->pending[j].handle) p->be.memory->drop(p->be.memory_ctx, bk->pending[j].handle);
    bk->pending[j].handle = NULL;
  }
  bk->n_pending = 0;
  MFSDP_CHECK(st);
  bk->gstate = MFSDP_G_DIRTY;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_grad_ready(mfsdp_pipeline* p, int32_t b, int32_t item, const void* src, int32_t src_dtype,
                                       int64_t numel, void* keepalive) {
  MFSDP_CHECK(pl_healthy(p));
  MFSDP_CHECK(pl_check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (!p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: gradient outside a backward pass", b);
  int32_t n_items = bk->spec.layout.n_items;
  if (item < 0 || item >= n_items || numel != bk->numels[item])
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d item %d: gradient of %lld elements, expected %lld", b,
                      item, (long long)numel, item >= 0 && item < n_items ? (long long)bk->numels[item] : -1LL);
  if (!bk->trainable[item]) /* [Note: requires_grad changes] in trainable.c */
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d item %d is frozen: no gradient expected", b, item);
  if (bk->ready[item])
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d item %d: gradient reported twice in one backward", b, item);
  if (bk->launched || bk->complete)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE,
                      "bucket %d item %d: gradient arrived after its bucket was reduced in this backward (a parameter "
                      "of a unit that did not run in this forward, or used after its unit's backward?)", b, item);
  if (!mfsdp_dtype_is_float(src_dtype))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d item %d: gradient of dtype %s", b, item,
                      mfsdp_dtype_name(src_dtype));
  if (keepalive) p->be.memory->retain(p->be.memory_ctx, keepalive);
  bk->pending[bk->n_pending++] = (pending_grad){src, src_dtype, item, keepalive};
  bk->ready[item] = 1;
  bk->used[item] = 1; /* [Note: used-flag tail] in reduce.c */
  bk->n_ready++;
  if (bk->n_ready == bk->n_trainable) {
    MFSDP_CHECK(flush_pending(p, bk));
    bk->complete = 1;
    MFSDP_CHECK(pl_launch_in_order(p));
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_seal(mfsdp_pipeline* p, const int32_t* ids, int32_t n) {
  MFSDP_CHECK(pl_healthy(p));
  if (!p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "seal outside a backward pass");
  for (int32_t i = 0; i < n; ++i) {
    MFSDP_CHECK(pl_check_bucket(p, ids[i]));
    bucket* bk = &p->b[ids[i]];
    MFSDP_CHECK(flush_pending(p, bk));
    bk->complete = 1;
  }
  return pl_launch_in_order(p);
}

mfsdp_status mfsdp_pipeline_end_backward(mfsdp_pipeline* p) {
  MFSDP_CHECK(pl_healthy(p));
  if (!p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "end_backward without begin_backward");
  for (int32_t i = 0; i < p->n; ++i) { /* incomplete buckets: what arrived, then zeros for the rest */
    MFSDP_CHECK(flush_pending(p, &p->b[i]));
    p->b[i].complete = 1;
  }
  MFSDP_CHECK(pl_launch_in_order(p));
  MFSDP_CHECK(pl_complete_all(p));
  MFSDP_CHECK(pl_complete_outer(p, 0));
  p->reduce_due = 0; /* no_shard/ZeRO-1 sums left unreduced by this backward: the step's sync reduces them */
  for (int32_t i = 0; i < p->n; ++i)
    if ((p->b[i].spec.grad_mode == MFSDP_GRAD_ALL_REDUCE || p->b[i].spec.grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE) &&
        pl_reduces(&p->b[i]) && !p->b[i].launched)
      p->reduce_due = 1;
  p->in_backward = 0;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_sync_grads(mfsdp_pipeline* p) {
  MFSDP_CHECK(pl_healthy(p));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "gradient sync requested inside a backward pass");
  if (p->reduce_due) { /* every no_shard/ZeRO-1 bucket, on every rank, in the shared order */
    for (int32_t k = 0; k < p->n; ++k) {
      bucket* bk = &p->b[p->order[k]];
      if ((bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE || bk->spec.grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE) &&
          pl_reduces(bk) && !bk->hold)
        MFSDP_CHECK(pl_launch_bucket(p, p->order[k]));
    }
    p->reduce_due = 0;
  }
  MFSDP_CHECK(pl_complete_all(p));
  MFSDP_CHECK(pl_complete_outer(p, 0));
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->storage[MFSDP_BUF_OPT_GRAD] == MFSDP_BUF_OPT_GRAD)
      MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, bk->buf[MFSDP_BUF_OPT_GRAD].data, bk->spec.main_dtype,
                                      pl_at(&bk->buf[MFSDP_BUF_GRAD_SHARD], bk->sub_start), bk->spec.grad_dtype,
                                      bk->sub_size, 1.0));
  }
  return pl_host_wait_offloaded(p);
}

/* [Note: a bucket's gradients before the sync]
 * An optimizer that steps each bucket as its gradients land (ZeRO-Offload's overlap,
 * [Note: stepping in backward] in megatron_fsdp_c/_backward_step.py) asks for one bucket's
 * optimizer gradient before sync_grads. It is final, and the host's to read, once the bucket's
 * reduction in this syncing backward has completed and landed in GRAD_SHARD, when that buffer is
 * also the optimizer's (OPT_GRAD aliases it) and no reduction across replicas still follows.
 * Offloaded, it has landed once mfsdp_pipeline_wait_grads returns (a GPU's kernels write the
 * host GRAD_SHARD in stream order, after finish_grads returned).
 * Anything else (no_shard/ZeRO-1 sums reduced at the sync, a bucket on hold, HSDP/HFSDP, an
 * OPT_GRAD of its own, a reduction not yet launched) answers "not ready", and the caller steps it
 * after the sync as usual. Completing a reduction issues no collective, so every rank may ask
 * about any bucket at any time without changing the collective order. */
mfsdp_status mfsdp_pipeline_finish_grads(mfsdp_pipeline* p, int32_t b, int* ready) {
  *ready = 0;
  MFSDP_CHECK(pl_healthy(p));
  MFSDP_CHECK(pl_check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (!p->sync || !bk->launched || bk->hold || bk->spec.grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE ||
      (p->cfg.outer_world > 1 && p->be.outer != NULL) || bk->storage[MFSDP_BUF_OPT_GRAD] != MFSDP_BUF_GRAD_SHARD)
    return MFSDP_OK;
  if (bk->gstate == MFSDP_G_REDUCING) MFSDP_CHECK(pl_complete_until(p, b));
  if (bk->spec.offload) MFSDP_CHECK(p->be.kernels->host_mark(p->be.kernels_ctx, &bk->landed));
  *ready = 1;
  return MFSDP_OK;
}

/* The wait for what finish_grads made final: the kernels that add the reduced slice into an
 * offloaded GRAD_SHARD (host memory, written in place) may still be queued when it returns, so
 * it leaves a mark behind them, and the thread that steps the bucket waits for that mark alone
 * (never the whole stream: the autograd thread queues the next unit's backward meanwhile). The
 * mark is recorded again only by the next syncing backward's finish_grads of the bucket, after
 * the steps of this one were joined ([Note: stepping in backward] in _backward_step.py). */
mfsdp_status mfsdp_pipeline_wait_grads(mfsdp_pipeline* p, int32_t b) {
  MFSDP_CHECK(pl_check_bucket(p, b));
  return p->be.kernels->host_wait_mark(p->be.kernels_ctx, p->b[b].landed);
}

mfsdp_status mfsdp_pipeline_zero_grads(mfsdp_pipeline* p) {
  MFSDP_CHECK(pl_healthy(p));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "zero_grad inside a backward pass");
  MFSDP_CHECK(pl_complete_all(p));
  MFSDP_CHECK(pl_complete_outer(p, 0));
  p->reduce_due = 0; /* nothing left to reduce */
  const mfsdp_kernel_ops* k = p->be.kernels;
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->spec.layout.n_items) memset(bk->used, 0, (size_t)bk->spec.layout.n_items); /* tails: zeroed below */
    if (!bk->has_grads) continue;
    int target = bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE ? MFSDP_BUF_GRAD_SHARD : MFSDP_BUF_GRAD;
    MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, bk->buf[target].data, bk->buf[target].dtype, bk->buf[target].numel));
    if (bk->held_grads) { /* discard what was held back */
      MFSDP_CHECK(pl_release(p, bk, MFSDP_BUF_GRAD));
      bk->held_grads = 0;
    }
    bk->outer_reduced = 0;
    bk->flags_local = 0; /* zero tails everywhere: every rank's */
    if (bk->storage[MFSDP_BUF_OPT_GRAD] == MFSDP_BUF_OPT_GRAD)
      MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, bk->buf[MFSDP_BUF_OPT_GRAD].data, bk->spec.main_dtype, bk->sub_size));
    bk->gstate = MFSDP_G_CLEAN;
  }
  return pl_host_wait_offloaded(p);
}

mfsdp_status mfsdp_pipeline_zero_item_grads(mfsdp_pipeline* p, int32_t b, const int32_t* items, int32_t n) {
  MFSDP_CHECK(pl_healthy(p));
  MFSDP_CHECK(pl_check_bucket(p, b));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "zero_grad inside a backward pass");
  bucket* bk = &p->b[b];
  if (!bk->has_grads) return MFSDP_OK;
  if (bk->gstate == MFSDP_G_REDUCING) MFSDP_CHECK(pl_complete_until(p, b));
  MFSDP_CHECK(pl_complete_outer(p, 0));
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  int persistent = bk->spec.grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE; /* GRAD holds every rank's pieces */
  const mfsdp_buffer* g = &bk->buf[persistent ? MFSDP_BUF_GRAD : MFSDP_BUF_GRAD_SHARD];
  for (int32_t j = 0; j < n; ++j) {
    int32_t i = items[j];
    if (i < 0 || i >= bk->spec.layout.n_items)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d has no item %d", b, i);
    if (persistent) {
      for (int32_t r = 0; r < bk->holders; ++r)
        MFSDP_CHECK(k->fill_zero(kc, pl_at(g, pl_slot_of(bk, r) + bk->shard_offsets[i]), g->dtype, bk->pieces[i]));
    } else {
      for (int32_t o = 0; o < bk->subs; ++o)
        MFSDP_CHECK(
            k->fill_zero(kc, pl_at(g, (int64_t)o * bk->sub_size + bk->shard_offsets[i]), g->dtype, bk->pieces[i]));
      const mfsdp_buffer* held = &bk->buf[MFSDP_BUF_GRAD];
      for (int32_t r = 0; bk->held_grads && r < bk->holders; ++r)
        MFSDP_CHECK(
            k->fill_zero(kc, pl_at(held, pl_slot_of(bk, r) + bk->shard_offsets[i]), held->dtype, bk->pieces[i]));
    }
    if (bk->storage[MFSDP_BUF_OPT_GRAD] == MFSDP_BUF_OPT_GRAD)
      MFSDP_CHECK(k->fill_zero(kc, pl_at(&bk->buf[MFSDP_BUF_OPT_GRAD], bk->shard_offsets[i]), bk->spec.main_dtype,
                               bk->pieces[i]));
    MFSDP_CHECK(pl_zero_item_flags(p, bk, i));
  }
  if (n == bk->spec.layout.n_items) { /* all zero: nothing of it was reduced across replicas either */
    bk->gstate = MFSDP_G_CLEAN;
    bk->outer_reduced = 0;
    bk->flags_local = 0;
  }
  return MFSDP_OK;
}

