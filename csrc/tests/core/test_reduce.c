/* test_reduce.c (a part of test_core, whose runner is csrc/tests/test_core.c): the gradient
 * reduction: its order, shared by ranks whose graphs differ, and the sums of the exchange
 * reduction. */
#include <math.h>

#include "../../core/mfsdp_kernels.h"
#include "../harness.h"
#include "core_tests.h"

/* graphs that differ across ranks (see [Note: collective order] in reduce.c) */

#define DIV_UNITS 3
#define DIV_WORLD 4 /* worlds 1 to this */

typedef struct divergent_thread {
  loop_world* world;
  int world_size, rank, grad_mode, sync;
  int disagree; /* rank 1 freezes item 1 of unit 2 (the others train it) */
} divergent_thread;

/* Rank r's gradient of item i of unit u, or 0 when rank r did not use it: unit 1 is skipped
 * (sealed) by rank 0, item 1 of unit 2 is unused on rank 2, unit 0's item 0 on every rank. */
static int div_used(int r, int u, int i) { return !(r == 0 && u == 1) && !(r == 2 && u == 2 && i == 1) && !(u == 0 && i == 0); }
static double div_grad(int r, int u, int i, int64_t j) { return div_used(r, u, i) ? (r + 1) * 0.5 + u + 0.01 * i + 1e-4 * j : 0; }

static void* divergent_worker(void* arg) {
  divergent_thread* t = arg;
  int W = t->world_size, r = t->rank;
  mfsdp_param_info infos[DIV_UNITS * 2];
  for (int u = 0; u < DIV_UNITS; ++u) { /* two items per unit, sizes differing by unit */
    infos[2 * u] = (mfsdp_param_info){(u + 2) * 4 * 5, 5, MFSDP_F32, u, 1, 0};
    infos[2 * u + 1] = (mfsdp_param_info){(u + 1) * 3, 1, MFSDP_F32, u, 1, 0};
  }
  int shard_world = t->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 1 : W;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build_tailed(infos, DIV_UNITS * 2, shard_world, 0, 16, 3, 0, &plan)); /* [Note: flag tail] */
  mfsdp_bucket_spec specs[DIV_UNITS];
  for (int b = 0; b < DIV_UNITS; ++b)
    specs[b] = (mfsdp_bucket_spec){plan.buckets[b].layout, shard_world > 1 ? r : 0, MFSDP_F32, MFSDP_F32, MFSDP_F32,
                                   MFSDP_F32, 0, shard_world > 1, t->grad_mode};
  loop_rank lr = {t->world, r};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &lr, &mfsdp_cpu_kernels, NULL};
  mfsdp_pipeline_config cfg = {W, r, 1.0, MFSDP_REDUCE_SUM, 1, 0}; /* a one-byte queue: every launch completes */
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, specs, DIV_UNITS, &p));
  if (p == NULL) goto out;
  float* grads[DIV_UNITS][2] = {{0}};
  int frozen_item = -1; /* unit 2's item holding parameter 2 * 2 + 1 */
  for (int q = 0; q < plan.buckets[2].layout.n_items; ++q)
    if (plan.buckets[2].params[q] == 5) frozen_item = q;
  if (t->disagree && r == 1) CHECK_OK(mfsdp_pipeline_set_trainable(p, 2, &frozen_item, 1, 0));
  CHECK_OK(mfsdp_pipeline_begin_backward(p, t->sync));
  if (r == 0) {
    int32_t skipped[1] = {1};
    CHECK_OK(mfsdp_pipeline_seal(p, skipped, 1));
  }
  for (int k = 0; k < DIV_UNITS * 2; ++k) { /* each rank its own arrival order */
    int n_slots = DIV_UNITS * 2;
    int slot = r % 2 ? (n_slots - 1 - k + r) % n_slots : (k + 2 * r) % n_slots, u = slot / 2, i = slot % 2;
    if (!div_used(r, u, i) || (t->disagree && r == 1 && slot == 5)) continue;
    int64_t n = infos[slot].numel;
    float* g = grads[u][i] = malloc((size_t)n * sizeof *g);
    for (int64_t j = 0; j < n; ++j) g[j] = (float)div_grad(r, u, i, j);
    int item = -1;
    for (int q = 0; q < plan.buckets[u].layout.n_items; ++q)
      if (plan.buckets[u].params[q] == slot) item = q;
    CHECK_OK(mfsdp_pipeline_grad_ready(p, u, item, g, MFSDP_F32, n, NULL));
  }
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  int wrong = 0;
  for (int u = 0; u < DIV_UNITS; ++u)
    for (int q = 0; q < plan.buckets[u].layout.n_items; ++q) {
      int slot = plan.buckets[u].params[q], i = slot % 2;
      int32_t where;
      int64_t off, first, n;
      CHECK_OK(mfsdp_pipeline_local_piece(p, u, q, MFSDP_BUF_OPT_GRAD, &where, &off, &n));
      mfsdp_piece_of(infos[slot].numel, plan.buckets[u].layout.pieces[q], specs[u].shard_rank, &first, &n);
      const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, u, where);
      for (int64_t j = first; j < first + n; ++j) {
        double want = 0;
        for (int k = 0; k < W; ++k) want += t->disagree && k == 1 && slot == 5 ? 0 : div_grad(k, u, i, j);
        wrong += fabs(load_as_double(og->data, MFSDP_F32, off + j - first) - want) > 1e-4 * (fabs(want) + 1);
      }
    }
  CHECK(wrong == 0, "grad mode %d sync %d rank %d: %d reduced gradients wrong", t->grad_mode, t->sync, r, wrong);
  /* [Note: used-flag tail]: the reductions brought every rank the same flags: used iff some rank
   * used the item, trainable disagreement only where rank 1 froze one */
  for (int u = 0; u < DIV_UNITS; ++u) {
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, u, &off, &n, &every));
    CHECK(n == plan.buckets[u].layout.n_items && every, "bucket %d carries its %d items' flags (%d), every rank's",
          u, plan.buckets[u].layout.n_items, n);
    const mfsdp_buffer* gs = mfsdp_pipeline_buffer(p, u, MFSDP_BUF_GRAD_SHARD);
    for (int q = 0; q < n; ++q) {
      int slot = plan.buckets[u].params[q], i = slot % 2, anywhere = 0;
      for (int k = 0; k < W; ++k) anywhere |= div_used(k, u, i) && !(t->disagree && k == 1 && slot == 5);
      double used = load_as_double(gs->data, MFSDP_F32, off + q);
      double trains = load_as_double(gs->data, MFSDP_F32, off + n + q);
      double frozen = load_as_double(gs->data, MFSDP_F32, off + 2 * n + q);
      CHECK((used > 0) == anywhere && used >= 0, "mode %d rank %d unit %d item %d: used flag %g, used anywhere %d",
            t->grad_mode, r, u, q, used, anywhere);
      int split = t->disagree && slot == 5;
      CHECK(trains > 0 && (frozen > 0) == split, "mode %d rank %d unit %d item %d: trains %g frozen %g (split %d)",
            t->grad_mode, r, u, q, trains, frozen, split);
    }
    /* the same, as the engine decodes them (mfsdp_pipeline_read_flags) */
    uint8_t used_b[16], split_b[16];
    int32_t m = -1;
    CHECK_OK(mfsdp_pipeline_read_flags(p, u, used_b, split_b, &m));
    CHECK(m == n && n <= 16, "bucket %d: read_flags %d items, flag_tail %d", u, m, n);
    for (int q = 0; q < m && q < 16; ++q) {
      int slot = plan.buckets[u].params[q], i = slot % 2, anywhere = 0;
      for (int k = 0; k < W; ++k) anywhere |= div_used(k, u, i) && !(t->disagree && k == 1 && slot == 5);
      CHECK(used_b[q] == anywhere && split_b[q] == (t->disagree && slot == 5),
            "mode %d rank %d unit %d item %d: decoded used %d split %d", t->grad_mode, r, u, q, used_b[q], split_b[q]);
    }
  }
  /* zeroed gradients take their used flags along (unit 2: used by rank 0 at least) */
  int32_t first = 0;
  CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 2, &first, 1));
  {
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, 2, &off, &n, &every));
    const mfsdp_buffer* gs = mfsdp_pipeline_buffer(p, 2, MFSDP_BUF_GRAD_SHARD);
    CHECK(load_as_double(gs->data, MFSDP_F32, off) == 0.0 && load_as_double(gs->data, MFSDP_F32, off + 1) > 0,
          "zero_item_grads clears its item's used flag only");
  }
  mfsdp_pipeline_destroy(p);
  for (int u = 0; u < DIV_UNITS; ++u) {
    free(grads[u][0]);
    free(grads[u][1]);
  }
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

/* Ranks deliver gradients in different orders, skip a whole unit (sealed) or single parameters:
 * every collective still matches across ranks (the thread transport compares them) and the
 * reduced gradients are the sums of what each rank used. */
void test_rank_divergent_graphs(void) {
  const int modes[5][3] = {{MFSDP_GRAD_SCATTER_ACCUMULATE, 0, 0}, {MFSDP_GRAD_SCATTER_IN_PLACE, 1, 0},
                           {MFSDP_GRAD_ALL_REDUCE, 1, 0}, {MFSDP_GRAD_SCATTER_ACCUMULATE, 1, 1},
                           {MFSDP_GRAD_ALL_REDUCE, 1, 1}};
  for (int w = 1; w <= DIV_WORLD; ++w)
    for (int m = 0; m < 5; ++m) {
      if (modes[m][2] && w < 2) continue; /* a disagreement needs two ranks */
      loop_world world;
      loop_world_init(&world, w);
      pthread_t threads[DIV_WORLD];
      divergent_thread args[DIV_WORLD];
      for (int r = 0; r < w; ++r) {
        args[r] = (divergent_thread){&world, w, r, modes[m][0], modes[m][1], modes[m][2]};
        pthread_create(&threads[r], NULL, divergent_worker, &args[r]);
      }
      for (int r = 0; r < w; ++r) pthread_join(threads[r], NULL);
      CHECK(world.mismatches == 0, "world %d grad mode %d: %d collectives differed across ranks", w, modes[m][0],
            world.mismatches);
      loop_world_destroy(&world);
    }
}
/* ------------------------------------------------------------------------------------------ */
/* narrow sums ([Note: exchange reduction] in reduce.c): bf16 gradients of 1 (rank 0) and 2^-9
 * (ranks 1, 2) sum to 1 + 2^-8. The exchange reduction of a reduce-scatter sums them in float32
 * (1.00390625); with `sum_in_comm_dtype` the collective's bf16 sum is kept, which rounds it to 1
 * (ties to even). */

#define NARROW_WORLD 3

typedef struct narrow_thread {
  loop_world* world;
  int rank, grad_mode, narrow;
} narrow_thread;

static void* narrow_worker(void* arg) {
  narrow_thread* t = arg;
  int W = NARROW_WORLD, sharded = t->grad_mode != MFSDP_GRAD_ALL_REDUCE;
  mfsdp_param_info info = {6 * 4, 4, MFSDP_F32, 0, 1, 0};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(&info, 1, sharded ? W : 1, 0, 16, &plan));
  const mfsdp_bucket_layout* L = &plan.buckets[0].layout;
  mfsdp_bucket_spec spec = {*L, sharded ? t->rank : 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_BF16,
                            t->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE, t->grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE,
                            t->grad_mode};
  spec.sum_in_comm_dtype = t->narrow;
  loop_rank lr = {t->world, t->rank};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &lr, &mfsdp_cpu_kernels, NULL};
  mfsdp_pipeline_config cfg = {W, t->rank, 1.0, MFSDP_REDUCE_SUM, 1 << 20, 0};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto out;
  float* g = malloc((size_t)L->numels[0] * sizeof *g);
  for (int64_t j = 0; j < L->numels[0]; ++j) g[j] = t->rank == 0 ? 1.0f : ldexpf(1.0f, -9);
  CHECK_OK(mfsdp_pipeline_begin_backward(p, 1));
  CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, 0, g, MFSDP_F32, L->numels[0], NULL));
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  free(g);
  int32_t where;
  int64_t off, n;
  CHECK_OK(mfsdp_pipeline_local_piece(p, 0, 0, MFSDP_BUF_OPT_GRAD, &where, &off, &n));
  const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, 0, where);
  /* the all-reduce form rounds its sum to the comm dtype either way (gather_exchanged), and this
   * transport sums exactly: both give 1 there, the check is that the flag changes nothing else */
  double want = t->narrow || !sharded ? 1.0 : 1.0 + ldexp(1.0, -8);
  int wrong = 0;
  for (int64_t k = 0; k < n; ++k) wrong += load_as_double(og->data, MFSDP_F32, off + k) != want;
  CHECK(n > 0 && wrong == 0, "grad mode %d, sum_in_comm_dtype %d, rank %d: %d of %lld reduced gradients are not %.9g",
        t->grad_mode, t->narrow, t->rank, wrong, (long long)n, want);
  mfsdp_pipeline_destroy(p);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

void test_narrow_sums(void) {
  const int modes[3] = {MFSDP_GRAD_SCATTER_ACCUMULATE, MFSDP_GRAD_SCATTER_IN_PLACE, MFSDP_GRAD_ALL_REDUCE};
  for (int m = 0; m < 3; ++m)
    for (int narrow = 0; narrow <= 1; ++narrow) {
      loop_world world;
      loop_world_init(&world, NARROW_WORLD);
      pthread_t threads[NARROW_WORLD];
      narrow_thread args[NARROW_WORLD];
      for (int r = 0; r < NARROW_WORLD; ++r) {
        args[r] = (narrow_thread){&world, r, modes[m], narrow};
        pthread_create(&threads[r], NULL, narrow_worker, &args[r]);
      }
      for (int r = 0; r < NARROW_WORLD; ++r) pthread_join(threads[r], NULL);
      loop_world_destroy(&world);
    }
}
