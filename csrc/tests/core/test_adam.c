/* test_adam.c (a part of test_core, whose runner is csrc/tests/test_core.c): the fused Adam step
 * ([Note: fused Adam] in core/mfsdp_adam.h) against a plain scalar loop of the same formula, the
 * same bits at every thread count, the bf16 gradient and compute-copy paths, and its refusals. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/mfsdp_adam.h"
#include "../../core/mfsdp_dtype.h"
#include "../harness.h"
#include "core_tests.h"

/* The note's formula, one element at a time, in double. */
static void reference_step(const mfsdp_adam_config* c, double* p, const double* g, double* m, double* v, double* vm,
                           int64_t n, int64_t step) {
  double bc1 = 1.0 - pow(c->beta1, (double)step), bc2s = pow(1.0 - pow(c->beta2, (double)step), 0.5);
  double w = 1.0 - c->beta1;
  for (int64_t i = 0; i < n; ++i) {
    double gi = c->maximize ? -g[i] : g[i];
    double pi = c->decoupled ? p[i] * (1.0 - c->lr * c->weight_decay) : p[i];
    if (!c->decoupled && c->weight_decay != 0.0) gi = fma(pi, c->weight_decay, gi);
    m[i] = fabs(w) < 0.5 ? fma(w, gi - m[i], m[i]) : fma(w - 1.0, gi - m[i], gi); /* torch's lerp */
    v[i] = fma((1.0 - c->beta2) * gi, gi, v[i] * c->beta2);
    double vv = v[i];
    if (c->amsgrad) vv = vm[i] = vm[i] >= vv ? vm[i] : vv;
    p[i] = pi + ((-(c->lr / bc1)) * m[i]) / (sqrt(vv) / bc2s + c->eps);
  }
}

static double* test_values(int64_t n, uint64_t* rng, double scale) {
  double* x = malloc(sizeof(double) * (size_t)n);
  for (int64_t i = 0; i < n; ++i) {
    *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
    x[i] = scale * ((double)(*rng >> 11) / 9007199254740992.0 - 0.5);
  }
  return x;
}

static void float64_matches_reference(void) {
  const int64_t n = 1003; /* not a multiple of any vector width: the tails run too */
  uint64_t rng = 7;
  mfsdp_adam_config configs[4] = {
      {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1, .decoupled = 1},
      {.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.05, .amsgrad = 1},
      {.lr = 1e-3, .beta1 = 0.3, .beta2 = 0.9, .eps = 1e-8, .maximize = 1, .decoupled = 1},
      {.lr = 1e-2, .beta1 = 0.0, .beta2 = 0.5, .eps = 1e-8}, /* 1-beta1 >= 0.5: lerp's other branch */
  };
  for (int k = 0; k < 4; ++k) {
    double *p = test_values(n, &rng, 2.0), *ref_p = malloc(sizeof(double) * n);
    double *m = calloc(n, sizeof(double)), *v = calloc(n, sizeof(double)), *vm = calloc(n, sizeof(double));
    double *rm = calloc(n, sizeof(double)), *rv = calloc(n, sizeof(double)), *rvm = calloc(n, sizeof(double));
    memcpy(ref_p, p, sizeof(double) * n);
    for (int64_t step = 1; step <= 5; ++step) {
      double* g = test_values(n, &rng, 1.0);
      mfsdp_adam_tensor t = {p, g, m, v, configs[k].amsgrad ? vm : NULL, NULL, n, step, MFSDP_F64, MFSDP_F64, 0};
      CHECK_OK(mfsdp_adam_step(&configs[k], &t, 1, 1));
      reference_step(&configs[k], ref_p, g, rm, rv, rvm, n, step);
      free(g);
    }
    CHECK(count_differences(p, ref_p, MFSDP_F64, n) == 0, "config %d: float64 differs from the scalar loop", k);
    CHECK(count_differences(m, rm, MFSDP_F64, n) == 0 && count_differences(v, rv, MFSDP_F64, n) == 0,
          "config %d: moments differ", k);
    free(p), free(ref_p), free(m), free(v), free(vm), free(rm), free(rv), free(rvm);
  }
}

/* Three float32 tensors (bf16 gradients on the second, a bf16 compute copy on the third) laid
 * end to end: the same bits on 1, 2, 3 and 7 threads, whose ranges cut inside tensors. */
static void threads_change_nothing(void) {
  const int64_t sizes[3] = {70001, 33, 120007};
  mfsdp_adam_config c = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1,
                         .amsgrad = 1, .decoupled = 1};
  float* runs[4][3];
  uint16_t* copies[4];
  const int threads[4] = {1, 2, 3, 7};
  for (int r = 0; r < 4; ++r) {
    uint64_t rng = 11;
    mfsdp_adam_tensor ts[3];
    void* owned[3][5];
    for (int i = 0; i < 3; ++i) {
      int64_t n = sizes[i];
      double* pd = test_values(n, &rng, 2.0);
      double* gd = test_values(n, &rng, 1.0);
      float* p = malloc(sizeof(float) * n);
      float* g = malloc(sizeof(float) * n);
      uint16_t* gb = malloc(sizeof(uint16_t) * n);
      for (int64_t j = 0; j < n; ++j) {
        p[j] = (float)pd[j];
        g[j] = (float)gd[j];
        gb[j] = mfsdp_f32_to_bf16(g[j]);
      }
      free(pd), free(gd);
      float *m = calloc(n, 4), *v = calloc(n, 4), *vm = calloc(n, 4);
      uint16_t* copy = i == 2 ? calloc(n, 2) : NULL;
      ts[i] = (mfsdp_adam_tensor){p, i == 1 ? (void*)gb : (void*)g, m, v, vm, copy, n, 3, MFSDP_F32,
                                  i == 1 ? MFSDP_BF16 : MFSDP_F32, MFSDP_BF16};
      owned[i][0] = g, owned[i][1] = gb, owned[i][2] = m, owned[i][3] = v, owned[i][4] = vm;
      runs[r][i] = p;
      if (i == 2) copies[r] = copy;
    }
    CHECK_OK(mfsdp_adam_step(&c, ts, 3, threads[r]));
    for (int i = 0; i < 3; ++i)
      for (int k = 0; k < 5; ++k) free(owned[i][k]);
  }
  for (int r = 1; r < 4; ++r) {
    for (int i = 0; i < 3; ++i)
      CHECK(count_differences(runs[r][i], runs[0][i], MFSDP_F32, sizes[i]) == 0, "tensor %d differs on %d threads", i,
            threads[r]);
    CHECK(count_differences(copies[r], copies[0], MFSDP_BF16, sizes[2]) == 0, "compute copy differs on %d threads",
          threads[r]);
  }
  int64_t wrong = 0;
  for (int64_t j = 0; j < sizes[2]; ++j) wrong += copies[0][j] != mfsdp_f32_to_bf16(runs[0][2][j]);
  CHECK(wrong == 0, "%lld compute-copy elements are not the updated parameter rounded to bf16", (long long)wrong);
  for (int r = 0; r < 4; ++r) {
    for (int i = 0; i < 3; ++i) free(runs[r][i]);
    free(copies[r]);
  }
}

static void refusals(void) {
  float x[4] = {0}, y[4] = {0}, z[4] = {0};
  mfsdp_adam_config c = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
  mfsdp_adam_tensor t = {x, y, z, z, NULL, NULL, 4, 1, MFSDP_BF16, MFSDP_BF16, 0};
  CHECK(mfsdp_adam_step(&c, &t, 1, 1) == MFSDP_ERR_UNSUPPORTED && strstr(mfsdp_last_error(), "float32 or float64"),
        "bf16 parameters not refused: %s", mfsdp_last_error());
  t.param_dtype = MFSDP_F64, t.grad_dtype = MFSDP_BF16;
  CHECK(mfsdp_adam_step(&c, &t, 1, 1) == MFSDP_ERR_UNSUPPORTED, "bf16 gradients of float64 parameters not refused");
  t.param_dtype = t.grad_dtype = MFSDP_F32, t.step = 0;
  CHECK(mfsdp_adam_step(&c, &t, 1, 1) == MFSDP_ERR_INVALID_ARGUMENT, "step 0 not refused");
  t.step = 1, c.amsgrad = 1;
  CHECK(mfsdp_adam_step(&c, &t, 1, 1) == MFSDP_ERR_INVALID_ARGUMENT, "amsgrad without its buffer not refused");
  c.amsgrad = 0, c.beta1 = 1.0;
  CHECK(mfsdp_adam_step(&c, &t, 1, 1) == MFSDP_ERR_INVALID_ARGUMENT, "beta1 = 1 not refused");
  c.beta1 = 0.9;
  CHECK_OK(mfsdp_adam_step(&c, &t, 1, 1));
  CHECK(strcmp(mfsdp_adam_isa(), "portable") == 0 || strcmp(mfsdp_adam_isa(), "avx2") == 0 ||
            strcmp(mfsdp_adam_isa(), "avx512") == 0, "isa %s", mfsdp_adam_isa());
}

void test_adam(void) {
  float64_matches_reference();
  threads_change_nothing();
  refusals();
}
