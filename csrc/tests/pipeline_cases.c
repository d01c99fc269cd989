/* pipeline_cases.c: see pipeline_cases.h. */
#include "pipeline_cases.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

/* ---- the loop rig: heap memory, thread transport, CPU kernels ---- */

static void* loop_rig_world_create(int n) {
  loop_world* w = malloc(sizeof *w);
  loop_world_init(w, n);
  return w;
}

static void loop_rig_world_destroy(void* world) {
  loop_world_destroy(world);
  free(world);
}

static int loop_rig_rank_setup(void* world, int rank, mfsdp_backend* be, void** state) {
  loop_rank* lr = malloc(sizeof *lr);
  *lr = (loop_rank){world, rank};
  *be = (mfsdp_backend){&heap_memory_ops, NULL, &loop_transport_ops, lr, &mfsdp_cpu_kernels, NULL};
  *state = lr;
  return 0;
}

static void loop_rig_rank_sync(void* state) { (void)state; } /* everything ran synchronously */

static void loop_rig_inject_failure(void* world, int after) {
  loop_world* w = world;
  w->fail_after = w->calls + after;
}

const pipe_rig loop_rig = {"threads", loop_rig_world_create, loop_rig_world_destroy, loop_rig_rank_setup,
                           loop_rig_rank_sync, free, loop_rig_inject_failure};

/* ---- the cases ---- */

int pipeline_cases_tail = 0;

typedef struct pipe_case {
  const char* name;
  int world, grad_mode, weights_sharded, regather, micro, sync_each;
  int param_dtype, main_dtype, grad_dtype, comm_dtype;
  int op;            /* mfsdp_reduce_op */
  int per_token;     /* prescale 1 (sum) instead of 1/world */
  int fail_after;    /* inject a collective failure; -1: none */
  int direct_init;   /* initialise shards directly (meta-device path) */
  int blocked;       /* items sharded on an inner dim: BLOCKED's outers ([Note: chunked layout]) */
  int keep;          /* ZeRO-3 keeps its full weights' memory when resharded ([Note: kept full weights]) */
  int offload;       /* main weights and gradients in host memory ([Note: offloaded buckets] in buffers.c): the
                        host reads and writes them right after sync_grads / zero_grads, without a sync of its own */
} pipe_case;

typedef struct pipe_thread {
  const pipe_case* c;
  const pipe_rig* rig;
  void* world;
  int rank;
  int force_comm;
  int failures;
} pipe_thread;

static const int64_t SHAPES[][2] = {{12, 4}, {5, 1}, {6, 2}, {3, 1}, {8, 8}};
#define N_ITEMS 5
/* (numel, row, outer) for the blocked cases: torch's Shard(1) of shapes (3, 4, 2), (5,), (2, 6, 3),
 * (8, 1) -- one row per block, so every rank but the first holds nothing -- and Shard(0) of (1, 8). */
static const int64_t BLOCKED[N_ITEMS][3] = {{24, 2, 3}, {5, 1, 1}, {36, 3, 2}, {8, 1, 8}, {8, 8, 1}};

/* Rank r's piece of item i as runs ([Note: chunked layout]); its element count. */
/* The engine's decoded flags (mfsdp_pipeline_read_flags: one copy to the host through the
 * kernels' to_host, on the emulated device too) agree with the tail: every item used, none split. */
static void check_read_flags(mfsdp_pipeline* p, int32_t n, const char* name, int r) {
  uint8_t used[64], split[64];
  int32_t m = -1;
  memset(used, 7, sizeof used);
  memset(split, 7, sizeof split);
  CHECK(n <= 64, "%s: %d items", name, n);
  CHECK_OK(mfsdp_pipeline_read_flags(p, 0, used, split, &m));
  CHECK(m == n, "%s rank %d: read_flags says %d items, flag_tail %d", name, r, m, n);
  for (int i = 0; i < n && i < 64; ++i)
    CHECK(used[i] == 1 && split[i] == 0, "%s rank %d item %d: decoded used %d split %d", name, r, i, used[i], split[i]);
}

static int64_t piece_runs(const mfsdp_bucket_layout* L, int i, int r, mfsdp_runs* ru) {
  mfsdp_piece_runs(L->numels[i], L->pieces[i], mfsdp_layout_outer(L, i), r, ru);
  return ru->count * ru->len;
}

/* The item element at position k of a piece (rank-major) given as runs. */
static int64_t piece_elem(const mfsdp_runs* ru, int64_t k) {
  return ru->first + (k / ru->len) * ru->stride + k % ru->len;
}

static double init_value(int item, int64_t j) { return 0.25 * item + 0.001 * (double)j; }
static double grad_value(int rank, int mb, int item, int64_t j) {
  return 0.5 * (rank + 1) + 0.125 * mb - 0.01 * item + 0.0001 * (double)j;
}

static double tolerance(int dtype) { return dtype == MFSDP_BF16 ? 2e-2 : dtype == MFSDP_F16 ? 2e-3 : 1e-5; }

/* The optimizer's worker of [Note: stepping in backward]: on its own thread, waits for the
 * bucket's gradients (mfsdp_pipeline_wait_grads) and copies them, while the test's thread goes on
 * with the backward. */
typedef struct early_read {
  mfsdp_pipeline* p;
  const mfsdp_buffer* og;
  void* copy;
  size_t bytes;
  mfsdp_status st;
} early_read;

static void* read_early(void* arg) {
  early_read* e = arg;
  e->st = mfsdp_pipeline_wait_grads(e->p, 0);
  if (e->st == MFSDP_OK && e->copy) memcpy(e->copy, e->og->data, e->bytes);
  return NULL;
}

static void* pipe_worker(void* arg) {
  pipe_thread* t = arg;
  const pipe_case* c = t->c;
  int before = test_failures;
  int W = c->world, r = t->rank;
  mfsdp_param_info infos[N_ITEMS];
  for (int i = 0; i < N_ITEMS; ++i)
    infos[i] = c->blocked ? (mfsdp_param_info){BLOCKED[i][0], BLOCKED[i][1], c->param_dtype, 0, 1, 0, BLOCKED[i][2]}
                          : (mfsdp_param_info){SHAPES[i][0], SHAPES[i][1], c->param_dtype, 0, 1, 0, 1};
  int shard_world = c->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 1 : W;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build_tailed(infos, N_ITEMS, shard_world, 0, 16, pipeline_cases_tail, 0, &plan));
  mfsdp_bucket_plan* bp = &plan.buckets[0];
  const mfsdp_bucket_layout* L = &bp->layout;
  mfsdp_bucket_spec spec = {*L, L->world > 1 ? r : 0, c->param_dtype, c->main_dtype, c->grad_dtype, c->comm_dtype,
                            c->weights_sharded && (W > 1 || t->force_comm), c->regather && (W > 1 || t->force_comm),
                            c->grad_mode};
  mfsdp_backend be;
  void* dev = NULL;
  mfsdp_pipeline* p = NULL;
  if (t->rig->rank_setup(t->world, r, &be, &dev) != 0) {
    CHECK(0, "%s rank %d: rig %s setup failed: %s", c->name, r, t->rig->name, mfsdp_last_error());
    goto out;
  }
  spec.offload = c->offload;
  if (c->offload) { /* host memory: plain heap blocks, device -1 (the rig's device memory says its device) */
    be.host_memory = &heap_memory_ops;
    be.host_memory_ctx = NULL;
  }
  double prescale = c->per_token || c->op == MFSDP_REDUCE_AVG ? 1.0 : 1.0 / W;
  mfsdp_pipeline_config cfg = {W, r, prescale, c->op, 1 << 20, t->force_comm};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto done;
  int pdt = c->param_dtype;

  /* init from float32 values */
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, c->direct_init));
  for (int i = 0; i < L->n_items; ++i) {
    int item_param = bp->params[i];
    float* v = malloc((size_t)L->numels[i] * sizeof *v + 4);
    for (int64_t j = 0; j < L->numels[i]; ++j) v[j] = (float)init_value(item_param, j);
    CHECK_OK(mfsdp_pipeline_set_item(p, 0, i, v, MFSDP_F32, L->numels[i]));
    t->rig->rank_sync(dev); /* the copy may still read v */
    free(v);
  }
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  const mfsdp_buffer* weight = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT);
  if (spec.weights_sharded)
    CHECK(weight->data == NULL && mfsdp_pipeline_weight_state(p, 0) == MFSDP_W_EMPTY, "ZeRO-3 releases weights");
  /* cast on gather: the main shard is the only copy */
  if (spec.weights_sharded && (c->main_dtype != c->param_dtype || c->offload))
    CHECK(mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT_SHARD)->data == NULL, "%s: no compute-dtype shard is held",
          c->name);
  for (int k = 0; c->offload && k < MFSDP_BUF_COUNT; ++k) { /* the optimizer's buffers, and only they, on the host */
    const mfsdp_buffer* b = mfsdp_pipeline_buffer(p, 0, k);
    int host = k == MFSDP_BUF_MAIN_SHARD || k == MFSDP_BUF_OPT_GRAD ||
               (k == MFSDP_BUF_GRAD_SHARD && c->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE);
    if (b != NULL)
      CHECK(host ? b->device == -1 : b->device == weight->device, "%s rank %d: buffer kind %d on device %d (%s)",
            c->name, r, k, b->device, host ? "host memory expected" : "the device's expected");
    else
      CHECK(!host, "%s rank %d: no buffer of kind %d", c->name, r, k);
  }

  /* gather: every item whole (parameter-major), padding zero */
  int32_t ids[1] = {0};
  CHECK_OK(mfsdp_pipeline_unshard(p, ids, 1));
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, ids, 1));
  t->rig->rank_sync(dev);
  int wrong = 0;
  for (int i = 0; i < L->n_items; ++i) {
    for (int64_t j = 0; j < L->numels[i]; ++j) {
      double rounded[1]; /* the float32 source value rounded to the parameter dtype */
      store_from_double(rounded, pdt, 0, (float)init_value(bp->params[i], j));
      wrong += load_as_double(weight->data, pdt, L->param_offsets[i] + j) != load_as_double(rounded, pdt, 0);
    }
  }
  double pad_sum = 0;
  for (int64_t k = 0; k < L->weight_size; ++k) pad_sum += fabs(load_as_double(weight->data, pdt, k));
  double item_sum = 0;
  for (int i = 0; i < L->n_items; ++i)
    for (int64_t j = 0; j < L->numels[i]; ++j)
      item_sum += fabs(load_as_double(weight->data, pdt, L->param_offsets[i] + j));
  CHECK(wrong == 0, "%s rank %d: %d gathered weights wrong", c->name, r, wrong);
  CHECK(fabs(pad_sum - item_sum) < 1e-9, "%s rank %d: padding is not zero", c->name, r);
  void* kept = weight->data;
  if (c->keep) CHECK_OK(mfsdp_pipeline_set_keep_weights(p, ids, 1, 1));
  CHECK_OK(mfsdp_pipeline_reshard(p, ids, 1));
  if (c->keep && spec.weights_sharded)
    CHECK(weight->data == kept && mfsdp_pipeline_weight_state(p, 0) == MFSDP_W_STALE,
          "%s rank %d: resharded weights kept in place, stale (state %d)", c->name, r, mfsdp_pipeline_weight_state(p, 0));

  if (c->fail_after >= 0) { /* the next collective fails on every rank: all refuse afterwards */
    t->rig->inject_failure(t->world, c->fail_after);
    mfsdp_status s1 = mfsdp_pipeline_unshard(p, ids, 1);
    if (!spec.weights_sharded && !spec.weights_regather) s1 = MFSDP_ERR_COMM; /* nothing to gather: skip */
    if (spec.weights_sharded) {
      CHECK(s1 == MFSDP_ERR_COMM, "%s: injected failure surfaces (%s)", c->name, mfsdp_status_name(s1));
      mfsdp_status s2 = mfsdp_pipeline_unshard(p, ids, 1);
      CHECK(s2 == MFSDP_ERR_INVALID_STATE && strstr(mfsdp_last_error(), "injected"),
            "%s: broken pipeline refuses with the cause: %s", c->name, mfsdp_last_error());
      CHECK(mfsdp_pipeline_broken(p)[0] != '\0', "broken text kept");
    }
    goto done;
  }

  /* gradients: several microbatches, items in reverse order (as autograd delivers them) */
  int final_early = 0; /* the last backward's gradients final before sync_grads (below) */
  void* early = NULL;   /* offloaded: the host's copy of them, taken straight after finish_grads */
  size_t early_bytes = 0;
  for (int mb = 0; mb < c->micro; ++mb) {
    int last = mb == c->micro - 1;
    CHECK_OK(mfsdp_pipeline_begin_backward(p, c->sync_each || last));
    float* grads[N_ITEMS] = {0}; /* alive until packed: the pipeline packs a bucket at once */
    for (int i = L->n_items - 1; i >= 0; --i) {
      float* g = grads[i] = malloc((size_t)L->numels[i] * sizeof *g + 4);
      for (int64_t j = 0; j < L->numels[i]; ++j) g[j] = (float)grad_value(r, mb, bp->params[i], j);
      CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, i, g, MFSDP_F32, L->numels[i], NULL));
      if (i == 0)
        CHECK(mfsdp_pipeline_grad_ready(p, 0, i, g, MFSDP_F32, L->numels[i], NULL) == MFSDP_ERR_INVALID_STATE,
              "a gradient reported twice is refused");
    }
    /* [Note: a bucket's gradients before the sync]: in a syncing backward a complete ZeRO-2/3
     * bucket whose OPT_GRAD is its GRAD_SHARD is final (offloaded: the host's) before end_backward */
    int ready = -1;
    CHECK_OK(mfsdp_pipeline_finish_grads(p, 0, &ready));
    int want = (c->sync_each || last) && c->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE && c->main_dtype == c->grad_dtype;
    CHECK(ready == want, "%s rank %d microbatch %d: finish_grads says %d, not %d", c->name, r, mb, ready, want);
    final_early = ready;
    early_read er = {p, NULL, NULL, 0, MFSDP_OK};
    pthread_t reader;
    int reading = 0;
    if (ready && c->offload) { /* the host's once waited for: a copy then must equal the values after everything */
      er.og = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_OPT_GRAD);
      early_bytes = er.bytes = (size_t)er.og->numel * (size_t)mfsdp_dtype_size(er.og->dtype);
      free(early);
      early = er.copy = malloc(early_bytes);
      reading = pthread_create(&reader, NULL, read_early, &er) == 0;
      CHECK(reading, "%s rank %d: no thread for the early read", c->name, r);
    }
    CHECK_OK(mfsdp_pipeline_end_backward(p));
    if (reading) {
      pthread_join(reader, NULL);
      CHECK(er.st == MFSDP_OK, "%s rank %d: wait_grads failed (%s)", c->name, r, mfsdp_status_name(er.st));
    }
    t->rig->rank_sync(dev); /* packs may still read the gradients */
    for (int i = 0; i < L->n_items; ++i) free(grads[i]);
  }
  if (!(final_early && c->offload)) /* else the host reads what finish_grads made final, with no sync at all */
    CHECK_OK(mfsdp_pipeline_sync_grads(p));
  if (!c->offload) t->rig->rank_sync(dev);
  const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_OPT_GRAD);
  double scale = c->op == MFSDP_REDUCE_AVG ? 1.0 / W : prescale;
  double tol = tolerance(c->comm_dtype) + tolerance(c->grad_dtype);
  wrong = 0;
  for (int i = 0; i < L->n_items; ++i) { /* this rank's rows of each item: its Shard(d) piece, run after run */
    int32_t where;
    int64_t at_off, n;
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_OPT_GRAD, &where, &at_off, &n));
    mfsdp_runs ru;
    mfsdp_piece_runs(L->numels[i], L->pieces[i], mfsdp_layout_outer(L, i), spec.shard_rank, &ru);
    CHECK(n == ru.count * ru.len, "%s rank %d item %d: local piece of %lld elements, runs of %lld", c->name, r, i,
          (long long)n, (long long)(ru.count * ru.len));
    for (int64_t at = 0; at < ru.count * ru.len; ++at) {
      int64_t j = ru.first + (at / (ru.len ? ru.len : 1)) * ru.stride + at % (ru.len ? ru.len : 1); /* in the item */
      double want = 0;
      for (int mb = 0; mb < c->micro; ++mb)
        for (int k = 0; k < W; ++k) want += grad_value(k, mb, bp->params[i], j) * scale;
      double got = load_as_double(og->data, c->main_dtype, at_off + at);
      if (fabs(got - want) > tol * (fabs(want) + 1e-3)) {
        if (wrong < 3) fprintf(stderr, "  %s rank %d item %d elem %lld: got %g want %g\n", c->name, r, i, (long long)j, got, want);
        wrong++;
      }
    }
  }
  CHECK(wrong == 0, "%s rank %d: %d reduced gradients wrong", c->name, r, wrong);
  if (final_early && c->offload)
    CHECK(early && memcmp(early, og->data, early_bytes) == 0,
          "%s rank %d: the host read other gradients after wait_grads than after end_backward", c->name, r);
  free(early);
  if (pipeline_cases_tail >= 3) { /* every rank used and trains every item ([Note: used-flag tail] in reduce.c) */
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, 0, &off, &n, &every));
    CHECK(n == L->n_items, "%s rank %d: the bucket carries its flags (%d)", c->name, r, n);
    const mfsdp_buffer* gs = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_GRAD_SHARD);
    for (int i = 0; i < n; ++i)
      CHECK(load_as_double(gs->data, c->grad_dtype, off + i) > 0 && load_as_double(gs->data, c->grad_dtype, off + n + i) > 0 &&
                load_as_double(gs->data, c->grad_dtype, off + 2 * n + i) == 0,
            "%s rank %d item %d: flags %g %g %g", c->name, r, i, load_as_double(gs->data, c->grad_dtype, off + i),
            load_as_double(gs->data, c->grad_dtype, off + n + i), load_as_double(gs->data, c->grad_dtype, off + 2 * n + i));
    check_read_flags(p, n, c->name, r);
  }

  /* optimizer step: main += 1 on this rank's rows, install, gather: everyone sees +1 */
  for (int i = 0; i < L->n_items; ++i) {
    int32_t where;
    int64_t at_off, n;
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_MAIN_SHARD, &where, &at_off, &n));
    const mfsdp_buffer* main = mfsdp_pipeline_buffer(p, 0, where);
    for (int64_t k = at_off; k < at_off + n; ++k)
      store_from_double(main->data, main->dtype, k, load_as_double(main->data, main->dtype, k) + 1.0);
  }
  CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
  CHECK_OK(mfsdp_pipeline_unshard(p, ids, 1));
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, ids, 1));
  t->rig->rank_sync(dev);
  wrong = 0;
  for (int i = 0; i < L->n_items; ++i)
    for (int64_t j = 0; j < L->numels[i]; ++j) {
      double want = init_value(bp->params[i], j) + 1.0;
      double got = load_as_double(weight->data, pdt, L->param_offsets[i] + j);
      wrong += fabs(got - want) > tolerance(pdt) * 2 * (fabs(want) + 1e-3);
    }
  CHECK(wrong == 0, "%s rank %d: %d weights not updated after install + gather", c->name, r, wrong);
  if (c->keep && spec.weights_sharded) { /* regathered into the same memory; turning keep off releases it */
    CHECK(weight->data == kept, "%s rank %d: the kept weights moved (%p -> %p)", c->name, r, kept, weight->data);
    CHECK_OK(mfsdp_pipeline_reshard(p, ids, 1));
    CHECK(weight->data == kept, "%s rank %d: a second reshard released the kept weights", c->name, r);
    CHECK_OK(mfsdp_pipeline_set_keep_weights(p, ids, 1, 0));
    CHECK(weight->data == NULL && mfsdp_pipeline_weight_state(p, 0) == MFSDP_W_EMPTY,
          "%s rank %d: keep off releases the resharded weights", c->name, r);
  }
  CHECK_OK(mfsdp_pipeline_zero_grads(p));
  if (!c->offload) t->rig->rank_sync(dev);
  const mfsdp_buffer* gs = mfsdp_pipeline_buffer(p, 0, c->offload ? MFSDP_BUF_OPT_GRAD : MFSDP_BUF_GRAD_SHARD);
  double gsum = 0;
  for (int64_t k = 0; k < L->shard_size && k < gs->numel; ++k) gsum += fabs(load_as_double(gs->data, gs->dtype, k));
  CHECK(gsum == 0.0, "%s: zero_grads leaves %g", c->name, gsum);
  mfsdp_comm_stats st;
  mfsdp_pipeline_stats(p, -1, &st);
  if (W == 1 && !t->force_comm)
    CHECK(st.all_gathers + st.reduce_scatters + st.all_reduces == 0, "world 1 never communicates");
  if (W > 1 || t->force_comm)
    CHECK(st.reduce_scatters + st.all_reduces > 0 &&
              (st.all_gathers > 0) == (spec.weights_sharded || (spec.weights_regather && L->world > 1)),
          "%s world %d: collectives went through %s (ag %lld rs %lld ar %lld)", c->name, W, t->rig->name,
          (long long)st.all_gathers, (long long)st.reduce_scatters, (long long)st.all_reduces);
done:
  if (p) t->rig->rank_sync(dev); /* nothing in flight reads what destroy frees */
  mfsdp_pipeline_destroy(p);
  t->rig->rank_teardown(dev);
out:
  mfsdp_plan_free(&plan);
  t->failures = test_failures - before;
  return NULL;
}

static void run_pipe_case(const pipe_case* c, const pipe_rig* rig, int force_comm) {
  if (c->fail_after >= 0 && rig->inject_failure == NULL) return;
  void* world = rig->world_create(c->world);
  pthread_t threads[LOOP_MAX_WORLD];
  pipe_thread args[LOOP_MAX_WORLD];
  for (int r = 0; r < c->world; ++r) {
    args[r] = (pipe_thread){c, rig, world, r, force_comm, 0};
    pthread_create(&threads[r], NULL, pipe_worker, &args[r]);
  }
  for (int r = 0; r < c->world; ++r) pthread_join(threads[r], NULL);
  rig->world_destroy(world);
}

void run_pipeline_cases(const pipe_rig* rig, int max_world, int force_comm) {
  const int F = MFSDP_F32, B = MFSDP_BF16, H = MFSDP_F16;
  const int SUM = MFSDP_REDUCE_SUM, AVG = MFSDP_REDUCE_AVG;
  const int AR = MFSDP_GRAD_ALL_REDUCE, RSI = MFSDP_GRAD_SCATTER_IN_PLACE, RSA = MFSDP_GRAD_SCATTER_ACCUMULATE;
  for (int world = 1; world <= max_world; ++world) {
    pipe_case cases[] = {
        /* name, world, grad_mode, sharded, regather, micro, sync_each, param, main, grad, comm, op, per_token, fail */
        {"zero3", world, RSA, 1, 0, 1, 0, F, F, F, F, SUM, 0, -1},
        {"zero3 x3 microbatches", world, RSA, 1, 0, 3, 0, F, F, F, F, SUM, 0, -1},
        {"zero2 avg", world, RSA, 0, 1, 2, 0, F, F, F, F, AVG, 0, -1},
        {"zero1 once per step", world, RSI, 0, 1, 3, 0, F, F, F, F, SUM, 0, -1},
        {"zero1 sync every microbatch", world, RSI, 0, 1, 3, 1, F, F, F, F, SUM, 0, -1},
        {"zero1 per-token sync every microbatch", world, RSI, 0, 1, 3, 1, F, F, F, F, SUM, 1, -1},
        {"no_shard sync every microbatch", world, AR, 0, 0, 3, 1, F, F, F, F, SUM, 0, -1},
        {"no_shard per-token sync every microbatch", world, AR, 0, 0, 3, 1, F, F, F, F, SUM, 1, -1},
        {"zero3 bf16 compute fp32 main", world, RSA, 1, 0, 2, 0, B, F, F, F, SUM, 0, -1},
        {"zero3 bf16 comm", world, RSA, 1, 0, 2, 0, B, F, F, B, SUM, 0, -1},
        {"zero1 fp16 comm fp32 grads", world, RSI, 0, 1, 2, 1, H, F, F, H, SUM, 0, -1},
        {"no_shard bf16 comm", world, AR, 0, 0, 2, 1, B, F, F, B, SUM, 0, -1},
        {"zero2 bf16 grads fp32 main", world, RSA, 0, 1, 1, 0, B, F, B, B, SUM, 0, -1},
        {"zero3 injected failure", world, RSA, 1, 0, 1, 0, F, F, F, F, SUM, 0, 0},
        {"zero3 direct init", world, RSA, 1, 0, 1, 0, F, F, F, F, SUM, 0, -1, 1},
        {"zero3 direct init bf16 + fp32 main", world, RSA, 1, 0, 1, 0, B, F, F, F, SUM, 0, -1, 1},
        {"zero1 direct init", world, RSI, 0, 1, 1, 0, F, F, F, F, SUM, 0, -1, 1},
        /* items sharded on an inner dim: every copy between the layouts moves one run per block */
        {"zero3 blocked", world, RSA, 1, 0, 2, 0, F, F, F, F, SUM, 0, -1, 0, 1},
        {"zero3 blocked direct init bf16 + fp32 main", world, RSA, 1, 0, 1, 0, B, F, F, F, SUM, 0, -1, 1, 1},
        {"zero2 blocked", world, RSA, 0, 1, 2, 0, F, F, F, F, SUM, 0, -1, 0, 1},
        {"zero1 blocked direct init", world, RSI, 0, 1, 3, 1, F, F, F, F, SUM, 0, -1, 1, 1},
        {"no_shard blocked", world, AR, 0, 0, 2, 1, F, F, F, F, SUM, 0, -1, 0, 1},
        /* the full weights kept across reshards (gathered into the same memory), and a cast on gather */
        {"zero3 keep weights", world, RSA, 1, 0, 2, 0, F, F, F, F, SUM, 0, -1, 0, 0, 1},
        {"zero3 keep weights bf16 + fp32 main blocked", world, RSA, 1, 0, 1, 0, B, F, F, F, SUM, 0, -1, 0, 1, 1},
        /* offloaded: the optimizer's buffers in host memory, read by the host straight after the pipeline returns */
        {"zero3 offload", world, RSA, 1, 0, 2, 0, F, F, F, F, SUM, 0, -1, 0, 0, 0, 1},
        {"zero3 offload bf16 compute, comm", world, RSA, 1, 0, 2, 0, B, F, F, B, SUM, 0, -1, 0, 0, 0, 1},
        {"zero3 offload direct init blocked", world, RSA, 1, 0, 1, 0, B, F, F, F, SUM, 0, -1, 1, 1, 0, 1},
        {"zero2 offload", world, RSA, 0, 1, 2, 0, F, F, F, F, AVG, 0, -1, 0, 0, 0, 1},
        {"zero1 offload", world, RSI, 0, 1, 3, 0, F, F, F, F, SUM, 0, -1, 0, 0, 0, 1},
        {"no_shard offload bf16 comm", world, AR, 0, 0, 2, 1, B, F, F, B, SUM, 0, -1, 0, 0, 0, 1},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; ++k) run_pipe_case(&cases[k], rig, force_comm);
  }
}


/* ---- quantized communication ([Note: quantized communication] in csrc/comm/wire.c) ----
 * Every value is checked exactly against a reference built from the CPU kernels: the gathered
 * weights are dequantize(quantize(every rank's shard)), and a reduced gradient is the sum, in
 * rank order, of dequantize(quantize(every rank's pre-scaled piece)), added in the main gradient
 * dtype. The reference sees every rank's values because they are functions of the rank. On the
 * emulated device the CUDA kernels must give the same bits (they are bit-identical to the CPU
 * ones) through the native transport. */

typedef struct quant_case {
  const char* name;
  int world, grad_mode, weights_sharded, regather, micro;
  int param_dtype, main_dtype, grad_dtype;
  int wmode, gmode; /* mfsdp_quant_mode, or -1: plain */
  int64_t block;
  int op;
  int direct_init;
  int blocked; /* BLOCKED's items: sharded on an inner dim */
} quant_case;

typedef struct quant_thread {
  const quant_case* c;
  const pipe_rig* rig;
  void* world;
  int rank, force_comm;
} quant_thread;

/* A value of `dtype` (exactly what a store into it keeps) as a double. */
static double rounded(int dtype, double v) {
  unsigned char tmp[8];
  store_from_double(tmp, dtype, 0, v);
  return load_as_double(tmp, dtype, 0);
}

/* This rank's main weight of item i element j after init (and `steps` updates of +1): the
 * float32 value, through the compute dtype unless set directly (init_end derives the main
 * weights from the full compute weights). */
static double q_main_value(const quant_case* c, int item, int64_t j, int steps) {
  double v = (float)init_value(item, j);
  if (!c->direct_init) v = rounded(c->param_dtype, v);
  v = rounded(c->main_dtype, v);
  for (int s = 0; s < steps; ++s) v = rounded(c->main_dtype, v + 1.0);
  return v;
}

/* The expected full compute weights (parameter-major, param dtype) of a gather: every holder's
 * shard in the main dtype (the gather's source), quantized and dequantized when `quantized`. */
static void q_expected_weights(const quant_case* c, const mfsdp_bucket_plan* bp, int quantized, int steps,
                               void* out) {
  const mfsdp_bucket_layout* L = &bp->layout;
  int64_t S = L->shard_size, esz = mfsdp_dtype_size(c->main_dtype), psz = mfsdp_dtype_size(c->param_dtype);
  char* shard = calloc((size_t)S, (size_t)esz);
  char* deq = calloc((size_t)S, (size_t)psz);
  int64_t wire_bytes = quantized ? mfsdp_quant_wire_bytes(c->wmode, S, c->block) : 0;
  uint8_t* wire = malloc((size_t)(wire_bytes + 16));
  for (int32_t r = 0; r < L->world; ++r) {
    memset(shard, 0, (size_t)(S * esz));
    for (int i = 0; i < L->n_items; ++i) {
      mfsdp_runs ru;
      int64_t n = piece_runs(L, i, r, &ru);
      for (int64_t k = 0; k < n; ++k)
        store_from_double(shard, c->main_dtype, L->shard_offsets[i] + k,
                          q_main_value(c, bp->params[i], piece_elem(&ru, k), steps));
    }
    if (quantized) {
      CHECK_OK(mfsdp_cpu_quantize(wire, c->wmode, c->block, shard, c->main_dtype, S, 1));
      CHECK_OK(mfsdp_cpu_dequantize(deq, c->param_dtype, wire, c->wmode, c->block, S, 1.0, 0));
    } else {
      CHECK_OK(mfsdp_cpu_copy(deq, c->param_dtype, shard, c->main_dtype, S, 1.0));
    }
    for (int i = 0; i < L->n_items; ++i) {
      mfsdp_runs ru;
      piece_runs(L, i, r, &ru);
      for (int64_t j = 0; j < ru.count; ++j)
        memcpy((char*)out + (L->param_offsets[i] + ru.first + j * ru.stride) * psz,
               deq + (L->shard_offsets[i] + j * ru.len) * psz, (size_t)(ru.len * psz));
    }
  }
  free(shard);
  free(deq);
  free(wire);
}

/* Rank r's gradients of every item in microbatch mb, into the rank-major piece `slice` of the
 * staging buffer (n_elems elements of grad dtype starting at rank-major element `from`), the way
 * the pipeline stages them: ZeRO-2/3 copy each microbatch pre-scaled; no_shard/ZeRO-1 add the
 * microbatches unscaled, then scale the local sum once (copy with alpha for no_shard). */
static void q_stage(const quant_case* c, const mfsdp_bucket_plan* bp, int r, double prescale, int mb_only,
                    int64_t from, int64_t n_elems, void* out) {
  const mfsdp_bucket_layout* L = &bp->layout;
  int gdt = c->grad_dtype;
  int64_t full = (int64_t)L->world * L->shard_size;
  void* local = calloc((size_t)full, (size_t)mfsdp_dtype_size(gdt));
  for (int mb = 0; mb < c->micro; ++mb) {
    if (mb_only >= 0 && mb != mb_only) continue;
    for (int i = 0; i < L->n_items; ++i)
      for (int32_t o = 0; o < L->world; ++o) {
        mfsdp_runs ru;
        int64_t n = piece_runs(L, i, o, &ru);
        float* g = malloc((size_t)(n + 1) * sizeof *g);
        for (int64_t k = 0; k < n; ++k) g[k] = (float)grad_value(r, mb, bp->params[i], piece_elem(&ru, k));
        void* dst = (char*)local + ((int64_t)o * L->shard_size + L->shard_offsets[i]) * mfsdp_dtype_size(gdt);
        if (c->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE)
          CHECK_OK(mfsdp_cpu_copy(dst, gdt, g, MFSDP_F32, n, prescale));
        else
          CHECK_OK(mfsdp_cpu_accumulate(dst, gdt, g, MFSDP_F32, n, 1.0));
        free(g);
      }
  }
  if (c->grad_mode == MFSDP_GRAD_SCATTER_IN_PLACE) CHECK_OK(mfsdp_cpu_scale(local, gdt, full, prescale));
  if (c->grad_mode == MFSDP_GRAD_ALL_REDUCE) CHECK_OK(mfsdp_cpu_copy(local, gdt, local, gdt, full, prescale));
  memset(out, 0, (size_t)(n_elems * mfsdp_dtype_size(gdt))); /* padding past the buffer (the exchange block) */
  int64_t avail = full - from < n_elems ? full - from : n_elems;
  if (avail > 0)
    memcpy(out, (char*)local + from * mfsdp_dtype_size(gdt), (size_t)(avail * mfsdp_dtype_size(gdt)));
  free(local);
}

/* dst (grad dtype, elements [0, n) of a piece of piece_n) += sum over ranks, in rank order, of
 * dequantize(quantize(that rank's staged piece)) * alpha: the reduction's reference. */
static void q_reduce_piece(const quant_case* c, const mfsdp_bucket_plan* bp, double prescale, int mb_only,
                           int64_t from, int64_t piece_n, int64_t n, double alpha, void* dst) {
  int gdt = c->grad_dtype;
  void* staged = calloc((size_t)piece_n + 1, (size_t)mfsdp_dtype_size(gdt));
  int64_t bytes = mfsdp_quant_wire_bytes(c->gmode, piece_n, c->block);
  uint8_t* wire = malloc((size_t)(bytes + 16));
  for (int r = 0; r < c->world; ++r) {
    q_stage(c, bp, r, prescale, mb_only, from, piece_n, staged);
    CHECK_OK(mfsdp_cpu_quantize(wire, c->gmode, c->block, staged, gdt, piece_n, 1));
    mfsdp_quant_item item = {wire, 0, 0, n};
    CHECK_OK(mfsdp_cpu_dequantize_pack(dst, gdt, &item, 1, c->gmode, c->block, piece_n, alpha, 1));
  }
  free(staged);
  free(wire);
}

static void* quant_worker(void* arg) {
  quant_thread* t = arg;
  const quant_case* c = t->c;
  int W = c->world, r = t->rank;
  mfsdp_param_info infos[N_ITEMS];
  for (int i = 0; i < N_ITEMS; ++i)
    infos[i] = c->blocked ? (mfsdp_param_info){BLOCKED[i][0], BLOCKED[i][1], c->param_dtype, 0, 1, 0, BLOCKED[i][2]}
                          : (mfsdp_param_info){SHAPES[i][0], SHAPES[i][1], c->param_dtype, 0, 1, 0, 1};
  int shard_world = c->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 1 : W;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build_tailed(infos, N_ITEMS, shard_world, 0, 16, pipeline_cases_tail, c->block, &plan));
  mfsdp_bucket_plan* bp = &plan.buckets[0];
  const mfsdp_bucket_layout* L = &bp->layout;
  int comm = W > 1 || t->force_comm;
  mfsdp_bucket_spec spec = {*L, L->world > 1 ? r : 0, c->param_dtype, c->main_dtype, c->grad_dtype, c->grad_dtype,
                            c->weights_sharded && comm, c->regather && comm, c->grad_mode,
                            {c->wmode >= 0 ? MFSDP_WIRE_QUANT(c->wmode) : MFSDP_WIRE_PLAIN,
                             c->gmode >= 0 ? MFSDP_WIRE_QUANT(c->gmode) : MFSDP_WIRE_PLAIN, MFSDP_WIRE_PLAIN,
                             c->block}};
  int gathered = spec.weights_sharded || (spec.weights_regather && L->world > 1);
  int qw = c->wmode >= 0 && gathered, qg = c->gmode >= 0 && W > 1;
  mfsdp_backend be;
  void* dev = NULL;
  mfsdp_pipeline* p = NULL;
  if (t->rig->rank_setup(t->world, r, &be, &dev) != 0) {
    CHECK(0, "%s rank %d: rig %s setup failed: %s", c->name, r, t->rig->name, mfsdp_last_error());
    goto out;
  }
  double prescale = c->op == MFSDP_REDUCE_AVG ? 1.0 : 1.0 / W;
  mfsdp_pipeline_config cfg = {W, r, prescale, c->op, 1 << 20, t->force_comm};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto done;
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, c->direct_init));
  for (int i = 0; i < L->n_items; ++i) {
    float* v = malloc((size_t)L->numels[i] * sizeof *v + 4);
    for (int64_t j = 0; j < L->numels[i]; ++j) v[j] = (float)init_value(bp->params[i], j);
    CHECK_OK(mfsdp_pipeline_set_item(p, 0, i, v, MFSDP_F32, L->numels[i]));
    t->rig->rank_sync(dev);
    free(v);
  }
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  int32_t ids[1] = {0};
  const mfsdp_buffer* weight = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT);
  size_t psz = (size_t)mfsdp_dtype_size(c->param_dtype);
  void* want = calloc((size_t)L->weight_size + 1, psz);
  /* two gathers: of the loaded weights (ZeRO-3; ZeRO-1/2 hold them already), and after an update */
  for (int steps = 0; steps < 2; ++steps) {
    if (steps == 1) { /* the optimizer: main += 1 on this rank's rows; install; gather */
      t->rig->rank_sync(dev); /* the host writes what init_end's kernels wrote */
      for (int i = 0; i < L->n_items; ++i) {
        int32_t where;
        int64_t off, n;
        CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_MAIN_SHARD, &where, &off, &n));
        const mfsdp_buffer* main = mfsdp_pipeline_buffer(p, 0, where);
        for (int64_t k = off; k < off + n; ++k)
          store_from_double(main->data, main->dtype, k, load_as_double(main->data, main->dtype, k) + 1.0);
      }
      CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
    } else if (!spec.weights_sharded) {
      continue;
    }
    CHECK_OK(mfsdp_pipeline_unshard(p, ids, 1));
    CHECK_OK(mfsdp_pipeline_wait_unshard(p, ids, 1));
    t->rig->rank_sync(dev);
    q_expected_weights(c, bp, qw, steps, want);
    int64_t wrong = 0;
    for (int i = 0; i < L->n_items; ++i)
      wrong += count_differences((char*)weight->data + L->param_offsets[i] * psz,
                                 (char*)want + L->param_offsets[i] * psz, c->param_dtype, L->numels[i]);
    CHECK(wrong == 0, "%s world %d rank %d (%s): %lld gathered weights differ from dequantize(quantize(shard)) after "
          "%d updates", c->name, W, r, t->rig->name, (long long)wrong, steps);
    if (spec.weights_sharded) CHECK_OK(mfsdp_pipeline_reshard(p, ids, 1));
  }
  free(want);

  /* gradients of several microbatches, one syncing backward at the end */
  for (int mb = 0; mb < c->micro; ++mb) {
    CHECK_OK(mfsdp_pipeline_begin_backward(p, mb == c->micro - 1));
    float* grads[N_ITEMS] = {0};
    for (int i = L->n_items - 1; i >= 0; --i) {
      float* g = grads[i] = malloc((size_t)L->numels[i] * sizeof *g + 4);
      for (int64_t j = 0; j < L->numels[i]; ++j) g[j] = (float)grad_value(r, mb, bp->params[i], j);
      CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, i, g, MFSDP_F32, L->numels[i], NULL));
    }
    CHECK_OK(mfsdp_pipeline_end_backward(p));
    t->rig->rank_sync(dev);
    for (int i = 0; i < L->n_items; ++i) free(grads[i]);
  }
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  t->rig->rank_sync(dev);
  if (pipeline_cases_tail >= 3) { /* [Note: used-flag tail] in reduce.c: quantized ZeRO-2/3 gradients carry flags */
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, 0, &off, &n, &every));
    int carries = !qg || c->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE;
    CHECK(n == (carries ? L->n_items : 0), "%s world %d rank %d: %d items' flags", c->name, W, r, n);
    const mfsdp_buffer* gs = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_GRAD_SHARD);
    for (int i = 0; i < n; ++i)
      CHECK(load_as_double(gs->data, c->grad_dtype, off + i) > 0 && load_as_double(gs->data, c->grad_dtype, off + n + i) > 0 &&
                load_as_double(gs->data, c->grad_dtype, off + 2 * n + i) == 0,
            "%s world %d rank %d item %d: flags %g %g %g", c->name, W, r, i, load_as_double(gs->data, c->grad_dtype, off + i),
            load_as_double(gs->data, c->grad_dtype, off + n + i), load_as_double(gs->data, c->grad_dtype, off + 2 * n + i));
    check_read_flags(p, n, c->name, r);
  }
  /* the reference of this rank's reduced slice (grad dtype), then as the optimizer sees it */
  int gdt = c->grad_dtype;
  double alpha = c->op == MFSDP_REDUCE_AVG ? 1.0 / W : 1.0;
  int64_t S = L->shard_size, full = (int64_t)L->world * S;
  int64_t block = (full + W - 1) / W; /* no_shard: the exchange's block per rank */
  void* ref = calloc((size_t)full + 1, (size_t)mfsdp_dtype_size(gdt));
  if (!qg) { /* plain gradients: checked against the exact sum below */
  } else if (c->grad_mode == MFSDP_GRAD_ALL_REDUCE) {
    for (int q = 0; q < W; ++q) { /* every rank's block, gathered */
      int64_t valid = full - q * block < block ? full - q * block : block;
      if (valid > 0)
        q_reduce_piece(c, bp, prescale, -1, q * block, block, valid, alpha,
                       (char*)ref + q * block * mfsdp_dtype_size(gdt));
    }
  } else if (c->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE) {
    for (int mb = 0; mb < c->micro; ++mb) /* each backward's reduction added to the main gradient */
      q_reduce_piece(c, bp, prescale, mb, (int64_t)r * S, S, S, alpha, (char*)ref + (int64_t)r * S * mfsdp_dtype_size(gdt));
  } else {
    q_reduce_piece(c, bp, prescale, -1, (int64_t)r * S, S, S, alpha, (char*)ref + (int64_t)r * S * mfsdp_dtype_size(gdt));
  }
  const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_OPT_GRAD);
  int64_t wrong = 0, checked = 0;
  for (int i = 0; i < L->n_items; ++i) {
    int32_t where;
    int64_t off, n;
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_OPT_GRAD, &where, &off, &n));
    mfsdp_runs ru;
    n = piece_runs(L, i, spec.shard_rank, &ru);
    int64_t at = (c->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 0 : (int64_t)r * S) + L->shard_offsets[i];
    for (int64_t k = 0; k < n; ++k) {
      double g = load_as_double(ref, gdt, at + k), got = load_as_double(og->data, c->main_dtype, off + k);
      double expect = rounded(c->main_dtype, g);
      if (!qg) { /* plain gradients: the exact sum, to the collectives' rounding */
        double exact = 0;
        for (int mb = 0; mb < c->micro; ++mb)
          for (int q = 0; q < W; ++q) exact += grad_value(q, mb, bp->params[i], piece_elem(&ru, k)) * prescale * alpha;
        expect = fabs(got - exact) <= 1e-5 * (fabs(exact) + 1e-3) ? got : exact;
      }
      checked++;
      if (got != expect && wrong++ < 3)
        fprintf(stderr, "  %s world %d rank %d item %d elem %lld: got %.9g want %.9g\n", c->name, W, r, i,
                (long long)piece_elem(&ru, k), got, expect);
    }
  }
  free(ref);
  CHECK(wrong == 0, "%s world %d rank %d (%s): %lld of %lld reduced gradients differ from the sum of "
        "dequantize(quantize(piece)) in rank order", c->name, W, r, t->rig->name, (long long)wrong, (long long)checked);
  mfsdp_comm_stats st;
  mfsdp_pipeline_stats(p, -1, &st);
  int64_t gpiece = qw ? mfsdp_quant_wire_bytes(c->wmode, S, c->block) : 0;
  CHECK(!qw || (st.all_gathers == 0 && st.quantized_all_gathers > 0 &&
                st.quantized_all_gather_bytes == st.quantized_all_gathers * W * gpiece),
        "%s world %d: %lld plain and %lld quantized gathers of %lld bytes (%lld bytes a piece)", c->name, W,
        (long long)st.all_gathers, (long long)st.quantized_all_gathers, (long long)st.quantized_all_gather_bytes,
        (long long)gpiece);
  int64_t reductions = st.quantized_reduce_scatters + st.quantized_all_reduces;
  CHECK(!qg || (st.reduce_scatters + st.all_reduces == 0 &&
                reductions == (c->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE ? c->micro : 1)),
        "%s world %d: %lld plain and %lld quantized reductions", c->name, W, (long long)(st.reduce_scatters + st.all_reduces),
        (long long)reductions);
  CHECK(qw || qg || st.quantized_all_gathers + reductions == 0, "%s world %d: nothing to quantize, yet quantized",
        c->name, W);
done:
  if (p) t->rig->rank_sync(dev);
  mfsdp_pipeline_destroy(p);
  t->rig->rank_teardown(dev);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

void run_quantized_cases(const pipe_rig* rig, int max_world, int force_comm) {
  const int F = MFSDP_F32, B = MFSDP_BF16, D = MFSDP_F64;
  const int I8 = MFSDP_QUANT_INT8, E4 = MFSDP_QUANT_FP8_E4M3, I4 = MFSDP_QUANT_INT4;
  const int SUM = MFSDP_REDUCE_SUM, AVG = MFSDP_REDUCE_AVG;
  const int AR = MFSDP_GRAD_ALL_REDUCE, RSI = MFSDP_GRAD_SCATTER_IN_PLACE, RSA = MFSDP_GRAD_SCATTER_ACCUMULATE;
  int cases = 0;
  for (int world = 1; world <= max_world; ++world) {
    quant_case list[] = {
        /* name, world, grad_mode, sharded, regather, micro, param, main, grad, wmode, gmode, block, op, direct */
        {"zero3 int8 weights int8 grads", world, RSA, 1, 0, 2, F, F, F, I8, I8, 6, SUM, 0},
        {"zero3 bf16 fp8 weights int4 grads x3", world, RSA, 1, 0, 3, B, F, F, E4, I4, 8, SUM, 0},
        {"zero3 int4 weights, block 128, direct init", world, RSA, 1, 0, 1, F, F, F, I4, -1, 128, SUM, 1},
        {"zero3 bf16 int8 grads only, avg", world, RSA, 1, 0, 2, B, F, F, -1, I8, 5, AVG, 0},
        {"zero2 int8 weights fp8 grads", world, RSA, 0, 1, 2, F, F, F, I8, E4, 7, SUM, 0},
        {"zero1 int8 weights int4 grads x3", world, RSI, 0, 1, 3, F, F, F, I8, I4, 4, SUM, 0},
        {"zero1 bf16 int4 weights float64 grads", world, RSI, 0, 1, 2, B, F, D, I4, I8, 2, SUM, 0},
        {"no_shard int8 grads x2", world, AR, 0, 0, 2, F, F, F, -1, I8, 3, SUM, 0},
        {"no_shard int4 grads avg", world, AR, 0, 0, 1, B, F, F, I8, I4, 64, AVG, 0},
        /* items sharded on an inner dim: the fused dequantizing copy-out moves one run per block */
        {"zero3 blocked int8 weights int8 grads", world, RSA, 1, 0, 2, F, F, F, I8, I8, 6, SUM, 0, 1},
        {"zero3 blocked bf16 int4 weights, direct init", world, RSA, 1, 0, 1, B, F, F, I4, -1, 4, SUM, 1, 1},
        {"zero1 blocked int8 weights fp8 grads", world, RSI, 0, 1, 2, F, F, F, I8, E4, 5, SUM, 0, 1},
    };
    for (size_t k = 0; k < sizeof list / sizeof list[0]; ++k) {
      const quant_case* c = &list[k];
      void* w = rig->world_create(world);
      pthread_t threads[LOOP_MAX_WORLD];
      quant_thread args[LOOP_MAX_WORLD];
      for (int r = 0; r < world; ++r) {
        args[r] = (quant_thread){c, rig, w, r, force_comm};
        pthread_create(&threads[r], NULL, quant_worker, &args[r]);
      }
      for (int r = 0; r < world; ++r) pthread_join(threads[r], NULL);
      rig->world_destroy(w);
      cases++;
    }
  }
  printf("%s: %d quantized pipeline cases at worlds 1-%d (%s)\n", rig->name, cases, max_world, rig->name);
}
