/* layout.c: parameter grouping and the row-aligned flat layout (see mfsdp_layout.h). */
#include "mfsdp_layout.h"

#include <stdlib.h>
#include <string.h>

#include "mfsdp_dtype.h"

/* A chunk may grow (by lcm) while the worst-case tail padding, world * chunk, stays within
 * 1/PAD_BUDGET_DIVISOR of the group, or while it is no larger than the item's own row. */
#define PAD_BUDGET_DIVISOR 8

int64_t mfsdp_gcd(int64_t a, int64_t b) {
  while (b != 0) {
    int64_t t = a % b;
    a = b;
    b = t;
  }
  return a < 0 ? -a : a;
}

int64_t mfsdp_lcm(int64_t a, int64_t b) {
  if (a <= 0 || b <= 0) return -1;
  int64_t g = mfsdp_gcd(a, b);
  int64_t q = a / g;
  if (q > (INT64_MAX / 4) / b) return -1;
  return q * b;
}

static int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

typedef struct group_builder {
  int32_t unit, dtype, requires_grad, replicated;
  int32_t n, cap;
  int32_t* members; /* param indices in first-seen order */
  int64_t total;
} group_builder;

typedef struct row_key {
  int64_t row;
  int32_t param;
} row_key;

static int by_row_desc(const void* pa, const void* pb) {
  const row_key* a = pa;
  const row_key* b = pb;
  if (a->row != b->row) return a->row > b->row ? -1 : 1;
  return (a->param > b->param) - (a->param < b->param); /* stable: first-seen order among equal rows */
}

static void free_bucket(mfsdp_bucket_plan* b) {
  free(b->params);
  free(b->offsets);
  free(b->numels);
  free(b->rows);
  memset(b, 0, sizeof *b);
}

void mfsdp_plan_free(mfsdp_plan* plan) {
  if (plan == NULL) return;
  for (int32_t i = 0; i < plan->n_buckets; ++i) free_bucket(&plan->buckets[i]);
  free(plan->buckets);
  plan->buckets = NULL;
  plan->n_buckets = 0;
}

static mfsdp_status push_bucket(mfsdp_plan* plan, int32_t* capacity, mfsdp_bucket_plan** out) {
  if (plan->n_buckets == *capacity) {
    int32_t next = *capacity ? *capacity * 2 : 16;
    mfsdp_bucket_plan* grown = realloc(plan->buckets, (size_t)next * sizeof *grown);
    if (grown == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "growing the bucket list to %d", next);
    plan->buckets = grown;
    *capacity = next;
  }
  *out = &plan->buckets[plan->n_buckets++];
  memset(*out, 0, sizeof **out);
  return MFSDP_OK;
}

/* Lays out `n` items (indices into params) as one bucket. */
static mfsdp_status layout_bucket(mfsdp_bucket_plan* b, const group_builder* g, const int32_t* items, int32_t n,
                                  const mfsdp_param_info* params, int32_t world, int64_t chunk) {
  b->unit = g->unit;
  b->dtype = g->dtype;
  b->requires_grad = g->requires_grad;
  b->replicated = g->replicated;
  b->world = world;
  b->n_items = n;
  b->chunk = chunk;
  b->params = malloc((size_t)(n ? n : 1) * sizeof *b->params);
  b->offsets = malloc((size_t)(n ? n : 1) * sizeof *b->offsets);
  b->numels = malloc((size_t)(n ? n : 1) * sizeof *b->numels);
  b->rows = malloc((size_t)(n ? n : 1) * sizeof *b->rows);
  if (!b->params || !b->offsets || !b->numels || !b->rows)
    return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "bucket of %d items", n);
  int64_t cursor = 0;
  for (int32_t i = 0; i < n; ++i) {
    const mfsdp_param_info* p = &params[items[i]];
    int64_t off = align_up(cursor, p->row);
    b->params[i] = items[i];
    b->offsets[i] = off;
    b->numels[i] = p->numel;
    b->rows[i] = p->row;
    cursor = off + p->numel;
  }
  int64_t per_rank = (cursor + world - 1) / world;
  b->shard_size = align_up(per_rank > 0 ? per_rank : 1, chunk);
  b->bucket_size = b->shard_size * world;
  return MFSDP_OK;
}

/* Splits one group into buckets: first fit over open buckets, each keeping its chunk within
 * the padding budget; groups outside every unit also respect bucket_cap. */
static mfsdp_status build_group(mfsdp_plan* plan, int32_t* capacity, group_builder* g,
                                const mfsdp_param_info* params, int32_t shard_world, int64_t bucket_cap,
                                int64_t align_bytes) {
  int32_t world = g->replicated ? 1 : shard_world;
  int64_t elem = mfsdp_dtype_size(g->dtype);
  int64_t align_elems = align_bytes >= elem ? align_bytes / elem : 1;
  int64_t budget = g->total / PAD_BUDGET_DIVISOR / world;

  /* Open buckets of this group: items, chunk and size so far. */
  int32_t* owner = malloc((size_t)g->n * sizeof *owner);
  int64_t* chunks = malloc((size_t)g->n * sizeof *chunks);
  int64_t* sizes = malloc((size_t)g->n * sizeof *sizes);
  int32_t* order = malloc((size_t)g->n * sizeof *order);
  row_key* keys = malloc((size_t)g->n * sizeof *keys);
  mfsdp_status st = MFSDP_OK;
  if (!owner || !chunks || !sizes || !order || !keys) {
    st = MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "grouping %d parameters", g->n);
    goto exit;
  }
  for (int32_t i = 0; i < g->n; ++i) keys[i] = (row_key){params[g->members[i]].row, g->members[i]};
  qsort(keys, (size_t)g->n, sizeof *keys, by_row_desc);
  for (int32_t i = 0; i < g->n; ++i) g->members[i] = keys[i].param;
  int32_t n_open = 0;
  for (int32_t i = 0; i < g->n; ++i) {
    const mfsdp_param_info* p = &params[g->members[i]];
    int32_t chosen = -1;
    int64_t chosen_chunk = 0;
    for (int32_t k = 0; k < n_open && chosen < 0; ++k) {
      if (g->unit < 0 && bucket_cap > 0 && sizes[k] > 0 && sizes[k] + p->numel > bucket_cap) continue;
      int64_t c = mfsdp_lcm(chunks[k], p->row);
      if (c < 0) continue;
      if (c == chunks[k] || c <= p->row || c <= budget) {
        chosen = k;
        chosen_chunk = c;
      }
    }
    if (chosen < 0) {
      chosen = n_open++;
      chosen_chunk = mfsdp_lcm(align_elems, p->row);
      if (chosen_chunk < 0) {
        st = MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "row size %lld overflows the chunk", (long long)p->row);
        goto exit;
      }
      sizes[chosen] = 0;
    }
    chunks[chosen] = chosen_chunk;
    sizes[chosen] += p->numel;
    owner[i] = chosen;
  }
  for (int32_t k = 0; k < n_open; ++k) {
    int32_t n = 0;
    for (int32_t i = 0; i < g->n; ++i)
      if (owner[i] == k) order[n++] = g->members[i];
    mfsdp_bucket_plan* b = NULL;
    MFSDP_CHECK_GOTO(push_bucket(plan, capacity, &b), st, exit);
    MFSDP_CHECK_GOTO(layout_bucket(b, g, order, n, params, world, chunks[k]), st, exit);
  }
exit:
  free(keys);
  free(owner);
  free(chunks);
  free(sizes);
  free(order);
  return st;
}

mfsdp_status mfsdp_plan_build(const mfsdp_param_info* params, int32_t n_params, int32_t shard_world,
                              int64_t bucket_cap, int32_t align_bytes, mfsdp_plan* out) {
  memset(out, 0, sizeof *out);
  if (n_params < 0 || (n_params > 0 && params == NULL))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bad parameter list (n=%d)", n_params);
  if (shard_world < 1) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "world size %d < 1", shard_world);
  if (align_bytes < 1 || (align_bytes & (align_bytes - 1)) != 0)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "alignment %d is not a power of two", align_bytes);
  for (int32_t i = 0; i < n_params; ++i) {
    const mfsdp_param_info* p = &params[i];
    if (!mfsdp_dtype_valid(p->dtype))
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "parameter %d has unsupported dtype code %d", i, p->dtype);
    if (p->numel < 0 || p->row < 1 || p->numel % p->row != 0)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "parameter %d: numel %lld is not whole rows of %lld", i,
                        (long long)p->numel, (long long)p->row);
  }

  group_builder* groups = calloc((size_t)(n_params ? n_params : 1), sizeof *groups);
  if (groups == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "%d groups", n_params);
  int32_t n_groups = 0, capacity = 0;
  mfsdp_status st = MFSDP_OK;
  for (int32_t i = 0; i < n_params; ++i) {
    const mfsdp_param_info* p = &params[i];
    int32_t k = 0;
    while (k < n_groups && !(groups[k].unit == p->unit && groups[k].dtype == p->dtype &&
                             groups[k].requires_grad == !!p->requires_grad &&
                             groups[k].replicated == !!p->replicated))
      ++k;
    if (k == n_groups) {
      groups[k] = (group_builder){p->unit, p->dtype, !!p->requires_grad, !!p->replicated, 0, 0, NULL, 0};
      n_groups++;
    }
    group_builder* g = &groups[k];
    if (g->n == g->cap) {
      int32_t next = g->cap ? g->cap * 2 : 8;
      int32_t* grown = realloc(g->members, (size_t)next * sizeof *grown);
      if (grown == NULL) {
        st = MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "group of %d parameters", next);
        goto exit;
      }
      g->members = grown;
      g->cap = next;
    }
    g->members[g->n++] = i;
    g->total += p->numel;
  }
  for (int32_t k = 0; k < n_groups; ++k)
    MFSDP_CHECK_GOTO(build_group(out, &capacity, &groups[k], params, shard_world, bucket_cap, align_bytes), st, exit);
exit:
  for (int32_t k = 0; k < n_groups; ++k) free(groups[k].members);
  free(groups);
  if (st != MFSDP_OK) mfsdp_plan_free(out);
  return st;
}

void mfsdp_item_shard_slice(const mfsdp_bucket_plan* b, int32_t item, int32_t rank, int64_t* lo, int64_t* hi,
                            int64_t* shard_offset) {
  int64_t start = b->offsets[item], end = start + b->numels[item];
  int64_t s0 = (int64_t)rank * b->shard_size, s1 = s0 + b->shard_size;
  int64_t a = start > s0 ? start : s0;
  int64_t z = end < s1 ? end : s1;
  if (a >= z) { /* empty: clamp to the item's side of the shard */
    int64_t at = end <= s0 ? b->numels[item] : 0;
    *lo = *hi = at;
    *shard_offset = 0;
    return;
  }
  *lo = a - start;
  *hi = z - start;
  *shard_offset = a - s0;
}

mfsdp_status mfsdp_plan_validate(const mfsdp_plan* plan, const mfsdp_param_info* params, int32_t n_params) {
  char* seen = calloc((size_t)(n_params ? n_params : 1), 1);
  if (seen == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "validate");
  mfsdp_status st = MFSDP_OK;
  for (int32_t bi = 0; bi < plan->n_buckets; ++bi) {
    const mfsdp_bucket_plan* b = &plan->buckets[bi];
    if (b->shard_size <= 0 || b->shard_size % b->chunk != 0 || b->bucket_size != b->shard_size * b->world) {
      st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: shard %lld not a multiple of chunk %lld", bi,
                      (long long)b->shard_size, (long long)b->chunk);
      goto exit;
    }
    int64_t prev_end = 0;
    for (int32_t i = 0; i < b->n_items; ++i) {
      int32_t p = b->params[i];
      if (p < 0 || p >= n_params || seen[p]) {
        st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d item %d: parameter %d missing or repeated", bi, i, p);
        goto exit;
      }
      seen[p] = 1;
      const mfsdp_param_info* info = &params[p];
      if (info->dtype != b->dtype || info->unit != b->unit || !!info->requires_grad != b->requires_grad ||
          !!info->replicated != b->replicated || b->numels[i] != info->numel || b->rows[i] != info->row) {
        st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d item %d: key or shape mismatch", bi, i);
        goto exit;
      }
      if (b->offsets[i] < prev_end || b->offsets[i] % info->row != 0 ||
          b->offsets[i] + info->numel > b->bucket_size) {
        st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d item %d: offset %lld overlaps or is unaligned", bi, i,
                        (long long)b->offsets[i]);
        goto exit;
      }
      prev_end = b->offsets[i] + info->numel;
      int64_t covered = 0;
      for (int32_t r = 0; r < b->world; ++r) {
        int64_t lo, hi, off;
        mfsdp_item_shard_slice(b, i, r, &lo, &hi, &off);
        if (lo > hi || lo % info->row != 0 || hi % info->row != 0 || (lo < hi && off + (hi - lo) > b->shard_size) ||
            (lo < hi && (int64_t)r * b->shard_size + off != b->offsets[i] + lo)) {
          st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d item %d rank %d: slice [%lld,%lld) splits a row", bi, i,
                          r, (long long)lo, (long long)hi);
          goto exit;
        }
        covered += hi - lo;
      }
      if (covered != info->numel) {
        st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d item %d: shards cover %lld of %lld elements", bi, i,
                        (long long)covered, (long long)info->numel);
        goto exit;
      }
    }
  }
  for (int32_t p = 0; p < n_params; ++p)
    if (!seen[p]) {
      st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "parameter %d is in no bucket", p);
      goto exit;
    }
exit:
  free(seen);
  return st;
}
