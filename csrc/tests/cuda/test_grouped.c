/* test_grouped.c (a part of test_emu, whose runner is csrc/tests/test_emu.c): a unit's gathers as
 * one NCCL group. */
#include "cuda_tests.h"

/* a unit of several buckets: its gathers go out as one NCCL group */

typedef struct unit_thread {
  emu_world* world;
  int rank;
} unit_thread;

static void* unit_worker(void* arg) {
  unit_thread* t = arg;
  int W = t->world->n, r = t->rank;
  mfsdp_param_info info = {UNIT_ROWS * UNIT_COLS, UNIT_COLS, MFSDP_F32, 0, 1, 0};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(&info, 1, W, 0, 16, &plan));
  mfsdp_bucket_plan* bp = &plan.buckets[0];
  const int dtypes[UNIT_BUCKETS] = {MFSDP_F32, MFSDP_BF16, MFSDP_F64};
  mfsdp_bucket_spec specs[UNIT_BUCKETS];
  for (int b = 0; b < UNIT_BUCKETS; ++b)
    specs[b] = (mfsdp_bucket_spec){bp->layout, r, dtypes[b], dtypes[b], dtypes[b], dtypes[b], 1, 0,
                                   MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_backend be;
  void* dev = NULL;
  mfsdp_pipeline* p = NULL;
  if (emu_rank_setup(t->world, r, &be, &dev) != 0) {
    CHECK(0, "setup: %s", mfsdp_last_error());
    goto out;
  }
  mfsdp_pipeline_config cfg = {W, r, 1.0 / W, MFSDP_REDUCE_SUM, 1 << 20, 0};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, specs, UNIT_BUCKETS, &p));
  if (p == NULL) goto done;
  float* v = malloc(UNIT_ROWS * UNIT_COLS * sizeof *v);
  for (int b = 0; b < UNIT_BUCKETS; ++b) {
    for (int j = 0; j < UNIT_ROWS * UNIT_COLS; ++j) v[j] = (float)(b * 100 + j);
    CHECK_OK(mfsdp_pipeline_init_begin(p, b, 0));
    CHECK_OK(mfsdp_pipeline_set_item(p, b, 0, v, MFSDP_F32, UNIT_ROWS * UNIT_COLS));
    CHECK_OK(mfsdp_pipeline_init_end(p, b));
    emu_rank_sync(dev);
  }
  free(v);
  int32_t ids[UNIT_BUCKETS] = {0, 1, 2};
  for (int round = 0; round < 3; ++round) { /* gather, use, release: as a unit's forward does */
    CHECK_OK(mfsdp_pipeline_unshard(p, ids, UNIT_BUCKETS));
    CHECK_OK(mfsdp_pipeline_wait_unshard(p, ids, UNIT_BUCKETS));
    /* the consumer reads on its stream right after the wait, with no host sync in between */
    double* seen = calloc(UNIT_BUCKETS * UNIT_ROWS * UNIT_COLS, sizeof *seen);
    for (int b = 0; b < UNIT_BUCKETS; ++b) {
      const mfsdp_buffer* w = mfsdp_pipeline_buffer(p, b, MFSDP_BUF_WEIGHT);
      CHECK_OK(mfsdp_cuda_kernels->copy(be.kernels_ctx, seen + b * UNIT_ROWS * UNIT_COLS, MFSDP_F64, w->data,
                                        dtypes[b], UNIT_ROWS * UNIT_COLS, 1.0));
    }
    CHECK_OK(mfsdp_pipeline_reshard(p, ids, UNIT_BUCKETS));
    emu_rank_sync(dev);
    int wrong = 0;
    for (int b = 0; b < UNIT_BUCKETS; ++b)
      for (int j = 0; j < UNIT_ROWS * UNIT_COLS; ++j) wrong += seen[b * UNIT_ROWS * UNIT_COLS + j] != b * 100 + j;
    CHECK(wrong == 0, "world %d rank %d round %d: %d weights of the grouped gather wrong", W, r, round, wrong);
    free(seen);
  }
done:
  if (p) emu_rank_sync(dev);
  mfsdp_pipeline_destroy(p);
  emu_rank_teardown(dev);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

void test_grouped_unit(void) {
  for (int n = 2; n <= 4; n += 2) {
    long before = emu_nccl_grouped_collectives();
    emu_world* w = emu_world_create(n);
    pthread_t threads[4];
    unit_thread args[4];
    for (int r = 0; r < n; ++r) {
      args[r] = (unit_thread){w, r};
      pthread_create(&threads[r], NULL, unit_worker, &args[r]);
    }
    for (int r = 0; r < n; ++r) pthread_join(threads[r], NULL);
    emu_world_destroy(w);
    long grouped = emu_nccl_grouped_collectives() - before;
    CHECK(grouped == 3L * UNIT_BUCKETS * n, "world %d: %ld gathers launched in groups, expected %d", n, grouped,
          3 * UNIT_BUCKETS * n);
  }
}
