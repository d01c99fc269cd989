/* test_threads.c: the engine's real thread mix, for ThreadSanitizer (`make tsan`; it runs under
 * any build, and make ctest's ASan build runs it too).
 *
 * What runs at once, as in a training process with FusedAdam(step_in_backward=True)
 * ([Note: stepping in backward] in megatron_fsdp_c/_backward_step.py), per rank:
 *   - the autograd thread: the backward, bucket by bucket (grad_ready, the reduce queue's launches
 *     and completions), finish_grads one bucket late, end_backward, the step of what was not
 *     stepped, install_main_weights and the next forward's gathers;
 *   - the sealer: waits for a finished bucket's gradients (mfsdp_pipeline_wait_grads, beside the
 *     autograd thread's engine calls) and takes their fingerprint;
 *   - the optimizer's worker: the fused Adam step of each sealed bucket (mfsdp_adam_step) on an
 *     OpenMP team of its own, writing main weights while the autograd thread runs the backward of
 *     earlier buckets;
 * and the ranks are threads of one process meeting in the thread transport (harness.c). Random
 * sleeps at the hand-offs change the interleaving from one repetition to the next. Every run is
 * checked bit for bit against the same training stepped after the backward on the autograd
 * thread alone, so the test fails on a wrong number as well as on a race report.
 *
 * What TSan cannot see here: the Python side (CPython, torch's allocator and autograd threads,
 * gloo's threads and the storages behind the engine's tensors: make asan's harness covers those
 * paths), the GPU's asynchrony (CUDA streams and events are host-ordered calls in the emulated
 * device) and interleavings this run did not take (it reports races between accesses that did
 * happen, unordered, in one run; not every possible schedule). libgomp is not instrumented: the
 * step's team hand-offs are made visible by the annotations in adam_cpu.c
 * ([Note: the team under ThreadSanitizer]). */
#include <math.h>
#include <pthread.h>
#include <time.h>

#include "../core/mfsdp_adam.h"
#include "../core/mfsdp_kernels.h"
#include "harness.h"

#define TB 4 /* buckets: one unit each */
#define TI 2 /* items per bucket */
#define STEPS 3
#define QMAX (TB * STEPS + 1)

/* ---- a blocking queue of jobs (the executors' queues in fused_adam.py) ---- */
typedef struct job {
  int bucket;
  int64_t step; /* the bucket's step count */
  mfsdp_adam_tensor ts[TI];
} job;

typedef struct job_queue {
  pthread_mutex_t lock;
  pthread_cond_t ready;
  job jobs[QMAX];
  int head, tail, closed;
} job_queue;

static void queue_init(job_queue* q) {
  memset(q, 0, sizeof *q);
  pthread_mutex_init(&q->lock, NULL);
  pthread_cond_init(&q->ready, NULL);
}

static void queue_destroy(job_queue* q) {
  pthread_mutex_destroy(&q->lock);
  pthread_cond_destroy(&q->ready);
}

static void queue_push(job_queue* q, const job* j) {
  pthread_mutex_lock(&q->lock);
  if (q->tail < QMAX) q->jobs[q->tail++] = *j;
  else CHECK(0, "job queue full");
  pthread_cond_signal(&q->ready);
  pthread_mutex_unlock(&q->lock);
}

static void queue_close(job_queue* q) {
  pthread_mutex_lock(&q->lock);
  q->closed = 1;
  pthread_cond_broadcast(&q->ready);
  pthread_mutex_unlock(&q->lock);
}

/* The next job, or 0 once the queue is closed and empty. */
static int queue_pop(job_queue* q, job* out) {
  pthread_mutex_lock(&q->lock);
  while (q->head == q->tail && !q->closed) pthread_cond_wait(&q->ready, &q->lock);
  int got = q->head < q->tail;
  if (got) *out = q->jobs[q->head++];
  pthread_mutex_unlock(&q->lock);
  return got;
}

/* ---- one rank ---- */
typedef struct thread_case {
  const char* name;
  int world, sharded, offload, queue_bytes;
} thread_case;

typedef struct rank_run {
  const thread_case* c;
  loop_world* world;
  int rank, in_backward; /* 0: the reference, every step after the backward on this thread */
  uint64_t seed;
  mfsdp_pipeline* p;
  float* avg[TB][TI];
  float* sq[TB][TI];
  int64_t steps[TB];
  double fingerprint[TB]; /* the sealer's, per bucket, of this step */
  job_queue to_seal, to_step;
  float* result[TB][TI]; /* this rank's main weights after the last step */
  int64_t result_n[TB][TI];
  int stepped_during; /* buckets the worker stepped while the backward ran */
} rank_run;

static const mfsdp_adam_config ADAM = {1e-2, 0.9, 0.999, 1e-8, 1e-2, 0, 0, 1};

static void jitter(uint64_t* rng) { /* up to 300 us at a hand-off */
  struct timespec ts = {0, (long)rng_range(rng, 0, 300) * 1000};
  nanosleep(&ts, NULL);
}

static double grad_of(int rank, int step, int b, int i, int64_t j) {
  return sin(0.001 * (double)j + 0.7 * b + 0.3 * i) * (rank + 1) + 0.05 * step;
}

/* The step's tensors of bucket b (taken on the autograd thread, as _tensors in fused_adam.py). */
static void bucket_job(rank_run* rr, int b, job* out) {
  out->bucket = b;
  out->step = ++rr->steps[b];
  for (int i = 0; i < TI; ++i) {
    int32_t wm, wg;
    int64_t om, og, nm, ng;
    CHECK_OK(mfsdp_pipeline_local_piece(rr->p, b, i, MFSDP_BUF_MAIN_SHARD, &wm, &om, &nm));
    CHECK_OK(mfsdp_pipeline_local_piece(rr->p, b, i, MFSDP_BUF_OPT_GRAD, &wg, &og, &ng));
    CHECK(nm == ng, "%s: bucket %d item %d: %lld main weights, %lld gradients", rr->c->name, b, i, (long long)nm,
          (long long)ng);
    const mfsdp_buffer* main = mfsdp_pipeline_buffer(rr->p, b, wm);
    const mfsdp_buffer* grad = mfsdp_pipeline_buffer(rr->p, b, wg);
    out->ts[i] = (mfsdp_adam_tensor){.param = (float*)main->data + om, .grad = (const float*)grad->data + og,
                                     .exp_avg = rr->avg[b][i], .exp_avg_sq = rr->sq[b][i], .n = nm,
                                     .step = out->step, .param_dtype = MFSDP_F32, .grad_dtype = MFSDP_F32};
  }
}

static double fingerprint_of(const job* j) {
  double s = 0;
  for (int i = 0; i < TI; ++i)
    for (int64_t k = 0; k < j->ts[i].n; ++k) s += fabs((double)((const float*)j->ts[i].grad)[k]);
  return s;
}

static void* sealer(void* arg) {
  rank_run* rr = arg;
  uint64_t rng = rr->seed ^ 0x5ea1;
  job j;
  while (queue_pop(&rr->to_seal, &j)) {
    jitter(&rng);
    CHECK_OK(mfsdp_pipeline_wait_grads(rr->p, j.bucket));
    rr->fingerprint[j.bucket] = fingerprint_of(&j);
    queue_push(&rr->to_step, &j);
  }
  queue_close(&rr->to_step);
  return NULL;
}

static void* worker(void* arg) {
  rank_run* rr = arg;
  uint64_t rng = rr->seed ^ 0x57e9;
  job j;
  while (queue_pop(&rr->to_step, &j)) {
    jitter(&rng);
    CHECK_OK(mfsdp_adam_step(&ADAM, j.ts, TI, 2)); /* its own team, beside the autograd thread */
  }
  return NULL;
}

/* Finishes bucket b in a syncing backward: to the sealer when final, else 0 (stepped after). */
static int finish(rank_run* rr, int b) {
  int ready = 0;
  CHECK_OK(mfsdp_pipeline_finish_grads(rr->p, b, &ready));
  if (!ready) return 0;
  job j;
  bucket_job(rr, b, &j);
  queue_push(&rr->to_seal, &j);
  return 1;
}

static void* rank_main(void* arg) {
  rank_run* rr = arg;
  const thread_case* c = rr->c;
  int W = c->world, r = rr->rank;
  uint64_t rng = rr->seed;
  mfsdp_param_info infos[TB * TI];
  for (int b = 0; b < TB; ++b)
    for (int i = 0; i < TI; ++i) /* large enough for a team of two on every rank (MIN_PER_THREAD) */
      infos[b * TI + i] = (mfsdp_param_info){(int64_t)(300 + 7 * b + 5 * i) * 128 * W, 128, MFSDP_F32, b, 1, 0};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(infos, TB * TI, W, 0, 16, &plan));
  CHECK(plan.n_buckets == TB, "%s: %d buckets", c->name, plan.n_buckets);
  mfsdp_bucket_spec specs[TB];
  for (int b = 0; b < TB; ++b) {
    specs[b] = (mfsdp_bucket_spec){plan.buckets[b].layout, W > 1 ? r : 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32,
                                   c->sharded && W > 1, !c->sharded && W > 1, MFSDP_GRAD_SCATTER_ACCUMULATE};
    specs[b].offload = c->offload;
  }
  loop_rank lr = {rr->world, r};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, &lr, &mfsdp_cpu_kernels, NULL};
  if (c->offload) {
    be.host_memory = &heap_memory_ops;
    be.host_memory_ctx = NULL;
  }
  mfsdp_pipeline_config cfg = {W, r, 1.0 / W, MFSDP_REDUCE_SUM, c->queue_bytes, 0};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, specs, TB, &rr->p));
  mfsdp_pipeline* p = rr->p;
  if (p == NULL) goto out;
  for (int b = 0; b < TB; ++b) {
    const mfsdp_bucket_layout* L = &plan.buckets[b].layout;
    CHECK_OK(mfsdp_pipeline_init_begin(p, b, 0));
    for (int i = 0; i < TI; ++i) {
      float* v = malloc((size_t)L->numels[i] * sizeof *v);
      for (int64_t j = 0; j < L->numels[i]; ++j) v[j] = (float)(0.01 * cos(0.002 * (double)j + b + 0.5 * i));
      CHECK_OK(mfsdp_pipeline_set_item(p, b, i, v, MFSDP_F32, L->numels[i]));
      free(v);
      int32_t where;
      int64_t off, n;
      CHECK_OK(mfsdp_pipeline_local_piece(p, b, i, MFSDP_BUF_MAIN_SHARD, &where, &off, &n));
      rr->avg[b][i] = calloc((size_t)(n ? n : 1), sizeof(float));
      rr->sq[b][i] = calloc((size_t)(n ? n : 1), sizeof(float));
    }
    CHECK_OK(mfsdp_pipeline_init_end(p, b));
  }
  int32_t all[TB];
  for (int b = 0; b < TB; ++b) all[b] = b;
  for (int step = 0; step < STEPS; ++step) {
    queue_init(&rr->to_seal);
    queue_init(&rr->to_step);
    pthread_t seal_thread, step_thread;
    if (rr->in_backward) {
      pthread_create(&seal_thread, NULL, sealer, rr);
      pthread_create(&step_thread, NULL, worker, rr);
    }
    /* forward: every bucket gathered (ZeRO-3 releases each after its use) */
    for (int b = 0; b < TB; ++b) {
      CHECK_OK(mfsdp_pipeline_unshard(p, &all[b], 1));
      CHECK_OK(mfsdp_pipeline_wait_unshard(p, &all[b], 1));
      if (c->sharded) CHECK_OK(mfsdp_pipeline_reshard(p, &all[b], 1));
    }
    /* backward: the last bucket first; each bucket finished one bucket late */
    int finished[TB] = {0};
    CHECK_OK(mfsdp_pipeline_begin_backward(p, 1));
    float* grads[TB][TI] = {{0}};
    for (int b = TB - 1; b >= 0; --b) {
      const mfsdp_bucket_layout* L = &plan.buckets[b].layout;
      if (c->sharded) {
        CHECK_OK(mfsdp_pipeline_unshard(p, &all[b], 1));
        CHECK_OK(mfsdp_pipeline_wait_unshard(p, &all[b], 1));
      }
      for (int i = 0; i < TI; ++i) {
        float* g = grads[b][i] = malloc((size_t)L->numels[i] * sizeof *g);
        for (int64_t j = 0; j < L->numels[i]; ++j) g[j] = (float)grad_of(r, step, b, i, j);
        CHECK_OK(mfsdp_pipeline_grad_ready(p, b, i, g, MFSDP_F32, L->numels[i], NULL));
      }
      if (c->sharded) CHECK_OK(mfsdp_pipeline_reshard(p, &all[b], 1));
      if (rr->in_backward && b + 1 < TB) rr->stepped_during += finished[b + 1] = finish(rr, b + 1);
      if (rr->in_backward) jitter(&rng);
    }
    CHECK_OK(mfsdp_pipeline_end_backward(p));
    for (int b = 0; rr->in_backward && b < TB; ++b)
      if (!finished[b]) finished[b] = finish(rr, b);
    if (rr->in_backward) { /* the backward's end waits for the sealer, optimizer.step() for the worker */
      queue_close(&rr->to_seal);
      pthread_join(seal_thread, NULL);
      pthread_join(step_thread, NULL);
    }
    CHECK_OK(mfsdp_pipeline_sync_grads(p));
    for (int b = 0; b < TB; ++b) {
      job j;
      if (finished[b]) { /* what the worker read has not changed since (_stepped_already) */
        int64_t count = rr->steps[b];
        bucket_job(rr, b, &j);
        rr->steps[b] = count;
        CHECK(fingerprint_of(&j) == rr->fingerprint[b], "%s rank %d step %d bucket %d: the gradient changed after "
              "the sealer read it", c->name, r, step, b);
        continue;
      }
      bucket_job(rr, b, &j);
      CHECK_OK(mfsdp_adam_step(&ADAM, j.ts, TI, 2));
    }
    CHECK_OK(mfsdp_pipeline_install_main_weights(p, 0));
    CHECK_OK(mfsdp_pipeline_zero_grads(p));
    for (int b = 0; b < TB; ++b)
      for (int i = 0; i < TI; ++i) free(grads[b][i]);
    queue_destroy(&rr->to_seal);
    queue_destroy(&rr->to_step);
  }
  for (int b = 0; b < TB; ++b)
    for (int i = 0; i < TI; ++i) {
      int32_t where;
      int64_t off, n;
      CHECK_OK(mfsdp_pipeline_local_piece(p, b, i, MFSDP_BUF_MAIN_SHARD, &where, &off, &n));
      rr->result[b][i] = malloc((size_t)(n ? n : 1) * sizeof(float));
      memcpy(rr->result[b][i], (float*)mfsdp_pipeline_buffer(p, b, where)->data + off, (size_t)n * sizeof(float));
      rr->result_n[b][i] = n;
      free(rr->avg[b][i]);
      free(rr->sq[b][i]);
    }
  mfsdp_pipeline_destroy(p);
out:
  mfsdp_plan_free(&plan);
  return NULL;
}

/* One training of `c` on every rank; runs[r] keeps rank r's results. */
static void train(const thread_case* c, int in_backward, uint64_t seed, rank_run* runs) {
  loop_world w;
  loop_world_init(&w, c->world);
  pthread_t threads[LOOP_MAX_WORLD];
  for (int r = 0; r < c->world; ++r) {
    runs[r] = (rank_run){.c = c, .world = &w, .rank = r, .in_backward = in_backward, .seed = seed * 131 + (uint64_t)r};
    pthread_create(&threads[r], NULL, rank_main, &runs[r]);
  }
  for (int r = 0; r < c->world; ++r) pthread_join(threads[r], NULL);
  CHECK(w.mismatches == 0, "%s: the ranks issued different collectives", c->name);
  loop_world_destroy(&w);
}

static void free_results(rank_run* runs, int world) {
  for (int r = 0; r < world; ++r)
    for (int b = 0; b < TB; ++b)
      for (int i = 0; i < TI; ++i) free(runs[r].result[b][i]);
}

int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 3;
  const thread_case cases[] = {
      /* name, world, sharded, offload, reduce queue bytes (1: every launch completes at once) */
      {"zero2", 2, 0, 0, 1 << 22},      {"zero2 offload", 2, 0, 1, 1 << 22}, {"zero3", 2, 1, 0, 1 << 22},
      {"zero3 offload", 2, 1, 1, 1},    {"zero2 world 4", 4, 0, 0, 1 << 22}, {"zero3 offload world 4", 4, 1, 1, 1 << 22},
  };
  int n_cases = (int)(sizeof cases / sizeof cases[0]);
  for (int k = 0; k < n_cases; ++k) {
    const thread_case* c = &cases[k];
    rank_run ref[LOOP_MAX_WORLD], run[LOOP_MAX_WORLD];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    train(c, 0, 0, ref);
    for (int rep = 0; rep < reps; ++rep) {
      train(c, 1, (uint64_t)(rep + 1), run);
      int during = 0;
      for (int r = 0; r < c->world; ++r) {
        during += run[r].stepped_during;
        for (int b = 0; b < TB; ++b)
          for (int i = 0; i < TI; ++i)
            CHECK(run[r].result_n[b][i] == ref[r].result_n[b][i] &&
                      !memcmp(run[r].result[b][i], ref[r].result[b][i], (size_t)ref[r].result_n[b][i] * sizeof(float)),
                  "%s rep %d rank %d bucket %d item %d: stepped in the backward != stepped after it", c->name, rep, r,
                  b, i);
      }
      CHECK(during == c->world * (TB - 1) * STEPS, "%s rep %d: %d buckets stepped while the backward ran, not %d",
            c->name, rep, during, c->world * (TB - 1) * STEPS);
      free_results(run, c->world);
    }
    free_results(ref, c->world);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("test_threads: %-22s %d repetitions in %.1f s\n", c->name, reps,
           (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    fflush(stdout);
  }
  if (test_failures) {
    fprintf(stderr, "test_threads: %d checks failed\n", test_failures);
    return test_failures > 100 ? 100 : test_failures;
  }
  printf("test_threads: all %ld checks passed (%d cases x %d repetitions)\n", (long)test_checks, n_cases, reps);
  return 0;
}
