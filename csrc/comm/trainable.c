/* trainable.c: which items of a bucket train, changed at run time (a parameter's requires_grad
 * set or cleared after the model was sharded): mfsdp_pipeline_set_trainable and
 * mfsdp_pipeline_release_grads.
 *
 * [Note: requires_grad changes]
 * Each item carries a `trainable` flag (all clear for a bucket created `frozen`, all set
 * otherwise); a bucket reduces while it has a trainable item (pl_reduces) and then expects
 * exactly its trainable items' gradients in each backward: it completes when they have all
 * arrived and launches in its turn of the shared order ([Note: collective order] in reduce.c);
 * a frozen item of a reducing bucket is packed as zeros, like an unused one, so its reduced
 * gradient is left as it was (ZeRO-2/3 add zero to the main gradient; no_shard/ZeRO-1 reduce the
 * rebased sum again, [Note: reduce once per step]), which is what DDP and FSDP2 do with the
 * `.grad` of a parameter frozen later. A bucket with no trainable item launches nothing.
 * - Gradient memory follows: a bucket created frozen has no gradient buffer; its first
 *   trainable item creates them, zero (pl_create_grad_buffers: the weights' buffers, and so the
 *   optimizer's parameters, do not change). mfsdp_pipeline_release_grads frees them again once
 *   no item trains and the caller knows nobody reads them (no `.grad` attached), so a
 *   parameter frozen for good costs no gradient memory after its last `.grad` is dropped.
 * - Whether a bucket reduces is part of the collective order: every rank must set the same
 *   flags between the same two backwards (as DDP needs the same parameters on every rank). The
 *   Python side applies requires_grad once per forward at the root, and checks agreement in the
 *   used-flag reduction it already makes ([Note: unused parameters] in megatron_fsdp_c/_owner.py).
 * - Changes are refused inside a backward; between the microbatches of one step they are
 *   allowed, but a bucket frozen in the middle of accumulation reduces no more: what it holds
 *   stays local (as under DDP, where such a `.grad` keeps its local sum). */
#include "pipeline_internal.h"

mfsdp_status mfsdp_pipeline_set_trainable(mfsdp_pipeline* p, int32_t b, const int32_t* items, int32_t n,
                                          int trainable) {
  MFSDP_CHECK(pl_healthy(p));
  MFSDP_CHECK(pl_check_bucket(p, b));
  if (p->in_backward)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: requires_grad cannot change inside a backward pass", b);
  bucket* bk = &p->b[b];
  for (int32_t j = 0; j < n; ++j)
    if (items[j] < 0 || items[j] >= bk->spec.layout.n_items)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d has no item %d", b, items[j]);
  if (trainable && bk->spec.grad_mode == MFSDP_GRAD_NONE)
    return MFSDP_FAIL(MFSDP_ERR_INVALID_ARGUMENT, "bucket %d holds %s parameters, which cannot train", b,
                      mfsdp_dtype_name(bk->spec.param_dtype));
  if (trainable && !bk->has_grads) MFSDP_CHECK(pl_create_grad_buffers(p, bk));
  for (int32_t j = 0; j < n; ++j) {
    uint8_t now = (uint8_t)!!trainable;
    bk->n_trainable += (int32_t)now - (int32_t)bk->trainable[items[j]];
    bk->trainable[items[j]] = now;
  }
  return MFSDP_OK;
}

mfsdp_status mfsdp_pipeline_release_grads(mfsdp_pipeline* p, const int32_t* ids, int32_t n) {
  MFSDP_CHECK(pl_healthy(p));
  if (p->in_backward) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "gradients released inside a backward pass");
  for (int32_t i = 0; i < n; ++i) {
    MFSDP_CHECK(pl_check_bucket(p, ids[i]));
    const bucket* bk = &p->b[ids[i]];
    if (bk->n_trainable > 0)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d: %d of its items train, its gradients stay", ids[i],
                        bk->n_trainable);
  }
  for (int32_t i = 0; i < n; ++i) {
    bucket* bk = &p->b[ids[i]];
    if (!bk->has_grads) continue;
    if (bk->gstate == MFSDP_G_REDUCING) MFSDP_CHECK(pl_complete_until(p, ids[i]));
    if (bk->outer_work != NULL && !bk->outer_gathering) MFSDP_CHECK(pl_complete_outer_of(p, bk));
    if (bk->gstate == MFSDP_G_DIRTY || bk->held_grads)
      return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "bucket %d holds local gradients not yet reduced", ids[i]);
    pl_drop_grad_buffers(p, bk);
  }
  return MFSDP_OK;
}
