/* reduce.c: the gradient reduction queue: launches in the order every rank shares, the
 * bounded queue of reductions in flight, their completion per gradient mode, and the exchange
 * reduction for narrow communication dtypes.
 *
 * [Note: collective order]
 * Every rank must issue the same collectives in the same order, whatever order its gradients
 * arrive in: a graph may differ across ranks (LayerDrop, a data-dependent branch, an MoE expert
 * that got no tokens here), and so may autograd's order. Gathers run in the order the caller
 * lists them (the hooks keep one shared unit order, see [Note: gather order] in _hooks.py).
 * Reductions follow one launch order shared by every rank (`order`: by default later units
 * first, the order backward normally completes them, then buckets outside every unit; the
 * wrappers give the units whose forwards start later first, as a unit containing others completes
 * after them, ParamBuffer.reduce_order): a
 * complete bucket waits until every bucket before it in that order has been launched, and in
 * every backward each bucket that reduces is launched exactly once -- complete, sealed (its
 * unit did not run here, mfsdp_pipeline_seal), or at the end of backward with zeros for what
 * this rank did not use. So the n-th reduction is the same bucket on every rank, as in DDP
 * (which launches its buckets in index order for the same reason).
 *
 * [Note: reduce once per step]
 * no_shard and ZeRO-1 accumulate local gradients in the persistent GRAD and reduce them once
 * per optimisation step. When a reduced buffer receives further gradients (several syncing
 * backwards before one step), `pl_rebase` first rescales it so that the next reduction counts the
 * already-reduced part exactly once: an all-reduced sum R sits on all `world` ranks, so it is
 * divided by world * f (f = the factor the reduction applies); a reduce-scattered slice sits on
 * one rank only, so it is divided by f and the stale local values around it are zeroed.
 *
 * [Note: exchange reduction]
 * A reduce-scatter in bf16 sums in bf16: every partial sum on the ring is rounded to 8 bits.
 * When the communication dtype is narrower than the main gradients, the pipeline sends the same
 * bytes with an all-to-all (each rank receives every rank's narrow piece of its own slice) and
 * adds the pieces into the main gradient in its own dtype, in rank order: each contribution is
 * rounded once (to the wire dtype) and the sum never is. Quantized gradients travel the same way,
 * as wire pieces ([Note: quantized communication] in wire.c). A bucket whose spec says
 * `sum_in_comm_dtype` (torch's MixedPrecisionPolicy: FSDP2 reduces in reduce_dtype) keeps the
 * collective's own narrow sum instead, and its reduced values are widened when accumulated.
 *
 * [Note: used-flag tail]
 * Which parameters some rank used (so that `.grad` stays None where none did, [Note: unused
 * parameters] in megatron_fsdp_c/_owner.py) rides in the gradient reductions themselves: no
 * collective of its own. A bucket planned with a tail of 3 per item ([Note: flag tail] in
 * core/mfsdp_layout.h) carries, in the tail of every sub-shard, for each item i: [i] used, [n + i]
 * trains, [2n + i] frozen. At each launch (write_flags, after the zeros of unready items and the
 * packing, before the reduction's scaling) this rank's FLAGS (1 where a gradient arrived since the
 * bucket's last launch, `used`; its trainable bits) go into every holder's tail: the used third is
 * added, the other two overwrite. The reduction then sums them like gradients (any op, pre/post
 * scaling, wire dtype, exchange, a sum in the comm dtype, across replicas): sums of 0/1 times a
 * positive factor, so "> 0" reads "on some rank" exactly (a positive sum never rounds to 0),
 * whatever the rounding. The used third lives in the main gradient shard like a gradient:
 * accumulated (ZeRO-2/3), rebased ([Note: reduce once per step]), zeroed with the gradients
 * (zero_grads, zero_item_grads), so it reads "used on some rank since the gradients were last
 * zeroed". The check thirds are fresh per reduction (the accumulator's are zeroed before each
 * reduced slice is added): both > 0 means the ranks disagreed on whether the item trains ([Note:
 * changing requires_grad] in _trainable.py). A bucket's flags are final when it launches
 * (complete, sealed or at the end of backward, [Note: collective order]): no reduction waits for
 * another. Nothing reads the tail as a weight or gradient: every view, norm and optimizer state is
 * per item. Quantized gradient wires ([Note: quantized communication] in wire.c) carry it only
 * where no block mixes flags and gradients and the flags are exactly 0 or 1 (ZeRO-2/3 with the
 * tail and sub-shards on block boundaries, which the planner's tail_align gives): a
 * no_shard/ZeRO-1 persistent sum puts a rebased flag (up to the world) beside a 1, which a coarse
 * int4 block could round to 0; those buckets carry none (pipeline.c). With replicas, the flags of a
 * reduction that did not cross them (a backward without sync under ZeRO-2/3 until the next sync's,
 * or set_outer_hold) are one replica's (`flags_local`, said by mfsdp_pipeline_flag_tail): the used
 * flags are then those of the replica, as its gradients are, and the trainable check waits for a
 * reduction across every rank (run on one replica only, its error would leave the others waiting). */
#include "pipeline_internal.h"

#include <string.h>

static int64_t reduce_bytes(const bucket* bk) {
  const mfsdp_buffer* b = bk->present[MFSDP_BUF_COMM] ? &bk->buf[MFSDP_BUF_COMM] : &bk->buf[MFSDP_BUF_GRAD];
  return b->numel * mfsdp_dtype_size(b->dtype);
}

/* Sums the `shards` pieces of EXCHANGE (every rank's contribution to this rank's slice, in the
 * comm dtype) into `dst` (grad dtype) in rank order, rounding in the grad dtype. */
static mfsdp_status sum_exchanged(mfsdp_pipeline* p, bucket* bk, void* dst, int zero_first) {
  const mfsdp_kernel_ops* k = p->be.kernels;
  int64_t size = bk->shard_size;
  double alpha = p->cfg.reduce_op == MFSDP_REDUCE_AVG ? 1.0 / bk->shards : 1.0;
  if (zero_first) MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, dst, bk->spec.grad_dtype, size));
  if (bk->q_grads >= 0) MFSDP_CHECK(pl_wire_sum(p, bk, dst, size, alpha));
  for (int32_t r = 0; r < bk->shards && bk->q_grads < 0; ++r)
    MFSDP_CHECK(k->accumulate(p->be.kernels_ctx, dst, bk->spec.grad_dtype,
                              pl_at(&bk->buf[MFSDP_BUF_EXCHANGE], r * size), bk->spec.comm_dtype, size, alpha));
  return pl_release(p, bk, MFSDP_BUF_EXCHANGE);
}

/* The second half of an all-reduce done by exchange: sum this rank's block in the grad dtype,
 * round it once to the comm dtype, gather every rank's block and widen the result. All ranks
 * end with identical values. */
static mfsdp_status gather_exchanged(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  int32_t world = p->cfg.dp_world, gdt = bk->spec.grad_dtype, cdt = bk->spec.comm_dtype;
  int64_t size = pl_exchange_block(p, bk), first = (int64_t)p->cfg.dp_rank * size;
  int64_t valid = bk->full_size - first;
  valid = valid < 0 ? 0 : valid > size ? size : valid;
  double alpha = p->cfg.reduce_op == MFSDP_REDUCE_AVG ? 1.0 / world : 1.0;
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
  MFSDP_CHECK(k->fill_zero(kc, pl_at(g, first), gdt, valid));
  if (bk->q_grads >= 0) MFSDP_CHECK(pl_wire_sum(p, bk, pl_at(g, first), valid, alpha));
  for (int32_t r = 0; r < world && bk->q_grads < 0; ++r)
    MFSDP_CHECK(
        k->accumulate(kc, pl_at(g, first), gdt, pl_at(&bk->buf[MFSDP_BUF_EXCHANGE], r * size), cdt, valid, alpha));
  MFSDP_CHECK(pl_release(p, bk, MFSDP_BUF_EXCHANGE));
  const mfsdp_buffer* block = &bk->buf[MFSDP_BUF_COMM_SLICE];
  MFSDP_CHECK(k->copy(kc, block->data, cdt, pl_at(g, first), gdt, valid, 1.0));
  MFSDP_CHECK(k->fill_zero(kc, pl_at(block, valid), cdt, size - valid));
  mfsdp_work* work = NULL;
  mfsdp_status st = p->be.transport->all_gather(p->be.transport_ctx, &bk->buf[MFSDP_BUF_COMM], block, &work);
  if (st != MFSDP_OK) return pl_comm_failed(p, st);
  MFSDP_CHECK(pl_wait_work(p, &work));
  return k->copy(kc, g->data, gdt, bk->buf[MFSDP_BUF_COMM].data, cdt, bk->full_size, 1.0);
}

/* Takes the oldest reduction off the queue. */
static bucket* pop_front(mfsdp_pipeline* p) {
  bucket* bk = &p->b[p->queue[p->q_head]];
  p->q_head = (p->q_head + 1) % (p->n ? p->n : 1);
  p->q_len--;
  p->q_bytes -= reduce_bytes(bk);
  return bk;
}

/* [Note: used-flag tail]: this rank's flags into the tail of every holder's sub-shard of GRAD
 * (materialised, this backward's gradients in): the used third added, the check thirds set. */
static mfsdp_status write_flags(mfsdp_pipeline* p, bucket* bk) {
  if (!bk->flags) return MFSDP_OK;
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  int32_t n = bk->spec.layout.n_items;
  const mfsdp_buffer* f = &bk->buf[MFSDP_BUF_FLAGS];
  MFSDP_CHECK(k->fill_zero(kc, f->data, MFSDP_F32, MFSDP_FLAG_TAIL * (int64_t)n));
  for (int third = 0; third < 3; ++third) /* runs of ones: few launches, whatever n */
    for (int32_t j = 0; j < n;) {
      int one = third == 0 ? bk->used[j] : third == 1 ? bk->trainable[j] : !bk->trainable[j];
      int32_t end = j + 1;
      while (end < n && (third == 0 ? bk->used[end] : third == 1 ? bk->trainable[end] : !bk->trainable[end]) == one)
        ++end;
      if (one) MFSDP_CHECK(k->fill(kc, pl_at(f, (int64_t)third * n + j), MFSDP_F32, end - j, 1.0));
      j = end;
    }
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
  for (int check = 0; check < 2; ++check) {
    packer pk = {p, g->data, g->dtype, 1.0, !check, 0, {{0}}};
    for (int32_t r = 0; r < bk->holders; ++r)
      MFSDP_CHECK(pl_packer_add(&pk, pl_at(f, check ? n : 0), MFSDP_F32,
                                pl_slot_of(bk, r) + pl_tail_of(bk) + (check ? n : 0), check ? 2 * (int64_t)n : n));
    MFSDP_CHECK(pl_packer_flush(&pk));
  }
  memset(bk->used, 0, (size_t)n);
  return MFSDP_OK;
}

/* The check thirds of the main gradient shard's tails start each reduction at zero ([Note:
 * used-flag tail]): they say what the ranks trained in this one. */
static mfsdp_status clear_checks(mfsdp_pipeline* p, bucket* bk) {
  if (!bk->flags) return MFSDP_OK;
  const mfsdp_buffer* gs = &bk->buf[MFSDP_BUF_GRAD_SHARD];
  int64_t n = bk->spec.layout.n_items;
  for (int32_t o = 0; o < bk->subs; ++o)
    MFSDP_CHECK(p->be.kernels->fill_zero(p->be.kernels_ctx, pl_at(gs, (int64_t)o * bk->sub_size + pl_tail_of(bk) + n),
                                         gs->dtype, 2 * n));
  return MFSDP_OK;
}

/* An item's gradients were zeroed: so is its used flag in every tail that holds it ([Note:
 * used-flag tail]), and its arrivals since the last launch are forgotten. */
mfsdp_status pl_zero_item_flags(mfsdp_pipeline* p, bucket* bk, int32_t item) {
  if (!bk->flags) return MFSDP_OK;
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  bk->used[item] = 0;
  int persistent = bk->spec.grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE;
  const mfsdp_buffer* g = &bk->buf[persistent ? MFSDP_BUF_GRAD : MFSDP_BUF_GRAD_SHARD];
  int32_t slots = persistent ? bk->holders : bk->subs;
  for (int32_t r = 0; r < slots; ++r) {
    int64_t slot = persistent ? pl_slot_of(bk, r) : (int64_t)r * bk->sub_size;
    MFSDP_CHECK(k->fill_zero(kc, pl_at(g, slot + pl_tail_of(bk) + item), g->dtype, 1));
  }
  const mfsdp_buffer* held = &bk->buf[MFSDP_BUF_GRAD];
  for (int32_t r = 0; !persistent && bk->held_grads && r < bk->holders; ++r)
    MFSDP_CHECK(k->fill_zero(kc, pl_at(held, pl_slot_of(bk, r) + pl_tail_of(bk) + item), held->dtype, 1));
  return MFSDP_OK;
}

/* ZeRO-2/3: this backward's reduced slice (or exchanged pieces) is added to the main gradient
 * shard; the temporary full gradients go. */
static mfsdp_status finish_accumulate(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(pl_rebase_across_replicas(p, bk));
  MFSDP_CHECK(clear_checks(p, bk));
  if (pl_exchanges(p, bk))
    MFSDP_CHECK(sum_exchanged(p, bk, bk->buf[MFSDP_BUF_GRAD_SHARD].data, 0));
  else
    MFSDP_CHECK(p->be.kernels->accumulate(p->be.kernels_ctx, bk->buf[MFSDP_BUF_GRAD_SHARD].data, bk->spec.grad_dtype,
                                          bk->buf[MFSDP_BUF_GRAD_SLICE].data, bk->spec.comm_dtype, bk->shard_size,
                                          1.0));
  MFSDP_CHECK(pl_release(p, bk, MFSDP_BUF_GRAD));
  bk->gstate = MFSDP_G_CLEAN;
  bk->held_grads = 0;
  return MFSDP_OK;
}

/* no_shard / ZeRO-1: the reduced values land in the persistent GRAD (all of it, or this rank's
 * slice), widened from the comm copy or summed from the exchanged pieces. */
static mfsdp_status finish_in_place(mfsdp_pipeline* p, bucket* bk) {
  int whole = bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE;
  if (pl_exchanges(p, bk) && whole) {
    MFSDP_CHECK(gather_exchanged(p, bk));
  } else if (pl_exchanges(p, bk)) {
    MFSDP_CHECK(sum_exchanged(p, bk, bk->buf[MFSDP_BUF_GRAD_SLICE].data, 1));
  } else if (bk->present[MFSDP_BUF_COMM]) {
    int dst = whole ? MFSDP_BUF_GRAD : MFSDP_BUF_GRAD_SLICE, src = whole ? MFSDP_BUF_COMM : MFSDP_BUF_COMM_SLICE;
    MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, bk->buf[dst].data, bk->spec.grad_dtype, bk->buf[src].data,
                                    bk->spec.comm_dtype, bk->buf[dst].numel, 1.0));
  }
  MFSDP_CHECK(pl_release(p, bk, MFSDP_BUF_COMM));
  bk->gstate = MFSDP_G_REDUCED;
  return MFSDP_OK;
}

/* Completes the reduction at the head of the queue: its bucket's per-mode work, then the
 * reduction across replicas that follows it. */
static mfsdp_status complete_front(mfsdp_pipeline* p) {
  bucket* bk = pop_front(p);
  MFSDP_CHECK(pl_wait_work(p, &bk->reduce_work));
  switch (bk->spec.grad_mode) {
    case MFSDP_GRAD_SCATTER_ACCUMULATE:
      MFSDP_CHECK(finish_accumulate(p, bk));
      break;
    case MFSDP_GRAD_ALL_REDUCE:
    case MFSDP_GRAD_SCATTER_IN_PLACE:
      MFSDP_CHECK(finish_in_place(p, bk));
      break;
    default:
      return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: queued without gradients", (int)(bk - p->b));
  }
  return pl_reduce_across_replicas(p, bk);
}

mfsdp_status pl_complete_until(mfsdp_pipeline* p, int32_t id) {
  while (p->b[id].gstate == MFSDP_G_REDUCING) {
    if (p->q_len == 0) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d reducing but not queued", id);
    MFSDP_CHECK(complete_front(p));
  }
  return MFSDP_OK;
}

mfsdp_status pl_complete_all(mfsdp_pipeline* p) {
  while (p->q_len > 0) MFSDP_CHECK(complete_front(p));
  return MFSDP_OK;
}

/* Issues the bucket's gradient reduction and queues it; bounds the bytes in flight. */
static mfsdp_status launch_reduce(mfsdp_pipeline* p, int32_t id) {
  bucket* bk = &p->b[id];
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  mfsdp_reduce_op op = (mfsdp_reduce_op)p->cfg.reduce_op;
  mfsdp_status st = MFSDP_OK;
  int comm = pl_communicates(p, bk);
  mfsdp_work* work = NULL;
  int exchange = pl_exchanges(p, bk);
  int full = MFSDP_BUF_GRAD, slice = MFSDP_BUF_GRAD_SLICE;
  double premul = 1.0;
  if (bk->spec.grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE) { /* ACCUMULATE scaled while packing */
    if (bk->present[MFSDP_BUF_COMM]) {
      MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_COMM));
      const mfsdp_buffer* c = &bk->buf[MFSDP_BUF_COMM];
      MFSDP_CHECK(k->copy(kc, c->data, bk->spec.comm_dtype, bk->buf[MFSDP_BUF_GRAD].data, bk->spec.grad_dtype,
                          bk->full_size, bk->prescale));
      MFSDP_CHECK(k->fill_zero(kc, pl_at(c, bk->full_size), c->dtype, c->numel - bk->full_size)); /* exchange padding */
      full = MFSDP_BUF_COMM;
      slice = MFSDP_BUF_COMM_SLICE;
    } else if (comm && !exchange && p->be.transport->fuses_premul &&
               (bk->buf[full].dtype == MFSDP_F32 || bk->buf[full].dtype == MFSDP_F64)) {
      premul = bk->prescale; /* scaled inside the collective: one pass less */
    } else {
      MFSDP_CHECK(k->scale(kc, bk->buf[full].data, bk->buf[full].dtype, bk->full_size, bk->prescale));
    }
  }
  if (exchange) {
    MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_EXCHANGE));
    if (bk->q_grads >= 0) /* [Note: quantized communication] in wire.c */
      st = pl_wire_exchange(p, bk, &bk->buf[full], &work);
    else
      st = p->be.transport->all_to_all(p->be.transport_ctx, &bk->buf[MFSDP_BUF_EXCHANGE], &bk->buf[full], &work);
  } else if (comm && bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE) {
    st = p->be.transport->all_reduce(p->be.transport_ctx, &bk->buf[full], op, premul, &work);
  } else if (comm) {
    st = p->be.transport->reduce_scatter(p->be.transport_ctx, &bk->buf[slice], &bk->buf[full], op, premul, &work);
  }
  if (st != MFSDP_OK) return pl_comm_failed(p, st);
  int all_reduce = bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE;
  if (bk->q_grads >= 0) /* the wire pieces, and for an all-reduce the gather of the reduced blocks */
    pl_count(bk, all_reduce ? PL_COMM_quantized_all_reduce : PL_COMM_quantized_reduce_scatter,
             bk->buf[MFSDP_BUF_GRAD_WIRE].numel + (all_reduce ? reduce_bytes(bk) : 0));
  else if (exchange || comm) /* an exchange counts as the reduction it replaces */
    pl_count(bk, all_reduce ? PL_COMM_all_reduce : PL_COMM_reduce_scatter, reduce_bytes(bk));
  bk->reduce_work = work;
  bk->gstate = MFSDP_G_REDUCING;
  bk->launched = 1;
  p->queue[(p->q_head + p->q_len) % p->n] = id;
  p->q_len++;
  p->q_bytes += reduce_bytes(bk);
  while (p->q_len > 1 && p->q_bytes > p->cfg.reduce_queue_bytes) MFSDP_CHECK(complete_front(p));
  return MFSDP_OK;
}

/* See [Note: reduce once per step]. */
mfsdp_status pl_rebase(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  double world = (double)p->cfg.dp_world;
  double f = bk->prescale * (p->cfg.reduce_op == MFSDP_REDUCE_AVG ? 1.0 / world : 1.0);
  if (bk->outer_reduced) f *= pl_outer_factor(p); /* held by every replica too ([Note: hybrid sharding]) */
  bk->outer_reduced = 0;
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
  if (bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE) {
    double c = 1.0 / (world * f);
    if (c != 1.0) MFSDP_CHECK(k->scale(kc, g->data, g->dtype, bk->full_size, c));
  } else {
    int64_t start = bk->shard_start, end = start + bk->shard_size;
    MFSDP_CHECK(k->fill_zero(kc, g->data, g->dtype, start));
    MFSDP_CHECK(k->fill_zero(kc, pl_at(g, end), g->dtype, bk->full_size - end));
    if (f != 1.0) MFSDP_CHECK(k->scale(kc, bk->buf[MFSDP_BUF_GRAD_SLICE].data, g->dtype, bk->shard_size, 1.0 / f));
  }
  bk->gstate = MFSDP_G_DIRTY;
  return MFSDP_OK;
}

/* Makes a bucket's gradient buffer ready to reduce and launches it: ZeRO-2/3 buckets get zeros
 * where this rank had no gradient; a no_shard/ZeRO-1 sum that was already reduced is rebased so
 * that this reduction counts it once ([Note: reduce once per step]). */
mfsdp_status pl_launch_bucket(mfsdp_pipeline* p, int32_t id) {
  bucket* bk = &p->b[id];
  if (bk->gstate == MFSDP_G_REDUCING) MFSDP_CHECK(pl_complete_until(p, id));
  if (bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE) {
    const mfsdp_kernel_ops* k = p->be.kernels;
    MFSDP_CHECK(pl_materialize(p, bk, MFSDP_BUF_GRAD));
    const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
    if (bk->held_grads) { /* unscaled sums of several backwards: scale once ([Note: held gradients]) */
      if (bk->prescale != 1.0) MFSDP_CHECK(k->scale(p->be.kernels_ctx, g->data, g->dtype, bk->full_size, bk->prescale));
    } else if (bk->gstate == MFSDP_G_CLEAN) { /* nothing of this backward packed here */
      MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, g->data, g->dtype, bk->full_size));
    } else if (bk->n_ready < bk->spec.layout.n_items) {
      for (int32_t j = 0; j < bk->spec.layout.n_items; ++j)
        for (int32_t r = 0; r < bk->holders && !bk->ready[j]; ++r)
          MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, pl_at(g, pl_slot_of(bk, r) + bk->shard_offsets[j]), g->dtype,
                                   bk->pieces[j]));
    }
  } else if (bk->gstate == MFSDP_G_REDUCED) {
    MFSDP_CHECK(pl_rebase(p, bk));
  }
  MFSDP_CHECK(write_flags(p, bk));
  return launch_reduce(p, id);
}

/* Launches, in the shared order, every bucket whose turn has come and whose gradients are
 * complete ([Note: collective order]). ZeRO-2/3 buckets reduce in every backward, no_shard and
 * ZeRO-1 buckets only in a syncing one. */
mfsdp_status pl_launch_in_order(mfsdp_pipeline* p) {
  while (p->next < p->n) {
    int32_t id = p->order[p->next];
    bucket* bk = &p->b[id];
    int reduces = pl_reduces(bk) && !bk->hold &&
                  (bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE || p->sync);
    if (reduces) {
      if (!bk->complete) break;
      MFSDP_CHECK(pl_launch_bucket(p, id));
    }
    p->next++;
  }
  return MFSDP_OK;
}

