/* test_replicas.c (a part of test_core, whose runner is csrc/tests/test_core.c): hybrid sharding
 * across replicas (HSDP, HFSDP), plain and quantized. */
#include <math.h>

#include "../../core/mfsdp_kernels.h"
#include "../harness.h"
#include "core_tests.h"

/* hybrid sharding (see [Note: hybrid sharding] in replicas.c): 2 replicas x 2 shards; HFSDP
 * ([Note: optimizer sharded across replicas]): the same, main weights and gradients in 4 pieces */

#define HY_INNER 2
#define HY_OUTER 2

typedef struct hybrid_thread {
  loop_world* inner;  /* this rank's replica */
  loop_world* outer;  /* the ranks holding the same shard in every replica */
  int inner_rank, outer_rank, grad_mode, backwards, sync_each;
  int outer_hold; /* sync each backward inside the replica, across replicas on the last one only */
  int hfsdp;      /* ZeRO-3 buckets whose main weights and gradients are sharded across replicas too */
} hybrid_thread;

/* Parameter 1 is used by the last rank of the last replica in the first backward only: its used
 * flag must cross the replicas ([Note: used-flag tail] in csrc/comm/reduce.c). */
static int hy_used(int rank, int mb, int item) { return item == 0 || (rank == HY_INNER * HY_OUTER - 1 && mb == 0); }
static double hy_grad(int rank, int mb, int item, int64_t j) {
  return hy_used(rank, mb, item) ? 0.25 * (rank + 1) + 0.5 * mb - 0.1 * item + 1e-3 * j : 0;
}
static double hy_weight(int item, int64_t j) { return item - 0.01 * j; }

static void* hybrid_worker(void* arg) {
  hybrid_thread* t = arg;
  int rank = t->outer_rank * HY_INNER + t->inner_rank, W = HY_INNER * HY_OUTER;
  mfsdp_param_info infos[2] = {{6 * 4, 4, MFSDP_F32, 0, 1, 0}, {5, 1, MFSDP_F32, 0, 1, 0}};
  int shard_world = t->hfsdp ? W : t->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 1 : HY_INNER;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build_tailed(infos, 2, shard_world, 0, 16, 3, 0, &plan)); /* [Note: flag tail] */
  const mfsdp_bucket_layout* L = &plan.buckets[0].layout;
  mfsdp_bucket_spec spec = {*L, t->hfsdp ? rank : shard_world > 1 ? t->inner_rank : 0, MFSDP_F32, MFSDP_F32, MFSDP_F32,
                            MFSDP_F32, t->hfsdp, shard_world > 1 && !t->hfsdp, t->grad_mode};
  loop_rank in = {t->inner, t->inner_rank}, out = {t->outer, t->outer_rank};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &in, &mfsdp_cpu_kernels, NULL,
                      &loop_transport_ops, &out};
  mfsdp_pipeline_config cfg = {HY_INNER, t->inner_rank, 1.0 / W, MFSDP_REDUCE_SUM, 1 << 20, 0, HY_OUTER, t->hfsdp};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto out;
  if (t->hfsdp) { /* known weights, so that the optimizer's update can be checked after the replicas' gather */
    CHECK_OK(mfsdp_pipeline_init_begin(p, 0, 0));
    for (int i = 0; i < L->n_items; ++i) {
      float* w = malloc((size_t)L->numels[i] * sizeof *w);
      for (int64_t j = 0; j < L->numels[i]; ++j) w[j] = (float)hy_weight(plan.buckets[0].params[i], j);
      CHECK_OK(mfsdp_pipeline_set_item(p, 0, i, w, MFSDP_F32, L->numels[i]));
      free(w);
    }
    CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  }
  int all_items[2] = {0, 1}, bucket0 = 0;
  /* two steps (the second after zeroing every item, as set_to_none does) of several backwards:
   * the first ones without sync (unless sync_each), or without the outer reduction (outer_hold) */
  for (int step = 0; step < 2; ++step) {
  if (step > 0) CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 0, all_items, L->n_items));
  for (int mb = 0; mb < t->backwards; ++mb) {
    int last = mb == t->backwards - 1, sync = t->sync_each || t->outer_hold || last;
    if (t->outer_hold) CHECK_OK(mfsdp_pipeline_set_outer_hold(p, &bucket0, 1, !last));
    CHECK_OK(mfsdp_pipeline_begin_backward(p, sync));
    float* g[2] = {NULL, NULL};
    for (int i = 1; i >= 0; --i) {
      if (!hy_used(rank, mb, plan.buckets[0].params[i])) continue;
      g[i] = malloc((size_t)L->numels[i] * sizeof *g[i]);
      for (int64_t j = 0; j < L->numels[i]; ++j) g[i][j] = (float)hy_grad(rank, mb, plan.buckets[0].params[i], j);
      CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, i, g[i], MFSDP_F32, L->numels[i], NULL));
    }
    CHECK_OK(mfsdp_pipeline_end_backward(p));
    free(g[0]);
    free(g[1]);
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, 0, &off, &n, &every)); /* every rank's once across the replicas */
    int crossed = sync && !t->outer_hold ? 1 : last;
    if (t->grad_mode == MFSDP_GRAD_SCATTER_ACCUMULATE || sync)
      CHECK(n == 2 && every == crossed, "hybrid mode %d (HFSDP %d) rank %d backward %d: %d flags, every rank's %d",
            t->grad_mode, t->hfsdp, rank, mb, n, every);
  }
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  int wrong = 0;
  for (int i = 0; i < L->n_items; ++i) {
    int32_t where;
    int64_t off, first, n;
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_OPT_GRAD, &where, &off, &n));
    mfsdp_piece_of(L->numels[i], L->pieces[i], spec.shard_rank, &first, &n);
    const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, 0, where);
    for (int64_t j = first; j < first + n; ++j) {
      double want = 0;
      for (int mb = 0; mb < t->backwards; ++mb)
        for (int r = 0; r < W; ++r) want += hy_grad(r, mb, plan.buckets[0].params[i], j) / W;
      double got = load_as_double(og->data, MFSDP_F32, off + j - first);
      if (fabs(got - want) > 1e-5 * (fabs(want) + 1) && wrong++ < 2)
        fprintf(stderr, "  hybrid mode %d rank %d item %d elem %lld: got %g want %g\n", t->grad_mode, rank, i,
                (long long)j, got, want);
    }
  }
  { /* every rank: both parameters used somewhere in this step, and trained everywhere */
    int64_t off;
    int32_t n, every;
    CHECK_OK(mfsdp_pipeline_flag_tail(p, 0, &off, &n, &every));
    const float* gs = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_GRAD_SHARD)->data;
    CHECK(n == 2 && every && gs[off] > 0 && gs[off + 1] > 0 && gs[off + 2] > 0 && gs[off + 3] > 0 && gs[off + 4] == 0 &&
              gs[off + 5] == 0,
          "hybrid mode %d (HFSDP %d) rank %d step %d: flags %g %g / %g %g / %g %g", t->grad_mode, t->hfsdp, rank, step,
          n ? gs[off] : -1, n ? gs[off + 1] : -1, n ? gs[off + 2] : -1, n ? gs[off + 3] : -1, n ? gs[off + 4] : -1,
          n ? gs[off + 5] : -1);
  }
  mfsdp_comm_stats st;
  mfsdp_pipeline_stats(p, -1, &st);
  int syncs = (step + 1) * (t->sync_each ? t->backwards : 1);
  CHECK(wrong == 0, "hybrid grad mode %d, %d backwards (sync each %d, outer hold %d), step %d, rank %d: %d gradients "
        "wrong", t->grad_mode, t->backwards, t->sync_each, t->outer_hold, step, rank, wrong);
  int64_t outer_reductions = t->hfsdp ? st.outer_reduce_scatters : st.outer_all_reduces;
  CHECK(outer_reductions == syncs && (t->hfsdp ? st.outer_all_reduces : st.outer_reduce_scatters) == 0,
        "hybrid grad mode %d (HFSDP %d): %lld reductions across replicas, expected %d (one per syncing backward)",
        t->grad_mode, t->hfsdp, (long long)outer_reductions, syncs);
  if (t->hfsdp) { /* an SGD step on this rank's piece, then every rank's full weights must carry every update */
    for (int i = 0; i < L->n_items; ++i) {
      int32_t where, gwhere;
      int64_t off, goff, first, n;
      CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_MAIN_SHARD, &where, &off, &n));
      CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_OPT_GRAD, &gwhere, &goff, &n));
      float* w = mfsdp_pipeline_buffer(p, 0, where)->data;
      const float* g = mfsdp_pipeline_buffer(p, 0, gwhere)->data;
      for (int64_t j = 0; j < n; ++j) w[off + j] -= 0.5f * g[goff + j];
      (void)first;
    }
    CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
    /* the first step's gather across replicas is left in flight: zeroing does not wait for it,
     * the next backward's reduction across replicas does (same communicator, one at a time) */
    CHECK_OK(mfsdp_pipeline_zero_item_grads(p, 0, all_items, L->n_items));
    if (step == 0) continue;
    CHECK_OK(mfsdp_pipeline_unshard(p, &bucket0, 1));
    CHECK_OK(mfsdp_pipeline_wait_unshard(p, &bucket0, 1));
    const mfsdp_buffer* full = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT);
    int bad = 0;
    for (int i = 0; i < L->n_items; ++i)
      for (int64_t j = 0; j < L->numels[i]; ++j) {
        double want = 0;
        for (int mb = 0; mb < t->backwards; ++mb)
          for (int r = 0; r < W; ++r) want += hy_grad(r, mb, plan.buckets[0].params[i], j) / W;
        want = hy_weight(plan.buckets[0].params[i], j) - 0.5 * (step + 1) * want;
        double got = load_as_double(full->data, MFSDP_F32, L->param_offsets[i] + j);
        if (fabs(got - want) > 1e-5 * (fabs(want) + 1) && bad++ < 2)
          fprintf(stderr, "  HFSDP rank %d step %d item %d elem %lld: weight %g want %g\n", rank, step, i, (long long)j,
                  got, want);
      }
    CHECK(bad == 0, "HFSDP rank %d step %d: %d weights wrong after the replicas' gather", rank, step, bad);
    mfsdp_pipeline_stats(p, -1, &st);
    CHECK(st.outer_all_gathers == step + 1, "HFSDP: %lld gathers across replicas after %d steps",
          (long long)st.outer_all_gathers, step + 1);
    CHECK_OK(mfsdp_pipeline_reshard(p, &bucket0, 1));
  }
  }
  mfsdp_pipeline_destroy(p);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

void test_hybrid_sharding(void) {
  const int modes[4] = {MFSDP_GRAD_SCATTER_ACCUMULATE, MFSDP_GRAD_SCATTER_IN_PLACE, MFSDP_GRAD_ALL_REDUCE,
                        MFSDP_GRAD_SCATTER_ACCUMULATE};
  for (int m = 0; m < 4; ++m) /* the last: HFSDP */
    for (int backwards = 1; backwards <= 3; backwards += 2)
      for (int sync_each = 0; sync_each <= 2; ++sync_each) { /* 2: outer hold */
        loop_world inner[HY_OUTER], outer[HY_INNER];
        for (int o = 0; o < HY_OUTER; ++o) loop_world_init(&inner[o], HY_INNER);
        for (int i = 0; i < HY_INNER; ++i) loop_world_init(&outer[i], HY_OUTER);
        pthread_t threads[HY_INNER * HY_OUTER];
        hybrid_thread args[HY_INNER * HY_OUTER];
        for (int o = 0; o < HY_OUTER; ++o)
          for (int i = 0; i < HY_INNER; ++i) {
            args[o * HY_INNER + i] = (hybrid_thread){&inner[o], &outer[i], i, o, modes[m], backwards, sync_each == 1,
                                                     sync_each == 2, m == 3};
            pthread_create(&threads[o * HY_INNER + i], NULL, hybrid_worker, &args[o * HY_INNER + i]);
          }
        for (int r = 0; r < HY_INNER * HY_OUTER; ++r) pthread_join(threads[r], NULL);
        for (int o = 0; o < HY_OUTER; ++o) loop_world_destroy(&inner[o]);
        for (int i = 0; i < HY_INNER; ++i) loop_world_destroy(&outer[i]);
      }
}

/* HFSDP with the weights' gather across replicas quantized (and the gather inside the replica
 * plain or quantized too): after an update, every rank's full weights must be exactly the
 * dequantized sub-shards of the replicas' gather, spread by the inner gather (quantized again
 * when it is). See [Note: quantized communication] in csrc/comm/wire.c. */
typedef struct hq_thread {
  loop_world *inner, *outer;
  int inner_rank, outer_rank, param_dtype, outer_mode, inner_mode;
} hq_thread;

static double hq_main(int param_dtype, int item, int64_t j) { /* main weight after init and +1 */
  unsigned char t[8];
  store_from_double(t, param_dtype, 0, (float)hy_weight(item, j));
  return (float)(load_as_double(t, param_dtype, 0) + 1.0);
}

static void* hfsdp_quant_worker(void* arg) {
  hq_thread* t = arg;
  int rank = t->outer_rank * HY_INNER + t->inner_rank, W = HY_INNER * HY_OUTER, pdt = t->param_dtype;
  const int64_t block = 6;
  mfsdp_param_info infos[3] = {{6 * 4, 4, pdt, 0, 1, 0}, {5, 1, pdt, 0, 1, 0}, {9 * 3, 3, pdt, 0, 1, 0}};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(infos, 3, W, 0, 16, &plan));
  const mfsdp_bucket_plan* bp = &plan.buckets[0];
  const mfsdp_bucket_layout* L = &bp->layout;
  mfsdp_bucket_spec spec = {*L, rank, pdt, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0, MFSDP_GRAD_SCATTER_ACCUMULATE,
                            {t->inner_mode >= 0 ? MFSDP_WIRE_QUANT(t->inner_mode) : MFSDP_WIRE_PLAIN, MFSDP_WIRE_PLAIN,
                             MFSDP_WIRE_QUANT(t->outer_mode), block}};
  loop_rank in = {t->inner, t->inner_rank}, out = {t->outer, t->outer_rank};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &in, &mfsdp_cpu_kernels, NULL,
                      &loop_transport_ops, &out};
  mfsdp_pipeline_config cfg = {HY_INNER, t->inner_rank, 1.0 / W, MFSDP_REDUCE_SUM, 1 << 20, 0, HY_OUTER, 1};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto out;
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, 0));
  for (int i = 0; i < L->n_items; ++i) {
    float* w = malloc((size_t)L->numels[i] * sizeof *w);
    for (int64_t j = 0; j < L->numels[i]; ++j) w[j] = (float)hy_weight(bp->params[i], j);
    CHECK_OK(mfsdp_pipeline_set_item(p, 0, i, w, MFSDP_F32, L->numels[i]));
    free(w);
  }
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  for (int i = 0; i < L->n_items; ++i) { /* the optimizer: +1 on this rank's sub-shard */
    int32_t where;
    int64_t off, n;
    CHECK_OK(mfsdp_pipeline_local_piece(p, 0, i, MFSDP_BUF_MAIN_SHARD, &where, &off, &n));
    CHECK(where == MFSDP_BUF_MAIN_SHARD, "quantized gathers across replicas keep main weights of their own");
    float* m = mfsdp_pipeline_buffer(p, 0, where)->data;
    for (int64_t k = 0; k < n; ++k) m[off + k] += 1.0f;
  }
  CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
  int32_t b0 = 0;
  CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, &b0, 1));
  /* the reference: inner rank i's collective shard = its twins' sub-shards, each dequantized
   * from the replicas' wire; then the inner gather (quantized again, or plain) */
  int64_t Sv = L->shard_size, S = HY_OUTER * Sv, psz = mfsdp_dtype_size(pdt);
  float* sub = calloc((size_t)Sv, sizeof *sub);
  char* shard = calloc((size_t)S, (size_t)psz);
  char* spread = calloc((size_t)S, (size_t)psz);
  uint8_t* wire = malloc((size_t)(mfsdp_quant_wire_bytes(MFSDP_QUANT_FP8_E4M3, S, block) + 64));
  char* want = calloc((size_t)L->weight_size, (size_t)psz);
  for (int i = 0; i < HY_INNER; ++i) {
    for (int o = 0; o < HY_OUTER; ++o) {
      int v = o * HY_INNER + i;
      memset(sub, 0, (size_t)Sv * sizeof *sub);
      for (int it = 0; it < L->n_items; ++it) {
        int64_t first, n;
        mfsdp_piece_of(L->numels[it], L->pieces[it], v, &first, &n);
        for (int64_t k = 0; k < n; ++k) sub[L->shard_offsets[it] + k] = (float)hq_main(pdt, bp->params[it], first + k);
      }
      CHECK_OK(mfsdp_cpu_quantize(wire, t->outer_mode, block, sub, MFSDP_F32, Sv, 1));
      CHECK_OK(mfsdp_cpu_dequantize(shard + o * Sv * psz, pdt, wire, t->outer_mode, block, Sv, 1.0, 0));
    }
    if (t->inner_mode >= 0) {
      CHECK_OK(mfsdp_cpu_quantize(wire, t->inner_mode, block, shard, pdt, S, 1));
      CHECK_OK(mfsdp_cpu_dequantize(spread, pdt, wire, t->inner_mode, block, S, 1.0, 0));
    } else {
      memcpy(spread, shard, (size_t)(S * psz));
    }
    for (int o = 0; o < HY_OUTER; ++o)
      for (int it = 0; it < L->n_items; ++it) {
        int64_t first, n;
        mfsdp_piece_of(L->numels[it], L->pieces[it], o * HY_INNER + i, &first, &n);
        if (n > 0)
          memcpy(want + (L->param_offsets[it] + first) * psz, spread + (o * Sv + L->shard_offsets[it]) * psz,
                 (size_t)(n * psz));
      }
  }
  const mfsdp_buffer* full = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT);
  int64_t wrong = 0;
  for (int it = 0; it < L->n_items; ++it)
    wrong += count_differences((char*)full->data + L->param_offsets[it] * psz, want + L->param_offsets[it] * psz, pdt,
                               L->numels[it]);
  if (wrong && rank == 0)
    for (int k = 0; k < 6; ++k)
      fprintf(stderr, "  elem %d got %g want %g\n", k, load_as_double(full->data, pdt, k), load_as_double(want, pdt, k));
  CHECK(wrong == 0, "HFSDP quantized across replicas (%s, inside %s, %s) rank %d: %lld weights differ",
        mfsdp_quant_mode_name(t->outer_mode), t->inner_mode >= 0 ? mfsdp_quant_mode_name(t->inner_mode) : "plain",
        mfsdp_dtype_name(pdt), rank, (long long)wrong);
  mfsdp_comm_stats st;
  mfsdp_pipeline_stats(p, -1, &st);
  CHECK(st.outer_quantized_all_gathers == 1 && st.outer_all_gathers == 0 &&
            st.outer_quantized_all_gather_bytes == HY_OUTER * mfsdp_quant_wire_bytes(t->outer_mode, Sv, block) &&
            st.quantized_all_gathers == (t->inner_mode >= 0) && st.all_gathers == (t->inner_mode < 0),
        "HFSDP quantized: %lld/%lld gathers across replicas (%lld bytes), %lld/%lld inside", (long long)st.outer_all_gathers,
        (long long)st.outer_quantized_all_gathers, (long long)st.outer_quantized_all_gather_bytes,
        (long long)st.all_gathers, (long long)st.quantized_all_gathers);
  free(sub);
  free(shard);
  free(spread);
  free(wire);
  free(want);
  mfsdp_pipeline_destroy(p);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

void test_hfsdp_quantized(void) {
  const int combos[4][3] = {{MFSDP_F32, MFSDP_QUANT_INT8, -1},
                            {MFSDP_BF16, MFSDP_QUANT_INT4, -1},
                            {MFSDP_F32, MFSDP_QUANT_FP8_E4M3, MFSDP_QUANT_INT8},
                            {MFSDP_BF16, MFSDP_QUANT_INT8, MFSDP_QUANT_FP8_E4M3}};
  for (int c = 0; c < 4; ++c) {
    loop_world inner[HY_OUTER], outer[HY_INNER];
    for (int o = 0; o < HY_OUTER; ++o) loop_world_init(&inner[o], HY_INNER);
    for (int i = 0; i < HY_INNER; ++i) loop_world_init(&outer[i], HY_OUTER);
    pthread_t threads[HY_INNER * HY_OUTER];
    hq_thread args[HY_INNER * HY_OUTER];
    for (int o = 0; o < HY_OUTER; ++o)
      for (int i = 0; i < HY_INNER; ++i) {
        args[o * HY_INNER + i] = (hq_thread){&inner[o], &outer[i], i, o, combos[c][0], combos[c][1], combos[c][2]};
        pthread_create(&threads[o * HY_INNER + i], NULL, hfsdp_quant_worker, &args[o * HY_INNER + i]);
      }
    for (int r = 0; r < HY_INNER * HY_OUTER; ++r) pthread_join(threads[r], NULL);
    for (int o = 0; o < HY_OUTER; ++o) loop_world_destroy(&inner[o]);
    for (int i = 0; i < HY_INNER; ++i) loop_world_destroy(&outer[i]);
  }
}
