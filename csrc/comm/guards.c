/* guards.c: what every entry point and every collective of the pipeline goes through: the
 * health check (a failed collective stops the engine for good), the bucket id check, waiting for
 * a collective's work, and the comm counters. A floor of csrc/comm: it calls no other file of
 * the pipeline (map at the top of pipeline.c). */
#include "pipeline_internal.h"

#include <string.h>

mfsdp_status pl_healthy(const mfsdp_pipeline* p) {
  if (p->broken[0])
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE,
                      "the engine stopped after a failed collective (%s); build a new model with fully_shard",
                      p->broken);
  return MFSDP_OK;
}

/* A failed collective leaves the ranks out of step: remember it and refuse further work. */
mfsdp_status pl_comm_failed(mfsdp_pipeline* p, mfsdp_status st) {
  if (st != MFSDP_OK && st != MFSDP_ERR_INVALID_ARGUMENT && !p->broken[0]) {
    strncpy(p->broken, mfsdp_last_error(), sizeof p->broken - 1);
    p->broken[sizeof p->broken - 1] = '\0';
  }
  return st;
}

mfsdp_status pl_check_bucket(const mfsdp_pipeline* p, int32_t b) {
  if (b < 0 || b >= p->n) return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d out of range [0, %d)", b, p->n);
  return MFSDP_OK;
}

mfsdp_status pl_wait_work(mfsdp_pipeline* p, mfsdp_work** work) {
  mfsdp_work* w = *work;
  *work = NULL;
  if (w == NULL) return MFSDP_OK;
  return pl_comm_failed(p, p->be.transport->wait(p->be.transport_ctx, w));
}

/* Every collective issued is counted here, once it went out: one more of `kind`, moving `bytes`. */
void pl_count(bucket* bk, pl_comm_kind kind, int64_t bytes) {
  switch (kind) {
#define COUNT_(k)                 \
  case PL_COMM_##k:               \
    bk->stats.k##s++;             \
    bk->stats.k##_bytes += bytes; \
    break;
    MFSDP_COMM_COUNTERS(COUNT_)
#undef COUNT_
  }
}
