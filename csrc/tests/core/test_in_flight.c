/* test_in_flight.c (a part of test_core, whose runner is csrc/tests/test_core.c): no buffer is
 * freed under a collective that may still write it ([Note: buffers under a collective] in
 * csrc/comm/buffers.c).
 *
 * Rank 0 of a world of 2 on a transport whose all-gather lands late: it returns a pending work,
 * and the peer's rows are written into the output when the work is waited for, or, for a wait
 * that failed, whenever the test says the late peer arrived (gloo's worker writes then: see
 * benchmarks/repro/gloo_freed_output.py). The buffers are heap blocks freed at release, so under
 * make ctest's ASan a landing in freed memory is a heap-use-after-free report, not a silent
 * write. */
#include <string.h>

#include "../../comm/pipeline_internal.h"
#include "../../core/mfsdp_kernels.h"
#include "../harness.h"
#include "core_tests.h"

typedef struct late_gather {
  char* full;     /* the output as the collective captured it */
  int64_t bytes;  /* one rank's rows */
  int pending;    /* issued, not landed */
  int fail_wait;  /* waits time out; the collective keeps running */
} late_gather;

/* The peer's rows arrive, written where the collective was told to write them. */
static void land(late_gather* g) {
  if (!g->pending) return;
  memset(g->full + g->bytes, 0x3c, (size_t)g->bytes);
  g->pending = 0;
}

static mfsdp_status late_all_gather(void* ctx, const mfsdp_buffer* full, const mfsdp_buffer* shard,
                                    mfsdp_work** work) {
  late_gather* g = ctx;
  CHECK(!g->pending, "one gather in flight at a time in this test");
  g->bytes = shard->numel * mfsdp_dtype_size(shard->dtype);
  g->full = full->data;
  memmove(g->full, shard->data, (size_t)g->bytes); /* rank 0's own rows: at once */
  g->pending = 1;
  *work = (mfsdp_work*)g;
  return MFSDP_OK;
}

static mfsdp_status late_wait(void* ctx, mfsdp_work* work) {
  late_gather* g = ctx;
  (void)work;
  if (g->fail_wait) return MFSDP_FAIL(MFSDP_ERR_TIMEOUT, "the peer is late (test)");
  land(g);
  return MFSDP_OK;
}

static void late_discard(void* ctx, mfsdp_work* work) {
  (void)ctx;
  (void)work;
}

static mfsdp_status late_reduce_scatter(void* ctx, const mfsdp_buffer* shard, const mfsdp_buffer* full,
                                        mfsdp_reduce_op op, double premul, mfsdp_work** work) {
  return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "no reductions in this test");
}

static mfsdp_status late_all_reduce(void* ctx, const mfsdp_buffer* buf, mfsdp_reduce_op op, double premul,
                                    mfsdp_work** work) {
  return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "no reductions in this test");
}

static mfsdp_status late_all_to_all(void* ctx, const mfsdp_buffer* out, const mfsdp_buffer* in, mfsdp_work** work) {
  return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "no exchanges in this test");
}

static const mfsdp_transport_ops late_transport_ops = {"late",          late_all_gather, late_reduce_scatter,
                                                       late_all_reduce, late_all_to_all, late_wait,
                                                       late_discard,    NULL,            NULL,
                                                       0};

/* A ZeRO-3 bucket of one 8-element item, initialised, its full weights released. */
static mfsdp_pipeline* zero3(late_gather* g) {
  static int64_t offsets[1] = {0}, numels[1] = {8}, pieces[1] = {4};
  mfsdp_bucket_layout halves = {2, 1, numels, pieces, offsets, offsets, 8, 4};
  mfsdp_bucket_spec spec = {halves, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0,
                            MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_pipeline_config cfg = {2, 0, 0.5, MFSDP_REDUCE_SUM, 1 << 20, 0};
  mfsdp_backend be = {&heap_memory_ops, NULL, &late_transport_ops, g, &mfsdp_cpu_kernels, NULL};
  mfsdp_pipeline* p = NULL;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &spec, 1, &p));
  if (p == NULL) return NULL;
  float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  CHECK_OK(mfsdp_pipeline_init_begin(p, 0, 0));
  CHECK_OK(mfsdp_pipeline_set_item(p, 0, 0, v, MFSDP_F32, 8));
  CHECK_OK(mfsdp_pipeline_init_end(p, 0));
  return p;
}

void test_in_flight(void) {
  const int32_t b0 = 0;
  /* the healthy paths: a gather waited for, and a prefetch resharded unused, release after the wait */
  late_gather g = {0};
  mfsdp_pipeline* p = zero3(&g);
  if (p == NULL) return;
  int o = p->b[0].storage[p->b[0].gather_kind];
  CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
  CHECK_OK(mfsdp_pipeline_wait_unshard(p, &b0, 1));
  CHECK_OK(mfsdp_pipeline_reshard(p, &b0, 1));
  CHECK(!p->b[0].materialized[o], "the full weights released at reshard");
  CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
  CHECK_OK(mfsdp_pipeline_reshard(p, &b0, 1)); /* abandon_gather waits, then releases */
  CHECK(!g.pending && !p->b[0].materialized[o], "an unused prefetch landed before its release");
  mfsdp_pipeline_destroy(p);

  /* a release under the gather in flight is refused, and the memory stays for the landing */
  g = (late_gather){0};
  p = zero3(&g);
  if (p == NULL) return;
  CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
  mfsdp_status st = pl_release(p, &p->b[0], p->b[0].gather_kind);
  CHECK(st == MFSDP_ERR_INVALID_STATE && strstr(mfsdp_last_error(), "in flight"),
        "a release under a gather in flight refused: %s", mfsdp_last_error());
  CHECK(p->b[0].materialized[o], "the gather's output kept");
  CHECK(mfsdp_pipeline_reshard(p, &b0, 1) == MFSDP_ERR_INVALID_STATE, "the engine stopped after it");
  land(&g); /* ASan: a heap-use-after-free here had the release gone through */
  mfsdp_pipeline_destroy(p);

  /* a wait that failed: the gather still runs, so nothing of the engine is freed before destroy */
  g = (late_gather){.fail_wait = 1};
  p = zero3(&g);
  if (p == NULL) return;
  CHECK_OK(mfsdp_pipeline_unshard(p, &b0, 1));
  CHECK(mfsdp_pipeline_wait_unshard(p, &b0, 1) == MFSDP_ERR_TIMEOUT, "the timed-out wait raised");
  CHECK(mfsdp_pipeline_reshard(p, &b0, 1) == MFSDP_ERR_INVALID_STATE &&
            strstr(mfsdp_last_error(), "failed collective"),
        "the engine stopped after the failed wait: %s", mfsdp_last_error());
  CHECK_OK(pl_release(p, &p->b[0], p->b[0].gather_kind)); /* a broken engine keeps its memory */
  CHECK(p->b[0].materialized[o], "the timed-out gather's output kept");
  land(&g); /* the late peer arrives: its rows land in live memory */
  mfsdp_pipeline_destroy(p);
}
