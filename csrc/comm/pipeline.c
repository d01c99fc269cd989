/* pipeline.c: the bucket state machine and collective pipeline (see mfsdp_pipeline.h).
 *
 * [Note: storage resize]
 * Temporary buffers (ZeRO-3 full weights, gather outputs, ZeRO-2/3 full gradients, comm
 * copies) keep one tensor object for the life of the model and only resize its storage between
 * 0 and full size. Parameter views and tensors autograd saved for backward point into that
 * storage object, so they stay valid across release and re-gather: no per-parameter work on
 * the hot path.
 *
 * [Note: collective order]
 * Every rank must issue the same collectives in the same order, whatever order its gradients
 * arrive in: a graph may differ across ranks (LayerDrop, a data-dependent branch, an MoE expert
 * that got no tokens here), and so may autograd's order. Gathers run in the order the caller
 * lists them (the hooks keep one shared unit order, see [Note: gather order] in hooks.py).
 * Reductions follow one launch order shared by every rank (`order`: by default later units
 * first, the order backward normally completes them, then buckets outside every unit): a
 * complete bucket waits until every bucket before it in that order has been launched, and in
 * every backward each bucket that reduces is launched exactly once -- complete, sealed (its
 * unit did not run here, mfsdp_pipeline_seal), or at the end of backward with zeros for what
 * this rank did not use. So the n-th reduction is the same bucket on every rank, as in DDP
 * (which launches its buckets in index order for the same reason).
 *
 * [Note: reduce once per step]
 * no_shard and ZeRO-1 accumulate local gradients in the persistent GRAD and reduce them once
 * per optimisation step. When a reduced buffer receives further gradients (several syncing
 * backwards before one step), `rebase` first rescales it so that the next reduction counts the
 * already-reduced part exactly once: an all-reduced sum R sits on all `world` ranks, so it is
 * divided by world * f (f = the factor the reduction applies); a reduce-scattered slice sits on
 * one rank only, so it is divided by f and the stale local values around it are zeroed.
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
 * A ZeRO-2/3 bucket put on hold (mfsdp_pipeline_set_hold: FSDP2's
 * set_requires_gradient_sync(False)) is not reduced in a backward: its gradients are added,
 * unscaled, into its full gradient buffer, which stays allocated (one full copy of the bucket's
 * gradients, as DDP holds). The next backward off hold adds its own, scales the sum once and
 * reduce-scatters it: the local sum over microbatches is formed exactly as DDP forms it.
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
 * HFSDP (cfg.outer_sharded): a sharded bucket is laid out over owners = shards * subs
 * sub-shards (its layout.world; subs = the replicas), torch.chunk over every data-parallel
 * rank: rank g = o * shards + i (replica o, inner rank i) holds the rows of sub-shard g, so its
 * parameters are Shard(0) over the flattened (outer, inner) mesh. The rank-major buffers put
 * sub-shard o * shards + i at slot i * subs + o (slot_of, [Note: bucket geometry]): inner rank
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
 * reduce-scatter then counts once (scaled back when the collective averages).
 *
 * [Note: exchange reduction]
 * A reduce-scatter in bf16 sums in bf16: every partial sum on the ring is rounded to 8 bits.
 * When the communication dtype is narrower than the main gradients, the pipeline sends the same
 * bytes with an all-to-all (each rank receives every rank's narrow piece of its own slice) and
 * adds the pieces into the main gradient in its own dtype, in rank order: each contribution is
 * rounded once (to the wire dtype) and the sum never is.
 *
 * [Note: cast on gather]
 * When the main weights are wider than the compute weights (bf16 model, fp32 main) and the
 * bucket is gathered (ZeRO-1/2/3 over several ranks), the only persistent copy of a rank's rows
 * is the main shard. Each gather casts it into this rank's slice of the freshly materialised
 * gather buffer and all-gathers in place, so no compute-dtype shard is kept between passes:
 * under ZeRO-3 that is 2 bytes a parameter / world less than keeping one, the same held memory
 * as FSDP2, for one cast of shard_size elements per gather. */
#include "mfsdp_pipeline.h"

#include <stdlib.h>
#include <string.h>

/* Beyond this many padding runs, zeroing a temporary gradient bucket is one fill of all of it. */
#define MAX_HOLE_FILLS 64
/* Pack items handed to one `pack` call: a bucket's pieces go out in chunks of this many. */
#define PACK_CHUNK 256

/* A gradient of this backward waiting for its bucket to complete ([Note: one pack per bucket]). */
typedef struct pending_grad {
  const void* src;
  int32_t dtype;
  int32_t item;
  void* handle; /* keeps the gradient's memory alive until packed (may be NULL) */
} pending_grad;

/* [Note: bucket geometry]
 * A bucket has two kinds of shard. Its layout (core/mfsdp_layout.h) cuts every item into
 * layout.world pieces of whole rows, torch.chunk's split: the "owners", one per rank that holds
 * rows of its own, each with a sub-shard of layout.shard_size elements. The collectives inside a
 * replica move "collective shards", one per rank they span. Without HFSDP the two coincide (one
 * sub-shard per collective shard); under HFSDP ([Note: optimizer sharded across replicas]) the
 * owners are the ranks of every replica and a collective shard holds the sub-shards of one
 * inner rank's twins in all replicas. The fields (and the letters the code used before):
 *   shards      W    collective shards: ranks an inner collective spans (1: not sharded)
 *   shard_size  S    elements of one collective shard: subs * sub_size
 *   full_size   W*S  rank-major elements: what an inner collective moves
 *   subs        O    sub-shards per collective shard: the replicas under HFSDP, else 1
 *   sub_size    Sv   elements of one sub-shard: layout.shard_size
 *   owners      V    sub-shards in all: layout.world = shards * subs
 *   own_shard   inner  this rank's collective shard: spec.shard_rank % shards
 *   own_sub     sub  this rank's sub-shard inside it: spec.shard_rank / shards (0 without HFSDP)
 *   shard_start, sub_start  own_shard * shard_size, own_sub * sub_size
 * Owner v = o * shards + i (replica o, inner rank i) sits at slot i * subs + o of the rank-major
 * buffers (slot_of), so collective shard i is one contiguous run; without HFSDP slot v is
 * owner v. */
typedef struct bucket {
  mfsdp_bucket_spec spec; /* spec.layout's arrays point at the copies below */
  int64_t* numels;
  int64_t* pieces;
  int64_t* param_offsets;
  int64_t* shard_offsets;
  /* geometry: see [Note: bucket geometry] */
  int32_t shards;      /* collective shards */
  int64_t shard_size;  /* elements of one: subs * sub_size */
  int64_t full_size;   /* rank-major elements: shards * shard_size */
  int32_t subs;        /* sub-shards per collective shard */
  int64_t sub_size;    /* elements of one: layout.shard_size */
  int32_t owners;      /* sub-shards in all: layout.world */
  int32_t own_shard;   /* this rank's collective shard */
  int32_t own_sub;     /* this rank's sub-shard inside it */
  int64_t shard_start; /* own_shard * shard_size: its collective shard in the rank-major buffers */
  int64_t sub_start;   /* own_sub * sub_size: its sub-shard inside the collective shard */
  int identity;       /* rank-major and parameter-major coincide: gathers land in WEIGHT */
  int gathered;       /* full weights come from all-gathers (ZeRO-3, or ZeRO-1/2 over several shards) */
  int gather_kind;    /* GATHER, or WEIGHT when identity */
  mfsdp_buffer buf[MFSDP_BUF_COUNT];
  int8_t present[MFSDP_BUF_COUNT];
  int8_t owner[MFSDP_BUF_COUNT];        /* kind whose storage this buffer uses (itself for owners) */
  int64_t view_offset[MFSDP_BUF_COUNT]; /* element offset into the owner */
  int8_t temporary[MFSDP_BUF_COUNT];    /* owner whose storage is released between uses */
  int8_t materialized[MFSDP_BUF_COUNT];
  int32_t wstate;
  mfsdp_work* gather_work;
  int32_t gstate;
  mfsdp_work* reduce_work;
  int32_t n_ready;
  int8_t launched; /* its reduction was issued in this backward (it may have completed since) */
  int8_t complete; /* every gradient of this backward is in (or it was sealed): it may launch */
  int8_t hold;     /* ZeRO-2/3: accumulate locally, do not reduce ([Note: held gradients]) */
  int8_t outer_hold;    /* hybrid sharding: skip the all-reduce across replicas */
  int8_t outer_reduced; /* its reduced gradients were all-reduced across replicas since the last zero */
  mfsdp_work* outer_work; /* across replicas: the gradient reduction, or (HFSDP) the weights' gather */
  int8_t outer_gathering; /* outer_work is the weights' gather: only this bucket's next unshard waits */
  int8_t held;     /* GRAD holds unscaled local sums of earlier backwards */
  double prescale; /* gradients are multiplied by this before the sum (default cfg.grad_prescale) */
  uint8_t* ready;
  pending_grad* pending; /* this backward's gradients not yet packed */
  int32_t n_pending;
  int64_t* holes; /* [start, end) pairs of the rank-major GRAD not covered by any item's rows */
  int32_t n_holes;
  int8_t initializing;
  mfsdp_comm_stats stats;
} bucket;

/* The kinds of MFSDP_COMM_COUNTERS, for count(). */
typedef enum comm_kind {
#define COMM_KIND_(kind) COMM_##kind,
  MFSDP_COMM_COUNTERS(COMM_KIND_)
#undef COMM_KIND_
} comm_kind;

struct mfsdp_pipeline {
  mfsdp_pipeline_config cfg;
  mfsdp_backend be;
  int32_t n;
  bucket* b;
  int32_t* queue; /* FIFO of buckets with a reduction in flight */
  int32_t q_head, q_len;
  int64_t q_bytes;
  int32_t* order;     /* the launch order of reductions, shared by every rank ([Note: collective order]) */
  int32_t next;       /* position in `order` of the next bucket to launch in this backward */
  int in_backward, sync;
  int reduce_due;     /* a backward left no_shard/ZeRO-1 gradients unreduced: the step's sync reduces */
  char broken[512];
};

/* ------------------------------------------------------------------------------------------ */
/* buffers */

static int64_t elem_size(int32_t dtype) { return mfsdp_dtype_size(dtype); }

/* Every collective issued is counted here, once it went out: one more of `kind`, moving `bytes`. */
static void count(bucket* bk, comm_kind kind, int64_t bytes) {
  switch (kind) {
#define COUNT_(k)                 \
  case COMM_##k:                  \
    bk->stats.k##s++;             \
    bk->stats.k##_bytes += bytes; \
    break;
    MFSDP_COMM_COUNTERS(COUNT_)
#undef COUNT_
  }
}

static void* at(const mfsdp_buffer* b, int64_t offset) {
  return b->data ? (char*)b->data + offset * elem_size(b->dtype) : NULL;
}

/* Where owner v's sub-shard starts in the rank-major buffers ([Note: bucket geometry]). */
static int64_t slot_of(const bucket* bk, int32_t v) { return ((int64_t)(v % bk->shards) * bk->subs + v / bk->shards) * bk->sub_size; }

static void refresh_views(bucket* bk, int owner) {
  for (int k = 0; k < MFSDP_BUF_COUNT; ++k)
    if (bk->present[k] && bk->owner[k] == owner && k != owner)
      bk->buf[k].data = at(&bk->buf[owner], bk->view_offset[k]);
}

static mfsdp_status materialize(mfsdp_pipeline* p, bucket* bk, int kind) {
  if (!bk->present[kind]) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "buffer kind %d does not exist in this bucket", kind);
  int o = bk->owner[kind];
  if (bk->materialized[o]) return MFSDP_OK;
  MFSDP_CHECK(p->be.memory->materialize(p->be.memory_ctx, &bk->buf[o]));
  bk->materialized[o] = 1;
  refresh_views(bk, o);
  return MFSDP_OK;
}

static mfsdp_status release(mfsdp_pipeline* p, bucket* bk, int kind) {
  if (!bk->present[kind]) return MFSDP_OK;
  int o = bk->owner[kind];
  if (!bk->materialized[o] || !bk->temporary[o]) return MFSDP_OK;
  MFSDP_CHECK(p->be.memory->release(p->be.memory_ctx, &bk->buf[o]));
  bk->materialized[o] = 0;
  refresh_views(bk, o);
  return MFSDP_OK;
}

static mfsdp_status add_owner(mfsdp_pipeline* p, bucket* bk, int kind, int64_t numel, int32_t dtype, int temporary) {
  MFSDP_CHECK(p->be.memory->create(p->be.memory_ctx, numel, dtype, &bk->buf[kind]));
  bk->present[kind] = 1;
  bk->owner[kind] = (int8_t)kind;
  bk->materialized[kind] = 1;
  bk->temporary[kind] = (int8_t)temporary;
  return MFSDP_OK;
}

static mfsdp_status add_view(mfsdp_pipeline* p, bucket* bk, int kind, int of, int64_t offset, int64_t numel) {
  int o = bk->owner[of];
  int64_t base = bk->view_offset[of] + offset;
  if (of == o && offset == 0 && numel == bk->buf[o].numel) {
    bk->buf[kind] = bk->buf[o]; /* the same range: share the handle, destroy only once */
  } else {
    MFSDP_CHECK(p->be.memory->create_view(p->be.memory_ctx, &bk->buf[o], base, numel, &bk->buf[kind]));
  }
  bk->present[kind] = 1;
  bk->owner[kind] = (int8_t)o;
  bk->view_offset[kind] = base;
  bk->buf[kind].data = at(&bk->buf[o], base);
  return MFSDP_OK;
}

static int own_main(const bucket* bk) { return bk->present[MFSDP_BUF_MAIN_SHARD] && bk->owner[MFSDP_BUF_MAIN_SHARD] == MFSDP_BUF_MAIN_SHARD; }

/* See [Note: cast on gather]. */
static int casts_on_gather(const bucket* bk) {
  return bk->gathered && own_main(bk) && bk->owner[MFSDP_BUF_WEIGHT_SHARD] != MFSDP_BUF_WEIGHT_SHARD;
}

/* ZeRO-1/2 with main == compute dtype and distinct layouts: the main weights are this rank's
 * rows inside WEIGHT (no MAIN_SHARD buffer); a gather first packs them into its own slice. */
static int main_in_weight(const bucket* bk) { return !bk->present[MFSDP_BUF_MAIN_SHARD]; }

/* Low-precision communication, high-precision accumulation: when a reduce-scatter would sum
 * in a dtype narrower than the main gradients, the pipeline exchanges the narrow pieces instead
 * (all-to-all: the same bytes on the wire as a reduce-scatter) and sums them itself in the
 * gradient dtype, rounding once. See [Note: exchange reduction]. */
static int exchanges(const mfsdp_pipeline* p, const bucket* bk) {
  const mfsdp_bucket_spec* s = &bk->spec;
  if (s->grad_mode == MFSDP_GRAD_NONE || p->cfg.dp_world < 2) return 0;
  if (s->grad_mode != MFSDP_GRAD_ALL_REDUCE && bk->shards < 2) return 0;
  return mfsdp_dtype_precision(s->comm_dtype) < mfsdp_dtype_precision(s->grad_dtype);
}

/* An all-reduce done as exchange + gather splits the bucket into dp_world blocks: its comm
 * buffers are padded to a multiple of dp_world. */
static int64_t exchange_block(const mfsdp_pipeline* p, const bucket* bk) {
  return (bk->full_size + p->cfg.dp_world - 1) / p->cfg.dp_world;
}

static void drop_buffer(mfsdp_pipeline* p, bucket* bk, int kind) {
  if (!bk->present[kind]) return;
  int shared = 0;
  for (int j = 0; j < MFSDP_BUF_COUNT; ++j)
    if (j != kind && bk->present[j] && bk->buf[j].handle == bk->buf[kind].handle) shared = 1;
  if (!shared) p->be.memory->destroy(p->be.memory_ctx, &bk->buf[kind]);
  memset(&bk->buf[kind], 0, sizeof bk->buf[kind]);
  bk->present[kind] = bk->materialized[kind] = bk->temporary[kind] = 0;
  bk->owner[kind] = -1;
  bk->view_offset[kind] = 0;
}

static mfsdp_status release_temporaries(mfsdp_pipeline* p, bucket* bk) {
  for (int k = 0; k < MFSDP_BUF_COUNT; ++k)
    if (bk->present[k] && bk->owner[k] == k && bk->temporary[k]) MFSDP_CHECK(release(p, bk, k));
  return MFSDP_OK;
}

/* The temporary buffers that depend on the communication dtype (see mfsdp_pipeline.h). */
static mfsdp_status create_comm_buffers(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_bucket_spec* s = &bk->spec;
  int64_t full = bk->full_size;
  if (s->grad_mode == MFSDP_GRAD_NONE) return MFSDP_OK;
  if (s->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE) {
    MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_GRAD, full, s->comm_dtype, 1));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_GRAD_SLICE, MFSDP_BUF_GRAD, bk->shard_start, bk->shard_size));
  } else if (s->grad_mode == MFSDP_GRAD_ALL_REDUCE && exchanges(p, bk)) {
    int64_t block = exchange_block(p, bk);
    full = block * p->cfg.dp_world;
    MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_COMM, full, s->comm_dtype, 1));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_COMM_SLICE, MFSDP_BUF_COMM, (int64_t)p->cfg.dp_rank * block, block));
  } else if (s->comm_dtype != s->grad_dtype) {
    MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_COMM, full, s->comm_dtype, 1));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_COMM_SLICE, MFSDP_BUF_COMM, bk->shard_start, bk->shard_size));
  }
  if (exchanges(p, bk)) MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_EXCHANGE, full, s->comm_dtype, 1));
  return MFSDP_OK;
}

static void drop_comm_buffers(mfsdp_pipeline* p, bucket* bk) {
  drop_buffer(p, bk, MFSDP_BUF_EXCHANGE);
  drop_buffer(p, bk, MFSDP_BUF_COMM_SLICE);
  drop_buffer(p, bk, MFSDP_BUF_COMM);
  if (bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE) {
    drop_buffer(p, bk, MFSDP_BUF_GRAD_SLICE);
    drop_buffer(p, bk, MFSDP_BUF_GRAD);
  }
}

/* Creates the buffers of one bucket per the table in mfsdp_pipeline.h. */
static mfsdp_status create_buffers(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_bucket_spec* s = &bk->spec;
  int64_t shard = bk->shard_size, sub = bk->sub_size, full = bk->full_size;
  int grads = s->grad_mode != MFSDP_GRAD_NONE;
  int accumulate = s->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE;
  int wide_main = grads && s->main_dtype != s->param_dtype;

  MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_WEIGHT, s->layout.weight_size, s->param_dtype, s->weights_sharded));
  if (bk->gathered && !bk->identity) MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_GATHER, full, s->param_dtype, 1));
  bk->gather_kind = bk->present[MFSDP_BUF_GATHER] ? MFSDP_BUF_GATHER : MFSDP_BUF_WEIGHT;
  /* HFSDP keeps the whole collective shard: the replicas' all-gather fills it once per step */
  if (s->weights_sharded && (!wide_main || bk->subs > 1))
    MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_WEIGHT_SHARD, shard, s->param_dtype, 0));
  else
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_WEIGHT_SHARD, bk->gather_kind, bk->shard_start, shard));
  if (bk->subs > 1) MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_WEIGHT_SUB, MFSDP_BUF_WEIGHT_SHARD, bk->sub_start, sub));
  if (wide_main)
    MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_MAIN_SHARD, sub, s->main_dtype, 0));
  else if (!(bk->present[MFSDP_BUF_GATHER] && !s->weights_sharded)) /* else: main_in_weight */
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_MAIN_SHARD, MFSDP_BUF_WEIGHT_SHARD, bk->sub_start, sub));
  if (grads) {
    if (accumulate) {
      MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_GRAD_SHARD, shard, s->grad_dtype, 0));
    } else { /* persistent full gradients accumulate locally until the step's reduction */
      MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_GRAD, full, s->grad_dtype, 0));
      MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_GRAD_SLICE, MFSDP_BUF_GRAD, bk->shard_start, shard));
      MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_GRAD_SHARD, MFSDP_BUF_GRAD_SLICE, 0, shard));
    }
    if (bk->subs > 1) MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_GRAD_SUB, MFSDP_BUF_GRAD_SHARD, bk->sub_start, sub));
    if (s->main_dtype != s->grad_dtype)
      MFSDP_CHECK(add_owner(p, bk, MFSDP_BUF_OPT_GRAD, sub, s->main_dtype, 0));
    else
      MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_OPT_GRAD, MFSDP_BUF_GRAD_SHARD, bk->sub_start, sub));
    MFSDP_CHECK(create_comm_buffers(p, bk));
  }
  /* Views exist now; temporaries give their memory back until first use. */
  return release_temporaries(p, bk);
}

/* Owner r's piece of item i (it sits at slot_of(r) + shard_offsets[i] in the rank-major
 * layout): elements [*first, +*n) of the item. */
static void piece(const bucket* bk, int32_t i, int32_t r, int64_t* first, int64_t* n) {
  mfsdp_piece_of(bk->numels[i], bk->pieces[i], r, first, n);
}

/* The runs of the rank-major GRAD holding no item's rows (see [Note: chunked layout]):
 * alignment gaps, the missing rows of the last ranks' pieces, each shard's tail. */
static mfsdp_status compute_holes(bucket* bk) {
  int32_t n = bk->spec.layout.n_items;
  bk->holes = malloc((size_t)(2 * ((int64_t)bk->owners * (n + 1))) * sizeof *bk->holes);
  if (bk->holes == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "hole table");
  for (int32_t slot = 0; slot < bk->owners; ++slot) { /* in memory order */
    int32_t r = (slot % bk->subs) * bk->shards + slot / bk->subs; /* the owner at this slot */
    int64_t cursor = (int64_t)slot * bk->sub_size;
    for (int32_t i = 0; i < n; ++i) { /* pieces are laid out in item order */
      int64_t first, len;
      piece(bk, i, r, &first, &len);
      if (len == 0) continue;
      int64_t start = (int64_t)slot * bk->sub_size + bk->shard_offsets[i];
      if (start > cursor) {
        if (bk->n_holes > 0 && bk->holes[2 * bk->n_holes - 1] == cursor) {
          bk->holes[2 * bk->n_holes - 1] = start; /* continues the previous hole */
        } else {
          bk->holes[2 * bk->n_holes] = cursor;
          bk->holes[2 * bk->n_holes + 1] = start;
          bk->n_holes++;
        }
      }
      cursor = start + len;
    }
    int64_t end = (int64_t)(slot + 1) * bk->sub_size;
    if (cursor < end) {
      if (bk->n_holes > 0 && bk->holes[2 * bk->n_holes - 1] == cursor) {
        bk->holes[2 * bk->n_holes - 1] = end;
      } else {
        bk->holes[2 * bk->n_holes] = cursor;
        bk->holes[2 * bk->n_holes + 1] = end;
        bk->n_holes++;
      }
    }
  }
  int64_t* fit = realloc(bk->holes, (size_t)(2 * bk->n_holes + 2) * sizeof *fit);
  if (fit) bk->holes = fit;
  return MFSDP_OK;
}

/* Pieces collected into chunks of pack items: one `pack` call per chunk. */
typedef struct packer {
  mfsdp_pipeline* p;
  void* dst;
  int32_t dst_dtype;
  double alpha;
  int accumulate;
  int32_t n;
  mfsdp_pack_item items[PACK_CHUNK];
} packer;

static mfsdp_status packer_flush(packer* k) {
  if (k->n == 0) return MFSDP_OK;
  mfsdp_status st = k->p->be.kernels->pack(k->p->be.kernels_ctx, k->dst, k->dst_dtype, k->items, k->n, k->alpha,
                                           k->accumulate);
  k->n = 0;
  return st;
}

static mfsdp_status packer_add(packer* k, const void* src, int32_t src_dtype, int64_t dst_offset, int64_t n) {
  if (n == 0) return MFSDP_OK;
  if (k->n == PACK_CHUNK) MFSDP_CHECK(packer_flush(k));
  k->items[k->n++] = (mfsdp_pack_item){src, src_dtype, dst_offset, n};
  return MFSDP_OK;
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
      int64_t first, n;
      piece(bk, i, r, &first, &n);
      MFSDP_CHECK(packer_add(&k, at(src, bk->param_offsets[i] + first), src->dtype, base + bk->shard_offsets[i], n));
    }
  }
  return packer_flush(&k);
}

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
      s->grad_mode > MFSDP_GRAD_SCATTER_ACCUMULATE)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d: bad dtype or grad mode", i);
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

/* See [Note: bucket geometry]. */
static void set_geometry(bucket* bk, const mfsdp_pipeline_config* cfg) {
  const mfsdp_bucket_layout* l = &bk->spec.layout;
  bk->owners = l->world;
  bk->subs = l->world > 1 && cfg->outer_sharded && cfg->outer_world > 1 ? cfg->outer_world : 1;
  bk->shards = bk->owners / bk->subs;
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
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(check_spec(cfg, &specs[i], i));

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
    bk->ready = calloc((size_t)(items ? items : 1), 1);
    bk->pending = calloc((size_t)(items ? items : 1), sizeof *bk->pending);
    if (!bk->numels || !bk->pieces || !bk->param_offsets || !bk->shard_offsets || !bk->ready || !bk->pending) {
      st = MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "bucket %d tables", i);
      goto fail;
    }
    bk->spec.layout.numels = bk->numels;
    bk->spec.layout.pieces = bk->pieces;
    bk->spec.layout.param_offsets = bk->param_offsets;
    bk->spec.layout.shard_offsets = bk->shard_offsets;
    set_geometry(bk, cfg);
    for (int k = 0; k < MFSDP_BUF_COUNT; ++k) bk->owner[k] = -1;
    MFSDP_CHECK_GOTO(compute_holes(bk), st, fail);
    MFSDP_CHECK_GOTO(create_buffers(p, bk), st, fail);
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
    /* A view that reuses its owner's handle is dropped once, with the owner: decide before
     * destroying anything, since destroy clears the handle it drops. */
    int8_t shared[MFSDP_BUF_COUNT] = {0};
    for (int k = 0; k < MFSDP_BUF_COUNT; ++k)
      for (int j = 0; j < k; ++j)
        if (bk->present[k] && bk->present[j] && bk->buf[j].handle == bk->buf[k].handle) shared[k] = 1;
    for (int k = 0; k < MFSDP_BUF_COUNT; ++k)
      if (bk->present[k] && !shared[k]) p->be.memory->destroy(p->be.memory_ctx, &bk->buf[k]);
    free(bk->numels);
    free(bk->pieces);
    free(bk->param_offsets);
    free(bk->shard_offsets);
    free(bk->ready);
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

/* ------------------------------------------------------------------------------------------ */
/* accessors */

int32_t mfsdp_pipeline_num_buckets(const mfsdp_pipeline* p) { return p->n; }

const mfsdp_buffer* mfsdp_pipeline_buffer(const mfsdp_pipeline* p, int32_t bucket_id, int32_t kind) {
  if (bucket_id < 0 || bucket_id >= p->n || kind < 0 || kind >= MFSDP_BUF_COUNT) return NULL;
  return p->b[bucket_id].present[kind] ? &p->b[bucket_id].buf[kind] : NULL;
}

int32_t mfsdp_pipeline_weight_state(const mfsdp_pipeline* p, int32_t b) { return p->b[b].wstate; }
int32_t mfsdp_pipeline_grad_state(const mfsdp_pipeline* p, int32_t b) { return p->b[b].gstate; }
const char* mfsdp_pipeline_broken(const mfsdp_pipeline* p) { return p->broken; }

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

mfsdp_status mfsdp_pipeline_local_piece(const mfsdp_pipeline* p, int32_t b, int32_t item, int32_t kind,
                                        int32_t* where, int64_t* offset, int64_t* n) {
  if (b < 0 || b >= p->n) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d out of range [0, %d)", b, p->n);
  const bucket* bk = &p->b[b];
  if (item < 0 || item >= bk->spec.layout.n_items)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d has no item %d", b, item);
  if (kind != MFSDP_BUF_MAIN_SHARD && kind != MFSDP_BUF_OPT_GRAD && kind != MFSDP_BUF_GRAD_SHARD &&
      kind != MFSDP_BUF_WEIGHT_SHARD)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "local_piece: buffer kind %d is not a shard", kind);
  int64_t first;
  piece(bk, item, bk->spec.shard_rank, &first, n);
  if (kind == MFSDP_BUF_MAIN_SHARD && main_in_weight(bk)) {
    *where = MFSDP_BUF_WEIGHT;
    *offset = bk->param_offsets[item] + first;
  } else if (!bk->present[kind]) {
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d has no buffer of kind %d", b, kind);
  } else { /* HFSDP: this rank's sub-shard inside the collective shard */
    int whole = kind == MFSDP_BUF_WEIGHT_SHARD || kind == MFSDP_BUF_GRAD_SHARD;
    *where = kind;
    *offset = bk->shard_offsets[item] + (whole ? bk->sub_start : 0);
  }
  return MFSDP_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* guards and transport calls */

static mfsdp_status healthy(const mfsdp_pipeline* p) {
  if (p->broken[0])
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE,
                      "the engine stopped after a failed collective (%s); build a new model with fully_shard",
                      p->broken);
  return MFSDP_OK;
}

/* A failed collective leaves the ranks out of step: remember it and refuse further work. */
static mfsdp_status comm_failed(mfsdp_pipeline* p, mfsdp_status st) {
  if (st != MFSDP_OK && st != MFSDP_ERR_INVALID_ARGUMENT && !p->broken[0]) {
    strncpy(p->broken, mfsdp_last_error(), sizeof p->broken - 1);
    p->broken[sizeof p->broken - 1] = '\0';
  }
  return st;
}

static mfsdp_status check_bucket(const mfsdp_pipeline* p, int32_t b) {
  if (b < 0 || b >= p->n) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d out of range [0, %d)", b, p->n);
  return MFSDP_OK;
}

static int communicates(const mfsdp_pipeline* p, const bucket* bk) {
  if (p->cfg.force_comm) return 1; /* single-rank collectives: exercises a transport on one device */
  return p->cfg.dp_world > 1 && (bk->shards > 1 || bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE);
}

static int has_outer(const mfsdp_pipeline* p) { return p->cfg.outer_world > 1 && p->be.outer != NULL; }

/* The factor by which the replicas' all-reduce multiplies a value all of them hold. */
static double outer_factor(const mfsdp_pipeline* p) {
  return p->cfg.reduce_op == MFSDP_REDUCE_SUM ? (double)p->cfg.outer_world : 1.0;
}

static mfsdp_status wait_work(mfsdp_pipeline* p, mfsdp_work** work) {
  mfsdp_work* w = *work;
  *work = NULL;
  if (w == NULL) return MFSDP_OK;
  return comm_failed(p, p->be.transport->wait(p->be.transport_ctx, w));
}

/* ------------------------------------------------------------------------------------------ */
/* initialisation */

static mfsdp_status zero_buffer(mfsdp_pipeline* p, bucket* bk, int kind) {
  const mfsdp_buffer* b = &bk->buf[kind];
  return p->be.kernels->fill_zero(p->be.kernels_ctx, b->data, b->dtype, b->numel);
}

static mfsdp_status finish_gather(mfsdp_pipeline* p, bucket* bk);
static mfsdp_status complete_outer_of(mfsdp_pipeline* p, bucket* bk);
static mfsdp_status launch_outer_gather(mfsdp_pipeline* p, bucket* bk);

/* Two ways in. Full (direct = 0): the full weights are materialised, items are copied into
 * them and init_end derives shard and main weights from them. Direct (direct = 1, for
 * meta-device models materialised one module at a time): each item's own rows go straight to
 * the shard and main weights, so no full bucket ever exists; ZeRO-3 buckets stay EMPTY. */
mfsdp_status mfsdp_pipeline_init_begin(mfsdp_pipeline* p, int32_t b, int direct) {
  MFSDP_CHECK(healthy(p));
  MFSDP_CHECK(check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (bk->initializing) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: init_begin twice", b);
  if (bk->wstate == MFSDP_W_GATHERING) MFSDP_CHECK(finish_gather(p, bk));
  if (!direct || !bk->spec.weights_sharded) {
    MFSDP_CHECK(materialize(p, bk, MFSDP_BUF_WEIGHT));
    MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_WEIGHT));
  }
  if (direct) { /* the shards receive rows item by item: their padding must be zero */
    if (bk->owner[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD) MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_WEIGHT_SHARD));
    if (own_main(bk)) MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_MAIN_SHARD));
  }
  bk->initializing = direct ? 2 : 1;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_item(mfsdp_pipeline* p, int32_t b, int32_t item, const void* src, int32_t src_dtype,
                                     int64_t numel) {
  MFSDP_CHECK(check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (!bk->initializing)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: set_item outside init_begin/init_end", b);
  if (item < 0 || item >= bk->spec.layout.n_items || numel != bk->numels[item])
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d item %d: %lld elements given, %lld expected", b, item,
                      (long long)numel,
                      item >= 0 && item < bk->spec.layout.n_items ? (long long)bk->numels[item] : -1LL);
  const mfsdp_kernel_ops* k = p->be.kernels;
  if (bk->initializing == 1 || !bk->spec.weights_sharded)
    MFSDP_CHECK(k->copy(p->be.kernels_ctx, at(&bk->buf[MFSDP_BUF_WEIGHT], bk->param_offsets[item]),
                        bk->spec.param_dtype, src, src_dtype, numel, 1.0));
  if (bk->initializing == 1) return MFSDP_OK;
  /* direct: this rank's rows of the item, into the persistent shard buffers (an own WEIGHT_SHARD
   * takes its whole collective shard: under HFSDP the rows of its replicas' twins too) */
  int64_t first, n, to = bk->shard_offsets[item];
  if (bk->owner[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD)
    for (int32_t o = 0; o < bk->subs; ++o) {
      piece(bk, item, o * bk->shards + bk->own_shard, &first, &n);
      if (n > 0)
        MFSDP_CHECK(k->copy(p->be.kernels_ctx, at(&bk->buf[MFSDP_BUF_WEIGHT_SHARD], (int64_t)o * bk->sub_size + to),
                            bk->spec.param_dtype, (const char*)src + first * elem_size(src_dtype), src_dtype, n, 1.0));
    }
  piece(bk, item, bk->spec.shard_rank, &first, &n);
  if (n > 0 && own_main(bk))
    MFSDP_CHECK(k->copy(p->be.kernels_ctx, at(&bk->buf[MFSDP_BUF_MAIN_SHARD], to), bk->spec.main_dtype,
                        (const char*)src + first * elem_size(src_dtype), src_dtype, n, 1.0));
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_init_end(mfsdp_pipeline* p, int32_t b) {
  MFSDP_CHECK(check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (!bk->initializing) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: init_end without init_begin", b);
  if (bk->initializing == 1) { /* derive the shards from the full weights; padding zero */
    const mfsdp_buffer* w = &bk->buf[MFSDP_BUF_WEIGHT];
    if (bk->owner[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD) {
      MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_WEIGHT_SHARD));
      MFSDP_CHECK(pack_own_rows(p, bk, bk->buf[MFSDP_BUF_WEIGHT_SHARD].data, bk->spec.param_dtype, w, 1));
    }
    if (own_main(bk)) {
      MFSDP_CHECK(zero_buffer(p, bk, MFSDP_BUF_MAIN_SHARD));
      MFSDP_CHECK(pack_own_rows(p, bk, bk->buf[MFSDP_BUF_MAIN_SHARD].data, bk->spec.main_dtype, w, 0));
    }
  }
  bk->initializing = 0;
  if (bk->spec.weights_sharded) {
    MFSDP_CHECK(release(p, bk, MFSDP_BUF_WEIGHT));
    bk->wstate = MFSDP_W_EMPTY;
  } else {
    bk->wstate = MFSDP_W_READY;
  }
  return MFSDP_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* weights */

/* This rank's slice of the gather buffer (WEIGHT_SHARD) from wherever its rows live. */
static mfsdp_status fill_own_slice(mfsdp_pipeline* p, bucket* bk) {
  void* slice = bk->buf[MFSDP_BUF_WEIGHT_SHARD].data;
  if (casts_on_gather(bk)) /* see [Note: cast on gather] */
    return p->be.kernels->copy(p->be.kernels_ctx, slice, bk->spec.param_dtype, bk->buf[MFSDP_BUF_MAIN_SHARD].data,
                               bk->spec.main_dtype, bk->shard_size, 1.0);
  if (main_in_weight(bk)) return pack_own_rows(p, bk, slice, bk->spec.param_dtype, &bk->buf[MFSDP_BUF_WEIGHT], 1);
  return MFSDP_OK; /* an own WEIGHT_SHARD, or the slice already is this rank's part of WEIGHT */
}

static mfsdp_status start_gather(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(complete_outer_of(p, bk)); /* HFSDP: the replicas' gather of this step's weights */
  MFSDP_CHECK(materialize(p, bk, bk->gather_kind));
  MFSDP_CHECK(fill_own_slice(p, bk));
  bk->wstate = MFSDP_W_GATHERING;
  if (!communicates(p, bk)) {
    if (bk->owner[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD) /* one inner rank (HFSDP 4x1): a copy */
      MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, at(&bk->buf[bk->gather_kind], bk->shard_start),
                                      bk->spec.param_dtype, bk->buf[MFSDP_BUF_WEIGHT_SHARD].data, bk->spec.param_dtype,
                                      bk->shard_size, 1.0));
    return MFSDP_OK;
  }
  mfsdp_status st = p->be.transport->all_gather(p->be.transport_ctx, &bk->buf[bk->gather_kind],
                                                &bk->buf[MFSDP_BUF_WEIGHT_SHARD], &bk->gather_work);
  if (st != MFSDP_OK) return comm_failed(p, st);
  count(bk, COMM_all_gather, bk->full_size * elem_size(bk->spec.param_dtype));
  return MFSDP_OK;
}

/* Rank-major gather -> parameter-major full weights (see [Note: chunked layout]). Under
 * ZeRO-1/2 with the main weights inside WEIGHT, this rank's own rows are already in place. */
static mfsdp_status copy_out(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GATHER];
  packer k = {p, bk->buf[MFSDP_BUF_WEIGHT].data, bk->spec.param_dtype, 1.0, 0, 0, {{0}}};
  int32_t skip = main_in_weight(bk) ? bk->spec.shard_rank : -1;
  for (int32_t i = 0; i < bk->spec.layout.n_items; ++i)
    for (int32_t r = 0; r < bk->owners; ++r) {
      if (r == skip) continue;
      int64_t first, n;
      piece(bk, i, r, &first, &n);
      MFSDP_CHECK(packer_add(&k, at(g, slot_of(bk, r) + bk->shard_offsets[i]), g->dtype, bk->param_offsets[i] + first,
                             n));
    }
  return packer_flush(&k);
}

/* The gather has been issued: wait for it and copy it out; full weights usable after this. */
static mfsdp_status finish_gather(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(wait_work(p, &bk->gather_work));
  if (bk->gather_kind == MFSDP_BUF_GATHER) {
    MFSDP_CHECK(materialize(p, bk, MFSDP_BUF_WEIGHT));
    MFSDP_CHECK(copy_out(p, bk));
    MFSDP_CHECK(release(p, bk, MFSDP_BUF_GATHER));
  }
  bk->wstate = MFSDP_W_READY;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_unshard(mfsdp_pipeline* p, const int32_t* ids, int32_t n) {
  MFSDP_CHECK(healthy(p));
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(check_bucket(p, ids[i]));
  /* A unit's gathers go out as one group (one NCCL launch for all its buckets). */
  const mfsdp_transport_ops* t = p->be.transport;
  int group = n > 1 && t->group_start != NULL;
  if (group) MFSDP_CHECK(comm_failed(p, t->group_start(p->be.transport_ctx)));
  mfsdp_status st = MFSDP_OK;
  for (int32_t i = 0; i < n && st == MFSDP_OK; ++i) {
    bucket* bk = &p->b[ids[i]];
    if (bk->wstate == MFSDP_W_EMPTY || bk->wstate == MFSDP_W_STALE) st = start_gather(p, bk);
  }
  if (group) { /* always closed, even after an error: NCCL groups must balance */
    mfsdp_status end = t->group_end(p->be.transport_ctx);
    if (st == MFSDP_OK && end != MFSDP_OK) st = comm_failed(p, end);
  }
  return st;
}

mfsdp_status mfsdp_pipeline_wait_unshard(mfsdp_pipeline* p, const int32_t* ids, int32_t n) {
  MFSDP_CHECK(healthy(p));
  for (int32_t i = 0; i < n; ++i) {
    MFSDP_CHECK(check_bucket(p, ids[i]));
    bucket* bk = &p->b[ids[i]];
    if (bk->wstate == MFSDP_W_GATHERING) {
      MFSDP_CHECK(finish_gather(p, bk));
    } else if (bk->wstate != MFSDP_W_READY) {
      return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: waited for weights that were never gathered", ids[i]);
    }
  }
  return MFSDP_OK;
}

/* Drops an in-flight gather's result (its values are about to be released or are stale). */
static mfsdp_status abandon_gather(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(wait_work(p, &bk->gather_work));
  return release(p, bk, MFSDP_BUF_GATHER);
}

mfsdp_status mfsdp_pipeline_reshard(mfsdp_pipeline* p, const int32_t* ids, int32_t n) {
  MFSDP_CHECK(healthy(p));
  for (int32_t i = 0; i < n; ++i) {
    MFSDP_CHECK(check_bucket(p, ids[i]));
    bucket* bk = &p->b[ids[i]];
    if (!bk->spec.weights_sharded || bk->wstate == MFSDP_W_EMPTY) continue;
    if (bk->wstate == MFSDP_W_GATHERING) MFSDP_CHECK(abandon_gather(p, bk));
    MFSDP_CHECK(release(p, bk, MFSDP_BUF_WEIGHT));
    bk->wstate = MFSDP_W_EMPTY;
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_install_main_weights(mfsdp_pipeline* p, int include_frozen) {
  MFSDP_CHECK(healthy(p));
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->spec.grad_mode == MFSDP_GRAD_NONE && !include_frozen) continue;
    if (!bk->gathered) { /* the shard is the whole bucket: main -> compute weights now */
      if (own_main(bk))
        MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, bk->buf[MFSDP_BUF_WEIGHT_SHARD].data, bk->spec.param_dtype,
                                        bk->buf[MFSDP_BUF_MAIN_SHARD].data, bk->spec.main_dtype, bk->shard_size, 1.0));
      continue;
    }
    if (bk->wstate == MFSDP_W_GATHERING) { /* carries the old values: drop it */
      MFSDP_CHECK(abandon_gather(p, bk));
      if (bk->spec.weights_sharded) MFSDP_CHECK(release(p, bk, MFSDP_BUF_WEIGHT));
      bk->wstate = bk->spec.weights_sharded ? MFSDP_W_EMPTY : MFSDP_W_STALE;
    }
    if (bk->wstate != MFSDP_W_EMPTY) bk->wstate = MFSDP_W_STALE; /* the next unshard spreads the new values */
    if (bk->subs > 1) { /* the replicas' sub-shards first ([Note: optimizer sharded across replicas]) */
      MFSDP_CHECK(complete_outer_of(p, bk));
      MFSDP_CHECK(launch_outer_gather(p, bk));
    }
  }
  return MFSDP_OK;
}
/* ------------------------------------------------------------------------------------------ */
/* gradients */

static int64_t reduce_bytes(const bucket* bk) {
  const mfsdp_buffer* b = bk->present[MFSDP_BUF_COMM] ? &bk->buf[MFSDP_BUF_COMM] : &bk->buf[MFSDP_BUF_GRAD];
  return b->numel * elem_size(b->dtype);
}

/* Zeroes the padding of a freshly materialised temporary GRAD (one fill when it has many runs). */
static mfsdp_status zero_holes(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
  if (bk->n_holes > MAX_HOLE_FILLS) return p->be.kernels->fill_zero(p->be.kernels_ctx, g->data, g->dtype, bk->full_size);
  for (int32_t h = 0; h < bk->n_holes; ++h)
    MFSDP_CHECK(p->be.kernels->fill_zero(p->be.kernels_ctx, at(g, bk->holes[2 * h]), g->dtype,
                                         bk->holes[2 * h + 1] - bk->holes[2 * h]));
  return MFSDP_OK;
}

/* Sums the `shards` pieces of EXCHANGE (every rank's contribution to this rank's slice, in the
 * comm dtype) into `dst` (grad dtype) in rank order, rounding in the grad dtype. */
static mfsdp_status sum_exchanged(mfsdp_pipeline* p, bucket* bk, void* dst, int zero_first) {
  const mfsdp_kernel_ops* k = p->be.kernels;
  int64_t size = bk->shard_size;
  double alpha = p->cfg.reduce_op == MFSDP_REDUCE_AVG ? 1.0 / bk->shards : 1.0;
  if (zero_first) MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, dst, bk->spec.grad_dtype, size));
  for (int32_t r = 0; r < bk->shards; ++r)
    MFSDP_CHECK(k->accumulate(p->be.kernels_ctx, dst, bk->spec.grad_dtype, at(&bk->buf[MFSDP_BUF_EXCHANGE], r * size),
                              bk->spec.comm_dtype, size, alpha));
  return release(p, bk, MFSDP_BUF_EXCHANGE);
}

/* The second half of an all-reduce done by exchange: sum this rank's block in the grad dtype,
 * round it once to the comm dtype, gather every rank's block and widen the result. All ranks
 * end with identical values. */
static mfsdp_status gather_exchanged(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  int32_t world = p->cfg.dp_world, gdt = bk->spec.grad_dtype, cdt = bk->spec.comm_dtype;
  int64_t size = exchange_block(p, bk), first = (int64_t)p->cfg.dp_rank * size;
  int64_t valid = bk->full_size - first;
  valid = valid < 0 ? 0 : valid > size ? size : valid;
  double alpha = p->cfg.reduce_op == MFSDP_REDUCE_AVG ? 1.0 / world : 1.0;
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
  MFSDP_CHECK(k->fill_zero(kc, at(g, first), gdt, valid));
  for (int32_t r = 0; r < world; ++r)
    MFSDP_CHECK(k->accumulate(kc, at(g, first), gdt, at(&bk->buf[MFSDP_BUF_EXCHANGE], r * size), cdt, valid, alpha));
  MFSDP_CHECK(release(p, bk, MFSDP_BUF_EXCHANGE));
  const mfsdp_buffer* block = &bk->buf[MFSDP_BUF_COMM_SLICE];
  MFSDP_CHECK(k->copy(kc, block->data, cdt, at(g, first), gdt, valid, 1.0));
  MFSDP_CHECK(k->fill_zero(kc, at(block, valid), cdt, size - valid));
  mfsdp_work* work = NULL;
  mfsdp_status st = p->be.transport->all_gather(p->be.transport_ctx, &bk->buf[MFSDP_BUF_COMM], block, &work);
  if (st != MFSDP_OK) return comm_failed(p, st);
  MFSDP_CHECK(wait_work(p, &work));
  return k->copy(kc, g->data, gdt, bk->buf[MFSDP_BUF_COMM].data, cdt, bk->full_size, 1.0);
}

/* The reduction across replicas of what the bucket's inner reduction left: an all-reduce
 * ([Note: hybrid sharding]), or under HFSDP a reduce-scatter of the accumulated collective
 * shard into this rank's sub-shard ([Note: optimizer sharded across replicas]). */
static mfsdp_status launch_outer(mfsdp_pipeline* p, bucket* bk) {
  mfsdp_reduce_op op = (mfsdp_reduce_op)p->cfg.reduce_op;
  MFSDP_CHECK(complete_outer_of(p, bk)); /* a weights' gather no forward waited for (its unit did not run) */
  mfsdp_status st;
  if (bk->subs > 1) {
    const mfsdp_buffer* b = &bk->buf[MFSDP_BUF_GRAD_SHARD];
    st = p->be.outer->reduce_scatter(p->be.outer_ctx, &bk->buf[MFSDP_BUF_GRAD_SUB], b, op, 1.0, &bk->outer_work);
    if (st != MFSDP_OK) return comm_failed(p, st);
    count(bk, COMM_outer_reduce_scatter, b->numel * elem_size(b->dtype));
  } else {
    int target = bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE ? MFSDP_BUF_GRAD_SHARD
                 : bk->spec.grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE ? MFSDP_BUF_GRAD_SLICE
                                                                     : MFSDP_BUF_GRAD;
    const mfsdp_buffer* b = &bk->buf[target];
    st = p->be.outer->all_reduce(p->be.outer_ctx, b, op, 1.0, &bk->outer_work);
    if (st != MFSDP_OK) return comm_failed(p, st);
    count(bk, COMM_outer_all_reduce, b->numel * elem_size(b->dtype));
  }
  bk->outer_reduced = 1; /* once the work completes (complete_outer, before anyone reads it) */
  return MFSDP_OK;
}

/* A bucket's inner reduction completed: in a syncing backward (no_shard/ZeRO-1 reduce only to
 * sync) its result goes on across the replicas, unless the bucket is held from that. */
static mfsdp_status reduce_across_replicas(mfsdp_pipeline* p, bucket* bk) {
  int syncing = bk->spec.grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE || p->sync;
  if (!has_outer(p) || bk->outer_hold || !syncing) return MFSDP_OK;
  return launch_outer(p, bk);
}

/* A ZeRO-2/3 gradient shard already reduced across the replicas is about to receive more: what
 * the replicas summed must count once in the next reduction across them. HFSDP ([Note: optimizer
 * sharded across replicas]): the stale partial sums around the reduced sub-shard go, and an
 * averaging collective's result is scaled back to a sum. HSDP ([Note: hybrid sharding]): the
 * replicas' sum is divided by the factor that reduction will apply again. */
static mfsdp_status rebase_across_replicas(mfsdp_pipeline* p, bucket* bk) {
  if (!bk->outer_reduced) return MFSDP_OK;
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  const mfsdp_buffer* gs = &bk->buf[MFSDP_BUF_GRAD_SHARD];
  if (bk->subs > 1) {
    int64_t end = bk->sub_start + bk->sub_size;
    MFSDP_CHECK(k->fill_zero(kc, gs->data, gs->dtype, bk->sub_start));
    MFSDP_CHECK(k->fill_zero(kc, at(gs, end), gs->dtype, bk->shard_size - end));
    if (p->cfg.reduce_op == MFSDP_REDUCE_AVG)
      MFSDP_CHECK(k->scale(kc, bk->buf[MFSDP_BUF_GRAD_SUB].data, gs->dtype, bk->sub_size, (double)bk->subs));
  } else {
    MFSDP_CHECK(k->scale(kc, gs->data, bk->spec.grad_dtype, bk->shard_size, 1.0 / outer_factor(p)));
  }
  bk->outer_reduced = 0;
  return MFSDP_OK;
}

/* HFSDP: the updated sub-shard into WEIGHT_SUB, then the collective shard gathered across the
 * replicas in place ([Note: optimizer sharded across replicas]); the next unshard waits. */
static mfsdp_status launch_outer_gather(mfsdp_pipeline* p, bucket* bk) {
  if (own_main(bk))
    MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, bk->buf[MFSDP_BUF_WEIGHT_SUB].data, bk->spec.param_dtype,
                                    bk->buf[MFSDP_BUF_MAIN_SHARD].data, bk->spec.main_dtype, bk->sub_size, 1.0));
  const mfsdp_buffer* b = &bk->buf[MFSDP_BUF_WEIGHT_SHARD];
  mfsdp_status st = p->be.outer->all_gather(p->be.outer_ctx, b, &bk->buf[MFSDP_BUF_WEIGHT_SUB], &bk->outer_work);
  if (st != MFSDP_OK) return comm_failed(p, st);
  bk->outer_gathering = 1;
  count(bk, COMM_outer_all_gather, b->numel * elem_size(b->dtype));
  return MFSDP_OK;
}

/* Waits for one bucket's collective across replicas. */
static mfsdp_status complete_outer_of(mfsdp_pipeline* p, bucket* bk) {
  mfsdp_work* w = bk->outer_work;
  bk->outer_work = NULL;
  bk->outer_gathering = 0;
  return w == NULL ? MFSDP_OK : comm_failed(p, p->be.outer->wait(p->be.outer_ctx, w));
}

/* Finishes the reductions across replicas (and, with `gathers`, the weights' gathers too: those
 * touch no gradient, so gradient work never waits for them). */
static mfsdp_status complete_outer(mfsdp_pipeline* p, int gathers) {
  for (int32_t i = 0; i < p->n; ++i)
    if (gathers || !p->b[i].outer_gathering) MFSDP_CHECK(complete_outer_of(p, &p->b[i]));
  return MFSDP_OK;
}

/* Takes the oldest reduction off the queue. */
static bucket* pop_front(mfsdp_pipeline* p) {
  bucket* bk = &p->b[p->queue[p->q_head]];
  p->q_head = (p->q_head + 1) % (p->n ? p->n : 1);
  p->q_len--;
  p->q_bytes -= reduce_bytes(bk);
  return bk;
}

/* ZeRO-2/3: this backward's reduced slice (or exchanged pieces) is added to the main gradient
 * shard; the temporary full gradients go. */
static mfsdp_status finish_accumulate(mfsdp_pipeline* p, bucket* bk) {
  MFSDP_CHECK(rebase_across_replicas(p, bk));
  if (exchanges(p, bk))
    MFSDP_CHECK(sum_exchanged(p, bk, bk->buf[MFSDP_BUF_GRAD_SHARD].data, 0));
  else
    MFSDP_CHECK(p->be.kernels->accumulate(p->be.kernels_ctx, bk->buf[MFSDP_BUF_GRAD_SHARD].data, bk->spec.grad_dtype,
                                          bk->buf[MFSDP_BUF_GRAD_SLICE].data, bk->spec.comm_dtype, bk->shard_size, 1.0));
  MFSDP_CHECK(release(p, bk, MFSDP_BUF_GRAD));
  bk->gstate = MFSDP_G_CLEAN;
  bk->held = 0;
  return MFSDP_OK;
}

/* no_shard / ZeRO-1: the reduced values land in the persistent GRAD (all of it, or this rank's
 * slice), widened from the comm copy or summed from the exchanged pieces. */
static mfsdp_status finish_in_place(mfsdp_pipeline* p, bucket* bk) {
  int whole = bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE;
  if (exchanges(p, bk) && whole) {
    MFSDP_CHECK(gather_exchanged(p, bk));
  } else if (exchanges(p, bk)) {
    MFSDP_CHECK(sum_exchanged(p, bk, bk->buf[MFSDP_BUF_GRAD_SLICE].data, 1));
  } else if (bk->present[MFSDP_BUF_COMM]) {
    int dst = whole ? MFSDP_BUF_GRAD : MFSDP_BUF_GRAD_SLICE, src = whole ? MFSDP_BUF_COMM : MFSDP_BUF_COMM_SLICE;
    MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, bk->buf[dst].data, bk->spec.grad_dtype, bk->buf[src].data,
                                    bk->spec.comm_dtype, bk->buf[dst].numel, 1.0));
  }
  MFSDP_CHECK(release(p, bk, MFSDP_BUF_COMM));
  bk->gstate = MFSDP_G_REDUCED;
  return MFSDP_OK;
}

/* Completes the reduction at the head of the queue: its bucket's per-mode work, then the
 * reduction across replicas that follows it. */
static mfsdp_status complete_front(mfsdp_pipeline* p) {
  bucket* bk = pop_front(p);
  MFSDP_CHECK(wait_work(p, &bk->reduce_work));
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
  return reduce_across_replicas(p, bk);
}

static mfsdp_status complete_until(mfsdp_pipeline* p, int32_t id) {
  while (p->b[id].gstate == MFSDP_G_REDUCING) {
    if (p->q_len == 0) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d reducing but not queued", id);
    MFSDP_CHECK(complete_front(p));
  }
  return MFSDP_OK;
}

static mfsdp_status complete_all(mfsdp_pipeline* p) {
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
  int comm = communicates(p, bk);
  mfsdp_work* work = NULL;
  int exchange = exchanges(p, bk);
  int full = MFSDP_BUF_GRAD, slice = MFSDP_BUF_GRAD_SLICE;
  double premul = 1.0;
  if (bk->spec.grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE) { /* ACCUMULATE scaled while packing */
    if (bk->present[MFSDP_BUF_COMM]) {
      MFSDP_CHECK(materialize(p, bk, MFSDP_BUF_COMM));
      const mfsdp_buffer* c = &bk->buf[MFSDP_BUF_COMM];
      MFSDP_CHECK(k->copy(kc, c->data, bk->spec.comm_dtype, bk->buf[MFSDP_BUF_GRAD].data, bk->spec.grad_dtype,
                          bk->full_size, bk->prescale));
      MFSDP_CHECK(k->fill_zero(kc, at(c, bk->full_size), c->dtype, c->numel - bk->full_size)); /* exchange padding */
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
    MFSDP_CHECK(materialize(p, bk, MFSDP_BUF_EXCHANGE));
    st = p->be.transport->all_to_all(p->be.transport_ctx, &bk->buf[MFSDP_BUF_EXCHANGE], &bk->buf[full], &work);
  } else if (comm && bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE) {
    st = p->be.transport->all_reduce(p->be.transport_ctx, &bk->buf[full], op, premul, &work);
  } else if (comm) {
    st = p->be.transport->reduce_scatter(p->be.transport_ctx, &bk->buf[slice], &bk->buf[full], op, premul, &work);
  }
  if (st != MFSDP_OK) return comm_failed(p, st);
  if (exchange || comm) /* an exchange counts as the reduction it replaces */
    count(bk, bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE ? COMM_all_reduce : COMM_reduce_scatter, reduce_bytes(bk));
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
static mfsdp_status rebase(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  double world = (double)p->cfg.dp_world;
  double f = bk->prescale * (p->cfg.reduce_op == MFSDP_REDUCE_AVG ? 1.0 / world : 1.0);
  if (bk->outer_reduced) f *= outer_factor(p); /* held by every replica too ([Note: hybrid sharding]) */
  bk->outer_reduced = 0;
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
  if (bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE) {
    double c = 1.0 / (world * f);
    if (c != 1.0) MFSDP_CHECK(k->scale(kc, g->data, g->dtype, bk->full_size, c));
  } else {
    int64_t start = bk->shard_start, end = start + bk->shard_size;
    MFSDP_CHECK(k->fill_zero(kc, g->data, g->dtype, start));
    MFSDP_CHECK(k->fill_zero(kc, at(g, end), g->dtype, bk->full_size - end));
    if (f != 1.0) MFSDP_CHECK(k->scale(kc, bk->buf[MFSDP_BUF_GRAD_SLICE].data, g->dtype, bk->shard_size, 1.0 / f));
  }
  bk->gstate = MFSDP_G_DIRTY;
  return MFSDP_OK;
}

/* Makes a bucket's gradient buffer ready to reduce and launches it: ZeRO-2/3 buckets get zeros
 * where this rank had no gradient; a no_shard/ZeRO-1 sum that was already reduced is rebased so
 * that this reduction counts it once ([Note: reduce once per step]). */
static mfsdp_status launch_bucket(mfsdp_pipeline* p, int32_t id) {
  bucket* bk = &p->b[id];
  if (bk->gstate == MFSDP_G_REDUCING) MFSDP_CHECK(complete_until(p, id));
  if (bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE) {
    const mfsdp_kernel_ops* k = p->be.kernels;
    MFSDP_CHECK(materialize(p, bk, MFSDP_BUF_GRAD));
    const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
    if (bk->held) { /* unscaled sums of several backwards: scale once ([Note: held gradients]) */
      if (bk->prescale != 1.0) MFSDP_CHECK(k->scale(p->be.kernels_ctx, g->data, g->dtype, bk->full_size, bk->prescale));
    } else if (bk->gstate == MFSDP_G_CLEAN) { /* nothing of this backward packed here */
      MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, g->data, g->dtype, bk->full_size));
    } else if (bk->n_ready < bk->spec.layout.n_items) {
      for (int32_t j = 0; j < bk->spec.layout.n_items; ++j)
        for (int32_t r = 0; r < bk->owners && !bk->ready[j]; ++r)
          MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, at(g, slot_of(bk, r) + bk->shard_offsets[j]), g->dtype,
                                   bk->pieces[j]));
    }
  } else if (bk->gstate == MFSDP_G_REDUCED) {
    MFSDP_CHECK(rebase(p, bk));
  }
  return launch_reduce(p, id);
}

/* Launches, in the shared order, every bucket whose turn has come and whose gradients are
 * complete ([Note: collective order]). ZeRO-2/3 buckets reduce in every backward, no_shard and
 * ZeRO-1 buckets only in a syncing one. */
static mfsdp_status launch_in_order(mfsdp_pipeline* p) {
  while (p->next < p->n) {
    int32_t id = p->order[p->next];
    bucket* bk = &p->b[id];
    int reduces = !bk->hold && (bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE ||
                                (p->sync && bk->spec.grad_mode != MFSDP_GRAD_NONE));
    if (reduces) {
      if (!bk->complete) break;
      MFSDP_CHECK(launch_bucket(p, id));
    }
    p->next++;
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_begin_backward(mfsdp_pipeline* p, int sync) {
  MFSDP_CHECK(healthy(p));
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
  if (!accumulate && (bk->hold || bk->held)) { /* [Note: held gradients]: unscaled local sums */
    if (!bk->held) {
      MFSDP_CHECK(materialize(p, bk, MFSDP_BUF_GRAD));
      MFSDP_CHECK(p->be.kernels->fill_zero(p->be.kernels_ctx, g->data, g->dtype, bk->full_size));
      bk->held = 1;
    }
    accumulate = 1;
    alpha = 1.0;
  } else if (!accumulate) {
    if (bk->gstate == MFSDP_G_CLEAN) {
      MFSDP_CHECK(materialize(p, bk, MFSDP_BUF_GRAD));
      MFSDP_CHECK(zero_holes(p, bk));
    }
  } else {
    int32_t id = (int32_t)(bk - p->b);
    if (bk->gstate == MFSDP_G_REDUCING) MFSDP_CHECK(complete_until(p, id));
    if (bk->gstate == MFSDP_G_REDUCED) MFSDP_CHECK(rebase(p, bk));
  }
  packer k = {p, g->data, g->dtype, alpha, accumulate, 0, {{0}}};
  mfsdp_status st = MFSDP_OK;
  for (int32_t j = 0; j < bk->n_pending && st == MFSDP_OK; ++j) {
    const pending_grad* pg = &bk->pending[j];
    int64_t width = elem_size(pg->dtype);
    for (int32_t r = 0; r < bk->owners && st == MFSDP_OK; ++r) {
      int64_t first, n;
      piece(bk, pg->item, r, &first, &n);
      st = packer_add(&k, (const char*)pg->src + first * width, pg->dtype, slot_of(bk, r) + bk->shard_offsets[pg->item],
                      n);
    }
  }
  if (st == MFSDP_OK) st = packer_flush(&k);
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
  MFSDP_CHECK(healthy(p));
  MFSDP_CHECK(check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (!p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: gradient outside a backward pass", b);
  if (bk->spec.grad_mode == MFSDP_GRAD_NONE)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d holds frozen parameters: no gradient expected", b);
  int32_t n_items = bk->spec.layout.n_items;
  if (item < 0 || item >= n_items || numel != bk->numels[item])
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d item %d: gradient of %lld elements, expected %lld", b,
                      item, (long long)numel, item >= 0 && item < n_items ? (long long)bk->numels[item] : -1LL);
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
  bk->n_ready++;
  if (bk->n_ready == n_items) {
    MFSDP_CHECK(flush_pending(p, bk));
    bk->complete = 1;
    MFSDP_CHECK(launch_in_order(p));
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_seal(mfsdp_pipeline* p, const int32_t* ids, int32_t n) {
  MFSDP_CHECK(healthy(p));
  if (!p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "seal outside a backward pass");
  for (int32_t i = 0; i < n; ++i) {
    MFSDP_CHECK(check_bucket(p, ids[i]));
    bucket* bk = &p->b[ids[i]];
    MFSDP_CHECK(flush_pending(p, bk));
    bk->complete = 1;
  }
  return launch_in_order(p);
}

mfsdp_status mfsdp_pipeline_end_backward(mfsdp_pipeline* p) {
  MFSDP_CHECK(healthy(p));
  if (!p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "end_backward without begin_backward");
  for (int32_t i = 0; i < p->n; ++i) { /* incomplete buckets: what arrived, then zeros for the rest */
    MFSDP_CHECK(flush_pending(p, &p->b[i]));
    p->b[i].complete = 1;
  }
  MFSDP_CHECK(launch_in_order(p));
  MFSDP_CHECK(complete_all(p));
  MFSDP_CHECK(complete_outer(p, 0));
  p->reduce_due = 0; /* no_shard/ZeRO-1 sums left unreduced by this backward: the step's sync reduces them */
  for (int32_t i = 0; i < p->n; ++i)
    if ((p->b[i].spec.grad_mode == MFSDP_GRAD_ALL_REDUCE || p->b[i].spec.grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE) &&
        !p->b[i].launched)
      p->reduce_due = 1;
  p->in_backward = 0;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_sync_grads(mfsdp_pipeline* p) {
  MFSDP_CHECK(healthy(p));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "gradient sync requested inside a backward pass");
  if (p->reduce_due) { /* every no_shard/ZeRO-1 bucket, on every rank, in the shared order */
    for (int32_t k = 0; k < p->n; ++k) {
      bucket* bk = &p->b[p->order[k]];
      if ((bk->spec.grad_mode == MFSDP_GRAD_ALL_REDUCE || bk->spec.grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE) &&
          !bk->hold)
        MFSDP_CHECK(launch_bucket(p, p->order[k]));
    }
    p->reduce_due = 0;
  }
  MFSDP_CHECK(complete_all(p));
  MFSDP_CHECK(complete_outer(p, 0));
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->owner[MFSDP_BUF_OPT_GRAD] == MFSDP_BUF_OPT_GRAD)
      MFSDP_CHECK(p->be.kernels->copy(p->be.kernels_ctx, bk->buf[MFSDP_BUF_OPT_GRAD].data, bk->spec.main_dtype,
                                      at(&bk->buf[MFSDP_BUF_GRAD_SHARD], bk->sub_start), bk->spec.grad_dtype,
                                      bk->sub_size, 1.0));
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_zero_grads(mfsdp_pipeline* p) {
  MFSDP_CHECK(healthy(p));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "zero_grad inside a backward pass");
  MFSDP_CHECK(complete_all(p));
  MFSDP_CHECK(complete_outer(p, 0));
  p->reduce_due = 0; /* nothing left to reduce */
  const mfsdp_kernel_ops* k = p->be.kernels;
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->spec.grad_mode == MFSDP_GRAD_NONE) continue;
    int target = bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE ? MFSDP_BUF_GRAD_SHARD : MFSDP_BUF_GRAD;
    MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, bk->buf[target].data, bk->buf[target].dtype, bk->buf[target].numel));
    if (bk->held) { /* discard what was held back */
      MFSDP_CHECK(release(p, bk, MFSDP_BUF_GRAD));
      bk->held = 0;
    }
    bk->outer_reduced = 0;
    if (bk->owner[MFSDP_BUF_OPT_GRAD] == MFSDP_BUF_OPT_GRAD)
      MFSDP_CHECK(k->fill_zero(p->be.kernels_ctx, bk->buf[MFSDP_BUF_OPT_GRAD].data, bk->spec.main_dtype, bk->sub_size));
    bk->gstate = MFSDP_G_CLEAN;
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_zero_item_grads(mfsdp_pipeline* p, int32_t b, const int32_t* items, int32_t n) {
  MFSDP_CHECK(healthy(p));
  MFSDP_CHECK(check_bucket(p, b));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "zero_grad inside a backward pass");
  bucket* bk = &p->b[b];
  if (bk->spec.grad_mode == MFSDP_GRAD_NONE) return MFSDP_OK;
  if (bk->gstate == MFSDP_G_REDUCING) MFSDP_CHECK(complete_until(p, b));
  MFSDP_CHECK(complete_outer(p, 0));
  const mfsdp_kernel_ops* k = p->be.kernels;
  void* kc = p->be.kernels_ctx;
  int persistent = bk->spec.grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE; /* GRAD holds every rank's pieces */
  const mfsdp_buffer* g = &bk->buf[persistent ? MFSDP_BUF_GRAD : MFSDP_BUF_GRAD_SHARD];
  for (int32_t j = 0; j < n; ++j) {
    int32_t i = items[j];
    if (i < 0 || i >= bk->spec.layout.n_items)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d has no item %d", b, i);
    if (persistent) {
      for (int32_t r = 0; r < bk->owners; ++r)
        MFSDP_CHECK(k->fill_zero(kc, at(g, slot_of(bk, r) + bk->shard_offsets[i]), g->dtype, bk->pieces[i]));
    } else {
      for (int32_t o = 0; o < bk->subs; ++o)
        MFSDP_CHECK(k->fill_zero(kc, at(g, (int64_t)o * bk->sub_size + bk->shard_offsets[i]), g->dtype, bk->pieces[i]));
      const mfsdp_buffer* held = &bk->buf[MFSDP_BUF_GRAD];
      for (int32_t r = 0; bk->held && r < bk->owners; ++r)
        MFSDP_CHECK(k->fill_zero(kc, at(held, slot_of(bk, r) + bk->shard_offsets[i]), held->dtype, bk->pieces[i]));
    }
    if (bk->owner[MFSDP_BUF_OPT_GRAD] == MFSDP_BUF_OPT_GRAD)
      MFSDP_CHECK(k->fill_zero(kc, at(&bk->buf[MFSDP_BUF_OPT_GRAD], bk->shard_offsets[i]), bk->spec.main_dtype,
                               bk->pieces[i]));
  }
  if (n == bk->spec.layout.n_items) { /* all zero: nothing of it was reduced across replicas either */
    bk->gstate = MFSDP_G_CLEAN;
    bk->outer_reduced = 0;
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_hold(mfsdp_pipeline* p, const int32_t* ids, int32_t n, int hold) {
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "gradient sync cannot change inside a backward pass");
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(check_bucket(p, ids[i]));
  for (int32_t i = 0; i < n; ++i) p->b[ids[i]].hold = (int8_t)!!hold;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_outer_hold(mfsdp_pipeline* p, const int32_t* ids, int32_t n, int hold) {
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "gradient sync cannot change inside a backward pass");
  for (int32_t i = 0; i < n; ++i) MFSDP_CHECK(check_bucket(p, ids[i]));
  for (int32_t i = 0; i < n; ++i) p->b[ids[i]].outer_hold = (int8_t)!!hold;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_prescale(mfsdp_pipeline* p, const int32_t* ids, int32_t n, double prescale) {
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "gradient scaling cannot change inside a backward");
  if (!(prescale > 0.0)) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "gradient pre-scale %g is not positive", prescale);
  for (int32_t i = 0; i < n; ++i) {
    MFSDP_CHECK(check_bucket(p, ids[i]));
    const bucket* bk = &p->b[ids[i]];
    /* gradients already scaled: a new scale would mix two; the same one is a no-op */
    if (bk->prescale != prescale && (bk->gstate == MFSDP_G_REDUCED || bk->held))
      return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d holds gradients scaled the old way: zero them first", ids[i]);
  }
  for (int32_t i = 0; i < n; ++i) p->b[ids[i]].prescale = prescale;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_local(mfsdp_pipeline* p, int32_t b, int32_t item, const void* src, int32_t src_dtype,
                                      int64_t numel) {
  MFSDP_CHECK(check_bucket(p, b));
  bucket* bk = &p->b[b];
  if (bk->initializing != 2)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: set_local outside init_begin(direct)/init_end", b);
  if (item < 0 || item >= bk->spec.layout.n_items)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d has no item %d", b, item);
  int64_t first, n;
  piece(bk, item, bk->spec.shard_rank, &first, &n);
  if (numel != n)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d item %d: %lld local elements given, this rank holds %lld", b,
                      item, (long long)numel, (long long)n);
  if (n == 0) return MFSDP_OK;
  const mfsdp_kernel_ops* k = p->be.kernels;
  int64_t to = bk->shard_offsets[item];
  if (bk->owner[MFSDP_BUF_WEIGHT_SHARD] == MFSDP_BUF_WEIGHT_SHARD) /* HFSDP: the replicas' gather brings the rest */
    MFSDP_CHECK(k->copy(p->be.kernels_ctx, at(&bk->buf[MFSDP_BUF_WEIGHT_SHARD], bk->sub_start + to),
                        bk->spec.param_dtype, src, src_dtype, n, 1.0));
  if (own_main(bk))
    MFSDP_CHECK(k->copy(p->be.kernels_ctx, at(&bk->buf[MFSDP_BUF_MAIN_SHARD], to), bk->spec.main_dtype, src, src_dtype,
                        n, 1.0));
  if (!bk->spec.weights_sharded) /* persistent full weights: this rank's rows (a gather brings the rest) */
    MFSDP_CHECK(k->copy(p->be.kernels_ctx, at(&bk->buf[MFSDP_BUF_WEIGHT], bk->param_offsets[item] + first),
                        bk->spec.param_dtype, src, src_dtype, n, 1.0));
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_set_comm_dtype(mfsdp_pipeline* p, int32_t dtype) {
  MFSDP_CHECK(healthy(p));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "communication dtype changed inside a backward pass");
  MFSDP_CHECK(complete_all(p));
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->spec.grad_mode == MFSDP_GRAD_NONE) continue;
    int32_t dt = dtype >= 0 ? dtype : bk->spec.grad_dtype;
    if (!mfsdp_dtype_is_float(dt))
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "communication dtype %s is not floating", mfsdp_dtype_name(dt));
    if (bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE && bk->gstate != MFSDP_G_CLEAN)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d still holds unreduced gradients", i);
  }
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->spec.grad_mode == MFSDP_GRAD_NONE) continue;
    int32_t dt = dtype >= 0 ? dtype : bk->spec.grad_dtype;
    if (dt == bk->spec.comm_dtype) continue;
    drop_comm_buffers(p, bk);
    bk->spec.comm_dtype = dt;
    MFSDP_CHECK(create_comm_buffers(p, bk));
    MFSDP_CHECK(release_temporaries(p, bk));
  }
  return MFSDP_OK;
}

int32_t mfsdp_pipeline_comm_dtype(const mfsdp_pipeline* p, int32_t bucket_id) {
  return p->b[bucket_id].spec.comm_dtype;
}

mfsdp_status mfsdp_pipeline_drain(mfsdp_pipeline* p) {
  MFSDP_CHECK(healthy(p));
  MFSDP_CHECK(complete_all(p));
  MFSDP_CHECK(complete_outer(p, 1));
  for (int32_t i = 0; i < p->n; ++i) {
    bucket* bk = &p->b[i];
    if (bk->wstate == MFSDP_W_GATHERING) MFSDP_CHECK(finish_gather(p, bk));
  }
  p->in_backward = 0;
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_count_nonfinite_grad(mfsdp_pipeline* p, int32_t b, int32_t item, int64_t* count) {
  MFSDP_CHECK(check_bucket(p, b));
  bucket* bk = &p->b[b];
  *count = 0;
  if (bk->spec.grad_mode == MFSDP_GRAD_NONE || item < 0 || item >= bk->spec.layout.n_items)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d item %d has no gradient", b, item);
  int64_t first, n;
  piece(bk, item, bk->spec.shard_rank, &first, &n);
  if (n == 0) return MFSDP_OK;
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD_SHARD];
  return p->be.kernels->count_nonfinite(p->be.kernels_ctx, at(g, bk->sub_start + bk->shard_offsets[item]),
                                        g->dtype, n, count);
}
