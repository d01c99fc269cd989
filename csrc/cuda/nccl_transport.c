/* nccl_transport.c: the native NCCL transport (see mfsdp_transport.h, mfsdp_nccl.h), in C: its
 * life cycle (create, close, destroy). The files, from the floor up:
 *   nccl_internal.h      the state they share (the transport, its works, pending collectives)
 *   nccl_watch.c         the device, health and failure, the watchdog, waits bounded by the
 *                        timeout ([Note: NCCL never blocks the engine], [Note: collective timeout])
 *   nccl_collectives.c   issuing collectives, groups, the table ([Note: groups])
 *   nccl_transport.c     create, close, destroy ([Note: closing])
 *
 * Two communicators over the same ranks, each with its own high-priority stream: lane 0 for
 * all-gathers, lane 1 for reductions, so a prefetching gather never queues behind a gradient
 * reduce-scatter (NCCL serialises launches per communicator). Every collective first makes its
 * lane wait for the producer (an event recorded on torch's current stream), and returns an event
 * recorded on its lane; wait() makes the consumer stream wait on that event without blocking
 * the host. Buffers are released by the caching allocator on the consumer stream after that
 * wait, so reuse is stream-ordered (no record_stream); discard() orders the consumer stream the
 * same way, so a pipeline torn down mid-collective frees nothing NCCL still writes.
 *
 * [Note: closing]
 * ncclCommDestroy waits for the communicator's queued collectives, which need their peers: a
 * rank that destroys while its peers are elsewhere hangs. close() is the collective end: a
 * barrier every rank must reach within the timeout, then ncclCommFinalize (non-blocking,
 * polled) and ncclCommDestroy. destroy() without close (a garbage-collected transport) stops
 * the watchdog and aborts, which never waits for a peer. */
#define _POSIX_C_SOURCE 200809L
#include "nccl_internal.h"

mfsdp_status mfsdp_nccl_create(const ncclUniqueId* ids, int rank, int world, int device, double timeout_s,
                               const mfsdp_nccl_hooks* hooks, mfsdp_nccl** out) {
  *out = NULL;
  mfsdp_nccl* t = calloc(1, sizeof *t);
  if (t == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "NCCL transport");
  t->device = device;
  t->rank = rank;
  t->world = world;
  t->timeout_s = timeout_s;
  if (hooks) t->hooks = *hooks;
  pthread_mutex_init(&t->lock, NULL);
  pthread_cond_init(&t->wake, NULL);
  pthread_mutex_init(&t->comm_lock, NULL);
  int saved = -1;
  mfsdp_status st = nt_enter_device(t, &saved);
  if (st == MFSDP_OK) st = mfsdp_cuda_kernel_context(device, &t->kernels_ctx);
  int least, greatest;
  if (st == MFSDP_OK) cudaDeviceGetStreamPriorityRange(&least, &greatest);
  for (int lane = 0; lane < 2 && st == MFSDP_OK; ++lane) {
    cudaError_t e = cudaStreamCreateWithPriority(&t->stream[lane], cudaStreamNonBlocking, greatest);
    if (e != cudaSuccess) st = CUDA_FAIL(e, "creating an NCCL stream");
  }
  if (st == MFSDP_OK) {
    cudaError_t e = cudaMallocAsync((void**)&t->barrier, sizeof *t->barrier, t->stream[1]);
    if (e == cudaSuccess) e = cudaMemsetAsync(t->barrier, 0, sizeof *t->barrier, t->stream[1]);
    if (e != cudaSuccess) st = CUDA_FAIL(e, "allocating the close barrier");
  }
  if (st == MFSDP_OK) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0; /* see [Note: NCCL never blocks the engine] in nccl_watch.c */
    pthread_mutex_lock(&t->comm_lock);
    ncclResult_t r = ncclGroupStart();
    for (int lane = 0; lane < 2 && (r == ncclSuccess || r == ncclInProgress); ++lane)
      r = ncclCommInitRankConfig(&t->comm[lane], world, ids[lane], rank, &config);
    ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    if (r != ncclSuccess && r != ncclInProgress) {
      nt_fail_locked(t, MFSDP_ERR_NCCL, "ncclCommInitRankConfig(rank %d of %d, device %d): %s (%s)", rank, world, device,
                  ncclGetErrorString(r), ncclGetLastError(NULL));
      st = nt_healthy(t);
    }
    pthread_mutex_unlock(&t->comm_lock);
  }
  unsigned both = 3;
  if (st == MFSDP_OK) st = nt_wait_until(t, nt_poll_settled, &both, "setting up the NCCL communicators (every rank joins)");
  if (st == MFSDP_OK) {
    t->running = 1;
    if (pthread_create(&t->watchdog, NULL, nt_watchdog_main, t) != 0) {
      t->running = 0;
      st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "could not start the NCCL watchdog thread");
    }
  }
  nt_leave_device(t, saved);
  if (st != MFSDP_OK) {
    mfsdp_nccl_destroy(t);
    return st;
  }
  *out = t;
  return MFSDP_OK;
}

mfsdp_status mfsdp_nccl_close(mfsdp_nccl* t) {
  if (t->closed) return MFSDP_OK;
  int saved;
  MFSDP_CHECK(nt_enter_device(t, &saved));
  mfsdp_status st = nt_healthy(t);
  if (st == MFSDP_OK && t->group_depth > 0)
    st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "close() inside a group_start/group_end pair");
  /* 1. a barrier after both lanes' work: when it completes, every rank has closed and no
   *    collective of ours is left anywhere */
  mfsdp_work* w = NULL;
  if (st == MFSDP_OK) {
    cudaEvent_t lane0;
    cudaError_t e = cudaEventCreateWithFlags(&lane0, cudaEventDisableTiming);
    if (e == cudaSuccess) {
      e = cudaEventRecord(lane0, t->stream[0]);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(t->stream[1], lane0, 0);
      cudaEventDestroy(lane0);
    }
    if (e != cudaSuccess) st = CUDA_FAIL(e, "ordering the lanes before close");
  }
  if (st == MFSDP_OK) st = nt_new_work(&w);
  if (st == MFSDP_OK) {
    pending p = nt_make(OP_ALL_REDUCE, 1, t->barrier, t->barrier, MFSDP_I32, 1);
    p.work = w;
    st = nt_launch(t, &p, 1, "close (a barrier every rank joins)");
  }
  if (st == MFSDP_OK) st = nt_wait_until(t, nt_poll_event, w, "close (waiting for every rank to close)");
  if (w) nt_drop(t, w);
  /* 2. nothing of ours is in flight: no watchdog from here on */
  nt_stop_watchdog(t);
  /* 3. finalize (polled, bounded by the timeout), then destroy, which is local after it */
  if (st == MFSDP_OK) {
    pthread_mutex_lock(&t->comm_lock);
    ncclResult_t r = ncclSuccess;
    for (int lane = 0; lane < 2 && (r == ncclSuccess || r == ncclInProgress); ++lane)
      r = ncclCommFinalize(t->comm[lane]);
    if (r != ncclSuccess && r != ncclInProgress) {
      nt_fail_locked(t, MFSDP_ERR_NCCL, "ncclCommFinalize: %s (%s)", ncclGetErrorString(r), ncclGetLastError(NULL));
      st = nt_healthy(t);
    }
    pthread_mutex_unlock(&t->comm_lock);
    unsigned both = 3;
    if (st == MFSDP_OK) st = nt_wait_until(t, nt_poll_settled, &both, "ncclCommFinalize");
  }
  pthread_mutex_lock(&t->comm_lock);
  for (int lane = 0; lane < 2; ++lane)
    if (t->comm[lane]) {
      (st == MFSDP_OK ? ncclCommDestroy : ncclCommAbort)(t->comm[lane]);
      t->comm[lane] = NULL;
    }
  pthread_mutex_unlock(&t->comm_lock);
  t->closed = 1;
  nt_leave_device(t, saved);
  return st;
}

void mfsdp_nccl_destroy(mfsdp_nccl* t) {
  if (t == NULL) return;
  nt_stop_watchdog(t);
  int saved;
  int on_device = nt_enter_device(t, &saved) == MFSDP_OK;
  pthread_mutex_lock(&t->comm_lock);
  for (int lane = 0; lane < 2; ++lane) /* not closed: abort, never wait for a peer (see [Note: closing]) */
    if (t->comm[lane]) {
      ncclCommAbort(t->comm[lane]);
      t->comm[lane] = NULL;
    }
  pthread_mutex_unlock(&t->comm_lock);
  pthread_mutex_lock(&t->lock);
  for (int i = 0; i < t->n_outstanding; ++i) unref(t->outstanding[i]);
  for (int i = 0; i < t->n_group; ++i) unref(t->group[i].work); /* a group never ended */
  pthread_mutex_unlock(&t->lock);
  if (t->barrier) cudaFreeAsync(t->barrier, t->stream[1]);
  for (int lane = 0; lane < 2; ++lane)
    if (t->stream[lane]) cudaStreamDestroy(t->stream[lane]);
  if (on_device) nt_leave_device(t, saved);
  pthread_mutex_destroy(&t->lock);
  pthread_cond_destroy(&t->wake);
  pthread_mutex_destroy(&t->comm_lock);
  free(t);
}

const char* mfsdp_nccl_failure(const mfsdp_nccl* t) { return t->failed ? t->reason : NULL; }
