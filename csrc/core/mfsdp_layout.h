/* mfsdp_layout.h: the bucket math. Which parameters share a bucket, where each one lives in
 * the flat bucket, and which whole rows of it every rank owns.
 *
 * [Note: row-aligned shards]
 * A bucket of `world` shards has shard_size S, a multiple of the bucket's chunk L = lcm of its
 * items' row sizes (and of the 16-byte alignment). Every item starts at a multiple of its own
 * row size. A shard boundary k*S is then a multiple of every row size, so it can only fall
 * between two rows of an item: each rank's slice of each parameter is whole rows, and the
 * slice viewed as (-1, *shape[1:]) is an uneven Shard(0) piece of the parameter. Gaps between
 * items and the tail up to world*S are padding; the engine keeps padding zero.
 *
 * Grouping: parameters are grouped by the key (unit, dtype, requires_grad, replicated); groups
 * keep first-seen order. Inside a group items are ordered by row size, largest first (fewest
 * alignment gaps). A group is cut into several buckets when an item would blow the chunk up
 * beyond the padding budget, or (groups outside every unit only) when it exceeds the size cap. */
#ifndef MFSDP_LAYOUT_H
#define MFSDP_LAYOUT_H

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
} mfsdp_param_info;

typedef struct mfsdp_bucket_plan {
  int32_t unit, dtype, requires_grad, replicated;
  int32_t world;       /* ranks the bucket is split over (1: not sharded) */
  int32_t n_items;
  int32_t* params;     /* caller's parameter indices, in layout order */
  int64_t* offsets;    /* element offset of each item in the bucket */
  int64_t* numels;
  int64_t* rows;
  int64_t chunk;       /* shard_size is a multiple of it */
  int64_t shard_size;  /* elements per rank */
  int64_t bucket_size; /* world * shard_size */
} mfsdp_bucket_plan;

typedef struct mfsdp_plan {
  int32_t n_buckets;
  mfsdp_bucket_plan* buckets; /* owned; free with mfsdp_plan_free */
} mfsdp_plan;

/* Groups `params` into buckets and lays each one out.
 * shard_world: ranks to shard over (1 for no_shard); replicated params always use 1.
 * bucket_cap: max elements of a bucket outside every unit (<= 0: no cap).
 * align_bytes: shard boundaries are multiples of this many bytes (power of two, >= 1). */
mfsdp_status mfsdp_plan_build(const mfsdp_param_info* params, int32_t n_params, int32_t shard_world,
                              int64_t bucket_cap, int32_t align_bytes, mfsdp_plan* out);
void mfsdp_plan_free(mfsdp_plan* plan);

/* Rank `rank`'s part of item `item`: elements [*lo, *hi) of the item (relative to its start),
 * stored at *shard_offset inside that rank's shard. Empty parts have *lo == *hi. */
void mfsdp_item_shard_slice(const mfsdp_bucket_plan* bucket, int32_t item, int32_t rank, int64_t* lo,
                            int64_t* hi, int64_t* shard_offset);

/* Checks every invariant of the note above; returns MFSDP_OK or the first violation. Used by
 * the C tests and the fuzz target, cheap enough to run on every plan in debug builds. */
mfsdp_status mfsdp_plan_validate(const mfsdp_plan* plan, const mfsdp_param_info* params, int32_t n_params);

int64_t mfsdp_gcd(int64_t a, int64_t b);
/* lcm, or -1 on overflow past INT64_MAX / 4. */
int64_t mfsdp_lcm(int64_t a, int64_t b);

#ifdef __cplusplus
}
#endif
#endif
