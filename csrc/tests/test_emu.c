/* test_emu.c: the shipped CUDA kernels (csrc/cuda/kernels.cu) and native NCCL transport
 * (csrc/cuda/nccl_transport.c) on the emulated device of csrc/tests/emu, for machines without
 * a GPU. Ranks are threads, each with its own "device", current stream and communicators.
 *
 *  - kernels: every dtype pair, aligned and misaligned, sizes around the vector width and past
 *    several grid strides, bit-identical to the CPU kernels; the one-launch pack; NaN counts;
 *    refusals with file:line.
 *  - the pipeline cases of pipeline_cases.c through NCCL transport + CUDA kernels, world 1-4,
 *    with stream-ordered frees (a buffer freed too early is an AddressSanitizer error), once as
 *    they come and once with every stream operation delayed at random (other interleavings).
 *  - a unit of three buckets (fp32, bf16, fp64) gathered as one NCCL group and read by the
 *    consumer stream straight after the wait.
 *  - the watchdog: a collective a peer never joins aborts the communicators within the timeout
 *    and the next call raises MFSDP_ERR_TIMEOUT; the peer then sees MFSDP_ERR_NCCL.
 *
 * Built with AddressSanitizer and UndefinedBehaviorSanitizer by `make ctest`. */
#include <math.h>
#include <time.h>

#include "../cuda/mfsdp_cuda.h"
#include "../cuda/mfsdp_nccl.h"
#include "harness.h"
#include "pipeline_cases.h"

static void nap(double seconds) {
  struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
  nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* kernels: the CUDA table against the CPU one, bit for bit */

typedef struct kernel_rig {
  void* ctx;
  cudaStream_t stream;
} kernel_rig;

/* dst[shift..] <- src[shift..] through both tables; shift misaligns the 16-byte vector path. */
static void expect_binary(kernel_rig* k, int dt, int st, int64_t n, int shift, double alpha, int accumulate) {
  uint64_t rng = (uint64_t)(dt * 131 + st * 17 + n + shift);
  size_t bytes = (size_t)(n + 8) * 8;
  char* src = malloc(bytes);
  char* want = malloc(bytes);
  char* got = malloc(bytes);
  fill_test_values(src, st, n + 8, &rng);
  fill_test_values(want, dt, n + 8, &rng);
  memcpy(got, want, bytes);
  void* s = src + shift * mfsdp_dtype_size(st);
  int64_t off = shift * mfsdp_dtype_size(dt);
  mfsdp_status cpu = accumulate ? mfsdp_cpu_accumulate(want + off, dt, s, st, n, alpha)
                                : mfsdp_cpu_copy(want + off, dt, s, st, n, alpha);
  mfsdp_status gpu = accumulate ? mfsdp_cuda_kernels->accumulate(k->ctx, got + off, dt, s, st, n, alpha)
                                : mfsdp_cuda_kernels->copy(k->ctx, got + off, dt, s, st, n, alpha);
  cudaStreamSynchronize(k->stream);
  CHECK(cpu == MFSDP_OK && gpu == MFSDP_OK, "%s<-%s: %s", mfsdp_dtype_name(dt), mfsdp_dtype_name(st), mfsdp_last_error());
  int64_t wrong = count_differences(want, got, dt, n + 8); /* includes the untouched edges */
  CHECK(wrong == 0, "%s %s<-%s n=%lld shift=%d alpha=%g: %lld elements differ from the CPU kernel",
        accumulate ? "accumulate" : "copy", mfsdp_dtype_name(dt), mfsdp_dtype_name(st), (long long)n, shift, alpha,
        (long long)wrong);
  free(src);
  free(want);
  free(got);
}

/* A bucket of items from mixed source dtypes, packed (or accumulated) by both tables. */
static void expect_pack(kernel_rig* k, int dt, double alpha, int accumulate) {
  enum { ITEMS = 23 };
  uint64_t rng = (uint64_t)(dt * 7 + accumulate + 1);
  mfsdp_pack_item items[ITEMS];
  void* srcs[ITEMS];
  int64_t total = 0;
  for (int i = 0; i < ITEMS; ++i) {
    int64_t n = i == 5 ? 0 : i == 9 ? 40000 : rng_range(&rng, 1, 700); /* an empty item, a long one */
    int st = i < 8 ? MFSDP_F32 : i < 15 ? MFSDP_BF16 : i < 19 ? MFSDP_F32 : MFSDP_F64; /* runs of dtypes */
    srcs[i] = malloc((size_t)(n + 1) * 8);
    fill_test_values(srcs[i], st, n, &rng);
    total += rng_range(&rng, 0, 3); /* holes between items */
    items[i] = (mfsdp_pack_item){srcs[i], st, total, n};
    total += n;
  }
  size_t bytes = (size_t)total * 8 + 8;
  char* want = malloc(bytes);
  char* got = malloc(bytes);
  fill_test_values(want, dt, total, &rng);
  memcpy(got, want, bytes);
  CHECK_OK(mfsdp_cpu_pack(want, dt, items, ITEMS, alpha, accumulate));
  CHECK_OK(mfsdp_cuda_kernels->pack(k->ctx, got, dt, items, ITEMS, alpha, accumulate));
  cudaStreamSynchronize(k->stream);
  int64_t wrong = count_differences(want, got, dt, total);
  CHECK(wrong == 0, "pack into %s alpha=%g accumulate=%d: %lld elements differ", mfsdp_dtype_name(dt), alpha,
        accumulate, (long long)wrong);
  for (int i = 0; i < ITEMS; ++i) free(srcs[i]);
  free(want);
  free(got);
}

/* A bucket pack while torch's caching allocator holds every byte of the device: the kernels
 * may not allocate (no stream-ordered table, no pageable upload), and a pack of more items
 * than one launch's table takes still lands in one call. */
static void expect_pack_with_full_pool(kernel_rig* k, int device) {
  enum { ITEMS = 3000 };
  mfsdp_pack_item* items = calloc(ITEMS, sizeof *items);
  float* src = malloc(ITEMS * 5 * sizeof *src);
  float* want = calloc(ITEMS * 6, sizeof *want);
  float* got = calloc(ITEMS * 6, sizeof *got);
  uint64_t rng = 11;
  fill_test_values(src, MFSDP_F32, ITEMS * 5, &rng);
  for (int i = 0; i < ITEMS; ++i) /* runs of 0-4 elements, one gap each */
    items[i] = (mfsdp_pack_item){src + 5 * i, MFSDP_F32, 6 * i + 1, i % 5};
  size_t held = emu_device_memory_free(device);
  CHECK(emu_device_reserve(device, (long long)held), "torch takes the whole pool");
  long allocations = emu_runtime_allocations();
  CHECK_OK(mfsdp_cpu_pack(want, MFSDP_F32, items, ITEMS, 1.0 / 3.0, 1));
  CHECK_OK(mfsdp_cuda_kernels->pack(k->ctx, got, MFSDP_F32, items, ITEMS, 1.0 / 3.0, 1));
  int64_t bad = -1;
  CHECK_OK(mfsdp_cuda_kernels->count_nonfinite(k->ctx, got, MFSDP_F32, ITEMS * 6, &bad));
  cudaStreamSynchronize(k->stream);
  CHECK(count_differences(want, got, MFSDP_F32, ITEMS * 6) == 0, "pack of %d items with a full pool differs", ITEMS);
  CHECK(emu_runtime_allocations() == allocations, "the kernels allocated device memory %ld times",
        emu_runtime_allocations() - allocations);
  emu_device_reserve(device, -(long long)held);
  free(items);
  free(src);
  free(want);
  free(got);
}

static void test_kernels(void) {
  /* The engine's tensors and torch's stream are on device 1 while the calling thread's current
   * device is 0 (a rank that never called torch.cuda.set_device): every entry point must make
   * its own device current, and give the caller's back. */
  const int device = 1;
  kernel_rig k;
  cudaSetDevice(device);
  cudaStreamCreateWithPriority(&k.stream, cudaStreamNonBlocking, 0);
  CHECK_OK(mfsdp_cuda_kernel_context(device, &k.ctx));
  mfsdp_cuda_set_stream(k.ctx, k.stream);
  cudaSetDevice(0);
  /* 2 SMs x 8 blocks x 256 threads: 4096 threads, so 100003 elements take several strides */
  const int64_t sizes[] = {1, 7, 8, 9, 1031, 100003};
  for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt)
    for (int st = 0; st < MFSDP_NUM_FLOAT_DTYPES; ++st)
      for (size_t z = 0; z < sizeof sizes / sizeof sizes[0]; ++z)
        for (int shift = 0; shift < 2; ++shift) {
          expect_binary(&k, dt, st, sizes[z], shift, 1.0, 0);
          expect_binary(&k, dt, st, sizes[z], shift, 1.0 / 3.0, 0);
          expect_binary(&k, dt, st, sizes[z], shift, 0.25, 1);
          expect_binary(&k, dt, st, sizes[z], shift, 1.0 / 3.0, 1); /* not a power of two: no FMA */
        }
  for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt)
    for (int acc = 0; acc < 2; ++acc) {
      expect_pack(&k, dt, 1.0, acc);
      expect_pack(&k, dt, 0.125, acc);
      expect_pack(&k, dt, 1.0 / 3.0, acc);
    }
  expect_pack_with_full_pool(&k, device);
  int current = -1;
  cudaGetDevice(&current);
  CHECK(current == 0, "a kernel entry point left device %d current (the caller's was 0)", current);
  /* scale and fill_zero */
  float x[1000], y[1000];
  uint64_t rng = 5;
  fill_test_values(x, MFSDP_F32, 1000, &rng);
  memcpy(y, x, sizeof x);
  CHECK_OK(mfsdp_cpu_scale(x + 1, MFSDP_F32, 998, 0.5));
  CHECK_OK(mfsdp_cuda_kernels->scale(k.ctx, y + 1, MFSDP_F32, 998, 0.5));
  cudaStreamSynchronize(k.stream);
  CHECK(count_differences(x, y, MFSDP_F32, 1000) == 0, "scale differs");
  CHECK_OK(mfsdp_cuda_kernels->fill_zero(k.ctx, y + 3, MFSDP_F32, 990));
  cudaStreamSynchronize(k.stream);
  CHECK(y[3] == 0.0f && y[992] == 0.0f && y[993] == x[993] && y[2] == x[2], "fill_zero covers exactly its range");
  /* NaN / Inf counts */
  for (int dt = 0; dt < MFSDP_NUM_FLOAT_DTYPES; ++dt) {
    char buf[70001 * 8];
    fill_test_values(buf, dt, 70001, &rng);
    int64_t want = -1, got = -2;
    CHECK_OK(mfsdp_cpu_count_nonfinite(buf, dt, 70001, &want));
    CHECK_OK(mfsdp_cuda_kernels->count_nonfinite(k.ctx, buf, dt, 70001, &got));
    CHECK(want == got && want > 0, "count_nonfinite %s: cpu %lld cuda %lld", mfsdp_dtype_name(dt), (long long)want,
          (long long)got);
  }
  /* refusals name the file and line */
  int32_t ints[4] = {0};
  CHECK(mfsdp_cuda_kernels->copy(k.ctx, x, MFSDP_F32, ints, MFSDP_I32, 4, 1.0) == MFSDP_ERR_UNSUPPORTED,
        "int -> float refused");
  CHECK(strstr(mfsdp_last_error(), "kernels.cu:") != NULL, "error names kernels.cu: %s", mfsdp_last_error());
  CHECK(mfsdp_cuda_kernels->copy(k.ctx, x, MFSDP_F32, y, MFSDP_F32, -1, 1.0) == MFSDP_ERR_INVALID_ARGUMENT,
        "negative count refused");
  CHECK(mfsdp_cuda_kernels->copy(k.ctx, NULL, MFSDP_F32, y, MFSDP_F32, 4, 1.0) == MFSDP_ERR_INVALID_ARGUMENT,
        "null buffer refused");
  cudaStreamSynchronize(k.stream);
  mfsdp_cuda_set_stream(k.ctx, NULL);
  cudaStreamDestroy(k.stream);
}

/* ------------------------------------------------------------------------------------------ */
/* the NCCL rig: emulated device memory, the native transport, the CUDA kernels */

typedef struct emu_world {
  int n;
  ncclUniqueId ids[2];
  double timeout_s;
} emu_world;

typedef struct emu_rank {
  cudaStream_t stream; /* the rank's "torch current stream" */
  void* kernels_ctx;
  mfsdp_nccl* nccl;
} emu_rank;

/* Device memory as torch's caching allocator gives it: allocation at once, freeing ordered
 * after the work already queued on the current stream. */
static mfsdp_status dev_create(void* ctx, int64_t numel, int32_t dtype, mfsdp_buffer* out) {
  MFSDP_CHECK(heap_memory_ops.create(ctx, numel, dtype, out));
  out->device = 0;
  return MFSDP_OK;
}

static void stream_free(void* mem) { free(mem); }

static mfsdp_status dev_release(void* ctx, mfsdp_buffer* buf) {
  emu_rank* r = ctx;
  heap_block* b = buf->handle;
  if (b->mem) emu_stream_host_fn(r->stream, stream_free, b->mem);
  b->mem = NULL;
  buf->data = NULL;
  return MFSDP_OK;
}

static void dev_destroy(void* ctx, mfsdp_buffer* buf) {
  dev_release(ctx, buf);
  free(buf->handle);
  buf->handle = NULL;
}

static mfsdp_memory_ops dev_memory_ops; /* heap ops with the two above; filled in main */

static void* emu_world_create(int n) {
  emu_world* w = calloc(1, sizeof *w);
  w->n = n;
  w->timeout_s = 30.0;
  ncclGetUniqueId(&w->ids[0]);
  ncclGetUniqueId(&w->ids[1]);
  return w;
}

static int emu_rank_setup(void* world, int rank, mfsdp_backend* be, void** state) {
  emu_world* w = world;
  emu_rank* r = calloc(1, sizeof *r);
  /* One device per rank, with torch's current stream on it; the thread's current device stays
   * 0, as on a rank that never called torch.cuda.set_device: the engine must not depend on it. */
  cudaSetDevice(rank);
  cudaStreamCreateWithPriority(&r->stream, cudaStreamNonBlocking, 0);
  cudaSetDevice(0);
  if (mfsdp_cuda_kernel_context(rank, &r->kernels_ctx) != MFSDP_OK) return -1;
  mfsdp_cuda_set_stream(r->kernels_ctx, r->stream);
  *state = r;
  if (mfsdp_nccl_create(w->ids, rank, w->n, rank, w->timeout_s, &r->nccl) != MFSDP_OK) return -1;
  *be = (mfsdp_backend){&dev_memory_ops, r, &mfsdp_nccl_ops, r->nccl, mfsdp_cuda_kernels, r->kernels_ctx};
  return 0;
}

static void emu_rank_sync(void* state) { cudaStreamSynchronize(((emu_rank*)state)->stream); }

static void emu_rank_teardown(void* state) {
  emu_rank* r = state;
  if (r == NULL) return;
  cudaStreamSynchronize(r->stream);
  mfsdp_nccl_destroy(r->nccl);
  mfsdp_cuda_set_stream(r->kernels_ctx, NULL);
  cudaStreamDestroy(r->stream);
  free(r);
}

static const pipe_rig nccl_rig = {"emulated NCCL + CUDA kernels", emu_world_create, free, emu_rank_setup,
                                  emu_rank_sync, emu_rank_teardown, NULL};

/* ------------------------------------------------------------------------------------------ */
/* a unit of several buckets: its gathers go out as one NCCL group */

enum { UNIT_BUCKETS = 3, UNIT_ROWS = 10, UNIT_COLS = 6 };

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
    specs[b] = (mfsdp_bucket_spec){bp->world, r, bp->shard_size, bp->n_items, bp->offsets, bp->numels, dtypes[b],
                                   dtypes[b], dtypes[b], dtypes[b], 1, 0, MFSDP_GRAD_SCATTER_ACCUMULATE};
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

static void test_grouped_unit(void) {
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
    free(w);
    long grouped = emu_nccl_grouped_collectives() - before;
    CHECK(grouped == 3L * UNIT_BUCKETS * n, "world %d: %ld gathers launched in groups, expected %d", n, grouped,
          3 * UNIT_BUCKETS * n);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* the watchdog: rank 1 never joins rank 0's all-gather */

typedef struct stall_thread {
  emu_world* world;
  int rank;
} stall_thread;

static _Atomic int g_rank0_aborted = 0;

static void* stall_worker(void* arg) {
  stall_thread* t = arg;
  mfsdp_backend be;
  void* state = NULL;
  CHECK(emu_rank_setup(t->world, t->rank, &be, &state) == 0, "setup: %s", mfsdp_last_error());
  emu_rank* r = state;
  float* full = calloc(64, sizeof *full);
  float* shard = full + 32 * t->rank;
  mfsdp_buffer fb = {full, 64, MFSDP_F32, 0, NULL}, sb = {shard, 32, MFSDP_F32, 0, NULL};
  mfsdp_work* w = NULL;
  if (t->rank == 0) {
    CHECK_OK(mfsdp_nccl_ops.all_gather(r->nccl, &fb, &sb, &w)); /* issued; the peer never comes */
    CHECK_OK(mfsdp_nccl_ops.wait(r->nccl, w));                  /* orders the stream, does not block */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    mfsdp_status s = MFSDP_OK;
    while (s == MFSDP_OK) { /* what a training loop sees: its next collective is refused */
      nap(0.05);
      mfsdp_work* w2 = NULL;
      s = mfsdp_nccl_ops.all_gather(r->nccl, &fb, &sb, &w2);
      if (s == MFSDP_OK) mfsdp_nccl_ops.discard(r->nccl, w2);
      clock_gettime(CLOCK_MONOTONIC, &b);
      if ((double)(b.tv_sec - a.tv_sec) > 10.0) break;
    }
    double waited = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
    CHECK(s == MFSDP_ERR_TIMEOUT, "stalled collective -> %s: %s", mfsdp_status_name(s), mfsdp_last_error());
    CHECK(strstr(mfsdp_last_error(), "within the timeout") && strstr(mfsdp_last_error(), "nccl_transport.c:"),
          "timeout message names the cause and file:line: %s", mfsdp_last_error());
    CHECK(waited > 0.2 && waited < 5.0, "timeout 0.3 s raised after %.2f s", waited);
    CHECK(mfsdp_nccl_failure(r->nccl) != NULL, "failure reason kept");
    printf("test_emu: a collective the peer never joined raised MFSDP_ERR_TIMEOUT after %.2f s (timeout 0.3 s)\n",
           waited);
    g_rank0_aborted = 1;
  } else {
    while (!g_rank0_aborted) nap(0.01);
    /* the peer aborted: this rank's collective cannot complete, NCCL reports a remote error */
    CHECK_OK(mfsdp_nccl_ops.all_gather(r->nccl, &fb, &sb, &w));
    CHECK_OK(mfsdp_nccl_ops.wait(r->nccl, w));
    mfsdp_status s = MFSDP_OK;
    for (int i = 0; i < 100 && s == MFSDP_OK; ++i) {
      nap(0.02);
      mfsdp_work* w2 = NULL;
      s = mfsdp_nccl_ops.all_gather(r->nccl, &fb, &sb, &w2);
      if (s == MFSDP_OK) mfsdp_nccl_ops.discard(r->nccl, w2);
    }
    CHECK(s == MFSDP_ERR_NCCL && strstr(mfsdp_last_error(), "remote"), "peer of an aborted rank -> %s: %s",
          mfsdp_status_name(s), mfsdp_last_error());
  }
  emu_rank_sync(r); /* the broken collectives ended: nothing waits forever */
  emu_rank_teardown(r);
  free(full);
  return NULL;
}

static void test_watchdog(void) {
  emu_world* w = emu_world_create(2);
  w->timeout_s = 0.3;
  pthread_t threads[2];
  stall_thread args[2] = {{w, 0}, {w, 1}};
  for (int r = 0; r < 2; ++r) pthread_create(&threads[r], NULL, stall_worker, &args[r]);
  for (int r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
  free(w);
}

/* ------------------------------------------------------------------------------------------ */

int main(void) {
  dev_memory_ops = heap_memory_ops;
  dev_memory_ops.create = dev_create;
  dev_memory_ops.release = dev_release;
  dev_memory_ops.destroy = dev_destroy;
  int streams_before = emu_streams_alive();
  test_kernels();
  long before = emu_nccl_collectives();
  run_pipeline_cases(&nccl_rig, 4, 0);
  run_pipeline_cases(&nccl_rig, 1, 1); /* world 1 with collectives, as tests/test_cuda.py runs on one GPU */
  emu_set_jitter_us(300);               /* again with streams starting work at random moments */
  run_pipeline_cases(&nccl_rig, 4, 0);
  emu_set_jitter_us(0);
  test_grouped_unit();
  long collectives = emu_nccl_collectives() - before;
  CHECK(emu_nccl_premul_reductions() > 0, "no_shard / ZeRO-1 float32 reductions pre-multiply inside NCCL");
  CHECK(emu_nccl_live_ops() == 0, "%d pre-multiply operators never destroyed", emu_nccl_live_ops());
  test_watchdog();
  CHECK(emu_streams_alive() == streams_before, "%d streams left alive", emu_streams_alive() - streams_before);
  if (test_failures) {
    fprintf(stderr, "test_emu: %d checks failed\n", test_failures);
    return test_failures > 100 ? 100 : test_failures;
  }
  printf("test_emu: all checks passed (%ld NCCL collectives through the native transport, %ld pre-multiplied)\n",
         collectives, emu_nccl_premul_reductions());
  return 0;
}
