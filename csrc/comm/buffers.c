/* buffers.c: the buffer table of a bucket (the kinds of mfsdp_pipeline.h): which buffers
 * own storage and which are views of them, materialising and releasing temporaries, the
 * padding runs of the gradient buffer, and the packer every copy between layouts goes through.
 *
 * [Note: storage resize]
 * Temporary buffers (ZeRO-3 full weights, gather outputs, ZeRO-2/3 full gradients, comm
 * copies) keep one tensor object for the life of the model and only resize its storage between
 * 0 and full size. Parameter views and tensors autograd saved for backward point into that
 * storage object, so they stay valid across release and re-gather: no per-parameter work on
 * the hot path.
 *
 * [Note: offloaded buckets]
 * CPU offload (spec.offload: FSDP2's CPUOffloadPolicy, Megatron's optimizer_cpu_offload) keeps
 * what the optimizer owns in host memory, each a storage of its own made by the backend's host
 * memory ops: MAIN_SHARD, the main gradients GRAD_SHARD of ZeRO-2/3, and OPT_GRAD where it is not
 * a view of GRAD_SHARD (main and gradient dtypes differ; or no_shard/ZeRO-1, whose GRAD_SHARD is a
 * view of the device GRAD: the optimizer's host copy is made at the sync; pl_create_grad_buffers).
 * The device keeps only the temporaries of the collectives (GATHER or WEIGHT, GRAD, COMM,
 * EXCHANGE) and persistent compute weights (ZeRO-1/2, no_shard). No copy step is added: the paths that already
 * move data between these buffers do it, as kernels that reach the host memory in place (pinned
 * memory on a GPU, mapped by unified addressing), in stream order:
 *   - a gather casts this rank's rows from the host MAIN_SHARD into the device gather buffer
 *     ([Note: cast on gather] in weights.c: an offloaded bucket always casts on gather, so no
 *     WEIGHT_SHARD stays on the device); unsharded buckets copy it into WEIGHT at
 *     install_main_weights;
 *   - ZeRO-2/3 add each backward's reduced slice into the host GRAD_SHARD (finish_accumulate);
 *     no_shard/ZeRO-1 reduce in the device GRAD and copy their shard into the host OPT_GRAD at
 *     the sync (mfsdp_pipeline_sync_grads).
 * The host reads and writes these buffers itself (the optimizer step, clipping, checkpoints)
 * only after mfsdp_pipeline_sync_grads or mfsdp_pipeline_zero_grads returned: both end with the
 * kernels' host_wait when a bucket is offloaded, so nothing queued before reads or writes them
 * any more. A bucket stepped inside the backward is read after mfsdp_pipeline_wait_grads instead,
 * which waits for that bucket's mark alone ([Note: a bucket's gradients before the sync] in
 * backward.c). What the host writes (the step) the device reads later, in stream order: the next
 * gather or install_main_weights is queued after it returns. Host buffers are never temporary:
 * nothing frees one while a copy reads it. On the CPU both memory ops make host memory, and the
 * same copies run (the staging path the CPU suite covers).
 *
 * [Note: buffers under a collective]
 * A collective keeps writing its output until it ends, whatever became of the wait: gloo's worker
 * runs an all-gather that was given up on (Work.wait timed out) when the late peer arrives, and
 * copies into the output then (benchmarks/repro/gloo_freed_output.py, torch alone: a SIGSEGV in
 * AsyncAllgatherWork::allgather once the output's storage had been resized to 0). So no temporary
 * is released while a collective that reads or writes it may run: every path that releases waits
 * for the bucket's work first (abandon_gather, complete_front, pl_complete_outer_of); a failed
 * wait breaks the pipeline (pl_comm_failed), which then keeps all of its memory (pl_release does
 * nothing) and refuses every call that could release; and destroy only drops references, never
 * resizes: the torch transport's Work holds its tensors, so their storages outlive the engine
 * while gloo still writes them. pl_release checks the first rule: a storage under the bucket's
 * gather, reduction or reduction across replicas in flight is an internal error, raised, where it
 * would otherwise free memory a collective writes later. */
#include "pipeline_internal.h"

#include <stdlib.h>
#include <string.h>

/* Beyond this many padding runs, zeroing a temporary gradient bucket is one fill of all of it. */
#define MAX_HOLE_FILLS 64

static void refresh_views(bucket* bk, int storage) {
  for (int k = 0; k < MFSDP_BUF_COUNT; ++k)
    if (bk->present[k] && bk->storage[k] == storage && k != storage)
      bk->buf[k].data = pl_at(&bk->buf[storage], bk->view_offset[k]);
}

mfsdp_status pl_materialize(mfsdp_pipeline* p, bucket* bk, int kind) {
  if (!bk->present[kind])
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "buffer kind %d does not exist in this bucket", kind);
  int o = bk->storage[kind];
  if (bk->materialized[o]) return MFSDP_OK;
  void* ctx;
  MFSDP_CHECK(pl_memory_of(p, bk, o, &ctx)->materialize(ctx, &bk->buf[o]));
  bk->materialized[o] = 1;
  refresh_views(bk, o);
  return MFSDP_OK;
}

/* Whether one of `kinds` of bk is a view of (or is) storage o. */
static int any_of(const bucket* bk, const int8_t* kinds, int n, int o) {
  for (int i = 0; i < n; ++i)
    if (kinds[i] >= 0 && bk->present[kinds[i]] && bk->storage[kinds[i]] == o) return 1;
  return 0;
}

/* The collective in flight that touches storage o ([Note: buffers under a collective]), or NULL. */
static const char* collective_on(const bucket* bk, int o) {
  const int8_t gather[] = {(int8_t)bk->gather_kind, MFSDP_BUF_WEIGHT_SHARD, MFSDP_BUF_GATHER_WIRE,
                           MFSDP_BUF_GATHER_WIRE_SHARD};
  const int8_t reduce[] = {MFSDP_BUF_GRAD,         MFSDP_BUF_GRAD_SLICE, MFSDP_BUF_COMM, MFSDP_BUF_COMM_SLICE,
                           MFSDP_BUF_EXCHANGE,     MFSDP_BUF_GRAD_WIRE};
  const int8_t outer_reduce[] = {MFSDP_BUF_GRAD,     MFSDP_BUF_GRAD_SLICE, MFSDP_BUF_GRAD_SHARD,
                                 MFSDP_BUF_GRAD_SUB, MFSDP_BUF_OUTER_WIRE, MFSDP_BUF_OUTER_WIRE_SUB};
  const int8_t outer_gather[] = {MFSDP_BUF_WEIGHT_SHARD, MFSDP_BUF_WEIGHT_SUB, MFSDP_BUF_OUTER_WIRE,
                                 MFSDP_BUF_OUTER_WIRE_SUB};
  if (bk->gather_work && any_of(bk, gather, 4, o)) return "an all-gather";
  if (bk->reduce_work && any_of(bk, reduce, 6, o)) return "a gradient reduction";
  if (bk->outer_work && (bk->outer_gathering ? any_of(bk, outer_gather, 4, o) : any_of(bk, outer_reduce, 6, o)))
    return "a collective across replicas";
  return NULL;
}

mfsdp_status pl_release(mfsdp_pipeline* p, bucket* bk, int kind) {
  if (!bk->present[kind]) return MFSDP_OK;
  int o = bk->storage[kind];
  if (!bk->materialized[o] || !bk->temporary[o]) return MFSDP_OK;
  if (p->broken[0]) return MFSDP_OK; /* a collective may still write it: [Note: buffers under a collective] */
  const char* busy = collective_on(bk, o);
  if (busy)
    return pl_comm_failed(p, MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: buffer %d released while %s that uses it "
                                        "is in flight (an engine bug: [Note: buffers under a collective])",
                                        (int)(bk - p->b), o, busy));
  void* ctx;
  MFSDP_CHECK(pl_memory_of(p, bk, o, &ctx)->release(ctx, &bk->buf[o]));
  bk->materialized[o] = 0;
  refresh_views(bk, o);
  return MFSDP_OK;
}

/* A new storage buffer, in the backend's host memory when `host` ([Note: offloaded buckets]). */
static mfsdp_status make_storage(mfsdp_pipeline* p, bucket* bk, int kind, int64_t numel, int32_t dtype, int temporary,
                               int host) {
  bk->host[kind] = (int8_t)host;
  bk->storage[kind] = (int8_t)kind;
  void* ctx;
  MFSDP_CHECK(pl_memory_of(p, bk, kind, &ctx)->create(ctx, numel, dtype, &bk->buf[kind]));
  bk->present[kind] = 1;
  bk->materialized[kind] = 1;
  bk->temporary[kind] = (int8_t)temporary;
  return MFSDP_OK;
}

static mfsdp_status add_storage(mfsdp_pipeline* p, bucket* bk, int kind, int64_t numel, int32_t dtype, int temporary) {
  return make_storage(p, bk, kind, numel, dtype, temporary, 0);
}

/* A storage of the optimizer's (MAIN_SHARD, GRAD_SHARD, OPT_GRAD): persistent, in host memory
 * when the bucket is offloaded. */
static mfsdp_status add_kept_storage(mfsdp_pipeline* p, bucket* bk, int kind, int64_t numel, int32_t dtype) {
  return make_storage(p, bk, kind, numel, dtype, 0, bk->spec.offload);
}

static mfsdp_status add_view(mfsdp_pipeline* p, bucket* bk, int kind, int of, int64_t offset, int64_t numel) {
  int o = bk->storage[of];
  int64_t base = bk->view_offset[of] + offset;
  if (of == o && offset == 0 && numel == bk->buf[o].numel) {
    bk->buf[kind] = bk->buf[o]; /* the same range: share the handle, destroy only once */
  } else {
    void* ctx;
    MFSDP_CHECK(pl_memory_of(p, bk, o, &ctx)->create_view(ctx, &bk->buf[o], base, numel, &bk->buf[kind]));
  }
  bk->present[kind] = 1;
  bk->storage[kind] = (int8_t)o;
  bk->view_offset[kind] = base;
  bk->buf[kind].data = pl_at(&bk->buf[o], base);
  return MFSDP_OK;
}

static void drop_buffer(mfsdp_pipeline* p, bucket* bk, int kind) {
  if (!bk->present[kind]) return;
  int shared = 0;
  for (int j = 0; j < MFSDP_BUF_COUNT; ++j)
    if (j != kind && bk->present[j] && bk->buf[j].handle == bk->buf[kind].handle) shared = 1;
  void* ctx;
  if (!shared) pl_memory_of(p, bk, kind, &ctx)->destroy(ctx, &bk->buf[kind]);
  memset(&bk->buf[kind], 0, sizeof bk->buf[kind]);
  bk->present[kind] = bk->materialized[kind] = bk->temporary[kind] = bk->host[kind] = 0;
  bk->storage[kind] = -1;
  bk->view_offset[kind] = 0;
}

mfsdp_status pl_release_temporaries(mfsdp_pipeline* p, bucket* bk) {
  for (int k = 0; k < MFSDP_BUF_COUNT; ++k)
    if (bk->present[k] && bk->storage[k] == k && bk->temporary[k]) MFSDP_CHECK(pl_release(p, bk, k));
  return MFSDP_OK;
}

/* The temporary buffers that depend on the communication dtype (see mfsdp_pipeline.h). */
mfsdp_status pl_create_comm_buffers(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_bucket_spec* s = &bk->spec;
  int64_t full = bk->full_size;
  if (s->grad_mode == MFSDP_GRAD_NONE) return MFSDP_OK;
  if (s->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE) {
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_GRAD, full, s->comm_dtype, 1));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_GRAD_SLICE, MFSDP_BUF_GRAD, bk->shard_start, bk->shard_size));
  } else if (s->grad_mode == MFSDP_GRAD_ALL_REDUCE && pl_exchanges(p, bk)) {
    int64_t block = pl_exchange_block(p, bk);
    full = block * p->cfg.dp_world;
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_COMM, full, s->comm_dtype, 1));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_COMM_SLICE, MFSDP_BUF_COMM, (int64_t)p->cfg.dp_rank * block, block));
  } else if (s->comm_dtype != s->grad_dtype) {
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_COMM, full, s->comm_dtype, 1));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_COMM_SLICE, MFSDP_BUF_COMM, bk->shard_start, bk->shard_size));
  }
  if (pl_exchanges(p, bk) && bk->q_grads >= 0) { /* wire pieces out and in ([Note: quantized communication]) */
    int64_t bytes = p->cfg.dp_world * bk->q_grad_piece;
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_GRAD_WIRE, bytes, MFSDP_U8, 1));
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_EXCHANGE, bytes, MFSDP_U8, 1));
  } else if (pl_exchanges(p, bk)) {
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_EXCHANGE, full, s->comm_dtype, 1));
  }
  return MFSDP_OK;
}

void pl_drop_comm_buffers(mfsdp_pipeline* p, bucket* bk) {
  drop_buffer(p, bk, MFSDP_BUF_GRAD_WIRE);
  drop_buffer(p, bk, MFSDP_BUF_EXCHANGE);
  drop_buffer(p, bk, MFSDP_BUF_COMM_SLICE);
  drop_buffer(p, bk, MFSDP_BUF_COMM);
  if (bk->spec.grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE) {
    drop_buffer(p, bk, MFSDP_BUF_GRAD_SLICE);
    drop_buffer(p, bk, MFSDP_BUF_GRAD);
  }
}

/* Creates the buffers of one bucket per the table in mfsdp_pipeline.h (the gradient buffers only
 * when an item trains: pl_create_grad_buffers). */
mfsdp_status pl_create_buffers(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_bucket_spec* s = &bk->spec;
  int64_t shard = bk->shard_size, sub = bk->sub_size;
  /* a bucket that can train keeps main weights of its own dtype, also while frozen: unfreezing
   * then changes no weight buffer (the optimizer's parameters keep their tensors) */
  int wide_main = s->grad_mode != MFSDP_GRAD_NONE && s->main_dtype != s->param_dtype;
  /* an offloaded bucket's main weights are a host copy of their own ([Note: offloaded buckets]) */
  int own_main = wide_main || s->offload;
  /* The main weights inside WEIGHT (pl_main_in_weight) must be one run per item: an item sharded
   * on a dim other than 0 has its rows in several, so its bucket keeps a main shard of its own. */
  int runs = 0;
  for (int32_t i = 0; i < s->layout.n_items && s->layout.world > 1; ++i) runs |= bk->outers[i] > 1;

  MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_WEIGHT, s->layout.weight_size, s->param_dtype, s->weights_sharded));
  if (bk->gathered && !bk->identity) MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_GATHER, bk->full_size, s->param_dtype, 1));
  bk->gather_kind = bk->present[MFSDP_BUF_GATHER] ? MFSDP_BUF_GATHER : MFSDP_BUF_WEIGHT;
  /* HFSDP keeps the whole collective shard: the replicas' all-gather fills it once per step */
  int keeps_shard = s->weights_sharded && (!own_main || bk->subs > 1);
  if (keeps_shard)
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_WEIGHT_SHARD, shard, s->param_dtype, 0));
  else
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_WEIGHT_SHARD, bk->gather_kind, bk->shard_start, shard));
  if (bk->subs > 1) MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_WEIGHT_SUB, MFSDP_BUF_WEIGHT_SHARD, bk->sub_start, sub));
  /* a quantized gather overwrites this rank's rows with their dequantized values: main weights
   * that would live there get storage of their own ([Note: quantized communication] in wire.c);
   * so do main weights whose items run in several pieces (`runs` above) */
  if (own_main || (runs && bk->present[MFSDP_BUF_GATHER] && !s->weights_sharded) ||
      (bk->q_weights >= 0 && !keeps_shard) || bk->q_outer >= 0)
    MFSDP_CHECK(add_kept_storage(p, bk, MFSDP_BUF_MAIN_SHARD, sub, s->main_dtype));
  else if (!(bk->present[MFSDP_BUF_GATHER] && !s->weights_sharded)) /* else: pl_main_in_weight */
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_MAIN_SHARD, MFSDP_BUF_WEIGHT_SHARD, bk->sub_start, sub));
  if (bk->n_trainable > 0) MFSDP_CHECK(pl_create_grad_buffers(p, bk));
  if (bk->q_weights >= 0) {
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_GATHER_WIRE, bk->shards * bk->q_gather_piece, MFSDP_U8, 1));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_GATHER_WIRE_SHARD, MFSDP_BUF_GATHER_WIRE,
                         bk->own_shard * bk->q_gather_piece, bk->q_gather_piece));
  }
  if (bk->q_outer >= 0) {
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_OUTER_WIRE, bk->subs * bk->q_outer_piece, MFSDP_U8, 1));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_OUTER_WIRE_SUB, MFSDP_BUF_OUTER_WIRE, bk->own_sub * bk->q_outer_piece,
                         bk->q_outer_piece));
  }
  /* Views exist now; temporaries give their memory back until first use. */
  return pl_release_temporaries(p, bk);
}

/* The gradient buffers of a bucket (zero, CLEAN), at its creation or when its first item starts
 * training ([Note: requires_grad changes] in trainable.c). Temporaries among them are released
 * at once: the weights' buffers are left as they are (a unit may be gathered now). */
mfsdp_status pl_create_grad_buffers(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_bucket_spec* s = &bk->spec;
  int64_t shard = bk->shard_size, sub = bk->sub_size, full = bk->full_size;
  if (s->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE) {
    MFSDP_CHECK(add_kept_storage(p, bk, MFSDP_BUF_GRAD_SHARD, shard, s->grad_dtype));
  } else { /* persistent full gradients accumulate locally until the step's reduction */
    MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_GRAD, full, s->grad_dtype, 0));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_GRAD_SLICE, MFSDP_BUF_GRAD, bk->shard_start, shard));
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_GRAD_SHARD, MFSDP_BUF_GRAD_SLICE, 0, shard));
  }
  if (bk->subs > 1) MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_GRAD_SUB, MFSDP_BUF_GRAD_SHARD, bk->sub_start, sub));
  /* offloaded no_shard/ZeRO-1: the main gradients are a view of the device GRAD, so the
   * optimizer's gradients are a host copy made at the sync */
  if (s->main_dtype != s->grad_dtype || (s->offload && s->grad_mode != MFSDP_GRAD_SCATTER_ACCUMULATE))
    MFSDP_CHECK(add_kept_storage(p, bk, MFSDP_BUF_OPT_GRAD, sub, s->main_dtype));
  else
    MFSDP_CHECK(add_view(p, bk, MFSDP_BUF_OPT_GRAD, MFSDP_BUF_GRAD_SHARD, bk->sub_start, sub));
  if (bk->flags) MFSDP_CHECK(add_storage(p, bk, MFSDP_BUF_FLAGS, MFSDP_FLAG_TAIL * (int64_t)s->layout.n_items, MFSDP_F32, 0));
  MFSDP_CHECK(pl_create_comm_buffers(p, bk));
  bk->has_grads = 1;
  bk->gstate = MFSDP_G_CLEAN;
  const int temporaries[4] = {MFSDP_BUF_GRAD, MFSDP_BUF_COMM, MFSDP_BUF_EXCHANGE, MFSDP_BUF_GRAD_WIRE};
  for (int k = 0; k < 4; ++k) MFSDP_CHECK(pl_release(p, bk, temporaries[k]));
  return MFSDP_OK;
}

/* Frees every gradient buffer of a bucket (views first); the weights' buffers stay. */
void pl_drop_grad_buffers(mfsdp_pipeline* p, bucket* bk) {
  pl_drop_comm_buffers(p, bk);
  const int kinds[6] = {MFSDP_BUF_OPT_GRAD, MFSDP_BUF_GRAD_SUB, MFSDP_BUF_GRAD_SHARD, MFSDP_BUF_GRAD_SLICE,
                        MFSDP_BUF_GRAD, MFSDP_BUF_FLAGS};
  for (int k = 0; k < 6; ++k) drop_buffer(p, bk, kinds[k]);
  if (bk->spec.layout.n_items) memset(bk->used, 0, (size_t)bk->spec.layout.n_items);
  bk->has_grads = 0;
  bk->gstate = MFSDP_G_CLEAN;
  bk->held_grads = 0;
  bk->outer_reduced = 0;
  bk->flags_local = 0;
}

/* The runs of the rank-major GRAD holding no item's rows (see [Note: chunked layout]):
 * alignment gaps, the missing rows of the last ranks' pieces, each shard's tail. */
mfsdp_status pl_compute_holes(bucket* bk) {
  int32_t n = bk->spec.layout.n_items;
  bk->holes = malloc((size_t)(2 * ((int64_t)bk->holders * (n + 1))) * sizeof *bk->holes);
  if (bk->holes == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "hole table");
  for (int32_t slot = 0; slot < bk->holders; ++slot) { /* in memory order */
    int32_t r = (slot % bk->subs) * bk->shards + slot / bk->subs; /* the holder at this slot */
    int64_t cursor = (int64_t)slot * bk->sub_size;
    for (int32_t i = 0; i < n; ++i) { /* pieces are laid out in item order */
      int64_t len = pl_piece_size(bk, i, r);
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

/* Zeroes the padding of a freshly materialised temporary GRAD (one fill when it has many runs). */
mfsdp_status pl_zero_holes(mfsdp_pipeline* p, bucket* bk) {
  const mfsdp_buffer* g = &bk->buf[MFSDP_BUF_GRAD];
  if (bk->n_holes > MAX_HOLE_FILLS)
    return p->be.kernels->fill_zero(p->be.kernels_ctx, g->data, g->dtype, bk->full_size);
  for (int32_t h = 0; h < bk->n_holes; ++h)
    MFSDP_CHECK(p->be.kernels->fill_zero(p->be.kernels_ctx, pl_at(g, bk->holes[2 * h]), g->dtype,
                                         bk->holes[2 * h + 1] - bk->holes[2 * h]));
  return MFSDP_OK;
}

mfsdp_status pl_packer_flush(packer* k) {
  if (k->n == 0) return MFSDP_OK;
  mfsdp_status st = k->p->be.kernels->pack(k->p->be.kernels_ctx, k->dst, k->dst_dtype, k->items, k->n, k->alpha,
                                           k->accumulate);
  k->n = 0;
  return st;
}

mfsdp_status pl_packer_add(packer* k, const void* src, int32_t src_dtype, int64_t dst_offset, int64_t n) {
  if (n == 0) return MFSDP_OK;
  if (k->n == PACK_CHUNK) MFSDP_CHECK(pl_packer_flush(k));
  k->items[k->n++] = (mfsdp_pack_item){src, src_dtype, dst_offset, n};
  return MFSDP_OK;
}

