/* geometry.c: a bucket's shape ([Note: bucket geometry] in pipeline_internal.h), set once at
 * creation, and the collectives that shape implies: whether the bucket communicates inside its
 * replica, whether its gradients travel as an exchange ([Note: exchange reduction] in reduce.c)
 * and the block of an all-reduce done that way. A floor of csrc/comm: it calls no other file of
 * the pipeline (map at the top of pipeline.c). */
#include "pipeline_internal.h"

/* See [Note: bucket geometry]. */
void pl_set_geometry(bucket* bk, const mfsdp_pipeline_config* cfg) {
  const mfsdp_bucket_layout* l = &bk->spec.layout;
  bk->holders = l->world;
  bk->subs = l->world > 1 && cfg->outer_sharded && cfg->outer_world > 1 ? cfg->outer_world : 1;
  bk->shards = bk->holders / bk->subs;
  bk->sub_size = l->shard_size;
  bk->shard_size = bk->subs * bk->sub_size;
  bk->full_size = (int64_t)l->world * l->shard_size;
  bk->own_shard = bk->spec.shard_rank % bk->shards;
  bk->own_sub = bk->spec.shard_rank / bk->shards;
  bk->shard_start = bk->own_shard * bk->shard_size;
  bk->sub_start = bk->own_sub * bk->sub_size;
  /* slots are permuted across replicas unless one index is trivial: then rank-major is piece order */
  bk->identity = mfsdp_layout_is_identity(l) && (bk->subs == 1 || bk->shards == 1);
  bk->gathered = bk->spec.weights_sharded || (bk->spec.weights_regather && l->world > 1);
}

/* The bucket's collectives inside a replica run: it is sharded, or it all-reduces over several
 * ranks. */
int pl_communicates(const mfsdp_pipeline* p, const bucket* bk) {
  if (p->cfg.force_comm) return 1; /* single-rank collectives: exercises a transport on one device */
  return p->cfg.dp_world > 1 && (bk->shards > 1 || bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE);
}

/* Low-precision communication, high-precision accumulation: when a reduce-scatter would sum
 * in a dtype narrower than the main gradients, the pipeline exchanges the narrow pieces instead
 * (all-to-all: the same bytes on the wire as a reduce-scatter) and sums them itself in the
 * gradient dtype, rounding once. See [Note: exchange reduction] in reduce.c. */
int pl_exchanges(const mfsdp_pipeline* p, const bucket* bk) {
  const mfsdp_bucket_spec* s = &bk->spec;
  if (s->grad_mode == MFSDP_GRAD_NONE || p->cfg.dp_world < 2) return 0;
  if (s->grad_mode != MFSDP_GRAD_ALL_REDUCE && bk->shards < 2) return 0;
  if (bk->q_grads >= 0) return 1;
  return !s->sum_in_comm_dtype && mfsdp_dtype_precision(s->comm_dtype) < mfsdp_dtype_precision(s->grad_dtype);
}

/* An all-reduce done as exchange + gather splits the bucket into dp_world blocks: its comm
 * buffers are padded to a multiple of dp_world. */
int64_t pl_exchange_block(const mfsdp_pipeline* p, const bucket* bk) {
  return (bk->full_size + p->cfg.dp_world - 1) / p->cfg.dp_world;
}
