/* test_core.c: the C engine without Python: conversions, kernels, layout and the pipeline
 * (on a thread transport at world sizes 1-4). Built with AddressSanitizer and
 * UndefinedBehaviorSanitizer by `make ctest`. Exit status = number of failed checks (capped). */
#include <math.h>

#include "../core/mfsdp_kernels.h"
#include "harness.h"
#include "pipeline_cases.h"

/* ------------------------------------------------------------------------------------------ */
/* conversions against an independent reference: nearest representable value by binary search
 * over the sorted table of finite values, ties to the even encoding. */

typedef struct format_table {
  double values[0x8000]; /* positive finite values by encoding */
  int count;             /* encodings 0 .. count-1 are finite */
  double overflow;       /* the value one step past the largest finite one (rounds to Inf) */
} format_table;

static void build_table(format_table* t, int is_bf16) {
  t->count = is_bf16 ? 0x7f80 : 0x7c00;
  for (int h = 0; h < t->count; ++h)
    t->values[h] = is_bf16 ? mfsdp_bf16_to_f32((uint16_t)h) : mfsdp_f16_to_f32((uint16_t)h);
  t->overflow = is_bf16 ? ldexp(1.0, 128) : 65536.0;
}

static uint16_t reference_round(const format_table* t, float x, int is_bf16) {
  uint32_t bits = mfsdp_f32_bits(x);
  uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
  double a = fabs((double)x);
  if (isinf(x)) return sign | (is_bf16 ? 0x7f80 : 0x7c00);
  int lo = 0, hi = t->count - 1; /* largest encoding with value <= a */
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (t->values[mid] <= a) lo = mid; else hi = mid - 1;
  }
  double below = t->values[lo];
  double above = lo + 1 < t->count ? t->values[lo + 1] : t->overflow;
  int pick;
  if (a - below < above - a) pick = lo;
  else if (a - below > above - a) pick = lo + 1;
  else pick = (lo % 2 == 0) ? lo : lo + 1; /* tie: even encoding */
  if (pick >= t->count) return sign | (is_bf16 ? 0x7f80 : 0x7c00);
  return sign | (uint16_t)pick;
}

static int is_nan16(uint16_t h, int is_bf16) {
  return is_bf16 ? ((h & 0x7f80u) == 0x7f80u && (h & 0x7fu)) : ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu));
}

static void test_conversions(void) {
  static format_table bf, hf;
  build_table(&bf, 1);
  build_table(&hf, 0);
  int bad_bf = 0, bad_hf = 0;
  for (uint32_t h = 0; h < 0x10000u; ++h) { /* every 16-bit value survives a round trip */
    uint16_t b = mfsdp_f32_to_bf16(mfsdp_bf16_to_f32((uint16_t)h));
    uint16_t f = mfsdp_f32_to_f16(mfsdp_f16_to_f32((uint16_t)h));
    bad_bf += is_nan16((uint16_t)h, 1) ? !is_nan16(b, 1) : b != h;
    bad_hf += is_nan16((uint16_t)h, 0) ? !is_nan16(f, 0) : f != h;
  }
  CHECK(bad_bf == 0, "%d bf16 values do not round-trip", bad_bf);
  CHECK(bad_hf == 0, "%d fp16 values do not round-trip", bad_hf);

  uint64_t rng = 42;
  int wrong_bf = 0, wrong_hf = 0;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t bits = (uint32_t)rng_next(&rng);
    if (i % 4 == 1) bits = (bits & 0x807fffffu) | ((uint32_t)rng_range(&rng, 96, 145) << 23); /* near f16 range */
    if (i % 4 == 2) bits = (bits & 0xffff0000u) | 0x8000u;                                    /* bf16 ties */
    if (i % 4 == 3) bits = (bits & 0x807fe000u) | 0x1000u | ((uint32_t)rng_range(&rng, 100, 142) << 23); /* f16 ties */
    float x = mfsdp_bits_f32(bits);
    if (isnan(x)) {
      wrong_bf += !is_nan16(mfsdp_f32_to_bf16(x), 1);
      wrong_hf += !is_nan16(mfsdp_f32_to_f16(x), 0);
      continue;
    }
    wrong_bf += mfsdp_f32_to_bf16(x) != reference_round(&bf, x, 1);
    wrong_hf += mfsdp_f32_to_f16(x) != reference_round(&hf, x, 0);
  }
  CHECK(wrong_bf == 0, "%d float32->bfloat16 results differ from round-to-nearest-even", wrong_bf);
  CHECK(wrong_hf == 0, "%d float32->float16 results differ from round-to-nearest-even", wrong_hf);
  /* named cases */
  CHECK(mfsdp_f32_to_bf16(1.00390625f) == 0x3f80, "tie rounds to even (down)");
  CHECK(mfsdp_f32_to_bf16(1.01171875f) == 0x3f82, "tie rounds to even (up)");
  CHECK(mfsdp_f32_to_f16(65519.0f) == 0x7bff && mfsdp_f32_to_f16(65520.0f) == 0x7c00, "fp16 overflow edge");
  CHECK(mfsdp_f32_to_f16(5.9604645e-8f) == 0x0001, "smallest fp16 subnormal");
  CHECK(mfsdp_f32_to_f16(2.9802322e-8f) == 0x0000, "half the smallest subnormal ties to zero");
  CHECK(mfsdp_f32_to_f16(-INFINITY) == 0xfc00 && mfsdp_f32_to_bf16(-INFINITY) == 0xff80, "-Inf kept");
}

/* ------------------------------------------------------------------------------------------ */
/* kernels: every pair of floating types, against the scalar formula in the pair's wide type */

static void expect_kernel_pair(int dt, int st, double alpha, int accumulate) {
  enum { N = 1031 };
  uint64_t rng = (uint64_t)(dt * 16 + st + 1);
  double src[N], dst[N], ref[N], out[N]; /* storage large enough for any dtype */
  fill_test_values(src, st, N, &rng);
  fill_test_values(dst, dt, N, &rng);
  memcpy(out, dst, sizeof dst);
  int wide = dt == MFSDP_F64 || st == MFSDP_F64;
  for (int64_t i = 0; i < N; ++i) {
    double s = load_as_double(src, st, i), d = load_as_double(dst, dt, i), v;
    if (wide) {
      v = accumulate ? d + alpha * s : (alpha == 1.0 ? s : alpha * s);
      store_from_double(ref, dt, i, v);
    } else {
      float fs = (float)s, fd = (float)d, fa = (float)alpha;
      float fv = accumulate ? fd + (alpha == 1.0 ? fs : fa * fs) : (alpha == 1.0 ? fs : fa * fs);
      store_from_double(ref, dt, i, fv);
    }
  }
  mfsdp_status s = accumulate ? mfsdp_cpu_accumulate(out, dt, src, st, N, alpha)
                              : mfsdp_cpu_copy(out, dt, src, st, N, alpha);
  CHECK(s == MFSDP_OK, "kernel %s<-%s failed", mfsdp_dtype_name(dt), mfsdp_dtype_name(st));
  int64_t wrong = count_differences(out, ref, dt, N);
  CHECK(wrong == 0, "%s %s<-%s alpha %g: %lld elements differ", accumulate ? "accumulate" : "copy",
        mfsdp_dtype_name(dt), mfsdp_dtype_name(st), alpha, (long long)wrong);
}

static void test_kernels(void) {
  for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt)
    for (int st = 0; st < MFSDP_NUM_FLOAT_DTYPES; ++st)
      for (int acc = 0; acc < 2; ++acc) {
        expect_kernel_pair(dt, st, 1.0, acc);
        expect_kernel_pair(dt, st, 0.25, acc);
        expect_kernel_pair(dt, st, 1.0 / 3.0, acc);
      }
  float x[5] = {1.0f, NAN, 2.0f, -INFINITY, 3.0f};
  int64_t count = -1;
  CHECK_OK(mfsdp_cpu_count_nonfinite(x, MFSDP_F32, 5, &count));
  CHECK(count == 2, "count_nonfinite found %lld", (long long)count);
  uint16_t h[3] = {0x3c00, 0x7e00, 0xfc00};
  CHECK_OK(mfsdp_cpu_count_nonfinite(h, MFSDP_F16, 3, &count));
  CHECK(count == 2, "fp16 count_nonfinite found %lld", (long long)count);
  CHECK_OK(mfsdp_cpu_scale(x, MFSDP_F32, 1, 4.0));
  CHECK(x[0] == 4.0f, "scale");
  int32_t ints[2] = {1, 2};
  CHECK(mfsdp_cpu_copy(x, MFSDP_F32, ints, MFSDP_I32, 2, 1.0) == MFSDP_ERR_UNSUPPORTED, "int -> float refused");
  CHECK(mfsdp_cpu_copy(NULL, MFSDP_F32, x, MFSDP_F32, 2, 1.0) == MFSDP_ERR_INVALID_ARGUMENT, "null refused");
  CHECK(strstr(mfsdp_last_error(), "kernels_cpu.c:") != NULL, "error names file:line: %s", mfsdp_last_error());
}

/* ------------------------------------------------------------------------------------------ */
/* layout */

static void test_layout(void) {
  /* A transformer block (d = 48) at world 4: one bucket; each rank holds torch.chunk rows. */
  mfsdp_param_info block[] = {
      {48, 1, MFSDP_F32, 0, 1, 0},      {48, 1, MFSDP_F32, 0, 1, 0},      /* ln */
      {144 * 48, 48, MFSDP_F32, 0, 1, 0}, {48 * 48, 48, MFSDP_F32, 0, 1, 0}, /* qkv, proj */
      {192 * 48, 48, MFSDP_F32, 0, 1, 0}, {192, 1, MFSDP_F32, 0, 1, 0},    /* fc */
      {48 * 192, 192, MFSDP_F32, 0, 1, 0}, {45, 1, MFSDP_F32, 0, 1, 0},    /* out, an odd bias */
  };
  int n = (int)(sizeof block / sizeof block[0]);
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(block, n, 4, 0, 16, &plan));
  CHECK(plan.n_buckets == 1, "one bucket for one unit, got %d", plan.n_buckets);
  CHECK_OK(mfsdp_plan_validate(&plan, block, n));
  const mfsdp_bucket_layout* L = &plan.buckets[0].layout;
  for (int i = 0; i < n; ++i) CHECK(plan.buckets[0].params[i] == i, "items keep registration order");
  CHECK(L->pieces[2] == 36 * 48, "144 rows over 4 ranks: pieces of 36 rows, got %lld", (long long)L->pieces[2]);
  CHECK(L->pieces[7] == 12, "45 rows over 4: torch.chunk gives 12, got %lld", (long long)L->pieces[7]);
  int64_t first, len;
  mfsdp_piece_of(L->numels[7], L->pieces[7], 3, &first, &len);
  CHECK(first == 36 && len == 9, "rank 3 holds rows 36..44 of 45 (%lld, +%lld)", (long long)first, (long long)len);
  CHECK(L->shard_size % 4 == 0 && L->weight_size % 4 == 0, "16-byte aligned sizes");
  CHECK(!mfsdp_layout_is_identity(L), "a block has two distinct layouts");
  mfsdp_plan_free(&plan);

  /* Keys split groups; a param with fewer rows than ranks leaves empty pieces; numel 0 is fine;
   * one evenly split parameter needs no copy-out. */
  mfsdp_param_info mixed[] = {
      {10, 5, MFSDP_F32, -1, 1, 0}, {6, 3, MFSDP_F32, -1, 1, 0}, {4, 1, MFSDP_BF16, -1, 1, 0},
      {8, 4, MFSDP_F32, -1, 0, 0},  {3, 1, MFSDP_F32, 0, 1, 0},  {0, 1, MFSDP_F32, 0, 1, 0},
      {7, 1, MFSDP_F32, -1, 1, 1},  {64, 4, MFSDP_F32, 1, 1, 0},
  };
  CHECK_OK(mfsdp_plan_build(mixed, 8, 4, 0, 16, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, mixed, 8));
  int empty_pieces = 0, identity = 0;
  for (int b = 0; b < plan.n_buckets; ++b) {
    const mfsdp_bucket_layout* l = &plan.buckets[b].layout;
    if (plan.buckets[b].replicated) CHECK(l->world == 1 && mfsdp_layout_is_identity(l), "replicated: not sharded");
    identity += l->world > 1 && mfsdp_layout_is_identity(l);
    for (int i = 0; i < l->n_items; ++i)
      for (int r = 0; r < l->world; ++r) {
        mfsdp_piece_of(l->numels[i], l->pieces[i], r, &first, &len);
        empty_pieces += len == 0;
      }
  }
  CHECK(empty_pieces > 0, "small parameters leave some ranks empty");
  CHECK(identity == 1, "the 16 x 4 parameter alone in unit 1 gathers in place (%d)", identity);
  mfsdp_plan_free(&plan);

  /* The size cap splits parameters outside units, never a unit. */
  mfsdp_param_info many[6];
  for (int i = 0; i < 6; ++i) many[i] = (mfsdp_param_info){100, 1, MFSDP_F32, i < 3 ? -1 : 0, 1, 0};
  CHECK_OK(mfsdp_plan_build(many, 6, 2, 150, 16, &plan));
  CHECK(plan.n_buckets == 4, "3 capped root buckets + 1 unit bucket, got %d", plan.n_buckets);
  mfsdp_plan_free(&plan);

  mfsdp_param_info bad = {10, 3, MFSDP_F32, 0, 1, 0};
  CHECK(mfsdp_plan_build(&bad, 1, 2, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "10 is not whole rows of 3");
  CHECK(mfsdp_plan_build(block, n, 0, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "world 0 refused");
}

/* ------------------------------------------------------------------------------------------ */
/* graphs that differ across ranks (see [Note: collective order] in reduce.c) */

#define DIV_UNITS 3
#define DIV_WORLD 3

typedef struct divergent_thread {
  loop_world* world;
  int rank, grad_mode, sync;
} divergent_thread;

/* Rank r's gradient of item i of unit u, or 0 when rank r did not use it: unit 1 is skipped
 * (sealed) by rank 0, item 1 of unit 2 is unused on rank 2, unit 0's item 0 on every rank. */
static int div_used(int r, int u, int i) { return !(r == 0 && u == 1) && !(r == 2 && u == 2 && i == 1) && !(u == 0 && i == 0); }
static double div_grad(int r, int u, int i, int64_t j) { return div_used(r, u, i) ? (r + 1) * 0.5 + u + 0.01 * i + 1e-4 * j : 0; }

static void* divergent_worker(void* arg) {
  divergent_thread* t = arg;
  int W = DIV_WORLD, r = t->rank;
  mfsdp_param_info infos[DIV_UNITS * 2];
  for (int u = 0; u < DIV_UNITS; ++u) { /* two items per unit, sizes differing by unit */
    infos[2 * u] = (mfsdp_param_info){(u + 2) * 4 * 5, 5, MFSDP_F32, u, 1, 0};
    infos[2 * u + 1] = (mfsdp_param_info){(u + 1) * 3, 1, MFSDP_F32, u, 1, 0};
  }
  int shard_world = t->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 1 : W;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(infos, DIV_UNITS * 2, shard_world, 0, 16, &plan));
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
  CHECK_OK(mfsdp_pipeline_begin_backward(p, t->sync));
  if (r == 0) {
    int32_t skipped[1] = {1};
    CHECK_OK(mfsdp_pipeline_seal(p, skipped, 1));
  }
  for (int k = 0; k < DIV_UNITS * 2; ++k) { /* each rank its own arrival order */
    int n_slots = DIV_UNITS * 2;
    int slot = r % 2 ? (n_slots - 1 - k + r) % n_slots : (k + 2 * r) % n_slots, u = slot / 2, i = slot % 2;
    if (!div_used(r, u, i)) continue;
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
        for (int k = 0; k < W; ++k) want += div_grad(k, u, i, j);
        wrong += fabs(load_as_double(og->data, MFSDP_F32, off + j - first) - want) > 1e-4 * (fabs(want) + 1);
      }
    }
  CHECK(wrong == 0, "grad mode %d sync %d rank %d: %d reduced gradients wrong", t->grad_mode, t->sync, r, wrong);
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
static void test_rank_divergent_graphs(void) {
  const int modes[3][2] = {{MFSDP_GRAD_SCATTER_ACCUMULATE, 0}, {MFSDP_GRAD_SCATTER_IN_PLACE, 1},
                           {MFSDP_GRAD_ALL_REDUCE, 1}};
  for (int m = 0; m < 3; ++m) {
    loop_world world;
    loop_world_init(&world, DIV_WORLD);
    pthread_t threads[DIV_WORLD];
    divergent_thread args[DIV_WORLD];
    for (int r = 0; r < DIV_WORLD; ++r) {
      args[r] = (divergent_thread){&world, r, modes[m][0], modes[m][1]};
      pthread_create(&threads[r], NULL, divergent_worker, &args[r]);
    }
    for (int r = 0; r < DIV_WORLD; ++r) pthread_join(threads[r], NULL);
    CHECK(world.mismatches == 0, "grad mode %d: %d collectives differed across ranks", modes[m][0], world.mismatches);
    loop_world_destroy(&world);
  }
}

/* ------------------------------------------------------------------------------------------ */
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

static double hy_grad(int rank, int mb, int item, int64_t j) { return 0.25 * (rank + 1) + 0.5 * mb - 0.1 * item + 1e-3 * j; }
static double hy_weight(int item, int64_t j) { return item - 0.01 * j; }

static void* hybrid_worker(void* arg) {
  hybrid_thread* t = arg;
  int rank = t->outer_rank * HY_INNER + t->inner_rank, W = HY_INNER * HY_OUTER;
  mfsdp_param_info infos[2] = {{6 * 4, 4, MFSDP_F32, 0, 1, 0}, {5, 1, MFSDP_F32, 0, 1, 0}};
  int shard_world = t->hfsdp ? W : t->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 1 : HY_INNER;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(infos, 2, shard_world, 0, 16, &plan));
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
    float* g[2];
    for (int i = 1; i >= 0; --i) {
      g[i] = malloc((size_t)L->numels[i] * sizeof *g[i]);
      for (int64_t j = 0; j < L->numels[i]; ++j) g[i][j] = (float)hy_grad(rank, mb, plan.buckets[0].params[i], j);
      CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, i, g[i], MFSDP_F32, L->numels[i], NULL));
    }
    CHECK_OK(mfsdp_pipeline_end_backward(p));
    free(g[0]);
    free(g[1]);
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

static void test_hybrid_sharding(void) {
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

/* ------------------------------------------------------------------------------------------ */
/* pipeline misuse (the cases at world sizes 1-4 are in pipeline_cases.c) */

static void test_pipeline_misuse(void) {
  mfsdp_pipeline_config cfg = {2, 0, 0.5, MFSDP_REDUCE_SUM, 1 << 20, 0};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, NULL, &mfsdp_cpu_kernels, NULL};
  int64_t offsets[1] = {0}, numels[1] = {8}, pieces[1] = {4}, small[1] = {1};
  mfsdp_bucket_layout too_small = {2, 1, numels, small, offsets, offsets, 8, 2}; /* pieces cannot cover 8 */
  mfsdp_bucket_spec bad = {too_small, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0,
                           MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_pipeline* p = NULL;
  CHECK(mfsdp_pipeline_create(&cfg, &be, &bad, 1, &p) == MFSDP_ERR_INVALID_ARGUMENT && p == NULL,
        "pieces that do not cover the item refused");
  mfsdp_bucket_layout never_gathered = {2, 1, numels, pieces, offsets, offsets, 8, 4};
  bad = (mfsdp_bucket_spec){never_gathered, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 0, 0,
                            MFSDP_GRAD_SCATTER_ACCUMULATE};
  CHECK(mfsdp_pipeline_create(&cfg, &be, &bad, 1, &p) == MFSDP_ERR_INVALID_ARGUMENT && p == NULL,
        "sharded weights that are never gathered refused");
  mfsdp_bucket_layout whole = {1, 1, numels, numels, offsets, offsets, 8, 8};
  mfsdp_bucket_spec ok = {whole, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 0, 0, MFSDP_GRAD_ALL_REDUCE};
  cfg.dp_world = 1;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &ok, 1, &p));
  float g[8] = {0};
  CHECK(mfsdp_pipeline_grad_ready(p, 0, 0, g, MFSDP_F32, 8, NULL) == MFSDP_ERR_INVALID_STATE, "grad outside backward");
  CHECK(mfsdp_pipeline_end_backward(p) == MFSDP_ERR_INVALID_STATE, "end without begin");
  CHECK_OK(mfsdp_pipeline_begin_backward(p, 1));
  CHECK(mfsdp_pipeline_grad_ready(p, 0, 0, g, MFSDP_F32, 7, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "wrong numel");
  CHECK(mfsdp_pipeline_grad_ready(p, 3, 0, g, MFSDP_F32, 8, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "bad bucket");
  CHECK(mfsdp_pipeline_sync_grads(p) == MFSDP_ERR_INVALID_STATE, "sync inside backward");
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  mfsdp_pipeline_destroy(p);
}

int main(void) {
  test_conversions();
  test_kernels();
  test_layout();
  test_rank_divergent_graphs();
  test_hybrid_sharding();
  run_pipeline_cases(&loop_rig, 4, 0);
  test_pipeline_misuse();
  if (test_failures) {
    fprintf(stderr, "test_core: %d checks failed\n", test_failures);
    return test_failures > 100 ? 100 : test_failures;
  }
  printf("test_core: all checks passed\n");
  return 0;
}
