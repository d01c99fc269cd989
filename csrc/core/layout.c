/* layout.c: parameter grouping and the chunked two-layout bucket (see mfsdp_layout.h). */
#include "mfsdp_layout.h"

#include <stdlib.h>
#include <string.h>

#include "mfsdp_dtype.h"

static int64_t align_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

static int64_t lcm(int64_t a, int64_t b) {
  int64_t x = a, y = b;
  while (y) {
    int64_t t = x % y;
    x = y;
    y = t;
  }
  return a / x * b;
}

void mfsdp_piece_of(int64_t numel, int64_t piece, int32_t rank, int64_t* first, int64_t* n) {
  int64_t a = (int64_t)rank * piece, z = a + piece;
  if (a > numel) a = numel;
  if (z > numel) z = numel;
  *first = a;
  *n = z - a;
}

void mfsdp_piece_runs(int64_t numel, int64_t piece, int64_t outer, int32_t rank, mfsdp_runs* out) {
  if (outer < 1) outer = 1;
  int64_t len;
  mfsdp_piece_of(numel / outer, piece / outer, rank, &out->first, &len);
  out->len = len;
  out->count = len > 0 ? outer : 0;
  out->stride = numel / outer;
}

int mfsdp_layout_is_identity(const mfsdp_bucket_layout* l) {
  if (l->world == 1) return 1; /* built so: pieces are whole items, shard offsets = param offsets */
  return l->n_items == 1 && l->tail == 0 && l->param_offsets[0] == 0 && l->shard_offsets[0] == 0 && l->shard_size == l->pieces[0] &&
         l->pieces[0] * l->world == l->numels[0] && mfsdp_layout_outer(l, 0) == 1;
}

static int64_t outer_of(const mfsdp_param_info* p) { return p->outer > 1 ? p->outer : 1; }

typedef struct group_builder {
  int32_t unit, dtype, requires_grad, replicated, role;
  int32_t n, cap;
  int32_t* members; /* param indices in first-seen order */
} group_builder;

static void free_bucket(mfsdp_bucket_plan* b) {
  free(b->params);
  free(b->row_sizes);
  free((void*)b->layout.numels);
  free((void*)b->layout.pieces);
  free((void*)b->layout.param_offsets);
  free((void*)b->layout.shard_offsets);
  free((void*)b->layout.outers);
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

/* Lays out `n` items (indices into params) as one bucket over `world` ranks. */
static mfsdp_status layout_bucket(mfsdp_bucket_plan* b, const group_builder* g, const int32_t* items, int32_t n,
                                  const mfsdp_param_info* params, int32_t world, int64_t align, int64_t tail,
                                  int64_t tail_align) {
  size_t count = (size_t)(n ? n : 1);
  int64_t* numels = malloc(count * sizeof *numels);
  int64_t* pieces = malloc(count * sizeof *pieces);
  int64_t* param_offsets = malloc(count * sizeof *param_offsets);
  int64_t* shard_offsets = malloc(count * sizeof *shard_offsets);
  int64_t* outers = malloc(count * sizeof *outers);
  b->unit = g->unit;
  b->dtype = g->dtype;
  b->requires_grad = g->requires_grad;
  b->replicated = g->replicated;
  b->role = g->role;
  b->params = malloc(count * sizeof *b->params);
  b->row_sizes = malloc(count * sizeof *b->row_sizes);
  b->layout = (mfsdp_bucket_layout){world, n, numels, pieces, param_offsets, shard_offsets, 0, 0, outers, 0, 0};
  if (!b->params || !b->row_sizes || !numels || !pieces || !param_offsets || !shard_offsets || !outers)
    return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "bucket of %d items", n);
  int64_t weight_cursor = 0, shard_cursor = 0;
  for (int32_t i = 0; i < n; ++i) {
    const mfsdp_param_info* p = &params[items[i]];
    int64_t outer = outer_of(p), rows = p->numel / (outer * p->row);
    b->params[i] = items[i];
    b->row_sizes[i] = p->row;
    numels[i] = p->numel;
    outers[i] = outer;
    pieces[i] = world == 1 ? p->numel : outer * ((rows + world - 1) / world) * p->row;
    param_offsets[i] = align_up(weight_cursor, align);
    shard_offsets[i] = world == 1 ? param_offsets[i] : align_up(shard_cursor, align);
    weight_cursor = param_offsets[i] + numels[i];
    shard_cursor = shard_offsets[i] + pieces[i];
  }
  if (tail > 0) { /* [Note: flag tail]: after the last piece of every shard (unsharded: after the last item) */
    int64_t* cursor = world == 1 ? &weight_cursor : &shard_cursor;
    align = tail_align > 1 ? lcm(align, tail_align) : align; /* the tail and the shard's end */
    b->layout.tail_offset = align_up(*cursor, align);
    b->layout.tail = tail;
    *cursor = b->layout.tail_offset + tail;
  }
  b->layout.weight_size = align_up(weight_cursor > 0 ? weight_cursor : 1, align);
  b->layout.shard_size = world == 1 ? b->layout.weight_size : align_up(shard_cursor > 0 ? shard_cursor : 1, align);
  if (mfsdp_layout_is_identity(&b->layout)) b->layout.weight_size = b->layout.shard_size * world;
  return MFSDP_OK;
}

/* Cuts one group into buckets: all of it for a unit, runs of at most bucket_cap elements
 * (at least one item each) outside every unit. */
static mfsdp_status build_group(mfsdp_plan* plan, int32_t* capacity, const group_builder* g,
                                const mfsdp_param_info* params, int32_t shard_world, int64_t bucket_cap,
                                int32_t align_bytes, int32_t tail_per_item, int64_t tail_align) {
  int32_t world = g->replicated ? 1 : shard_world;
  int64_t elem = mfsdp_dtype_size(g->dtype);
  int64_t align = align_bytes >= elem ? align_bytes / elem : 1;
  int32_t start = 0;
  while (start < g->n) {
    int32_t end = start + 1;
    int64_t size = params[g->members[start]].numel;
    if (g->unit >= 0 || bucket_cap <= 0) {
      end = g->n;
    } else {
      while (end < g->n && size + params[g->members[end]].numel <= bucket_cap) size += params[g->members[end++]].numel;
    }
    mfsdp_bucket_plan* b = NULL;
    MFSDP_CHECK(push_bucket(plan, capacity, &b));
    int64_t tail = mfsdp_dtype_is_float(g->dtype) ? (int64_t)tail_per_item * (end - start) : 0;
    MFSDP_CHECK(layout_bucket(b, g, g->members + start, end - start, params, world, align, tail, tail_align));
    start = end;
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_plan_build(const mfsdp_param_info* params, int32_t n_params, int32_t shard_world,
                              int64_t bucket_cap, int32_t align_bytes, mfsdp_plan* out) {
  return mfsdp_plan_build_tailed(params, n_params, shard_world, bucket_cap, align_bytes, 0, 0, out);
}

mfsdp_status mfsdp_plan_build_tailed(const mfsdp_param_info* params, int32_t n_params, int32_t shard_world,
                                     int64_t bucket_cap, int32_t align_bytes, int32_t tail_per_item,
                                     int64_t tail_align, mfsdp_plan* out) {
  memset(out, 0, sizeof *out);
  if (tail_per_item < 0 || tail_align < 0 || tail_align > (1 << 20))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "a tail of %d elements per item aligned to %lld", tail_per_item,
                      (long long)tail_align);
  if (n_params < 0 || (n_params > 0 && params == NULL))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bad parameter list (n=%d)", n_params);
  if (shard_world < 1) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "world size %d < 1", shard_world);
  if (align_bytes < 1 || (align_bytes & (align_bytes - 1)) != 0)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "alignment %d is not a power of two", align_bytes);
  for (int32_t i = 0; i < n_params; ++i) {
    const mfsdp_param_info* p = &params[i];
    if (!mfsdp_dtype_valid(p->dtype))
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "parameter %d has unsupported dtype code %d", i, p->dtype);
    if (p->numel < 0 || p->row < 1 || p->outer < 0 || p->numel % (outer_of(p) * p->row) != 0)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "parameter %d: numel %lld is not %lld blocks of whole rows of %lld",
                        i, (long long)p->numel, (long long)outer_of(p), (long long)p->row);
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
                             groups[k].replicated == !!p->replicated && groups[k].role == p->role))
      ++k;
    if (k == n_groups) {
      groups[k] = (group_builder){p->unit, p->dtype, !!p->requires_grad, !!p->replicated, p->role, 0, 0, NULL};
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
  }
  for (int32_t k = 0; k < n_groups; ++k)
    MFSDP_CHECK_GOTO(build_group(out, &capacity, &groups[k], params, shard_world, bucket_cap, align_bytes, tail_per_item, tail_align),
                     st, exit);
exit:
  for (int32_t k = 0; k < n_groups; ++k) free(groups[k].members);
  free(groups);
  if (st != MFSDP_OK) mfsdp_plan_free(out);
  return st;
}

/* Are [a, a + n) and [b, b + m) disjoint? Empty ranges never overlap. */
static int disjoint(int64_t a, int64_t n, int64_t b, int64_t m) { return n == 0 || m == 0 || a + n <= b || b + m <= a; }

mfsdp_status mfsdp_layout_validate(const mfsdp_bucket_layout* l, const int64_t* row_sizes) {
  if (l->world < 1 || l->n_items < 0 || l->shard_size < 1 || l->weight_size < 0)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout: world %d, %d items, shard %lld, weights %lld", l->world,
                      l->n_items, (long long)l->shard_size, (long long)l->weight_size);
  for (int32_t i = 0; i < l->n_items; ++i) {
    int64_t numel = l->numels[i], piece = l->pieces[i];
    if (numel < 0 || piece < 0 || (numel > 0 && piece == 0) || piece * l->world < numel)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout item %d: %lld elements in pieces of %lld", i,
                        (long long)numel, (long long)piece);
    int64_t outer = mfsdp_layout_outer(l, i);
    if (l->outers != NULL && l->outers[i] < 1)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout item %d: %lld blocks", i, (long long)l->outers[i]);
    if (piece % outer != 0 || numel % outer != 0)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout item %d: %lld elements / piece %lld are not %lld blocks", i,
                        (long long)numel, (long long)piece, (long long)outer);
    if (row_sizes && (piece % (outer * row_sizes[i]) != 0 || numel % (outer * row_sizes[i]) != 0))
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout item %d: piece %lld splits a row of %lld", i,
                        (long long)piece, (long long)row_sizes[i]);
    if (l->param_offsets[i] < 0 || l->param_offsets[i] + numel > l->weight_size || l->shard_offsets[i] < 0 ||
        l->shard_offsets[i] + piece > l->shard_size)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout item %d: [%lld, +%lld) / piece [%lld, +%lld) out of range",
                        i, (long long)l->param_offsets[i], (long long)numel, (long long)l->shard_offsets[i],
                        (long long)piece);
    for (int32_t j = 0; j < i; ++j)
      if (!disjoint(l->param_offsets[i], numel, l->param_offsets[j], l->numels[j]) ||
          !disjoint(l->shard_offsets[i], piece, l->shard_offsets[j], l->pieces[j]))
        return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout items %d and %d overlap", j, i);
  }
  if (l->tail < 0 || l->tail_offset < 0 || (l->tail > 0 && l->tail_offset + l->tail > l->shard_size))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout: tail [%lld, +%lld) outside a shard of %lld",
                      (long long)l->tail_offset, (long long)l->tail, (long long)l->shard_size);
  for (int32_t i = 0; i < l->n_items; ++i) /* [Note: flag tail]: no item's rows in it, in either layout */
    if (!disjoint(l->tail_offset, l->tail, l->shard_offsets[i], l->pieces[i]) ||
        (l->world == 1 && !disjoint(l->tail_offset, l->tail, l->param_offsets[i], l->numels[i])))
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout item %d overlaps the tail", i);
  if (l->world == 1 && l->tail > 0 && l->tail_offset + l->tail > l->weight_size)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout: tail past the %lld weights", (long long)l->weight_size);
  if (l->world == 1)
    for (int32_t i = 0; i < l->n_items; ++i)
      if (l->pieces[i] != l->numels[i] || l->shard_offsets[i] != l->param_offsets[i])
        return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "layout item %d: an unsharded bucket must have one layout", i);
  return MFSDP_OK;
}

mfsdp_status mfsdp_plan_validate(const mfsdp_plan* plan, const mfsdp_param_info* params, int32_t n_params) {
  char* seen = calloc((size_t)(n_params ? n_params : 1), 1);
  if (seen == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "validate");
  mfsdp_status st = MFSDP_OK;
  for (int32_t bi = 0; bi < plan->n_buckets; ++bi) {
    const mfsdp_bucket_plan* b = &plan->buckets[bi];
    const mfsdp_bucket_layout* l = &b->layout;
    MFSDP_CHECK_GOTO(mfsdp_layout_validate(l, b->row_sizes), st, exit);
    for (int32_t i = 0; i < l->n_items; ++i) {
      int32_t p = b->params[i];
      if (p < 0 || p >= n_params || seen[p]) {
        st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d item %d: parameter %d missing or repeated", bi, i, p);
        goto exit;
      }
      seen[p] = 1;
      const mfsdp_param_info* info = &params[p];
      int64_t outer = outer_of(info), rows = info->numel / (outer * info->row);
      int64_t want_piece = l->world == 1 ? info->numel : outer * ((rows + l->world - 1) / l->world) * info->row;
      if (info->dtype != b->dtype || info->unit != b->unit || !!info->requires_grad != b->requires_grad ||
          !!info->replicated != b->replicated || info->role != b->role || l->numels[i] != info->numel || b->row_sizes[i] != info->row ||
          mfsdp_layout_outer(l, i) != outer || l->pieces[i] != want_piece) {
        st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d item %d: key, shape or piece mismatch", bi, i);
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
