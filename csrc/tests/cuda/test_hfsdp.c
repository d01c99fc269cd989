/* test_hfsdp.c (a part of test_emu, whose runner is csrc/tests/test_emu.c): HFSDP on the native
 * NCCL transport. */
#include <math.h>

#include "cuda_tests.h"

/* HFSDP on native NCCL: 2 replicas x 2 shards, each rank with its own communicators inside the
 * replica and across replicas ([Note: optimizer sharded across replicas] in replicas.c). Run
 * in several timings (hf_modes), each legal in CUDA: as it comes; with every rank's current
 * stream deferred until its host synchronizes, so that a host touching memory its stream has
 * yet to use fails on every run, whatever the machine's load; and deferred with one kind of
 * stream slowed by 1 ms an operation, so that a collective ordered after another (inside vs.
 * across the replicas) or after the producer's work by timing rather than by an event reads
 * stale values on (nearly) every run instead of now and then. */

enum { HF_OUTER = 2, HF_INNER = 2, HF_ROWS = 7, HF_COLS = 3, HF_STEPS = 2, HF_MICRO = 3 };

typedef struct hf_mode {
  const char* name;
  int param_dtype;     /* of the compute weights; main weights, gradients, communication: float32 */
  int defer;           /* every rank's current stream deferred (emu_stream_defer) */
  int stream_delay_us; /* each operation on a rank's current stream starts this much later */
  int inner_delay_us;  /* ... on the lanes inside the replica */
  int outer_delay_us;  /* ... on the lanes across the replicas */
  int jitter_us;       /* every stream operation starts up to this much later (emu_set_jitter_us) */
} hf_mode;

typedef struct hfsdp_thread {
  const hf_mode* mode;
  emu_world* inner; /* this rank's replica */
  emu_world* outer; /* its twins in the other replicas */
  int o, i;
} hfsdp_thread;

static double hf_grad(int rank, int mb, int64_t j) { return 0.5 * (rank + 1) - 0.25 * mb + 1e-2 * j; }
static double hf_init(int64_t j) { return 1.0 - 0.05 * j; }

static void* hfsdp_worker(void* arg) {
  hfsdp_thread* t = arg;
  const hf_mode* m = t->mode;
  int W = HF_OUTER * HF_INNER, rank = t->o * HF_INNER + t->i, n = HF_ROWS * HF_COLS, pdt = m->param_dtype;
  mfsdp_param_info info = {n, HF_COLS, pdt, 0, 1, 0};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(&info, 1, W, 0, 16, &plan));
  mfsdp_bucket_spec spec = {plan.buckets[0].layout, rank, pdt, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0,
                            MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_backend be;
  void* dev = NULL;
  mfsdp_pipeline* p = NULL;
  mfsdp_nccl* across = NULL;
  if (emu_rank_setup_on(t->inner, t->i, rank, &be, &dev) != 0) {
    CHECK(0, "setup: %s", mfsdp_last_error());
    goto out;
  }
  pthread_barrier_wait(&t->outer->start);
  emu_set_stream_delay_us(t->outer->lane_delay_us);
  CHECK_OK(mfsdp_nccl_create(t->outer->ids, t->o, HF_OUTER, rank, t->outer->timeout_s, NULL, &across));
  emu_set_stream_delay_us(0);
  if (across == NULL) goto done;
  be.outer = &mfsdp_nccl_ops;
  be.outer_ctx = across;
  mfsdp_pipeline_config cfg = {HF_INNER, t->i, 1.0 / W, MFSDP_REDUCE_SUM, 1 << 20, 0, HF_OUTER, 1};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto done;
  float* v = malloc((size_t)n * sizeof *v);
  for (int j = 0; j < n; ++j) v[j] = (float)hf_init(j);
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, 0));
  CHECK_OK(mfsdp_pipeline_set_item(p, 0, 0, v, MFSDP_F32, n));
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  emu_rank_sync(dev); /* set_item's copy reads v on the stream, and v takes the gradients below */
  int32_t b0 = 0;
  for (int step = 0; step < HF_STEPS; ++step) {
    CHECK_OK(mfsdp_pipeline_zero_grads(p));
    for (int mb = 0; mb < HF_MICRO; ++mb) { /* the outer reduce-scatter on the last backward only */
      CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
      CHECK_OK(mfsdp_pipeline_wait_unshard(p, &b0, 1));
      CHECK_OK(mfsdp_pipeline_reshard(p, &b0, 1));
      CHECK_OK(mfsdp_pipeline_begin_backward(p, mb == HF_MICRO - 1));
      for (int j = 0; j < n; ++j) v[j] = (float)hf_grad(rank, mb, j);
      CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, 0, v, MFSDP_F32, n, NULL));
      CHECK_OK(mfsdp_pipeline_end_backward(p));
      emu_rank_sync(dev); /* v is reused: its packing must have run */
    }
    CHECK_OK(mfsdp_pipeline_sync_grads(p));
    emu_rank_sync(dev);
    int32_t where, gwhere;
    int64_t off, goff, len, first, count;
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, 0, MFSDP_BUF_MAIN_SHARD, &where, &off, &len));
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, 0, MFSDP_BUF_OPT_GRAD, &gwhere, &goff, &len));
    mfsdp_piece_of(n, plan.buckets[0].layout.pieces[0], rank, &first, &count);
    float* w = mfsdp_pipeline_buffer(p, 0, where)->data;
    const float* g = mfsdp_pipeline_buffer(p, 0, gwhere)->data;
    int wrong = 0;
    for (int64_t j = 0; j < len; ++j) {
      double want = 0;
      for (int mb = 0; mb < HF_MICRO; ++mb)
        for (int r = 0; r < W; ++r) want += hf_grad(r, mb, first + j) / W;
      wrong += fabs(g[goff + j] - want) > 1e-5 * (fabs(want) + 1);
      w[off + j] -= 0.5f * g[goff + j]; /* the optimizer, on this rank's piece only */
    }
    CHECK(wrong == 0, "HFSDP on NCCL (%s), rank %d step %d: %d main gradients wrong", m->name, rank, step, wrong);
    CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
  }
  CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, &b0, 1));
  emu_rank_sync(dev);
  const void* full = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT)->data;
  double tol = pdt == MFSDP_F32 ? 1e-4 : 2e-2; /* bf16: the main weights rounded on install */
  int wrong = 0;
  for (int j = 0; j < n; ++j) {
    double step_grad = 0, init[1];
    for (int mb = 0; mb < HF_MICRO; ++mb)
      for (int r = 0; r < W; ++r) step_grad += hf_grad(r, mb, j) / W;
    store_from_double(init, pdt, 0, hf_init(j)); /* the main weights start from the compute weights */
    double want = load_as_double(init, pdt, 0) - 0.5 * HF_STEPS * step_grad;
    wrong += fabs(load_as_double(full, pdt, j) - want) > tol * (fabs(want) + 1);
  }
  CHECK(wrong == 0, "HFSDP on NCCL (%s), rank %d: %d full weights wrong after the replicas' gathers", m->name, rank,
        wrong);
  mfsdp_comm_stats st;
  mfsdp_pipeline_stats(p, -1, &st);
  CHECK(st.outer_reduce_scatters == HF_STEPS && st.outer_all_gathers == HF_STEPS && st.outer_all_reduces == 0,
        "HFSDP on NCCL: %lld reduce-scatters and %lld all-gathers across replicas, expected %d each",
        (long long)st.outer_reduce_scatters, (long long)st.outer_all_gathers, HF_STEPS);
  free(v);
done:
  if (p) emu_rank_sync(dev);
  mfsdp_pipeline_destroy(p);
  if (across) {
    mfsdp_nccl_close(across);
    mfsdp_nccl_destroy(across);
  }
  emu_rank_teardown(dev);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

static void run_hfsdp(const hf_mode* m) {
  emu_world* inner[HF_OUTER];
  emu_world* outer[HF_INNER];
  for (int o = 0; o < HF_OUTER; ++o) {
    inner[o] = emu_world_create(HF_INNER);
    inner[o]->defer = m->defer;
    inner[o]->stream_delay_us = m->stream_delay_us;
    inner[o]->lane_delay_us = m->inner_delay_us;
  }
  for (int i = 0; i < HF_INNER; ++i) {
    outer[i] = emu_world_create(HF_OUTER);
    outer[i]->lane_delay_us = m->outer_delay_us;
  }
  emu_set_jitter_us(m->jitter_us);
  pthread_t threads[HF_OUTER * HF_INNER];
  hfsdp_thread args[HF_OUTER * HF_INNER];
  for (int o = 0; o < HF_OUTER; ++o)
    for (int i = 0; i < HF_INNER; ++i) {
      args[o * HF_INNER + i] = (hfsdp_thread){m, inner[o], outer[i], o, i};
      pthread_create(&threads[o * HF_INNER + i], NULL, hfsdp_worker, &args[o * HF_INNER + i]);
    }
  for (int r = 0; r < HF_OUTER * HF_INNER; ++r) pthread_join(threads[r], NULL);
  emu_set_jitter_us(0);
  for (int o = 0; o < HF_OUTER; ++o) emu_world_destroy(inner[o]);
  for (int i = 0; i < HF_INNER; ++i) emu_world_destroy(outer[i]);
}

void test_hfsdp(void) {
  const int F = MFSDP_F32, B = MFSDP_BF16;
  const hf_mode modes[] = {
      /* name, param dtype, defer, current streams' delay, inner lanes' delay, outer lanes' delay, jitter */
      {"as it comes", F, 0, 0, 0, 0, 0},
      {"streams deferred", F, 1, 0, 0, 0, 0},
      {"streams deferred, lanes across replicas slow", F, 1, 0, 0, 1000, 0},
      {"streams deferred, lanes inside replicas slow", F, 1, 0, 1000, 0, 0},
      {"jitter", F, 0, 0, 0, 0, 300},
      {"bf16 compute fp32 main, streams deferred, lanes across replicas slow", B, 1, 0, 0, 1000, 0},
      {"bf16 compute fp32 main, streams deferred, lanes inside replicas slow", B, 1, 0, 1000, 0, 0},
      {"bf16 compute fp32 main, streams deferred and slow", B, 1, 1000, 0, 0, 0},
  };
  for (size_t k = 0; k < sizeof modes / sizeof modes[0]; ++k) run_hfsdp(&modes[k]);
}
