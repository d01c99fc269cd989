/* test_trainable.c (a part of test_core, whose runner is csrc/tests/test_core.c): requires_grad
 * changed at run time. */
#include <math.h>

#include "../../core/mfsdp_kernels.h"
#include "../harness.h"
#include "core_tests.h"

/* requires_grad changed at run time ([Note: requires_grad changes] in trainable.c): bucket 0 is
 * created trainable, bucket 1 frozen (no gradient memory); bucket 1 starts training while item 1
 * of bucket 0 stops (its reduced gradient is kept), then bucket 1 is frozen again and its
 * gradient memory released. Worlds 1-4, ZeRO-3, ZeRO-1 and no_shard. */

#define RG_BUCKETS 2
#define RG_ITEMS 2

typedef struct trainable_thread {
  loop_world* world;
  int rank, grad_mode;
} trainable_thread;

static double rg_grad(int rank, int step, int b, int i, int64_t j) {
  return 0.5 * (rank + 1) + 0.1 * step + b + 0.01 * i + 1e-4 * (double)j;
}

/* Rank `t->rank`'s backward of `step`: the gradients of the (bucket, item) pairs in `used`,
 * bucket 1's first (the shared order launches later buckets first). */
static void rg_backward(mfsdp_pipeline* p, const mfsdp_plan* plan, int mode, int world, int rank, int step, int sync,
                        const int used[RG_BUCKETS][RG_ITEMS]) {
  float* grads[RG_BUCKETS][RG_ITEMS] = {{0}};
  mfsdp_comm_stats before, after;
  mfsdp_pipeline_stats(p, 0, &before);
  CHECK_OK(mfsdp_pipeline_begin_backward(p, sync));
  for (int b = RG_BUCKETS - 1; b >= 0; --b)
    for (int i = 0; i < RG_ITEMS; ++i) {
      int64_t n = plan->buckets[b].layout.numels[i];
      float* g = grads[b][i] = malloc((size_t)n * sizeof *g);
      for (int64_t j = 0; j < n; ++j) g[j] = (float)rg_grad(rank, step, b, i, j);
      mfsdp_status st = mfsdp_pipeline_grad_ready(p, b, i, g, MFSDP_F32, n, NULL);
      if (used[b][i])
        CHECK(st == MFSDP_OK, "step %d bucket %d item %d: %s", step, b, i, mfsdp_last_error());
      else
        CHECK(st == MFSDP_ERR_INVALID_STATE && strstr(mfsdp_last_error(), "frozen"),
              "step %d: a frozen item's gradient is refused (bucket %d item %d: %s)", step, b, i, mfsdp_status_name(st));
    }
  mfsdp_pipeline_stats(p, 0, &after);
  if (used[0][0] && !used[0][1] && (sync || mode == MFSDP_GRAD_SCATTER_ACCUMULATE) && world > 1)
    CHECK(after.reduce_scatters + after.all_reduces > before.reduce_scatters + before.all_reduces,
          "mode %d step %d: bucket 0 reduced once its one trainable item arrived, before the end", mode, step);
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  for (int b = 0; b < RG_BUCKETS; ++b)
    for (int i = 0; i < RG_ITEMS; ++i) free(grads[b][i]);
}

/* Item i of bucket b after the sync: `want_step` steps' reduced gradient (-1: zero). */
static int rg_wrong(mfsdp_pipeline* p, const mfsdp_plan* plan, const mfsdp_bucket_spec* specs, int W, int b, int i,
                    int want_step) {
  int32_t where;
  int64_t off, first, n;
  const mfsdp_bucket_layout* L = &plan->buckets[b].layout;
  CHECK_OK(mfsdp_pipeline_local_piece(p, b, i, MFSDP_BUF_OPT_GRAD, &where, &off, &n));
  mfsdp_piece_of(L->numels[i], L->pieces[i], specs[b].shard_rank, &first, &n);
  const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, b, where);
  int wrong = 0;
  for (int64_t j = first; j < first + n; ++j) {
    double want = 0;
    for (int r = 0; want_step >= 0 && r < W; ++r) want += rg_grad(r, want_step, b, i, j) / W;
    double got = load_as_double(og->data, MFSDP_F32, off + j - first);
    if (fabs(got - want) > 1e-5 * (fabs(want) + 1) && wrong++ < 2)
      fprintf(stderr, "  mode %d bucket %d item %d elem %lld: got %g want %g\n", specs[b].grad_mode, b, i,
              (long long)j, got, want);
  }
  return wrong;
}

static void* trainable_worker(void* arg) {
  trainable_thread* t = arg;
  int W = t->world->n, r = t->rank, mode = t->grad_mode;
  mfsdp_param_info infos[RG_BUCKETS * RG_ITEMS];
  for (int b = 0; b < RG_BUCKETS; ++b) { /* bucket b: items of unit b */
    infos[2 * b] = (mfsdp_param_info){(b + 3) * 4, 4, MFSDP_F32, b, 1, 0};
    infos[2 * b + 1] = (mfsdp_param_info){5 + b, 1, MFSDP_F32, b, 1, 0};
  }
  int shard_world = mode == MFSDP_GRAD_ALL_REDUCE ? 1 : W;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(infos, RG_BUCKETS * RG_ITEMS, shard_world, 0, 16, &plan));
  mfsdp_bucket_spec specs[RG_BUCKETS];
  int sharded = mode == MFSDP_GRAD_SCATTER_ACCUMULATE && W > 1;
  for (int b = 0; b < RG_BUCKETS; ++b) {
    specs[b] = (mfsdp_bucket_spec){plan.buckets[b].layout, shard_world > 1 ? r : 0, MFSDP_F32, MFSDP_F32, MFSDP_F32,
                                   MFSDP_F32, sharded, shard_world > 1 && !sharded, mode};
    specs[b].frozen = b == 1;
  }
  loop_rank lr = {t->world, r};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &lr, &mfsdp_cpu_kernels, NULL};
  mfsdp_pipeline_config cfg = {W, r, 1.0 / W, MFSDP_REDUCE_SUM, 1, 0}; /* a one-byte queue: every launch completes */
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, specs, RG_BUCKETS, &p));
  if (p == NULL) goto out;
  CHECK(mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_GRAD_SHARD) == NULL && mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_GRAD) == NULL,
        "mode %d: a bucket created frozen has no gradient memory", mode);
  mfsdp_comm_stats st1;
  int sync = 1, items01[2] = {0, 1}, item1[1] = {1}, item0[1] = {0};

  /* step 0: bucket 0 trains, bucket 1 is frozen */
  const int step0[RG_BUCKETS][RG_ITEMS] = {{1, 1}, {0, 0}};
  rg_backward(p, &plan, mode, W, r, 0, sync, step0);
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  CHECK(rg_wrong(p, &plan, specs, W, 0, 0, 0) + rg_wrong(p, &plan, specs, W, 0, 1, 0) == 0, "mode %d rank %d step 0", mode, r);
  mfsdp_pipeline_stats(p, 1, &st1);
  CHECK(st1.reduce_scatters + st1.all_reduces == 0, "mode %d: the frozen bucket reduced nothing", mode);

  /* bucket 1 starts training, item 1 of bucket 0 stops and keeps its gradient (not zeroed) */
  CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 0, item0, 1));
  CHECK(mfsdp_pipeline_set_trainable(p, 0, items01, 2, 1) == MFSDP_OK, "setting a set flag is a no-op");
  CHECK_OK(mfsdp_pipeline_set_trainable(p, 1, items01, 2, 1));
  CHECK_OK(mfsdp_pipeline_set_trainable(p, 0, item1, 1, 0));
  CHECK(mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_OPT_GRAD) != NULL && rg_wrong(p, &plan, specs, W, 1, 0, -1) == 0,
        "mode %d: gradient buffers created zero at the first trainable item", mode);
  const int step1[RG_BUCKETS][RG_ITEMS] = {{1, 0}, {1, 1}};
  rg_backward(p, &plan, mode, W, r, 1, sync, step1);
  CHECK(mfsdp_pipeline_set_trainable(p, 1, item0, 1, 0) == MFSDP_OK, "flags may change between backwards");
  CHECK_OK(mfsdp_pipeline_set_trainable(p, 1, item0, 1, 1));
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  int wrong = rg_wrong(p, &plan, specs, W, 0, 0, 1) + rg_wrong(p, &plan, specs, W, 0, 1, 0) + rg_wrong(p, &plan, specs, W, 1, 0, 1) +
              rg_wrong(p, &plan, specs, W, 1, 1, 1);
  CHECK(wrong == 0, "mode %d rank %d step 1: %d gradients wrong (the frozen item must keep step 0's)", mode, r, wrong);

  /* bucket 1 frozen again: it reduces no more and keeps its gradients (as DDP keeps a frozen
   * parameter's .grad) until they are dropped, then its memory goes; bucket 0's stays */
  CHECK_OK(mfsdp_pipeline_set_trainable(p, 1, items01, 2, 0));
  CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 0, item0, 1));
  const int step2[RG_BUCKETS][RG_ITEMS] = {{1, 0}, {0, 0}};
  mfsdp_pipeline_stats(p, 1, &st1);
  rg_backward(p, &plan, mode, W, r, 2, sync, step2);
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  mfsdp_comm_stats st2;
  mfsdp_pipeline_stats(p, 1, &st2);
  CHECK(st2.reduce_scatters + st2.all_reduces == st1.reduce_scatters + st1.all_reduces,
        "mode %d: a bucket frozen again reduces no more", mode);
  wrong = rg_wrong(p, &plan, specs, W, 0, 0, 2) + rg_wrong(p, &plan, specs, W, 1, 0, 1) +
          rg_wrong(p, &plan, specs, W, 1, 1, 1);
  CHECK(wrong == 0, "mode %d rank %d step 2: %d gradients wrong (bucket 1 must keep step 1's)", mode, r, wrong);
  CHECK(mfsdp_pipeline_release_grads(p, &(int32_t){0}, 1) == MFSDP_ERR_INVALID_STATE, "a training bucket keeps its gradients");
  CHECK_OK(mfsdp_pipeline_zero_grads(p));
  CHECK_OK(mfsdp_pipeline_release_grads(p, &(int32_t){1}, 1));
  CHECK(mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_GRAD_SHARD) == NULL && mfsdp_pipeline_buffer(p, 1, MFSDP_BUF_OPT_GRAD) == NULL,
        "mode %d: released", mode);
  CHECK_OK(mfsdp_pipeline_release_grads(p, &(int32_t){1}, 1)); /* nothing left: a no-op */

  /* misuse: inside a backward; a dtype that cannot train; local sums not yet reduced */
  CHECK_OK(mfsdp_pipeline_begin_backward(p, 0));
  CHECK(mfsdp_pipeline_set_trainable(p, 1, item0, 1, 1) == MFSDP_ERR_INVALID_STATE, "refused inside a backward");
  CHECK(mfsdp_pipeline_release_grads(p, &(int32_t){1}, 1) == MFSDP_ERR_INVALID_STATE, "refused inside a backward");
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  CHECK(mfsdp_pipeline_set_trainable(p, 0, (int32_t[]){2}, 1, 1) == MFSDP_ERR_INVALID_ARGUMENT, "no such item");
  if (mode != MFSDP_GRAD_SCATTER_ACCUMULATE) { /* a backward without sync leaves a local sum */
    CHECK_OK(mfsdp_pipeline_zero_grads(p));
    const int local[RG_BUCKETS][RG_ITEMS] = {{1, 0}, {0, 0}};
    rg_backward(p, &plan, mode, W, r, 3, 0, local);
    CHECK_OK(mfsdp_pipeline_set_trainable(p, 0, item0, 1, 0));
    CHECK(mfsdp_pipeline_release_grads(p, &(int32_t){0}, 1) == MFSDP_ERR_INVALID_STATE &&
              strstr(mfsdp_last_error(), "not yet reduced"),
          "mode %d: local gradients not yet reduced are not released", mode);
  }
  mfsdp_pipeline_destroy(p);
  mfsdp_bucket_spec never = specs[1];
  never.grad_mode = MFSDP_GRAD_NONE;
  never.weights_regather = shard_world > 1; /* an integer-like bucket: weights only */
  never.weights_sharded = 0;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &never, 1, &p));
  if (p) {
    CHECK(mfsdp_pipeline_set_trainable(p, 0, item0, 1, 1) == MFSDP_ERR_INVALID_ARGUMENT, "grad mode NONE never trains");
    mfsdp_pipeline_destroy(p);
  }
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

void test_requires_grad_changes(void) {
  const int modes[3] = {MFSDP_GRAD_SCATTER_ACCUMULATE, MFSDP_GRAD_SCATTER_IN_PLACE, MFSDP_GRAD_ALL_REDUCE};
  for (int world = 1; world <= 4; ++world)
    for (int m = 0; m < 3; ++m) {
      loop_world w;
      loop_world_init(&w, world);
      pthread_t threads[4];
      trainable_thread args[4];
      for (int r = 0; r < world; ++r) {
        args[r] = (trainable_thread){&w, r, modes[m]};
        pthread_create(&threads[r], NULL, trainable_worker, &args[r]);
      }
      for (int r = 0; r < world; ++r) pthread_join(threads[r], NULL);
      CHECK(w.mismatches == 0, "mode %d world %d: %d collectives differed across ranks", modes[m], world, w.mismatches);
      loop_world_destroy(&w);
    }
}
