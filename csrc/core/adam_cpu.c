/* adam_cpu.c: the fused Adam/AdamW step over host memory ([Note: fused Adam] in mfsdp_adam.h).
 *
 * One loop body, instantiated per (dtype, gradient type, amsgrad, compute copy) with constant
 * flags so that each instance is a straight loop the compiler vectorises, and compiled three
 * times: for AVX-512, for AVX2 with FMA and portable. The first step picks the widest this CPU
 * runs (__builtin_cpu_supports). Threads split the concatenated elements of all tensors into
 * equal ranges: the work is elementwise, so the result does not depend on the split.
 *
 * [Note: the step's threads]
 * The threads are OpenMP's, and in a process that imported torch they are torch's own: our
 * NEEDED libgomp.so.1 is the soname torch's wheels ship in torch/lib, and the package imports
 * torch before this extension, so the loader binds us to torch's copy, one runtime and one team
 * per calling thread (tests/test_fused_adam.py checks that one libgomp is mapped). That is what
 * makes the step fast right after torch's work: torch's OpenMP threads spin on the cores for a
 * while after each parallel region, and threads of our own (pthreads, or a second OpenMP
 * runtime) would wait behind them for the cores, while the spinning team takes our ranges at
 * once (measured on 2 cores at 10M parameters: 11.3-12.5 ms with pthreads, 7.0-8.5 ms on torch's
 * team, torch's fused step 7.4-9.2 ms). A step called from another thread (the optimizer's
 * worker, stepping inside the backward) gets that thread's own team. As for torch's own ops, a
 * process forked after a parallel region ran must not start one (libgomp's team is not in the
 * child: measured, torch's add hangs there as our step does); ranks start by spawn or forkserver. */
#include "mfsdp_adam.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "mfsdp_dtype.h"

/* [Note: the team under ThreadSanitizer]
 * libgomp is not built with ThreadSanitizer, so the ordering its team hand-off gives (the caller's
 * writes before the region, the team's accesses before the region's end) is invisible to TSan,
 * which then reports every later reuse of the step's memory (the caller's stack, `starts`, a
 * gradient the engine accumulates into after the team read it) as a race. These annotations state
 * what OpenMP guarantees for a parallel region: a release by the caller before it, an acquire as
 * each range starts, a release as it ends and the caller's acquire of every range after the
 * region. Two limits, both in TSan builds only: the outlined region reads its shared variables
 * (n, jobs) through a restrict pointer before any statement of ours runs, so those reads alone are
 * suppressed by their top frame (csrc/tests/tsan.supp); and the entry's sync object is one per
 * process (a member can read nothing of its caller's before it acquires), so every step's start is
 * ordered after every earlier step's start, which can hide a race between one caller's writes
 * before its step and another caller's team (not one between a team and the engine, which is what
 * csrc/tests/test_threads.c probes). The annotations compile to nothing elsewhere. */
#if defined(__SANITIZE_THREAD__)
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
#define TEAM_RELEASE(addr) __tsan_release((void*)(addr))
#define TEAM_ACQUIRE(addr) __tsan_acquire((void*)(addr))
static char team_entry;
#else
#define TEAM_RELEASE(addr) ((void)0)
#define TEAM_ACQUIRE(addr) ((void)0)
#endif

/* The per-tensor scalars of one step, rounded to the parameter's type T as torch rounds them. */
#define ADAM_COEFFS(T)                                                                          \
  typedef struct coeffs_##T {                                                                   \
    T sign, decay, wd, w, wm1, b2, c2, bc2s, eps, neg_step_size;                                \
    int coupled, small;                                                                         \
  } coeffs_##T;                                                                                 \
  static inline coeffs_##T coeffs_of_##T(const mfsdp_adam_config* c, int64_t step) {            \
    coeffs_##T k;                                                                               \
    double bc1 = 1.0 - pow(c->beta1, (double)step), bc2 = 1.0 - pow(c->beta2, (double)step);  \
    k.sign = c->maximize ? (T)-1 : (T)1;                                                        \
    k.decay = (T)(c->decoupled ? 1.0 - c->lr * c->weight_decay : 1.0);                          \
    k.coupled = !c->decoupled && c->weight_decay != 0.0;                                        \
    k.wd = (T)c->weight_decay;                                                                  \
    k.w = (T)(1.0 - c->beta1);                                                                  \
    k.small = fabs((double)k.w) < 0.5;                                                          \
    k.wm1 = k.w - (T)1;                                                                         \
    k.b2 = (T)c->beta2;                                                                         \
    k.c2 = (T)(1.0 - c->beta2);                                                                 \
    k.bc2s = (T)pow(bc2, 0.5);                                                                  \
    k.eps = (T)c->eps;                                                                          \
    k.neg_step_size = (T)(-(c->lr / bc1));                                                      \
    return k;                                                                                   \
  }
ADAM_COEFFS(float)
ADAM_COEFFS(double)

/* Gradient reads and compute-copy writes by type code (constants after inlining). */
#define GRAD_SAME 0
#define GRAD_BF16 1
#define GRAD_F16 2
#define COPY_NONE 0
#define COPY_BF16 1
#define COPY_F16 2
#define COPY_F32 3

static inline __attribute__((always_inline)) float grad_f32(const void* g, int64_t i, int gt) {
  if (gt == GRAD_BF16) return mfsdp_bf16_to_f32(((const uint16_t*)g)[i]);
  if (gt == GRAD_F16) return mfsdp_f16_to_f32(((const uint16_t*)g)[i]);
  return ((const float*)g)[i];
}

static inline __attribute__((always_inline)) void put_copy(void* out, int64_t i, float p, int ct) {
  if (ct == COPY_BF16) ((uint16_t*)out)[i] = mfsdp_f32_to_bf16(p);
  if (ct == COPY_F16) ((uint16_t*)out)[i] = mfsdp_f32_to_f16(p);
  if (ct == COPY_F32) ((float*)out)[i] = p;
}

/* The loop of [Note: fused Adam] over elements [lo, hi) of one tensor; SMALL (1-beta1 < 0.5)
 * and COUPLED (Adam's weight decay) are constants, so each loop computes one lerp branch. */
#define ADAM_LOOP(T, SQRT, FMA, GRAD, PUT, SMALL, COUPLED)                                   \
  for (int64_t i = lo; i < hi; ++i) {                                                        \
    T g = GRAD * k.sign;                                                                     \
    T pv = p[i] * k.decay;                                                                   \
    if (COUPLED) g = FMA(pv, k.wd, g);                                                       \
    T mv = m[i];                                                                             \
    T d = g - mv;                                                                            \
    mv = SMALL ? FMA(k.w, d, mv) : FMA(k.wm1, d, g);                                         \
    T vv = v[i] * k.b2;                                                                      \
    vv = FMA(k.c2 * g, g, vv);                                                               \
    m[i] = mv;                                                                               \
    v[i] = vv;                                                                               \
    if (ams) {                                                                               \
      T top = vm[i];                                                                         \
      top = (top >= vv || top != top) ? top : vv; /* torch.maximum: NaN wins */              \
      vm[i] = top;                                                                           \
      vv = top;                                                                              \
    }                                                                                        \
    T denom = SQRT(vv) / k.bc2s + k.eps;                                                     \
    pv = pv + (k.neg_step_size * mv) / denom;                                                \
    p[i] = pv;                                                                               \
    PUT;                                                                                     \
  }
#define ADAM_LOOPS(T, SQRT, FMA, GRAD, PUT)            \
  if (k.small && !k.coupled) {                         \
    ADAM_LOOP(T, SQRT, FMA, GRAD, PUT, 1, 0)           \
  } else if (k.small) {                                \
    ADAM_LOOP(T, SQRT, FMA, GRAD, PUT, 1, 1)           \
  } else if (!k.coupled) {                             \
    ADAM_LOOP(T, SQRT, FMA, GRAD, PUT, 0, 0)           \
  } else {                                             \
    ADAM_LOOP(T, SQRT, FMA, GRAD, PUT, 0, 1)           \
  }

static inline __attribute__((always_inline)) void range_f32(const mfsdp_adam_config* c, const mfsdp_adam_tensor* t,
                                                            int64_t lo, int64_t hi, int gt, int ams, int ct) {
  const coeffs_float k = coeffs_of_float(c, t->step);
  float* restrict p = (float*)t->param;
  float* restrict m = (float*)t->exp_avg;
  float* restrict v = (float*)t->exp_avg_sq;
  float* restrict vm = (float*)t->max_exp_avg_sq;
  const void* restrict gr = t->grad;
  void* restrict out = t->compute;
  ADAM_LOOPS(float, sqrtf, fmaf, grad_f32(gr, i, gt), put_copy(out, i, pv, ct))
}

static inline __attribute__((always_inline)) void range_f64(const mfsdp_adam_config* c, const mfsdp_adam_tensor* t,
                                                            int64_t lo, int64_t hi, int ams) {
  const coeffs_double k = coeffs_of_double(c, t->step);
  double* restrict p = (double*)t->param;
  double* restrict m = (double*)t->exp_avg;
  double* restrict v = (double*)t->exp_avg_sq;
  double* restrict vm = (double*)t->max_exp_avg_sq;
  const double* restrict gr = (const double*)t->grad;
  ADAM_LOOPS(double, sqrt, fma, gr[i], (void)0)
}

static inline int grad_kind(int32_t dtype) {
  return dtype == MFSDP_BF16 ? GRAD_BF16 : dtype == MFSDP_F16 ? GRAD_F16 : GRAD_SAME;
}
static inline int copy_kind(const mfsdp_adam_tensor* t) {
  if (!t->compute) return COPY_NONE;
  return t->compute_dtype == MFSDP_BF16 ? COPY_BF16 : t->compute_dtype == MFSDP_F16 ? COPY_F16 : COPY_F32;
}

/* Every combination spelled out with constants, so each call inlines into its own loop. */
#define F32_CASE(gt, ct)                                   \
  case (gt) * 8 + (ct) * 2:                                \
    range_f32(c, t, lo, hi, (gt), 0, (ct));                \
    return;                                                \
  case (gt) * 8 + (ct) * 2 + 1:                            \
    range_f32(c, t, lo, hi, (gt), 1, (ct));                \
    return;
#define F32_CASES(gt) F32_CASE(gt, COPY_NONE) F32_CASE(gt, COPY_BF16) F32_CASE(gt, COPY_F16) F32_CASE(gt, COPY_F32)

#define DEFINE_STEP_RANGE(name, attr)                                                                   \
  attr static void name(const mfsdp_adam_config* c, const mfsdp_adam_tensor* t, int64_t lo, int64_t hi) { \
    const int ams = c->amsgrad != 0;                                                                    \
    if (t->param_dtype == MFSDP_F64) {                                                                  \
      if (ams)                                                                                          \
        range_f64(c, t, lo, hi, 1);                                                                     \
      else                                                                                              \
        range_f64(c, t, lo, hi, 0);                                                                     \
      return;                                                                                           \
    }                                                                                                   \
    switch (grad_kind(t->grad_dtype) * 8 + copy_kind(t) * 2 + ams) {                                    \
      F32_CASES(GRAD_SAME)                                                                              \
      F32_CASES(GRAD_BF16)                                                                              \
      F32_CASES(GRAD_F16)                                                                               \
      default:                                                                                          \
        return;                                                                                         \
    }                                                                                                   \
  }

#if defined(__x86_64__) && defined(__GNUC__)
DEFINE_STEP_RANGE(step_range_avx512, __attribute__((target("avx512f,avx512vl,avx512bw,avx2,fma"))))
DEFINE_STEP_RANGE(step_range_avx2, __attribute__((target("avx2,fma"))))
#endif
DEFINE_STEP_RANGE(step_range_portable, )

typedef void (*step_range_fn)(const mfsdp_adam_config*, const mfsdp_adam_tensor*, int64_t, int64_t);

static step_range_fn chosen_fn;
static const char* chosen_isa;
static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

static void choose(void) {
  chosen_fn = step_range_portable;
  chosen_isa = "portable";
#if defined(__x86_64__) && defined(__GNUC__)
  const char* cap = getenv("MFSDP_ADAM_ISA"); /* tests compare the paths: "portable" or "avx2" caps the choice */
  int cap_level = !cap ? 2 : !strcmp(cap, "portable") ? 0 : !strcmp(cap, "avx2") ? 1 : 2;
  __builtin_cpu_init();
  if (cap_level >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw")) {
    chosen_fn = step_range_avx512;
    chosen_isa = "avx512";
  } else if (cap_level >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    chosen_fn = step_range_avx2;
    chosen_isa = "avx2";
  }
#endif
}

const char* mfsdp_adam_isa(void) {
  pthread_once(&choose_once, choose);
  return chosen_isa;
}

/* Elements [begin, end) of the tensors laid end to end; starts[i] is tensor i's first. */
typedef struct adam_job {
  const mfsdp_adam_config* cfg;
  const mfsdp_adam_tensor* tensors;
  const int64_t* starts;
  int32_t n_tensors;
  int64_t begin, end;
} adam_job;

static void run_job(const adam_job* j) {
  for (int32_t i = 0; i < j->n_tensors; ++i) {
    int64_t s = j->starts[i], e = s + j->tensors[i].n;
    int64_t lo = s > j->begin ? s : j->begin, hi = e < j->end ? e : j->end;
    if (lo < hi) chosen_fn(j->cfg, &j->tensors[i], lo - s, hi - s);
  }
}

static mfsdp_status check_tensor(const mfsdp_adam_config* cfg, const mfsdp_adam_tensor* t, int32_t i) {
  if (t->n < 0 || t->step < 1)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "tensor %d: %lld elements at step %lld (steps count from 1)", i,
                      (long long)t->n, (long long)t->step);
  if (t->param_dtype != MFSDP_F32 && t->param_dtype != MFSDP_F64)
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "tensor %d: parameters of %s; the fused step takes float32 or float64",
                      i, mfsdp_dtype_name(t->param_dtype));
  int grad_ok = t->grad_dtype == t->param_dtype ||
                (t->param_dtype == MFSDP_F32 && (t->grad_dtype == MFSDP_BF16 || t->grad_dtype == MFSDP_F16));
  if (!grad_ok)
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "tensor %d: %s gradients for %s parameters", i,
                      mfsdp_dtype_name(t->grad_dtype), mfsdp_dtype_name(t->param_dtype));
  if (t->compute && (t->param_dtype != MFSDP_F32 || !mfsdp_dtype_is_float(t->compute_dtype) ||
                     t->compute_dtype == MFSDP_F64))
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "tensor %d: a %s compute copy of %s parameters", i,
                      mfsdp_dtype_name(t->compute_dtype), mfsdp_dtype_name(t->param_dtype));
  if (t->n > 0 && (!t->param || !t->grad || !t->exp_avg || !t->exp_avg_sq || (cfg->amsgrad && !t->max_exp_avg_sq)))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "tensor %d: a null buffer", i);
  return MFSDP_OK;
}

/* Below this many elements per thread a thread costs more than it saves. */
#define MIN_PER_THREAD ((int64_t)1 << 15)
#define MAX_THREADS 256

mfsdp_status mfsdp_adam_step(const mfsdp_adam_config* cfg, const mfsdp_adam_tensor* tensors, int32_t n_tensors,
                             int32_t threads) {
  if (!cfg || n_tensors < 0 || (n_tensors > 0 && !tensors))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "no config or tensors");
  if (!(cfg->beta1 >= 0.0 && cfg->beta1 < 1.0 && cfg->beta2 >= 0.0 && cfg->beta2 < 1.0 && cfg->eps >= 0.0 &&
        cfg->lr >= 0.0 && cfg->weight_decay >= 0.0))
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "lr %g, betas (%g, %g), eps %g, weight_decay %g out of range", cfg->lr,
                      cfg->beta1, cfg->beta2, cfg->eps, cfg->weight_decay);
  int64_t* starts = malloc(sizeof(int64_t) * (size_t)(n_tensors + 1));
  if (!starts) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "%d tensors", n_tensors);
  int64_t total = 0;
  for (int32_t i = 0; i < n_tensors; ++i) {
    mfsdp_status s = check_tensor(cfg, &tensors[i], i);
    if (s != MFSDP_OK) {
      free(starts);
      return s;
    }
    starts[i] = total;
    total += tensors[i].n;
  }
  pthread_once(&choose_once, choose);
  int64_t want = total / MIN_PER_THREAD;
  int32_t n = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
  if (want < n) n = want < 1 ? 1 : (int32_t)want;
  adam_job jobs[MAX_THREADS];
  for (int32_t k = 0; k < n; ++k) {
    /* ranges on 64-element boundaries: whole vectors, and no cache line shared by two threads */
    int64_t b = total * k / n, e = total * (k + 1) / n;
    jobs[k] = (adam_job){cfg, tensors, starts, n_tensors, k ? b & ~(int64_t)63 : 0, k + 1 < n ? e & ~(int64_t)63 : total};
  }
  /* [Note: the step's threads]; a team smaller than asked still runs every range */
  TEAM_RELEASE(&team_entry); /* [Note: the team under ThreadSanitizer] */
#pragma omp parallel for num_threads(n) schedule(static, 1)
  for (int32_t k = 0; k < n; ++k) {
    TEAM_ACQUIRE(&team_entry);
    run_job(&jobs[k]);
    TEAM_RELEASE(&jobs[k]);
  }
  for (int32_t k = 0; k < n; ++k) TEAM_ACQUIRE(&jobs[k]);
  free(starts);
  return MFSDP_OK;
}
