/* mfsdp_pipeline.h: the bucket state machine and the collective pipeline.
 *
 * One pipeline per wrapped model. It owns every bucket's buffers (through the memory ops),
 * issues all-gathers for weights and reduce-scatters / all-reduces for gradients through the
 * transport ops, and runs the element-wise kernels between them. The Python hooks only say
 * *when* (unshard this unit, this gradient is ready, backward ended); the pipeline decides
 * *what* (which collectives, into which buffers, with which scaling). The implementation is cut
 * by concern into the files listed at the top of pipeline.c.
 *
 * Buffers of one bucket (see [Note: chunked layout] in core/mfsdp_layout.h; S = shard_size,
 * W = shards, r = shard rank; "rank-major" is W*S elements, "parameter-major" weight_size):
 *   WEIGHT        full compute weights, parameter-major, param_dtype: every compute parameter
 *                 is a view of it. Temporary under ZeRO-3.
 *   GATHER        the all-gather output, rank-major, param_dtype, temporary: copied out to
 *                 WEIGHT once the gather lands. Absent when the two layouts coincide: then the
 *                 gather lands in WEIGHT itself.
 *   WEIGHT_SHARD  rank r's S elements, the all-gather input: own storage under ZeRO-3 when the
 *                 main weights are the compute weights; else a view of GATHER (or WEIGHT) at
 *                 r*S, filled at each gather ([Note: cast on gather]).
 *   MAIN_SHARD    optimizer weights (main_dtype), rank-major: own storage if main_dtype !=
 *                 param_dtype, or when a quantized gather would overwrite where they live
 *                 ([Note: quantized communication] in wire.c), else a view of WEIGHT_SHARD. Absent
 *                 under ZeRO-1/2 with equal dtypes and distinct layouts: the optimizer then updates
 *                 this rank's rows inside WEIGHT (mfsdp_pipeline_local_piece says where each item's
 *                 rows are).
 *   GRAD          full gradients, rank-major. ZeRO-2/3: temporary, in comm_dtype, filled each
 *                 backward and reduce-scattered. no_shard/ZeRO-1: persistent, grad_dtype,
 *                 accumulates local gradients until the step's single reduction.
 *   GRAD_SLICE    view of GRAD at r*S: the reduce-scatter output.
 *   GRAD_SHARD    main gradients (grad_dtype) of the shard: own storage under ZeRO-2/3.
 *   OPT_GRAD      what the optimizer reads as .grad (main_dtype): own storage if it differs.
 *   COMM, COMM_SLICE  temporary comm_dtype copy for persistent GRAD when comm != grad dtype.
 *   EXCHANGE      temporary comm_dtype receive buffer when comm_dtype is narrower than
 *                 grad_dtype: all ranks' pieces of this rank's slice, summed here in grad_dtype
 *                 (see [Note: exchange reduction] in reduce.c).
 *   WEIGHT_SUB, GRAD_SUB  HFSDP only ([Note: optimizer sharded across replicas] in replicas.c):
 *                 views of this rank's sub-shard (1/replicas) of WEIGHT_SHARD and GRAD_SHARD,
 *                 the shards of the all-gather and reduce-scatter across the replicas.
 *   GATHER_WIRE, GATHER_WIRE_SHARD  quantized weights ([Note: quantized communication] in
 *                 wire.c): the all-gather's output, W wire pieces (uint8, temporary; it replaces
 *                 GATHER), and a view of this rank's piece, its input.
 *   GRAD_WIRE     quantized gradients: this rank's W pieces, the exchange's input (uint8,
 *                 temporary); EXCHANGE is then uint8 too: every rank's piece of this rank's slice.
 *   OUTER_WIRE, OUTER_WIRE_SUB  HFSDP with quantized weights across replicas: the replicas'
 *                 all-gather output (one piece per replica, uint8, temporary) and this rank's.
 *   FLAGS         float32, 3 per item: this rank's used-parameter flags and trainable check,
 *                 copied into every shard's tail at each launch ([Note: used-flag tail] in reduce.c).
 * An offloaded bucket (spec.offload) keeps what the optimizer owns in host memory: MAIN_SHARD, the
 * ZeRO-2/3 GRAD_SHARD, and OPT_GRAD where it is not a view of GRAD_SHARD ([Note: offloaded buckets]
 * in buffers.c). */
#ifndef MFSDP_PIPELINE_H
#define MFSDP_PIPELINE_H

#include <stdint.h>

#include "../core/mfsdp_kernels.h"
#include "../core/mfsdp_layout.h"
#include "mfsdp_transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per item of a bucket's flag tail, the planner's tail_per_item ([Note: used-flag tail]
 * in reduce.c: used, trains, frozen). */
#define MFSDP_FLAG_TAIL 3

typedef enum mfsdp_buf_kind {
  MFSDP_BUF_WEIGHT = 0,
  MFSDP_BUF_GATHER,
  MFSDP_BUF_WEIGHT_SHARD,
  MFSDP_BUF_MAIN_SHARD,
  MFSDP_BUF_GRAD,
  MFSDP_BUF_GRAD_SLICE,
  MFSDP_BUF_GRAD_SHARD,
  MFSDP_BUF_OPT_GRAD,
  MFSDP_BUF_COMM,
  MFSDP_BUF_COMM_SLICE,
  MFSDP_BUF_EXCHANGE,
  MFSDP_BUF_WEIGHT_SUB,
  MFSDP_BUF_GRAD_SUB,
  MFSDP_BUF_GATHER_WIRE,
  MFSDP_BUF_GATHER_WIRE_SHARD,
  MFSDP_BUF_GRAD_WIRE,
  MFSDP_BUF_OUTER_WIRE,
  MFSDP_BUF_OUTER_WIRE_SUB,
  MFSDP_BUF_FLAGS,
  MFSDP_BUF_COUNT
} mfsdp_buf_kind;

typedef enum mfsdp_grad_mode {
  MFSDP_GRAD_NONE = 0,               /* frozen bucket: no gradient memory at all */
  MFSDP_GRAD_ALL_REDUCE = 1,         /* no_shard, replicated: all-reduce once per step */
  MFSDP_GRAD_SCATTER_IN_PLACE = 2,   /* ZeRO-1: reduce-scatter the local sum once per step */
  MFSDP_GRAD_SCATTER_ACCUMULATE = 3  /* ZeRO-2/3: reduce-scatter every backward, += shard */
} mfsdp_grad_mode;

typedef enum mfsdp_weight_state {
  MFSDP_W_EMPTY = 0,     /* full weights released (ZeRO-3 only) */
  MFSDP_W_GATHERING = 1, /* all-gather in flight */
  MFSDP_W_READY = 2,     /* full weights valid */
  MFSDP_W_STALE = 3      /* storage present, contents older than the shard: needs a gather */
} mfsdp_weight_state;

typedef enum mfsdp_grad_state {
  MFSDP_G_CLEAN = 0,    /* nothing accumulated since the last zero (or last reduction, ZeRO-2/3) */
  MFSDP_G_DIRTY = 1,    /* local, unreduced gradients present */
  MFSDP_G_REDUCING = 2, /* reduction in flight */
  MFSDP_G_REDUCED = 3   /* persistent GRAD holds reduced values (no_shard / ZeRO-1) */
} mfsdp_grad_state;

/* What of a bucket crosses the wire quantized, in the format of [Note: quantized wire format]
 * (core/mfsdp_quant.h); see [Note: quantized communication] in wire.c. Each wire is
 * MFSDP_WIRE_PLAIN (the buffer's own dtype, as without quantization: a zero-initialised spec
 * communicates as before) or MFSDP_WIRE_QUANT(an mfsdp_quant_mode). */
#define MFSDP_WIRE_PLAIN 0
#define MFSDP_WIRE_QUANT(mode) ((mode) + 1)
typedef struct mfsdp_wire_spec {
  int32_t weights;       /* the all-gather of weights inside the replica (ZeRO-1/2/3 over several ranks) */
  int32_t grads;         /* the gradient reduction inside the replica, done as an exchange */
  int32_t outer_weights; /* HFSDP: the all-gather of the updated weights across the replicas */
  int64_t block;         /* elements per block, >= 1 (even with int4); 0: MFSDP_QUANT_DEFAULT_BLOCK */
} mfsdp_wire_spec;

typedef struct mfsdp_bucket_spec {
  mfsdp_bucket_layout layout; /* copied; layout.world is the number of shards (1: replicated) */
  int32_t shard_rank;         /* this rank's index among the shards (HFSDP: outer * dp_world + inner) */
  int32_t param_dtype, main_dtype, grad_dtype, comm_dtype;
  int32_t weights_sharded;  /* full weights are temporary (ZeRO-3) */
  int32_t weights_regather; /* optimizer updates a shard of persistent weights (ZeRO-1/2) */
  int32_t grad_mode;        /* mfsdp_grad_mode of its gradients while any item trains (NONE: it never can) */
  mfsdp_wire_spec wire;     /* quantized communication (zero: none) */
  int32_t frozen;           /* every item frozen at creation: no gradient memory until one trains
                               (mfsdp_pipeline_set_trainable, [Note: requires_grad changes] in trainable.c) */
  int32_t sum_in_comm_dtype; /* a comm dtype narrower than the gradients is summed by the collective in
                                it (NCCL's and torch FSDP2's numbers), not by the exchange reduction
                                ([Note: exchange reduction] in reduce.c); quantized wires ignore it */
  int32_t offload;          /* main weights, main gradients and the optimizer's gradients live in the
                               backend's host memory ([Note: offloaded buckets] in buffers.c) */
} mfsdp_bucket_spec;

typedef struct mfsdp_pipeline_config {
  int32_t dp_world;        /* data-parallel size (collectives span it) */
  int32_t dp_rank;         /* this rank's index in it */
  double grad_prescale;    /* gradients are multiplied by this before the sum: 1/dp_world or 1 */
  int32_t reduce_op;       /* mfsdp_reduce_op */
  int64_t reduce_queue_bytes; /* in-flight gradient reductions beyond this are completed */
  int32_t force_comm;      /* issue collectives even on one rank (tests a transport on one GPU) */
  int32_t outer_world;     /* hybrid sharding (HSDP): replicas of the dp_world shards, across which
                              reduced gradients are also all-reduced; 0 or 1: none */
  int32_t outer_sharded;   /* HFSDP: sharded buckets split main weights, main gradients and optimizer
                              state over all dp_world x outer_world ranks (their layout.world);
                              replicated buckets stay HSDP */
} mfsdp_pipeline_config;

typedef struct mfsdp_backend {
  const mfsdp_memory_ops* memory;
  void* memory_ctx;
  const mfsdp_transport_ops* transport;
  void* transport_ctx;
  const mfsdp_kernel_ops* kernels;
  void* kernels_ctx;
  const mfsdp_transport_ops* outer; /* hybrid sharding: the transport over the replicas (NULL: none) */
  void* outer_ctx;
  /* Offloaded buckets' host buffers ([Note: offloaded buckets] in buffers.c): memory the kernels
   * reach in place (torch's pinned host memory on a GPU, which unified addressing maps). NULL: `memory` serves them too (the
   * CPU, where every buffer is host memory). */
  const mfsdp_memory_ops* host_memory;
  void* host_memory_ctx;
} mfsdp_backend;

/* Collective accounting, per bucket and summed over the pipeline. Each kind of collective has a
 * count `<kind>s` and a byte total `<kind>_bytes`. This list is their only spelling: it makes
 * the struct below, the sum in mfsdp_pipeline_stats and the Python stats dict (engine.c).
 *   all_gather            bytes of the full output
 *   reduce_scatter        bytes of the full input
 *   all_reduce            bytes of the buffer
 *   outer_all_reduce      hybrid sharding: across the replicas
 *   outer_reduce_scatter  HFSDP: bytes of the full input
 *   outer_all_gather      HFSDP: bytes of the full output
 *   quantized_*           the same collectives with quantized pieces ([Note: quantized
 *                         communication] in wire.c), counted there instead of in the plain kind,
 *                         in bytes of the wire: what really crossed. quantized_all_reduce (no_shard)
 *                         adds the gather of the reduced blocks, which goes in the gradient dtype.
 * A reduction done as an exchange ([Note: exchange reduction] in reduce.c) counts as the
 * all-reduce or reduce-scatter it replaces. */
#define MFSDP_COMM_COUNTERS(X)   \
  X(all_gather)                  \
  X(reduce_scatter)              \
  X(all_reduce)                  \
  X(outer_all_reduce)            \
  X(outer_reduce_scatter)        \
  X(outer_all_gather)            \
  X(quantized_all_gather)        \
  X(quantized_reduce_scatter)    \
  X(quantized_all_reduce)        \
  X(outer_quantized_all_gather)

typedef struct mfsdp_comm_stats {
#define MFSDP_COMM_FIELDS_(kind) int64_t kind##s, kind##_bytes;
  MFSDP_COMM_COUNTERS(MFSDP_COMM_FIELDS_)
#undef MFSDP_COMM_FIELDS_
} mfsdp_comm_stats;

typedef struct mfsdp_pipeline mfsdp_pipeline;

mfsdp_status mfsdp_pipeline_create(const mfsdp_pipeline_config* config, const mfsdp_backend* backend,
                                   const mfsdp_bucket_spec* buckets, int32_t n_buckets, mfsdp_pipeline** out);
/* Waits for nothing: in-flight work is discarded. Call mfsdp_pipeline_drain first when healthy. */
void mfsdp_pipeline_destroy(mfsdp_pipeline* p);

int32_t mfsdp_pipeline_num_buckets(const mfsdp_pipeline* p);
const mfsdp_buffer* mfsdp_pipeline_buffer(const mfsdp_pipeline* p, int32_t bucket, int32_t kind); /* NULL if absent */
int32_t mfsdp_pipeline_weight_state(const mfsdp_pipeline* p, int32_t bucket);
int32_t mfsdp_pipeline_grad_state(const mfsdp_pipeline* p, int32_t bucket);
void mfsdp_pipeline_stats(const mfsdp_pipeline* p, int32_t bucket, mfsdp_comm_stats* out); /* bucket -1: total */
/* Where this rank's rows of item `item` live in buffer `kind` (MAIN_SHARD, OPT_GRAD,
 * GRAD_SHARD, WEIGHT_SHARD): *where is the buffer that holds them (WEIGHT for main weights kept
 * inside the full weights), at element *offset, *n elements (0 past the item's last row). */
mfsdp_status mfsdp_pipeline_local_piece(const mfsdp_pipeline* p, int32_t bucket, int32_t item, int32_t kind,
                                        int32_t* where, int64_t* offset, int64_t* n);
/* Non-empty once a collective failed: every later call refuses with this text. */
const char* mfsdp_pipeline_broken(const mfsdp_pipeline* p);

/* Initialisation: begin materialises WEIGHT (zeroed), set_item copies a parameter in,
 * end derives the shard and main weights and releases what is temporary. direct = 1 writes
 * only this rank's rows (no full ZeRO-3 bucket; for meta-device initialisation). set_item and
 * set_local copy `src` with the kernels, on a GPU asynchronously on the current stream: the
 * caller leaves it unchanged until that stream has passed the copy (a torch tensor freed
 * after the call is: its memory goes back to the stream-ordered caching allocator). */
mfsdp_status mfsdp_pipeline_init_begin(mfsdp_pipeline* p, int32_t bucket, int direct);
mfsdp_status mfsdp_pipeline_set_item(mfsdp_pipeline* p, int32_t bucket, int32_t item, const void* src,
                                     int32_t src_dtype, int64_t numel);
mfsdp_status mfsdp_pipeline_init_end(mfsdp_pipeline* p, int32_t bucket);
/* Direct initialisation from this rank's rows only (the local tensor of a Shard(0) DTensor):
 * numel must be this rank's share of the item. Persistent full weights get these rows only: mark
 * them stale (install_main_weights(include_frozen)) so that the next unshard gathers the rest. */
mfsdp_status mfsdp_pipeline_set_local(mfsdp_pipeline* p, int32_t bucket, int32_t item, const void* src,
                                      int32_t src_dtype, int64_t numel);

/* Weights. unshard issues gathers (asynchronous); wait makes the full weights usable. */
mfsdp_status mfsdp_pipeline_unshard(mfsdp_pipeline* p, const int32_t* buckets, int32_t n);
mfsdp_status mfsdp_pipeline_wait_unshard(mfsdp_pipeline* p, const int32_t* buckets, int32_t n);
mfsdp_status mfsdp_pipeline_reshard(mfsdp_pipeline* p, const int32_t* buckets, int32_t n);
/* ZeRO-3 buckets whose full weights stay allocated when resharded ([Note: kept full weights] in
 * weights.c; FSDP2's set_keep_unsharded_storage). Turning it off releases those now resharded. */
mfsdp_status mfsdp_pipeline_set_keep_weights(mfsdp_pipeline* p, const int32_t* buckets, int32_t n, int keep);
/* The optimizer (or a checkpoint load) changed the main weights: cast main -> compute shard and
 * mark full weights stale so the next unshard spreads the new values (HFSDP: after an
 * all-gather across the replicas, issued here and awaited by that unshard). Frozen buckets are
 * skipped unless include_frozen (they only change by loading). */
mfsdp_status mfsdp_pipeline_install_main_weights(mfsdp_pipeline* p, int include_frozen);

/* Gradients. */
mfsdp_status mfsdp_pipeline_begin_backward(mfsdp_pipeline* p, int sync);
/* keepalive: a memory handle retained until the gradient has been packed (may be NULL when the
 * caller keeps `src` alive until end_backward). */
mfsdp_status mfsdp_pipeline_grad_ready(mfsdp_pipeline* p, int32_t bucket, int32_t item, const void* src,
                                       int32_t src_dtype, int64_t numel, void* keepalive);
/* The buckets' gradients of this backward are final (their unit did not run in this forward on
 * this rank): what arrived, zeros for the rest; they may launch in their turn. */
mfsdp_status mfsdp_pipeline_seal(mfsdp_pipeline* p, const int32_t* buckets, int32_t n);
mfsdp_status mfsdp_pipeline_end_backward(mfsdp_pipeline* p);
/* The order in which every rank launches gradient reductions: a permutation of the buckets
 * (default: descending id). See [Note: collective order] in reduce.c. */
mfsdp_status mfsdp_pipeline_set_reduce_order(mfsdp_pipeline* p, const int32_t* order, int32_t n);
/* Reduce whatever no_shard / ZeRO-1 gradients are not yet reduced (exactly once per step),
 * finish every in-flight reduction, and fill OPT_GRAD. */
mfsdp_status mfsdp_pipeline_sync_grads(mfsdp_pipeline* p);
/* *ready = 1 when bucket b's optimizer gradient of this syncing backward is final and the
 * host's to read before sync_grads (completing its reduction); 0 when it is final only after
 * sync_grads. See [Note: a bucket's gradients before the sync] in backward.c. */
mfsdp_status mfsdp_pipeline_finish_grads(mfsdp_pipeline* p, int32_t b, int* ready);
/* The host waits until the gradients finish_grads last answered ready for bucket b have landed
 * in its host memory (offloaded buckets; others at once). Touches only that bucket's mark, so
 * another thread may call it while this one goes on with the backward. */
mfsdp_status mfsdp_pipeline_wait_grads(mfsdp_pipeline* p, int32_t b);
mfsdp_status mfsdp_pipeline_zero_grads(mfsdp_pipeline* p);
/* Zeroes the main gradients of some items only (one optimizer of several over one model);
 * `items` are distinct. */
mfsdp_status mfsdp_pipeline_zero_item_grads(mfsdp_pipeline* p, int32_t bucket, const int32_t* items, int32_t n);
/* Puts buckets on (or off) hold: ZeRO-2/3 buckets on hold accumulate unreduced local gradients
 * (see [Note: held gradients] in backward.c); others are left out of this backward's reductions. */
mfsdp_status mfsdp_pipeline_set_hold(mfsdp_pipeline* p, const int32_t* buckets, int32_t n, int hold);
/* Hybrid sharding: buckets whose reduced gradients skip the all-reduce across replicas (FSDP2's
 * set_requires_all_reduce(False)); their inner reduction goes on. */
mfsdp_status mfsdp_pipeline_set_outer_hold(mfsdp_pipeline* p, const int32_t* buckets, int32_t n, int hold);
/* The factor gradients of these buckets are multiplied by before the sum (default: the config's). */
mfsdp_status mfsdp_pipeline_set_prescale(mfsdp_pipeline* p, const int32_t* buckets, int32_t n, double prescale);
/* Switches every trainable bucket to communicating gradients in `dtype` (-1: the grad dtype).
 * Only temporary buffers change; refused while gradients are half reduced, and for a bucket
 * whose gradients cross the wire quantized (its staging dtype is its gradient dtype). */
mfsdp_status mfsdp_pipeline_set_comm_dtype(mfsdp_pipeline* p, int32_t dtype);
int32_t mfsdp_pipeline_comm_dtype(const mfsdp_pipeline* p, int32_t bucket);
/* Which items train ([Note: requires_grad changes] in trainable.c): sets the flag of `items` of
 * one bucket. The first trainable item of a bucket without gradient buffers creates them (zero);
 * from then on the bucket reduces like any trainable one, each backward expecting exactly the
 * gradients of its trainable items (the others get zeros). Every rank must make the same changes
 * between the same two backwards. Refused inside a backward and for a grad mode NONE bucket. */
mfsdp_status mfsdp_pipeline_set_trainable(mfsdp_pipeline* p, int32_t bucket, const int32_t* items, int32_t n,
                                          int trainable);
/* Frees the gradient buffers of buckets none of whose items trains, discarding their values (the
 * caller knows nobody reads them: no `.grad` is attached). Refused for a bucket with a trainable
 * item or holding local gradients not yet reduced; a bucket without buffers is left alone. */
mfsdp_status mfsdp_pipeline_release_grads(mfsdp_pipeline* p, const int32_t* buckets, int32_t n);
/* Finish every in-flight collective (between backwards: refused inside one). */
mfsdp_status mfsdp_pipeline_drain(mfsdp_pipeline* p);
/* Where the bucket's reduced used-parameter flags are ([Note: used-flag tail] in reduce.c): *n
 * items (0: the bucket carries none), 3 * *n float elements of GRAD_SHARD from element *offset
 * (its grad dtype): item i was used on some rank since the gradients were last zeroed iff
 * element i is > 0; in the bucket's last reduction ranks disagreed on whether it trains iff
 * elements n + i and 2n + i are both > 0. *every_rank: 0 when, with replicas, its last reduction
 * did not cross them (the flags are this replica's). Valid after end_backward / sync_grads. */
mfsdp_status mfsdp_pipeline_flag_tail(const mfsdp_pipeline* p, int32_t bucket, int64_t* offset, int32_t* n,
                                      int32_t* every_rank);
/* The same flags read and decoded (one synchronous copy to the host): used[i] = 1 iff item i
 * was used on some rank; split[i] = 1 iff ranks disagreed on whether it trains, in a reduction
 * that crossed every rank. `used` and `split` hold the bucket's items; *n as flag_tail's (0: the
 * bucket carries no flags, nothing written). */
mfsdp_status mfsdp_pipeline_read_flags(mfsdp_pipeline* p, int32_t bucket, uint8_t* used, uint8_t* split, int32_t* n);
/* Number of NaN/Inf elements in item `item`'s main gradient shard. */
mfsdp_status mfsdp_pipeline_count_nonfinite_grad(mfsdp_pipeline* p, int32_t bucket, int32_t item,
                                                 int64_t* count);

#ifdef __cplusplus
}
#endif
#endif
