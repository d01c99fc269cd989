/* test_core.c: the C engine without Python: conversions, kernels, layout and the pipeline
 * (on a thread transport at world sizes 1-4). Built with AddressSanitizer and
 * UndefinedBehaviorSanitizer by `make ctest`. Exit status = number of failed checks (capped). */
#include <math.h>

#include "../core/mfsdp_kernels.h"
#include "harness.h"

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

static void fill_random(void* p, int dtype, int64_t n, uint64_t* rng) {
  for (int64_t i = 0; i < n; ++i) {
    double v = (rng_uniform(rng) - 0.5) * 8.0;
    if (i % 97 == 3) v = NAN;
    if (i % 89 == 5) v = INFINITY;
    if (i % 83 == 7) v = 1e-41; /* float32 subnormal */
    store_from_double(p, dtype, i, v);
  }
}

static int same_element(const void* a, const void* b, int dtype, int64_t i) {
  double x = load_as_double(a, dtype, i), y = load_as_double(b, dtype, i);
  if (isnan(x) || isnan(y)) return isnan(x) && isnan(y);
  return memcmp((const char*)a + i * mfsdp_dtype_size(dtype), (const char*)b + i * mfsdp_dtype_size(dtype),
                (size_t)mfsdp_dtype_size(dtype)) == 0;
}

static void expect_kernel_pair(int dt, int st, double alpha, int accumulate) {
  enum { N = 1031 };
  uint64_t rng = (uint64_t)(dt * 16 + st + 1);
  double src[N], dst[N], ref[N], out[N]; /* storage large enough for any dtype */
  fill_random(src, st, N, &rng);
  fill_random(dst, dt, N, &rng);
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
  int wrong = 0;
  for (int64_t i = 0; i < N; ++i) wrong += !same_element(out, ref, dt, i);
  CHECK(wrong == 0, "%s %s<-%s alpha %g: %d elements differ", accumulate ? "accumulate" : "copy",
        mfsdp_dtype_name(dt), mfsdp_dtype_name(st), alpha, wrong);
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
  /* A transformer block (d = 48) at world 4: one bucket, every slice whole rows. */
  mfsdp_param_info block[] = {
      {48, 1, MFSDP_F32, 0, 1, 0},      {48, 1, MFSDP_F32, 0, 1, 0},      /* ln */
      {144 * 48, 48, MFSDP_F32, 0, 1, 0}, {48 * 48, 48, MFSDP_F32, 0, 1, 0}, /* qkv, proj */
      {192 * 48, 48, MFSDP_F32, 0, 1, 0}, {192, 1, MFSDP_F32, 0, 1, 0},    /* fc */
      {48 * 192, 192, MFSDP_F32, 0, 1, 0}, {48, 1, MFSDP_F32, 0, 1, 0},    /* out */
  };
  int n = (int)(sizeof block / sizeof block[0]);
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(block, n, 4, 0, 16, &plan));
  CHECK(plan.n_buckets == 1, "one bucket for one unit, got %d", plan.n_buckets);
  CHECK_OK(mfsdp_plan_validate(&plan, block, n));
  CHECK(plan.buckets[0].rows[0] == 192, "largest rows first");
  int64_t total = 0;
  for (int i = 0; i < n; ++i) total += block[i].numel;
  CHECK(plan.buckets[0].bucket_size - total <= 4 * plan.buckets[0].chunk, "padding within world * chunk");
  mfsdp_plan_free(&plan);

  /* Keys split groups; a param smaller than the world leaves empty shards; numel 0 is fine. */
  mfsdp_param_info mixed[] = {
      {10, 5, MFSDP_F32, -1, 1, 0}, {6, 3, MFSDP_F32, -1, 1, 0}, {4, 1, MFSDP_BF16, -1, 1, 0},
      {8, 4, MFSDP_F32, -1, 0, 0},  {3, 1, MFSDP_F32, 0, 1, 0},  {0, 1, MFSDP_F32, 0, 1, 0},
      {7, 1, MFSDP_F32, -1, 1, 1},
  };
  CHECK_OK(mfsdp_plan_build(mixed, 7, 4, 0, 16, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, mixed, 7));
  for (int b = 0; b < plan.n_buckets; ++b)
    if (plan.buckets[b].replicated) CHECK(plan.buckets[b].world == 1, "replicated bucket is not sharded");
  int empty_shards = 0;
  for (int b = 0; b < plan.n_buckets; ++b)
    for (int i = 0; i < plan.buckets[b].n_items; ++i)
      for (int r = 0; r < plan.buckets[b].world; ++r) {
        int64_t lo, hi, off;
        mfsdp_item_shard_slice(&plan.buckets[b], i, r, &lo, &hi, &off);
        empty_shards += lo == hi;
      }
  CHECK(empty_shards > 0, "small parameters leave some ranks empty");
  mfsdp_plan_free(&plan);

  /* Coprime rows would need a huge chunk: the group splits instead of padding. */
  mfsdp_param_info coprime[] = {{4096 * 4097, 4097, MFSDP_F32, 0, 1, 0}, {4096 * 4096, 4096, MFSDP_F32, 0, 1, 0}};
  CHECK_OK(mfsdp_plan_build(coprime, 2, 8, 0, 16, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, coprime, 2));
  CHECK(plan.n_buckets == 2, "coprime rows split into %d buckets", plan.n_buckets);
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
/* pipeline on the thread transport */

typedef struct pipe_case {
  const char* name;
  int world, grad_mode, weights_sharded, regather, micro, sync_each;
  int param_dtype, main_dtype, grad_dtype, comm_dtype;
  int op;            /* mfsdp_reduce_op */
  int per_token;     /* prescale 1 (sum) instead of 1/world */
  int fail_after;    /* inject a collective failure; -1: none */
  int direct_init;   /* initialise shards directly (meta-device path) */
} pipe_case;

typedef struct pipe_thread {
  const pipe_case* c;
  loop_world* world;
  int rank;
  int failures;
} pipe_thread;

static const int64_t SHAPES[][2] = {{12, 4}, {5, 1}, {6, 2}, {3, 1}, {8, 8}};
#define N_ITEMS 5

static double init_value(int item, int64_t j) { return 0.25 * item + 0.001 * (double)j; }
static double grad_value(int rank, int mb, int item, int64_t j) {
  return 0.5 * (rank + 1) + 0.125 * mb - 0.01 * item + 0.0001 * (double)j;
}

static double tolerance(int dtype) { return dtype == MFSDP_BF16 ? 2e-2 : dtype == MFSDP_F16 ? 2e-3 : 1e-5; }

static void* pipe_worker(void* arg) {
  pipe_thread* t = arg;
  const pipe_case* c = t->c;
  int before = test_failures;
  int W = c->world, r = t->rank;
  mfsdp_param_info infos[N_ITEMS];
  for (int i = 0; i < N_ITEMS; ++i)
    infos[i] = (mfsdp_param_info){SHAPES[i][0], SHAPES[i][1], c->param_dtype, 0, 1, 0};
  int shard_world = c->grad_mode == MFSDP_GRAD_ALL_REDUCE ? 1 : W;
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(infos, N_ITEMS, shard_world, 0, 16, &plan));
  mfsdp_bucket_plan* bp = &plan.buckets[0];
  mfsdp_bucket_spec spec = {bp->world, bp->world > 1 ? r : 0, bp->shard_size, bp->n_items, bp->offsets, bp->numels,
                            c->param_dtype, c->main_dtype, c->grad_dtype, c->comm_dtype,
                            c->weights_sharded && W > 1, c->regather && W > 1, c->grad_mode};
  loop_rank lr = {t->world, r};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &lr, &mfsdp_cpu_kernels, NULL};
  double prescale = c->per_token || c->op == MFSDP_REDUCE_AVG ? 1.0 : 1.0 / W;
  mfsdp_pipeline_config cfg = {W, r, prescale, c->op, 1 << 20, 0};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) goto out;
  int pdt = c->param_dtype;
  int64_t S = bp->shard_size, first = (int64_t)spec.shard_rank * S;

  /* init from float32 values */
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, c->direct_init));
  for (int i = 0; i < bp->n_items; ++i) {
    int item_param = bp->params[i];
    float* v = malloc((size_t)bp->numels[i] * sizeof *v + 4);
    for (int64_t j = 0; j < bp->numels[i]; ++j) v[j] = (float)init_value(item_param, j);
    CHECK_OK(mfsdp_pipeline_set_item(p, 0, i, v, MFSDP_F32, bp->numels[i]));
    free(v);
  }
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  const mfsdp_buffer* weight = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_WEIGHT);
  if (spec.weights_sharded)
    CHECK(weight->data == NULL && mfsdp_pipeline_weight_state(p, 0) == MFSDP_W_EMPTY, "ZeRO-3 releases weights");

  /* gather: every item whole, padding zero */
  int32_t ids[1] = {0};
  CHECK_OK(mfsdp_pipeline_unshard(p, ids, 1));
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, ids, 1));
  int wrong = 0;
  for (int i = 0; i < bp->n_items; ++i) {
    for (int64_t j = 0; j < bp->numels[i]; ++j) {
      double rounded[1]; /* the float32 source value rounded to the parameter dtype */
      store_from_double(rounded, pdt, 0, (float)init_value(bp->params[i], j));
      wrong += load_as_double(weight->data, pdt, bp->offsets[i] + j) != load_as_double(rounded, pdt, 0);
    }
  }
  double pad_sum = 0;
  for (int64_t k = 0; k < bp->bucket_size; ++k) pad_sum += fabs(load_as_double(weight->data, pdt, k));
  double item_sum = 0;
  for (int i = 0; i < bp->n_items; ++i)
    for (int64_t j = 0; j < bp->numels[i]; ++j) item_sum += fabs(load_as_double(weight->data, pdt, bp->offsets[i] + j));
  CHECK(wrong == 0, "%s rank %d: %d gathered weights wrong", c->name, r, wrong);
  CHECK(fabs(pad_sum - item_sum) < 1e-9, "%s rank %d: padding is not zero", c->name, r);
  CHECK_OK(mfsdp_pipeline_reshard(p, ids, 1));

  if (c->fail_after >= 0) { /* the next collective fails on every rank: all refuse afterwards */
    t->world->fail_after = t->world->calls + c->fail_after;
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
  for (int mb = 0; mb < c->micro; ++mb) {
    int last = mb == c->micro - 1;
    CHECK_OK(mfsdp_pipeline_begin_backward(p, c->sync_each || last));
    float* grads[N_ITEMS] = {0}; /* alive until packed: the pipeline packs a bucket at once */
    for (int i = bp->n_items - 1; i >= 0; --i) {
      float* g = grads[i] = malloc((size_t)bp->numels[i] * sizeof *g + 4);
      for (int64_t j = 0; j < bp->numels[i]; ++j) g[j] = (float)grad_value(r, mb, bp->params[i], j);
      CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, i, g, MFSDP_F32, bp->numels[i], NULL));
      if (i == 0)
        CHECK(mfsdp_pipeline_grad_ready(p, 0, i, g, MFSDP_F32, bp->numels[i], NULL) == MFSDP_ERR_INVALID_STATE,
              "a gradient reported twice is refused");
    }
    CHECK_OK(mfsdp_pipeline_end_backward(p));
    for (int i = 0; i < bp->n_items; ++i) free(grads[i]);
  }
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  const mfsdp_buffer* og = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_OPT_GRAD);
  double scale = c->op == MFSDP_REDUCE_AVG ? 1.0 / W : prescale;
  double tol = tolerance(c->comm_dtype) + tolerance(c->grad_dtype);
  wrong = 0;
  for (int i = 0; i < bp->n_items; ++i) {
    for (int64_t j = 0; j < bp->numels[i]; ++j) {
      int64_t pos = bp->offsets[i] + j;
      if (pos < first || pos >= first + S) continue;
      double want = 0;
      for (int mb = 0; mb < c->micro; ++mb)
        for (int k = 0; k < W; ++k) want += grad_value(k, mb, bp->params[i], j) * scale;
      double got = load_as_double(og->data, c->main_dtype, pos - first);
      if (fabs(got - want) > tol * (fabs(want) + 1e-3)) {
        if (wrong < 3) fprintf(stderr, "  %s rank %d item %d elem %lld: got %g want %g\n", c->name, r, i, (long long)j, got, want);
        wrong++;
      }
    }
  }
  CHECK(wrong == 0, "%s rank %d: %d reduced gradients wrong", c->name, r, wrong);

  /* optimizer step: main += 1 on this rank's shard, install, gather: everyone sees +1 */
  const mfsdp_buffer* main = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_MAIN_SHARD);
  for (int64_t k = 0; k < S; ++k)
    store_from_double(main->data, c->main_dtype, k, load_as_double(main->data, c->main_dtype, k) + 1.0);
  CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
  CHECK_OK(mfsdp_pipeline_unshard(p, ids, 1));
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, ids, 1));
  wrong = 0;
  for (int i = 0; i < bp->n_items; ++i)
    for (int64_t j = 0; j < bp->numels[i]; ++j) {
      double want = init_value(bp->params[i], j) + 1.0;
      double got = load_as_double(weight->data, pdt, bp->offsets[i] + j);
      wrong += fabs(got - want) > tolerance(pdt) * 2 * (fabs(want) + 1e-3);
    }
  CHECK(wrong == 0, "%s rank %d: %d weights not updated after install + gather", c->name, r, wrong);
  CHECK_OK(mfsdp_pipeline_zero_grads(p));
  const mfsdp_buffer* gs = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_GRAD_SHARD);
  double gsum = 0;
  for (int64_t k = 0; k < S; ++k) gsum += fabs(load_as_double(gs->data, c->grad_dtype, k));
  CHECK(gsum == 0.0, "%s: zero_grads leaves %g", c->name, gsum);
  mfsdp_comm_stats st;
  mfsdp_pipeline_stats(p, -1, &st);
  if (W == 1) CHECK(st.all_gathers + st.reduce_scatters + st.all_reduces == 0, "world 1 never communicates");
done:
  mfsdp_pipeline_destroy(p);
out:
  mfsdp_plan_free(&plan);
  t->failures = test_failures - before;
  return NULL;
}

static void run_pipe_case(const pipe_case* c) {
  loop_world w;
  loop_world_init(&w, c->world);
  pthread_t threads[LOOP_MAX_WORLD];
  pipe_thread args[LOOP_MAX_WORLD];
  for (int r = 0; r < c->world; ++r) {
    args[r] = (pipe_thread){c, &w, r, 0};
    pthread_create(&threads[r], NULL, pipe_worker, &args[r]);
  }
  for (int r = 0; r < c->world; ++r) pthread_join(threads[r], NULL);
  loop_world_destroy(&w);
}

static void test_pipeline(void) {
  const int F = MFSDP_F32, B = MFSDP_BF16, H = MFSDP_F16;
  const int SUM = MFSDP_REDUCE_SUM, AVG = MFSDP_REDUCE_AVG;
  const int AR = MFSDP_GRAD_ALL_REDUCE, RSI = MFSDP_GRAD_SCATTER_IN_PLACE, RSA = MFSDP_GRAD_SCATTER_ACCUMULATE;
  for (int world = 1; world <= 4; ++world) {
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
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; ++k) run_pipe_case(&cases[k]);
  }
}

static void test_pipeline_misuse(void) {
  mfsdp_pipeline_config cfg = {2, 0, 0.5, MFSDP_REDUCE_SUM, 1 << 20, 0};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, NULL, &mfsdp_cpu_kernels, NULL};
  int64_t offsets[1] = {0}, numels[1] = {8};
  mfsdp_bucket_spec bad = {2, 0, 2, 1, offsets, numels, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0,
                           MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_pipeline* p = NULL;
  CHECK(mfsdp_pipeline_create(&cfg, &be, &bad, 1, &p) == MFSDP_ERR_INVALID_ARGUMENT && p == NULL,
        "item larger than the bucket refused");
  mfsdp_bucket_spec ok = {1, 0, 8, 1, offsets, numels, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 0, 0,
                          MFSDP_GRAD_ALL_REDUCE};
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
  test_pipeline();
  test_pipeline_misuse();
  if (test_failures) {
    fprintf(stderr, "test_core: %d checks failed\n", test_failures);
    return test_failures > 100 ? 100 : test_failures;
  }
  printf("test_core: all checks passed\n");
  return 0;
}
