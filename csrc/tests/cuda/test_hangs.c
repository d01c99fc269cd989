/* test_hangs.c (a part of test_emu, whose runner is csrc/tests/test_emu.c): what must never hang:
 * teardown, blocking waits, the watchdog. */
#include <math.h>

#include "cuda_tests.h"

/* teardown and blocking: what must never hang */

/* One all-gather every rank joins: the communicators connect (NCCL does at first use). */
void warm_up(emu_rank* r, const mfsdp_buffer* full, const mfsdp_buffer* shard) {
  mfsdp_work* w = NULL;
  CHECK_OK(mfsdp_nccl_ops.all_gather(r->nccl, full, shard, &w));
  CHECK_OK(mfsdp_nccl_ops.wait(r->nccl, w));
  emu_rank_sync(r);
}

/* Runs fn(arg) on a thread; 1 if it returned within `seconds`. If not, the caller must make it
 * return (release what it waits for) and then join `*thread`. */
typedef struct timed_call {
  void (*fn)(void*);
  void* arg;
  _Atomic int done;
} timed_call;

static void* timed_main(void* p) {
  timed_call* c = p;
  c->fn(c->arg);
  c->done = 1;
  return NULL;
}

static int returns_within(timed_call* c, double seconds, pthread_t* thread) {
  c->done = 0;
  pthread_create(thread, NULL, timed_main, c);
  for (double waited = 0; waited < seconds && !c->done; waited += 0.01) nap(0.01);
  if (!c->done) return 0;
  pthread_join(*thread, NULL);
  return 1;
}

/* Two ranks, each a thread running its part of a scenario in turn (see the tests below). */
typedef struct duo {
  emu_world* world;
  emu_rank* rank[2];
  float* full[2];
  mfsdp_buffer fb[2], sb[2];
  _Atomic int step; /* rank 1 waits for rank 0 to reach a step */
  mfsdp_status seen[2];
  double took[2];
} duo;

static void duo_setup(duo* d, int n_connect, double timeout_s) {
  memset(d, 0, sizeof *d);
  d->world = emu_world_create(2);
  d->world->timeout_s = timeout_s;
  for (int r = 0; r < 2; ++r) {
    d->full[r] = calloc(64, sizeof(float));
    d->fb[r] = (mfsdp_buffer){d->full[r], 64, MFSDP_F32, r, NULL};
    d->sb[r] = (mfsdp_buffer){d->full[r] + 32 * r, 32, MFSDP_F32, r, NULL};
  }
  (void)n_connect;
}

static void duo_free(duo* d) {
  for (int r = 0; r < 2; ++r) free(d->full[r]);
  emu_world_destroy(d->world);
}

static void wait_step(duo* d, int step) {
  while (d->step < step) nap(0.005);
}

typedef struct duo_rank {
  duo* d;
  int rank;
  void (*body)(duo* d, int rank);
} duo_rank;

static void* duo_main(void* p) {
  duo_rank* a = p;
  mfsdp_backend be;
  void* state = NULL;
  CHECK(emu_rank_setup(a->d->world, a->rank, &be, &state) == 0, "setup: %s", mfsdp_last_error());
  a->d->rank[a->rank] = state;
  a->body(a->d, a->rank);
  return NULL;
}

static void run_duo(duo* d, void (*body)(duo*, int)) {
  pthread_t threads[2];
  duo_rank args[2] = {{d, 0, body}, {d, 1, body}};
  for (int r = 0; r < 2; ++r) pthread_create(&threads[r], NULL, duo_main, &args[r]);
  for (int r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
}

/* Item: a peer that dies before the communicators connected. NCCL connects at a communicator's
 * first collective and waits for the peers there; the engine must still raise within the
 * timeout (and never hold the lock the watchdog aborts under while NCCL waits). */
static void issue_gather(void* arg) {
  duo* d = arg;
  struct timespec a;
  clock_gettime(CLOCK_MONOTONIC, &a);
  mfsdp_work* w = NULL;
  d->seen[0] = mfsdp_nccl_ops.all_gather(d->rank[0]->nccl, &d->fb[0], &d->sb[0], &w);
  if (d->seen[0] == MFSDP_OK) d->seen[0] = mfsdp_nccl_ops.wait(d->rank[0]->nccl, w);
  d->took[0] = seconds_since(&a);
}

static void dead_peer_at_connect(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  if (rank == 0) {
    timed_call call = {issue_gather, d, 0};
    pthread_t th;
    int returned = returns_within(&call, 5.0, &th);
    CHECK(returned, "a collective whose peer never connected held the engine for 5 s (timeout 0.5 s)");
    d->step = 1; /* the peer shows up now: lets a blocked call finish */
    if (!returned) pthread_join(th, NULL);
    CHECK(d->seen[0] == MFSDP_ERR_TIMEOUT, "a peer that never connected -> %s: %s", mfsdp_status_name(d->seen[0]),
          mfsdp_last_error());
    CHECK(!returned || d->took[0] < 3.0, "raised after %.2f s (timeout 0.5 s)", d->took[0]);
    printf("test_emu: a collective whose peer never connected raised %s after %.2f s (timeout 0.5 s)\n",
           mfsdp_status_name(d->seen[0]), d->took[0]);
    d->step = 2;
  } else {
    wait_step(d, 1);
    mfsdp_work* w = NULL;
    if (mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[1], &d->sb[1], &w) == MFSDP_OK) mfsdp_nccl_ops.discard(r->nccl, w);
    wait_step(d, 2);
  }
  emu_rank_teardown(r);
}

void test_dead_peer_at_connect(void) {
  duo d;
  duo_setup(&d, 0, 0.5);
  run_duo(&d, dead_peer_at_connect);
  duo_free(&d);
}

/* Item: a transport dropped while a collective is in flight (garbage collection of a model in a
 * reference cycle happens at different moments on different ranks). Destroying the
 * communicators waits for that collective, which needs the peer: it must abort instead. */
static void drop_transport(void* arg) { /* what NcclTransport's dealloc does */
  emu_rank* r = arg;
  mfsdp_nccl_destroy(r->nccl);
  r->nccl = NULL;
}

static void destroy_in_flight(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  warm_up(r, &d->fb[rank], &d->sb[rank]);
  if (rank == 0) {
    mfsdp_work* w = NULL;
    CHECK_OK(mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[0], &d->sb[0], &w)); /* rank 1 joins late, or never */
    mfsdp_nccl_ops.discard(r->nccl, w);
    long aborts = emu_nccl_aborts();
    timed_call call = {drop_transport, r, 0};
    pthread_t th;
    int returned = returns_within(&call, 3.0, &th);
    CHECK(returned, "dropping a transport with a collective in flight hung for 3 s (ncclCommDestroy waits for peers)");
    d->step = 1;
    if (!returned) pthread_join(th, NULL);
    CHECK(emu_nccl_aborts() - aborts >= 2, "dropped without close: its communicators are aborted, not destroyed");
    d->step = 2;
    emu_rank_teardown(r);
  } else {
    wait_step(d, 1);
    mfsdp_work* w = NULL;
    mfsdp_status s = mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[1], &d->sb[1], &w);
    if (s == MFSDP_OK) s = mfsdp_nccl_ops.wait(r->nccl, w);
    emu_rank_sync(r);
    wait_step(d, 2);
    emu_rank_teardown(r);
  }
}

void test_destroy_in_flight(void) {
  duo d;
  duo_setup(&d, 1, 30.0);
  run_duo(&d, destroy_in_flight);
  duo_free(&d);
}

/* Item: the watchdog aborting the communicators while a group is open. A collective the peer
 * never joins goes stale while rank 0 sits between group_start and group_end; the group's end
 * must report the timeout and touch no aborted communicator. */
static void abort_inside_group(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  warm_up(r, &d->fb[rank], &d->sb[rank]);
  if (rank == 0) {
    mfsdp_work *stale = NULL, *grouped = NULL;
    CHECK_OK(mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[0], &d->sb[0], &stale)); /* never joined */
    mfsdp_status s = mfsdp_nccl_ops.group_start(r->nccl);
    if (s == MFSDP_OK) {
      mfsdp_status g = mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[0], &d->sb[0], &grouped);
      nap(1.0); /* the watchdog aborts meanwhile (timeout 0.3 s) */
      s = mfsdp_nccl_ops.group_end(r->nccl);
      if (s == MFSDP_OK) s = g;
      if (grouped) {
        mfsdp_status ws = mfsdp_nccl_ops.wait(r->nccl, grouped);
        if (s == MFSDP_OK) s = ws;
      }
    }
    CHECK(s == MFSDP_ERR_TIMEOUT, "a group the watchdog aborted -> %s: %s", mfsdp_status_name(s), mfsdp_last_error());
    mfsdp_nccl_ops.discard(r->nccl, stale);
    d->step = 1;
  } else {
    wait_step(d, 1);
  }
  emu_rank_teardown(r);
}

void test_abort_inside_group(void) {
  duo d;
  duo_setup(&d, 1, 0.3);
  run_duo(&d, abort_inside_group);
  duo_free(&d);
}

/* Item: a pipeline destroyed while its gather is in flight. Its buffers go back to the
 * allocator on the consumer stream (stream-ordered frees, as torch's caching allocator): that
 * stream must first wait for the collective, or NCCL writes into freed memory (an
 * AddressSanitizer error here). */
static void pipeline_destroy_in_flight(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  mfsdp_param_info info = {UNIT_ROWS * UNIT_COLS, UNIT_COLS, MFSDP_F32, 0, 1, 0};
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(&info, 1, 2, 0, 16, &plan));
  mfsdp_bucket_plan* bp = &plan.buckets[0];
  mfsdp_bucket_spec spec = {bp->layout, rank, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0,
                            MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_backend be = {&dev_memory_ops, r, &mfsdp_nccl_ops, r->nccl, mfsdp_cuda_kernels, r->kernels_ctx};
  mfsdp_pipeline_config cfg = {2, rank, 0.5, MFSDP_REDUCE_SUM, 1 << 20, 0};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  float v[UNIT_ROWS * UNIT_COLS] = {0};
  int32_t id = 0;
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, 0));
  CHECK_OK(mfsdp_pipeline_set_item(p, 0, 0, v, MFSDP_F32, UNIT_ROWS * UNIT_COLS));
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  CHECK_OK(mfsdp_pipeline_unshard(p, &id, 1)); /* connects */
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, &id, 1));
  CHECK_OK(mfsdp_pipeline_reshard(p, &id, 1));
  emu_rank_sync(r);
  if (rank == 1) nap(0.3); /* the peer comes late to the next gather */
  CHECK_OK(mfsdp_pipeline_unshard(p, &id, 1));
  mfsdp_pipeline_destroy(p); /* rank 0: the gather has not run yet */
  emu_rank_sync(r);
  emu_rank_teardown(r);
  mfsdp_plan_free(&plan);
}

void test_pipeline_destroy_in_flight(void) {
  duo d;
  duo_setup(&d, 0, 30.0);
  run_duo(&d, pipeline_destroy_in_flight);
  duo_free(&d);
}

/* Item: the explicit, collective end. Every rank closes: the communicators are finalized and
 * destroyed, none aborted, and the transport refuses further collectives. */
static void close_together(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  warm_up(r, &d->fb[rank], &d->sb[rank]);
  long destroys = emu_nccl_destroys(), aborts = emu_nccl_aborts();
  CHECK_OK(mfsdp_nccl_close(r->nccl));
  mfsdp_work* w = NULL;
  CHECK(mfsdp_nccl_ops.all_gather(r->nccl, &d->fb[rank], &d->sb[rank], &w) == MFSDP_ERR_INVALID_STATE && w == NULL,
        "a collective after close is refused: %s", mfsdp_last_error());
  d->step++;
  while (d->step < 2) nap(0.005); /* both closed before the counts are read */
  CHECK(emu_nccl_destroys() - destroys >= 2 && emu_nccl_aborts() == aborts,
        "closed: %ld communicators destroyed, %ld aborted", emu_nccl_destroys() - destroys, emu_nccl_aborts() - aborts);
  mfsdp_nccl_destroy(r->nccl);
  r->nccl = NULL;
  d->step++;
  while (d->step < 4) nap(0.005);
  emu_rank_teardown(r);
}

/* ... and a rank whose peer never closes gets the timeout, not a hang. */
static void close_alone(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  warm_up(r, &d->fb[rank], &d->sb[rank]);
  if (rank == 0) {
    struct timespec a;
    clock_gettime(CLOCK_MONOTONIC, &a);
    mfsdp_status s = mfsdp_nccl_close(r->nccl);
    double took = seconds_since(&a);
    CHECK(s == MFSDP_ERR_TIMEOUT && took < 3.0, "close without the peer -> %s after %.2f s (timeout 0.5 s): %s",
          mfsdp_status_name(s), took, mfsdp_last_error());
    d->step = 1;
  } else {
    wait_step(d, 1);
  }
  emu_rank_teardown(r);
}

void test_close(void) {
  duo d;
  duo_setup(&d, 1, 30.0);
  run_duo(&d, close_together);
  duo_free(&d);
  duo_setup(&d, 1, 0.5);
  run_duo(&d, close_alone);
  duo_free(&d);
}

/* Waiting for NCCL lets others run (the glue releases the GIL there) and stops on Ctrl-C. */
typedef struct hook_state {
  _Atomic int begins, ends, polls;
} hook_state;
static void* hook_begin(void* arg) {
  ((hook_state*)arg)->begins++;
  return arg;
}
static void hook_end(void* arg, void* token) {
  CHECK(token == arg, "block_end gets block_begin's token");
  ((hook_state*)arg)->ends++;
}
static int hook_interrupted(void* arg) { return ++((hook_state*)arg)->polls > 150; /* ~0.1 s in */ }

static void interrupted_wait(duo* d, int rank) {
  emu_rank* r = d->rank[rank];
  if (rank == 0) {
    issue_gather(d); /* the peer never connects; the timeout is 30 s */
    CHECK(d->seen[0] == MFSDP_ERR_COMM && strstr(mfsdp_last_error(), "interrupted") && d->took[0] < 3.0,
          "Ctrl-C while NCCL connects -> %s after %.2f s: %s", mfsdp_status_name(d->seen[0]), d->took[0],
          mfsdp_last_error());
    d->step = 1;
  } else {
    wait_step(d, 1);
  }
  emu_rank_teardown(r);
}

void test_interrupt(void) {
  hook_state hs = {0, 0, 0};
  mfsdp_nccl_hooks hooks = {hook_begin, hook_end, hook_interrupted, &hs};
  duo d;
  duo_setup(&d, 0, 30.0);
  d.world->hooks = &hooks;
  run_duo(&d, interrupted_wait);
  CHECK(hs.begins >= 1 && hs.begins == hs.ends, "the wait was bracketed by the hooks (%d begins, %d ends)", hs.begins,
        hs.ends);
  duo_free(&d);
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
  mfsdp_buffer fb = {full, 64, MFSDP_F32, t->rank, NULL}, sb = {shard, 32, MFSDP_F32, t->rank, NULL};
  mfsdp_work* w = NULL;
  warm_up(r, &fb, &sb); /* connected: what stalls below is a launched collective */
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
    CHECK(strstr(mfsdp_last_error(), "within the timeout") && strstr(mfsdp_last_error(), "nccl_watch.c:"),
          "timeout message names the cause and file:line: %s", mfsdp_last_error());
    CHECK(waited > 0.2 && waited < 5.0, "timeout 0.3 s raised after %.2f s", waited);
    CHECK(mfsdp_nccl_failure(r->nccl) != NULL, "failure reason kept");
    printf("test_emu: a collective the peer never joined raised MFSDP_ERR_TIMEOUT after %.2f s (timeout 0.3 s)\n",
           waited);
    g_rank0_aborted = 1;
  } else {
    while (!g_rank0_aborted) nap(0.01);
    /* the peer aborted: this rank's collective cannot complete, NCCL reports a remote error
     * (at once, or at a later call) */
    mfsdp_status s = mfsdp_nccl_ops.all_gather(r->nccl, &fb, &sb, &w);
    if (s == MFSDP_OK) s = mfsdp_nccl_ops.wait(r->nccl, w);
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

void test_watchdog(void) {
  emu_world* w = emu_world_create(2);
  w->timeout_s = 0.3;
  pthread_t threads[2];
  stall_thread args[2] = {{w, 0}, {w, 1}};
  for (int r = 0; r < 2; ++r) pthread_create(&threads[r], NULL, stall_worker, &args[r]);
  for (int r = 0; r < 2; ++r) pthread_join(threads[r], NULL);
  emu_world_destroy(w);
}
