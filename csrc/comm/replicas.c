/* replicas.c: hybrid sharding: the collectives across replicas of the data-parallel shards
 * (HSDP: an all-reduce of reduced gradients; HFSDP: a reduce-scatter of them and an all-gather
 * of the updated weights).
 *
 * [Note: hybrid sharding]
 * With replicas (HSDP: outer_world > 1), the shards of a bucket live on dp_world ranks of a
 * replica and every replica holds the same weights. A gradient is reduced inside the replica as
 * without replicas, then, in a syncing backward only, all-reduced across the replicas: right
 * after its inner reduction completes (overlapped with the rest of the backward; completed at
 * the end of it) on the buffer that reduction left: the main gradient shard of ZeRO-2/3, the
 * reduced slice of ZeRO-1, the full gradients of no_shard. Inner gradients are pre-scaled by
 * 1/(dp_world * outer_world) (the caller's grad_prescale); the replicas sum. When a bucket
 * reduced across replicas receives more gradients before it is zeroed (several syncing backwards
 * in one step), its reduced part is divided by the replicas first, so that it is counted once.
 *
 * [Note: optimizer sharded across replicas]
 * HFSDP (cfg.outer_sharded): a sharded bucket is laid out over holders = shards * subs
 * sub-shards (its layout.world; subs = the replicas), torch.chunk over every data-parallel
 * rank: rank g = o * shards + i (replica o, inner rank i) holds the rows of sub-shard g, so its
 * parameters are Shard(0) over the flattened (outer, inner) mesh. The rank-major buffers put
 * sub-shard o * shards + i at slot i * subs + o (pl_slot_of, [Note: bucket geometry]): inner rank
 * i's collective shard (shard_size = subs * sub_size elements) is then the sub-shards its
 * replicas' twins hold, contiguous, and every inner collective moves whole collective shards
 * exactly as without replicas. Rank (o, i) owns sub-shard o of its collective shard:
 * - every backward reduce-scatters inside the replica into GRAD_SHARD (shard_size: the
 *   accumulator);
 * - a syncing backward then reduce-scatters GRAD_SHARD across the replicas, in place, into
 *   GRAD_SUB (its sub-shard): the main gradients, sub_size elements;
 * - the optimizer steps MAIN_SHARD (sub_size elements); install_main_weights writes it into
 *   WEIGHT_SUB and all-gathers WEIGHT_SHARD across the replicas, once per step, overlapped
 *   with whatever runs until the next unshard of the bucket waits for it.
 * WEIGHT_SHARD and GRAD_SHARD stay shard_size elements (the inner gather's input, the
 * accumulator), as in Megatron-FSDP: main weights, main gradients and optimizer state shrink by
 * the replicas. A second syncing backward before zeroing finds stale partial sums around
 * GRAD_SUB (zeroed) and a reduced sub-shard that only this replica holds, which the next
 * reduce-scatter then counts once (scaled back when the collective averages). */
#include "pipeline_internal.h"

static int has_outer(const mfsdp_pipeline* p) { return p->cfg.outer_world > 1 && p->be.outer != NULL; }

/* The factor by which the replicas' all-reduce multiplies a value all of them hold. */
double pl_outer_factor(const mfsdp_pipeline* p) {
  return p->cfg.reduce_op == MFSDP_REDUCE_SUM ? (double)p->cfg.outer_world : 1.0;
}

/* The reduction across replicas of what the bucket's inner reduction left: an all-reduce
 * ([Note: hybrid sharding]), or under HFSDP a reduce-scatter of the accumulated collective
 * shard into this rank's sub-shard ([Note: optimizer sharded across replicas]). */
static mfsdp_status launch_outer(mfsdp_pipeline* p, bucket* bk) {
  mfsdp_reduce_op op = (mfsdp_reduce_op)p->cfg.reduce_op;
  MFSDP_CHECK(pl_complete_outer_of(p, bk)); /* a weights' gather no forward waited for (its unit did not run) */
  mfsdp_status st;
  if (bk->subs > 1) {
    const mfsdp_buffer* b = &bk->buf[MFSDP_BUF_GRAD_SHARD];
    st = p->be.outer->reduce_scatter(p->be.outer_ctx, &bk->buf[MFSDP_BUF_GRAD_SUB], b, op, 1.0, &bk->outer_work);
    if (st != MFSDP_OK) return pl_comm_failed(p, st);
    pl_count(bk, PL_COMM_outer_reduce_scatter, b->numel * mfsdp_dtype_size(b->dtype));
  } else {
    int target = bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE ? MFSDP_BUF_GRAD_SHARD
                 : bk->spec.grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE ? MFSDP_BUF_GRAD_SLICE
                                                                     : MFSDP_BUF_GRAD;
    const mfsdp_buffer* b = &bk->buf[target];
    st = p->be.outer->all_reduce(p->be.outer_ctx, b, op, 1.0, &bk->outer_work);
    if (st != MFSDP_OK) return pl_comm_failed(p, st);
    pl_count(bk, PL_COMM_outer_all_reduce, b->numel * mfsdp_dtype_size(b->dtype));
  }
  bk->outer_reduced = 1; /* once the work completes (pl_complete_outer, before anyone reads it) */
  return MFSDP_OK;
}

/* A bucket's inner reduction completed: in a syncing backward (no_shard/ZeRO-1 reduce only to
 * sync) its result goes on across the replicas, unless that reduction is deferred. */
mfsdp_status pl_reduce_across_replicas(mfsdp_pipeline* p, bucket* bk) {
  int syncing = bk->spec.grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE || p->sync;
  if (!has_outer(p)) return MFSDP_OK;
  /* the used-parameter flags in its tail are every rank's only once they crossed the replicas
   * ([Note: used-flag tail] in reduce.c) */
  bk->flags_local = bk->outer_hold || !syncing;
  return bk->flags_local ? MFSDP_OK : launch_outer(p, bk);
}

/* A ZeRO-2/3 gradient shard already reduced across the replicas is about to receive more: what
 * the replicas summed must count once in the next reduction across them. HFSDP ([Note: optimizer
 * sharded across replicas]): the stale partial sums around the reduced sub-shard go, and an
 * averaging collective's result is scaled back to a sum. HSDP ([Note: hybrid sharding]): the
 * replicas' sum is divided by the factor that reduction will apply again. */
mfsdp_status pl_rebase_across_replicas(mfsdp_pipeline* p, bucket* bk) {
  if (!bk->outer_reduced) return MFSDP_OK;
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  const mfsdp_buffer* gs = &bk->buf[MFSDP_BUF_GRAD_SHARD];
  if (bk->subs > 1) {
    int64_t end = bk->sub_start + bk->sub_size;
    MFSDP_CHECK(k->fill_zero(kc, gs->data, gs->dtype, bk->sub_start));
    MFSDP_CHECK(k->fill_zero(kc, pl_at(gs, end), gs->dtype, bk->shard_size - end));
    if (p->cfg.reduce_op == MFSDP_REDUCE_AVG)
      MFSDP_CHECK(k->scale(kc, bk->buf[MFSDP_BUF_GRAD_SUB].data, gs->dtype, bk->sub_size, (double)bk->subs));
  } else {
    MFSDP_CHECK(k->scale(kc, gs->data, bk->spec.grad_dtype, bk->shard_size, 1.0 / pl_outer_factor(p)));
  }
  bk->outer_reduced = 0;
  return MFSDP_OK;
}

/* HFSDP, after the optimizer step: the updated sub-shard into WEIGHT_SUB, then the collective
 * shard gathered across the replicas in place ([Note: optimizer sharded across replicas]) once
 * the bucket's previous collective across them is done; the next unshard waits. */
mfsdp_status pl_launch_outer_gather(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(pl_complete_outer_of(p, bk));
  if (bk->q_outer >= 0) return pl_wire_outer_gather(p, bk); /* [Note: quantized communication] in wire.c */
  if (pl_own_main(bk))
    MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, bk->buf[MFSDP_BUF_WEIGHT_SUB].data, bk->spec.param_dtype,
                                    bk->buf[MFSDP_BUF_MAIN_SHARD].data, bk->spec.main_dtype, bk->sub_size, 1.0));
  const mfsdp_buffer* b = &bk->buf[MFSDP_BUF_WEIGHT_SHARD];
  mfsdp_status st = p->be.outer->all_gather(p->be.outer_ctx, b, &bk->buf[MFSDP_BUF_WEIGHT_SUB], &bk->outer_work);
  if (st != MFSDP_OK) return pl_comm_failed(p, st);
  bk->outer_gathering = 1;
  pl_count(bk, PL_COMM_outer_all_gather, b->numel * mfsdp_dtype_size(b->dtype));
  return MFSDP_OK;
}

/* Waits for one bucket's collective across replicas; a quantized gather then lands (also when
 * the transport completed it at once and returned no work). */
mfsdp_status pl_complete_outer_of(mfsdp_pipeline* p, bucket* bk) {
  mfsdp_work* w = bk->outer_work;
  int gathering = bk->outer_gathering;
  bk->outer_work = NULL;
  bk->outer_gathering = 0;
  if (w != NULL) MFSDP_CHECK(pl_comm_failed(p, p->be.outer->wait(p->be.outer_ctx, w)));
  return gathering && bk->q_outer >= 0 ? pl_wire_outer_land(p, bk) : MFSDP_OK;
}

/* Finishes the reductions across replicas (and, with `gathers`, the weights' gathers too: those
 * touch no gradient, so gradient work never waits for them). */
mfsdp_status pl_complete_outer(mfsdp_pipeline* p, int gathers) {
  for (int32_t i = 0; i < p->n; ++i)
    if (gathers || !p->b[i].outer_gathering) MFSDP_CHECK(pl_complete_outer_of(p, &p->b[i]));
  return MFSDP_OK;
}

