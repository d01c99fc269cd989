/* mfsdp_nccl.h: the native NCCL transport (csrc/cuda/nccl_transport.c, with the map of its files).
 *
 * Lifetime: mfsdp_nccl_create (collective: every rank joins), then collectives through
 * mfsdp_nccl_ops, then mfsdp_nccl_close (collective, at a point every rank reaches) and
 * mfsdp_nccl_destroy (local). Destroy without close aborts the communicators: it is what a
 * garbage-collected transport does, and ranks collect garbage at different moments. */
#ifndef MFSDP_NCCL_H
#define MFSDP_NCCL_H

#include <cuda_runtime.h>
#include <nccl.h>

#include "../comm/mfsdp_transport.h"
#include "../core/mfsdp_dtype.h"

typedef struct mfsdp_nccl mfsdp_nccl;

/* How the caller lets others run while the transport waits for NCCL (the Python glue releases
 * the GIL and checks for Ctrl-C). Every member may be NULL. */
typedef struct mfsdp_nccl_hooks {
  /* Around a wait that may be long: begin returns a token handed to end. */
  void* (*block_begin)(void* arg);
  void (*block_end)(void* arg, void* token);
  /* Polled during such a wait, between begin and end: nonzero stops the wait, aborts the
   * communicators and fails the call (the caller has recorded why). */
  int (*interrupted)(void* arg);
  void* arg;
} mfsdp_nccl_hooks;

/* ids[0] for the all-gather communicator, ids[1] for reductions (from rank 0, broadcast).
 * timeout_s > 0: a collective (or the set-up, or close) older than this aborts the
 * communicators and fails with MFSDP_ERR_TIMEOUT; <= 0: none (NCCL errors are still caught).
 * Blocks until all ranks joined (or the timeout): call without the GIL. hooks may be NULL. */
mfsdp_status mfsdp_nccl_create(const ncclUniqueId* ids, int rank, int world, int device, double timeout_s,
                               const mfsdp_nccl_hooks* hooks, mfsdp_nccl** out);
/* Collective: waits until every rank has closed (or the timeout), then finalizes and destroys
 * the communicators. After it, collectives fail; destroy still frees. */
mfsdp_status mfsdp_nccl_close(mfsdp_nccl* t);
/* Local: stops the watchdog, aborts communicators still open, frees. Never waits for peers. */
void mfsdp_nccl_destroy(mfsdp_nccl* t);
/* NULL while healthy, else why it stopped. */
const char* mfsdp_nccl_failure(const mfsdp_nccl* t);

extern const mfsdp_transport_ops mfsdp_nccl_ops;

#endif
