/* mfsdp_layout.h: the bucket math. Which parameters share a bucket, and where every element
 * lives in the bucket's two layouts.
 *
 * [Note: chunked layout]
 * A parameter's dim-0 rows (a row is shape[1:].numel() elements; 1-d parameters have rows of
 * one element) are split over the `world` ranks exactly as torch's Shard(0) splits them, by the
 * torch.chunk rule: with c = ceil(rows / world), rank r holds rows [r*c, min(rows, (r+1)*c)),
 * so the last ranks may hold fewer rows, or none. Every DTensor the library hands out is
 * therefore a true Shard(0) DTensor that torch can redistribute, gather and checkpoint
 * unaided.
 *
 * A bucket keeps its items in two layouts:
 *   parameter-major  the full weights the module computes with: item i's numel elements start
 *                    at param_offsets[i], so every compute parameter is a view, never a copy;
 *   rank-major       what the collectives move: `world` shards of shard_size elements each;
 *                    item i's piece (c * row elements; the last ranks' pieces are partly or
 *                    wholly padding) starts at shard_offsets[i] inside every shard.
 * An all-gather delivers rank-major; one pack per bucket copies it out to parameter-major (as
 * FSDP2 does). Gradients are packed straight into rank-major at no extra cost, so a
 * reduce-scatter leaves each rank exactly its Shard(0) rows. The layouts coincide when the
 * bucket is not sharded (world 1), or holds one parameter whose pieces need no padding: then a
 * gather runs in place and nothing is copied (mfsdp_layout_is_identity).
 *
 * A parameter sharded on another dim d (torch's Shard(d), e.g. for Muon-style optimizers) is
 * `outer` = shape[:d].numel() blocks, each of whole rows of dim d (a row is shape[d+1:].numel()
 * elements); every block is split by the same torch.chunk rule, and a rank's piece is its rows
 * of every block, block after block: rank r's piece is exactly torch.chunk(w, world, dim=d)[r]
 * made contiguous, the local tensor of torch's Shard(d) DTensor. In the parameter-major layout
 * its rows of block j start at j * (rows * row) + r * c * row (mfsdp_piece_runs), so a copy
 * between the layouts moves `outer` runs per rank instead of one; dim 0 is outer = 1.
 *
 * Grouping: parameters are grouped by the key (unit, dtype, requires_grad, replicated), groups
 * in first-seen order, items in registration order. Groups outside every unit are cut into
 * buckets of at most bucket_cap elements. Offsets in both layouts and the shard size are
 * multiples of the alignment.
 *
 * [Note: flag tail]
 * mfsdp_plan_build_tailed reserves `tail` elements of every shard of a floating bucket, after
 * its last piece at an aligned tail_offset (an unsharded bucket: after its last item, so the two
 * layouts stay one): tail_per_item elements per item. No item's rows are ever there, so every
 * rank-major buffer (the gathers, the gradient buckets, the reduce-scatter's slices, the main
 * weights and gradient shards) carries the tail at the same offset of each shard with no stride
 * of its own, and every reduction sums it like a gradient: the pipeline keeps the used-parameter
 * flags there ([Note: used-flag tail] in csrc/comm/reduce.c); weights never read it (every view
 * is per item). A tail makes a sharded one-item bucket a non-identity layout (its gather is
 * copied out, as FSDP2 copies out every gather). */
#ifndef MFSDP_LAYOUT_H
#define MFSDP_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "mfsdp_status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mfsdp_param_info {
  int64_t numel;
  int64_t row;           /* elements per dim-0 row: shape[1:].numel(), 1 for 0-d and 1-d */
  int32_t dtype;         /* mfsdp_dtype */
  int32_t unit;          /* FSDP unit index, -1 outside every unit */
  int32_t requires_grad;
  int32_t replicated;    /* fsdp_no_shard: one full copy per rank, never sharded */
  int64_t outer;         /* blocks before the sharded dim: shape[:d].numel() for Shard(d); 0 or 1: dim 0 */
  int32_t role;          /* a bucket holds parameters of one role only; what a role means is the caller's
                          * (the wrapper's [Note: extension parameters]); 0 for every ordinary parameter */
} mfsdp_param_info;

/* Where a bucket's items live; shared by the planner and the pipeline. */
typedef struct mfsdp_bucket_layout {
  int32_t world;                /* ranks the bucket is split over (1: not sharded) */
  int32_t n_items;
  const int64_t* numels;
  const int64_t* pieces;        /* elements of every rank's piece of each item: ceil(rows/world) * row */
  const int64_t* param_offsets; /* parameter-major start of each item */
  const int64_t* shard_offsets; /* start of each item's piece inside every shard */
  int64_t weight_size;          /* parameter-major elements */
  int64_t shard_size;           /* rank-major elements per rank; world * shard_size in all */
  const int64_t* outers;        /* blocks of each item (see [Note: chunked layout]); NULL: 1 each */
  int64_t tail_offset;          /* start of the reserved tail inside every shard ([Note: flag tail]) */
  int64_t tail;                 /* elements of it (0: none) */
} mfsdp_bucket_layout;

typedef struct mfsdp_bucket_plan {
  int32_t unit, dtype, requires_grad, replicated, role;
  int32_t* params;     /* caller's parameter indices, in layout order */
  int64_t* row_sizes;  /* elements per row (one index of the sharded dim) of each item */
  mfsdp_bucket_layout layout; /* its arrays are owned by the plan */
} mfsdp_bucket_plan;

typedef struct mfsdp_plan {
  int32_t n_buckets;
  mfsdp_bucket_plan* buckets; /* owned; free with mfsdp_plan_free */
} mfsdp_plan;

/* Groups `params` into buckets and lays each one out.
 * shard_world: ranks to shard over (1 for no_shard); replicated params always use 1.
 * bucket_cap: max elements of a bucket outside every unit (<= 0: no cap).
 * align_bytes: offsets and shard sizes are multiples of this many bytes (power of two, >= 1). */
mfsdp_status mfsdp_plan_build(const mfsdp_param_info* params, int32_t n_params, int32_t shard_world,
                              int64_t bucket_cap, int32_t align_bytes, mfsdp_plan* out);
/* The same, with tail_per_item (>= 0) elements per item reserved in every shard of each bucket
 * of a floating dtype ([Note: flag tail]); 0 is mfsdp_plan_build. tail_align (<= 1: none): the
 * tail's offset and the shard size of a tailed bucket are also multiples of this many elements
 * (a quantization block: the tail then shares no block with an item's rows). */
mfsdp_status mfsdp_plan_build_tailed(const mfsdp_param_info* params, int32_t n_params, int32_t shard_world,
                                     int64_t bucket_cap, int32_t align_bytes, int32_t tail_per_item,
                                     int64_t tail_align, mfsdp_plan* out);
void mfsdp_plan_free(mfsdp_plan* plan);

/* Rank `rank`'s rows of an item of `numel` elements cut in pieces of `piece` elements:
 * elements [*first, *first + *n) of the item; *n is 0 for a rank past the last row. */
void mfsdp_piece_of(int64_t numel, int64_t piece, int32_t rank, int64_t* first, int64_t* n);

/* Rank `rank`'s rows of an item of `numel` elements in `outer` blocks (1: sharded on dim 0), cut
 * in pieces of `piece` elements (all blocks together), as `count` runs of `len` elements: run j
 * is elements [first + j * stride, +len) of the item (parameter-major) and elements
 * [j * len, +len) of the rank's piece (rank-major). count is 0 for a rank past the last row;
 * with outer = 1 there is one run, mfsdp_piece_of's. */
typedef struct mfsdp_runs {
  int64_t first, len, count, stride;
} mfsdp_runs;
void mfsdp_piece_runs(int64_t numel, int64_t piece, int64_t outer, int32_t rank, mfsdp_runs* out);

/* Item i's blocks in `layout` (1 when it has no outers table). */
static inline int64_t mfsdp_layout_outer(const mfsdp_bucket_layout* layout, int32_t i) {
  return layout->outers != NULL && layout->outers[i] > 1 ? layout->outers[i] : 1;
}

/* 1 when the rank-major and parameter-major layouts are the same memory order. */
int mfsdp_layout_is_identity(const mfsdp_bucket_layout* layout);

/* Checks a layout (offsets in range, disjoint, pieces of whole rows tiling every item); returns
 * MFSDP_OK or the first violation. row_sizes may be NULL (row checks skipped). */
mfsdp_status mfsdp_layout_validate(const mfsdp_bucket_layout* layout, const int64_t* row_sizes);

/* Checks every invariant of the note above on a whole plan; used by the C tests, the fuzz
 * target and the Python glue. */
mfsdp_status mfsdp_plan_validate(const mfsdp_plan* plan, const mfsdp_param_info* params, int32_t n_params);

#ifdef __cplusplus
}
#endif
#endif
