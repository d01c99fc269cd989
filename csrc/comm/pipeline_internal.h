/* pipeline_internal.h: the state every part of the pipeline shares (the bucket, the pipeline)
 * and the helpers they call across files. Not installed, not part of the API (mfsdp_pipeline.h):
 * helpers shared between the pipeline's files are prefixed pl_ and have hidden visibility, so
 * the extension exports none of them; helpers of one file stay static there. The map of the
 * files is at the top of pipeline.c. */
#ifndef MFSDP_PIPELINE_INTERNAL_H
#define MFSDP_PIPELINE_INTERNAL_H

#include "mfsdp_pipeline.h"

#if defined(__GNUC__)
#define PL_INTERNAL __attribute__((visibility("hidden")))
#else
#define PL_INTERNAL
#endif

/* Pack items handed to one `pack` call: a bucket's pieces go out in chunks of this many. */
#define PACK_CHUNK 256

/* Where a bucket is in loading its weights (mfsdp_pipeline_init_begin .. init_end). */
typedef enum pl_init_mode {
  PL_INIT_NONE = 0, /* not loading: set_item and set_local are refused */
  PL_INIT_FULL,     /* items go into the full weights (WEIGHT); init_end derives the shards from them */
  PL_INIT_DIRECT    /* each item's own rows go straight to the shard and main weights (meta-device
                       initialisation): no full ZeRO-3 bucket ever exists */
} pl_init_mode;

/* A gradient of this backward waiting for its bucket to complete ([Note: one pack per bucket]). */
typedef struct pending_grad {
  const void* src;
  int32_t dtype;
  int32_t item;
  void* handle; /* keeps the gradient's memory alive until packed (may be NULL) */
} pending_grad;

/* [Note: bucket geometry]
 * A bucket has two kinds of shard. Its layout (core/mfsdp_layout.h) cuts every item into
 * layout.world pieces of whole rows, torch.chunk's split: the "holders", one per rank that holds
 * rows of its own, each with a sub-shard of layout.shard_size elements. The collectives inside a
 * replica move "collective shards", one per rank they span. Without HFSDP the two coincide (one
 * sub-shard per collective shard); under HFSDP ([Note: optimizer sharded across replicas]) the
 * holders are the ranks of every replica and a collective shard holds the sub-shards of one
 * inner rank's twins in all replicas. The fields (and the letters the code used before):
 *   shards      W    collective shards: ranks an inner collective spans (1: not sharded)
 *   shard_size  S    elements of one collective shard: subs * sub_size
 *   full_size   W*S  rank-major elements: what an inner collective moves
 *   subs        O    sub-shards per collective shard: the replicas under HFSDP, else 1
 *   sub_size    Sv   elements of one sub-shard: layout.shard_size
 *   holders     V    sub-shards in all: layout.world = shards * subs
 *   own_shard   inner  this rank's collective shard: spec.shard_rank % shards
 *   own_sub     sub  this rank's sub-shard inside it: spec.shard_rank / shards (0 without HFSDP)
 *   shard_start, sub_start  own_shard * shard_size, own_sub * sub_size
 * Holder v = o * shards + i (replica o, inner rank i) sits at slot i * subs + o of the rank-major
 * buffers (pl_slot_of), so collective shard i is one contiguous run; without HFSDP slot v is
 * holder v. */
typedef struct bucket {
  mfsdp_bucket_spec spec; /* spec.layout's arrays point at the copies below */
  int64_t* numels;
  int64_t* pieces;
  int64_t* param_offsets;
  int64_t* shard_offsets;
  int64_t* outers; /* blocks of each item: 1 unless sharded on a dim other than 0 ([Note: chunked layout]) */
  /* geometry: see [Note: bucket geometry] */
  int32_t shards;      /* collective shards */
  int64_t shard_size;  /* elements of one: subs * sub_size */
  int64_t full_size;   /* rank-major elements: shards * shard_size */
  int32_t subs;        /* sub-shards per collective shard */
  int64_t sub_size;    /* elements of one: layout.shard_size */
  int32_t holders;     /* sub-shards in all: layout.world */
  int32_t own_shard;   /* this rank's collective shard */
  int32_t own_sub;     /* this rank's sub-shard inside it */
  int64_t shard_start; /* own_shard * shard_size: its collective shard in the rank-major buffers */
  int64_t sub_start;   /* own_sub * sub_size: its sub-shard inside the collective shard */
  int identity;        /* rank-major and parameter-major coincide: gathers land in WEIGHT */
  int gathered;        /* full weights come from all-gathers (ZeRO-3, or ZeRO-1/2 over several shards) */
  int gather_kind;     /* GATHER, or WEIGHT when identity */
  mfsdp_buffer buf[MFSDP_BUF_COUNT];
  int8_t present[MFSDP_BUF_COUNT];
  int8_t storage[MFSDP_BUF_COUNT];      /* kind whose memory this buffer uses (itself for a storage) */
  int64_t view_offset[MFSDP_BUF_COUNT]; /* element offset into its storage */
  int8_t temporary[MFSDP_BUF_COUNT];    /* a storage whose memory is released between uses */
  int8_t materialized[MFSDP_BUF_COUNT];
  int8_t host[MFSDP_BUF_COUNT];         /* a storage in the backend's host memory ([Note: offloaded buckets]) */
  int32_t wstate;
  int8_t keep_weights; /* ZeRO-3: reshard leaves WEIGHT allocated, stale ([Note: kept full weights] in weights.c) */
  mfsdp_work* gather_work;
  int32_t gstate;
  mfsdp_work* reduce_work;
  int32_t n_ready;
  int8_t launched; /* its reduction was issued in this backward (it may have completed since) */
  int8_t complete; /* every gradient of this backward is in (or it was sealed): it may launch */
  /* mfsdp_pipeline_set_hold: its reduction waits for a backward off hold. ZeRO-2/3 accumulate
   * unscaled local sums meanwhile ([Note: held gradients]); no_shard/ZeRO-1 are left out of
   * the reductions (their local sums accumulate in GRAD anyway). */
  int8_t hold;
  int8_t outer_hold; /* set_outer_hold: the reduction across replicas waits (the inner one goes on) */
  int8_t outer_reduced; /* its reduced gradients were all-reduced across replicas since the last zero */
  mfsdp_work* outer_work; /* across replicas: the gradient reduction, or (HFSDP) the weights' gather */
  int8_t outer_gathering; /* outer_work is the weights' gather: only this bucket's next unshard waits */
  int8_t held_grads; /* ZeRO-2/3: GRAD holds the unscaled local sums of backwards on hold */
  void* landed; /* offloaded: the host mark after finish_grads' last write of GRAD_SHARD (kernels' host_mark) */
  double prescale; /* gradients are multiplied by this before the sum (default cfg.grad_prescale) */
  uint8_t* ready;
  pending_grad* pending; /* this backward's gradients not yet packed */
  int32_t n_pending;
  int64_t* holes; /* [start, end) pairs of the rank-major GRAD not covered by any item's rows */
  int32_t n_holes;
  pl_init_mode init; /* between init_begin and init_end: how the weights are loaded */
  /* quantized wires ([Note: quantized communication] in wire.c): each one's mfsdp_quant_mode, or
   * -1 when it carries the buffer's own dtype; the block; elements and bytes of one piece */
  int8_t q_weights;     /* the all-gather inside the replica: pieces of shard_size elements */
  int8_t q_grads;       /* the gradient exchange: pieces of q_grad_n elements */
  int8_t q_outer;       /* HFSDP, the all-gather across replicas: pieces of sub_size elements */
  int64_t q_block;
  int64_t q_grad_n;     /* shard_size, or the exchange block of an all-reduce (pl_exchange_block) */
  int64_t q_gather_piece, q_grad_piece, q_outer_piece; /* bytes */
  /* [Note: requires_grad changes] in trainable.c */
  uint8_t* trainable;  /* per item: it trains now (its gradient is expected in every backward) */
  int32_t n_trainable; /* items that train: the bucket reduces while it is > 0 */
  int8_t has_grads;    /* its gradient buffers exist (from the first trainable item until released) */
  /* [Note: used-flag tail] in reduce.c */
  int8_t flags;        /* its reductions carry the used-parameter flags in every shard's tail */
  uint8_t* used;       /* per item: a gradient arrived since the bucket's last launch */
  int8_t flags_local;  /* replicas: its last reduction did not cross them (the flags are this replica's) */
  mfsdp_comm_stats stats;
} bucket;

/* The kinds of MFSDP_COMM_COUNTERS, for pl_count(). */
typedef enum pl_comm_kind {
#define COMM_KIND_(kind) PL_COMM_##kind,
  MFSDP_COMM_COUNTERS(COMM_KIND_)
#undef COMM_KIND_
} pl_comm_kind;

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

/* Element `offset` of a buffer (NULL while its storage is released). The accessors below are
 * static inline: they run once per piece in the packing loops. */
static inline void* pl_at(const mfsdp_buffer* b, int64_t offset) {
  return b->data ? (char*)b->data + offset * mfsdp_dtype_size(b->dtype) : NULL;
}

/* Where holder v's sub-shard starts in the rank-major buffers ([Note: bucket geometry]). */
static inline int64_t pl_slot_of(const bucket* bk, int32_t v) {
  return ((int64_t)(v % bk->shards) * bk->subs + v / bk->shards) * bk->sub_size;
}

/* Owner r's piece of item i (it sits at pl_slot_of(r) + shard_offsets[i] in the rank-major
 * layout) as runs of the item: run j is elements [first + j * stride, +len) of the item and
 * [j * len, +len) of the piece (one run unless the item is sharded on a dim other than 0, see
 * [Note: chunked layout] in core/mfsdp_layout.h). */
static inline void pl_runs(const bucket* bk, int32_t i, int32_t r, mfsdp_runs* out) {
  mfsdp_piece_runs(bk->numels[i], bk->pieces[i], bk->outers[i], r, out);
}

/* Elements of holder r's piece of item i (the rest of pieces[i] is padding). */
static inline int64_t pl_piece_size(const bucket* bk, int32_t i, int32_t r) {
  mfsdp_runs ru;
  pl_runs(bk, i, r, &ru);
  return ru.count * ru.len;
}

/* The memory ops (and their context) that made buffer `kind`'s storage: the host memory for an
 * offloaded bucket's host buffers ([Note: offloaded buckets] in buffers.c), else the device's. */
static inline const mfsdp_memory_ops* pl_memory_of(const mfsdp_pipeline* p, const bucket* bk, int kind, void** ctx) {
  int host = bk->storage[kind] >= 0 && bk->host[bk->storage[kind]] && p->be.host_memory != NULL;
  *ctx = host ? p->be.host_memory_ctx : p->be.memory_ctx;
  return host ? p->be.host_memory : p->be.memory;
}

/* When a bucket is offloaded, the host waits for the kernels queued so far: its host buffers are
 * the host's to read and write ([Note: offloaded buckets] in buffers.c). */
static inline mfsdp_status pl_host_wait_offloaded(mfsdp_pipeline* p) {
  for (int32_t i = 0; i < p->n; ++i)
    if (p->b[i].spec.offload) return p->be.kernels->host_wait(p->be.kernels_ctx);
  return MFSDP_OK;
}

/* The main weights have storage of their own (a wider dtype than the compute weights, or an
 * offloaded bucket's host copy). */
static inline int pl_own_main(const bucket* bk) {
  return bk->present[MFSDP_BUF_MAIN_SHARD] && bk->storage[MFSDP_BUF_MAIN_SHARD] == MFSDP_BUF_MAIN_SHARD;
}

/* ZeRO-1/2 with main == compute dtype and distinct layouts: the main weights are this rank's
 * rows inside WEIGHT (no MAIN_SHARD buffer); a gather first packs them into its own slice. */
static inline int pl_main_in_weight(const bucket* bk) { return !bk->present[MFSDP_BUF_MAIN_SHARD]; }

/* The bucket reduces its gradients in backwards and syncs: some item trains (so its gradient
 * buffers exist). Every rank agrees on it ([Note: requires_grad changes]), as the shared launch
 * order needs ([Note: collective order]). */
static inline int pl_reduces(const bucket* bk) { return bk->n_trainable > 0; }

/* Element offset of the flag tail inside every sub-shard ([Note: used-flag tail] in reduce.c). */
static inline int64_t pl_tail_of(const bucket* bk) { return bk->spec.layout.tail_offset; }

/* Shared helpers, by the file that defines them, from the floor up (the map at the top of
 * pipeline.c; each documented at its definition). */

/* guards.c */
PL_INTERNAL mfsdp_status pl_healthy(const mfsdp_pipeline* p);
PL_INTERNAL mfsdp_status pl_comm_failed(mfsdp_pipeline* p, mfsdp_status st);
PL_INTERNAL mfsdp_status pl_check_bucket(const mfsdp_pipeline* p, int32_t b);
PL_INTERNAL mfsdp_status pl_wait_work(mfsdp_pipeline* p, mfsdp_work** work);
PL_INTERNAL void pl_count(bucket* bk, pl_comm_kind kind, int64_t bytes);

/* geometry.c */
PL_INTERNAL void pl_set_geometry(bucket* bk, const mfsdp_pipeline_config* cfg);
PL_INTERNAL int pl_communicates(const mfsdp_pipeline* p, const bucket* bk);
PL_INTERNAL int pl_exchanges(const mfsdp_pipeline* p, const bucket* bk);
PL_INTERNAL int64_t pl_exchange_block(const mfsdp_pipeline* p, const bucket* bk);

/* buffers.c */
PL_INTERNAL mfsdp_status pl_materialize(mfsdp_pipeline* p, bucket* bk, int kind);
PL_INTERNAL mfsdp_status pl_release(mfsdp_pipeline* p, bucket* bk, int kind);
PL_INTERNAL mfsdp_status pl_release_temporaries(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_create_comm_buffers(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL void pl_drop_comm_buffers(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_create_buffers(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_create_grad_buffers(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL void pl_drop_grad_buffers(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_compute_holes(bucket* bk);
PL_INTERNAL mfsdp_status pl_zero_holes(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_packer_flush(packer* k);
PL_INTERNAL mfsdp_status pl_packer_add(packer* k, const void* src, int32_t src_dtype, int64_t dst_offset, int64_t n);

/* wire.c */
PL_INTERNAL mfsdp_status pl_wire_check(const mfsdp_pipeline_config* cfg, const mfsdp_backend* be,
                                       const mfsdp_bucket_spec* s, int32_t i);
PL_INTERNAL void pl_wire_setup(const mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_wire_start_gather(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_wire_finish_gather(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_wire_exchange(mfsdp_pipeline* p, bucket* bk, const mfsdp_buffer* full, mfsdp_work** work);
PL_INTERNAL mfsdp_status pl_wire_sum(mfsdp_pipeline* p, bucket* bk, void* dst, int64_t n, double alpha);
PL_INTERNAL mfsdp_status pl_wire_outer_gather(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_wire_outer_land(mfsdp_pipeline* p, bucket* bk);

/* replicas.c */
PL_INTERNAL double pl_outer_factor(const mfsdp_pipeline* p);
PL_INTERNAL mfsdp_status pl_reduce_across_replicas(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_rebase_across_replicas(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_launch_outer_gather(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_complete_outer_of(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_complete_outer(mfsdp_pipeline* p, int gathers);

/* reduce.c */
PL_INTERNAL mfsdp_status pl_complete_until(mfsdp_pipeline* p, int32_t id);
PL_INTERNAL mfsdp_status pl_complete_all(mfsdp_pipeline* p);
PL_INTERNAL mfsdp_status pl_rebase(mfsdp_pipeline* p, bucket* bk);
PL_INTERNAL mfsdp_status pl_launch_bucket(mfsdp_pipeline* p, int32_t id);
PL_INTERNAL mfsdp_status pl_launch_in_order(mfsdp_pipeline* p);
PL_INTERNAL mfsdp_status pl_zero_item_flags(mfsdp_pipeline* p, bucket* bk, int32_t item);

/* weights.c */
PL_INTERNAL mfsdp_status pl_finish_gather(mfsdp_pipeline* p, bucket* bk);

#endif
