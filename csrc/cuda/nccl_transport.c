/* nccl_transport.c: the native NCCL transport (see mfsdp_transport.h), in C.
 *
 * Two communicators over the same ranks, each with its own high-priority stream: lane 0 for
 * all-gathers, lane 1 for reductions, so a prefetching gather never queues behind a gradient
 * reduce-scatter (NCCL serialises launches per communicator). Every collective first makes its
 * lane wait for the producer (an event recorded on torch's current stream), and returns an event
 * recorded on its lane; wait() makes the consumer stream wait on that event without blocking
 * the host. Buffers are released by the caching allocator on the consumer stream after that
 * wait, so reuse is stream-ordered (no record_stream).
 *
 * [Note: collective timeout]
 * A watchdog thread polls the events of outstanding collectives and NCCL's asynchronous error.
 * A collective older than the timeout, or an NCCL error, aborts both communicators (the only way
 * to unblock a kernel waiting for a dead peer) and marks the transport failed: the next call
 * from the engine returns MFSDP_ERR_TIMEOUT / MFSDP_ERR_NCCL with the reason, never a hang. */
#define _POSIX_C_SOURCE 200809L
#include "mfsdp_nccl.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mfsdp_cuda.h"

#define MAX_OUTSTANDING 4096

/* Owned jointly by the engine (until wait/discard) and the watchdog's outstanding list (until
 * the event completes): the last of the two to let go frees it, under the transport's lock. */
struct mfsdp_work {
  cudaEvent_t done;
  double issued;
  int refs;
};

static void unref(mfsdp_work* w) { /* call with the lock held */
  if (--w->refs == 0) {
    cudaEventDestroy(w->done);
    free(w);
  }
}

struct mfsdp_nccl {
  ncclComm_t comm[2];
  cudaStream_t stream[2];
  int device, rank, world;
  double timeout_s;
  void* kernels_ctx; /* holds torch's current stream */
  pthread_t watchdog;
  pthread_mutex_t lock;
  int running;
  volatile int failed; /* 0, MFSDP_ERR_TIMEOUT or MFSDP_ERR_NCCL */
  char reason[256];
  mfsdp_work* outstanding[MAX_OUTSTANDING];
  int n_outstanding;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define CUDA_TRY(call)                                                                              \
  do {                                                                                              \
    cudaError_t e_ = (call);                                                                        \
    if (e_ != cudaSuccess)                                                                          \
      return MFSDP_FAIL(MFSDP_ERR_CUDA, "%s: %s (%s)", #call, cudaGetErrorString(e_), cudaGetErrorName(e_)); \
  } while (0)

#define NCCL_TRY(call)                                                                                        \
  do {                                                                                                        \
    ncclResult_t r_ = (call);                                                                                 \
    if (r_ != ncclSuccess)                                                                                    \
      return MFSDP_FAIL(MFSDP_ERR_NCCL, "%s: %s (%s)", #call, ncclGetErrorString(r_), ncclGetLastError(NULL)); \
  } while (0)

static ncclDataType_t nccl_dtype(int dtype) {
  switch (dtype) {
    case MFSDP_F32: return ncclFloat32;
    case MFSDP_BF16: return ncclBfloat16;
    case MFSDP_F16: return ncclFloat16;
    case MFSDP_F64: return ncclFloat64;
    case MFSDP_I32: return ncclInt32;
    case MFSDP_I64: return ncclInt64;
    case MFSDP_I8: return ncclInt8;
    default: return ncclUint8; /* bytes: u8, bool (counts scaled by the caller) */
  }
}

static size_t nccl_count(const mfsdp_buffer* b) {
  int d = b->dtype;
  /* int16 has no NCCL type: move it as bytes */
  return d == MFSDP_I16 ? (size_t)b->numel * 2 : (size_t)b->numel;
}

static mfsdp_status healthy(mfsdp_nccl* t) {
  if (t->failed) return MFSDP_FAIL((mfsdp_status)t->failed, "NCCL transport stopped: %s", t->reason);
  return MFSDP_OK;
}

static void* watchdog_main(void* arg) {
  mfsdp_nccl* t = arg;
  cudaSetDevice(t->device);
  while (1) {
    pthread_mutex_lock(&t->lock);
    if (!t->running) {
      pthread_mutex_unlock(&t->lock);
      break;
    }
    double now = now_s();
    int stale = 0;
    for (int i = 0; i < t->n_outstanding;) {
      mfsdp_work* w = t->outstanding[i];
      cudaError_t q = cudaEventQuery(w->done);
      if (q == cudaSuccess) {
        t->outstanding[i] = t->outstanding[--t->n_outstanding];
        unref(w);
        continue;
      }
      if (q != cudaErrorNotReady) cudaGetLastError();
      if (t->timeout_s > 0 && now - w->issued > t->timeout_s) stale = 1;
      ++i;
    }
    ncclResult_t async = ncclSuccess;
    for (int lane = 0; lane < 2 && async == ncclSuccess; ++lane)
      if (t->comm[lane]) ncclCommGetAsyncError(t->comm[lane], &async);
    if (!t->failed && (stale || (async != ncclSuccess && async != ncclInProgress))) {
      t->failed = stale ? MFSDP_ERR_TIMEOUT : MFSDP_ERR_NCCL;
      snprintf(t->reason, sizeof t->reason, "%s", stale ? "a collective did not finish within the timeout; "
                                                         "communicators aborted (a peer rank died or stalled?)"
                                                       : ncclGetErrorString(async));
      for (int lane = 0; lane < 2; ++lane)
        if (t->comm[lane]) ncclCommAbort(t->comm[lane]);
      t->comm[0] = t->comm[1] = NULL;
    }
    pthread_mutex_unlock(&t->lock);
    struct timespec nap = {0, 50 * 1000 * 1000};
    nanosleep(&nap, NULL);
  }
  return NULL;
}

mfsdp_status mfsdp_nccl_create(const ncclUniqueId* ids, int rank, int world, int device, double timeout_s,
                               mfsdp_nccl** out) {
  *out = NULL;
  mfsdp_nccl* t = calloc(1, sizeof *t);
  if (t == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "NCCL transport");
  t->device = device;
  t->rank = rank;
  t->world = world;
  t->timeout_s = timeout_s;
  t->kernels_ctx = mfsdp_cuda_kernel_context(device);
  pthread_mutex_init(&t->lock, NULL);
  mfsdp_status st = MFSDP_OK;
  cudaError_t ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    st = MFSDP_FAIL(MFSDP_ERR_CUDA, "cudaSetDevice(%d): %s", device, cudaGetErrorString(ce));
    goto fail;
  }
  int least, greatest;
  cudaDeviceGetStreamPriorityRange(&least, &greatest);
  for (int lane = 0; lane < 2; ++lane) {
    ce = cudaStreamCreateWithPriority(&t->stream[lane], cudaStreamNonBlocking, greatest);
    if (ce != cudaSuccess) {
      st = MFSDP_FAIL(MFSDP_ERR_CUDA, "stream: %s", cudaGetErrorString(ce));
      goto fail;
    }
  }
  ncclResult_t nr = ncclGroupStart();
  for (int lane = 0; lane < 2 && nr == ncclSuccess; ++lane) nr = ncclCommInitRank(&t->comm[lane], world, ids[lane], rank);
  ncclResult_t end = ncclGroupEnd();
  if (nr != ncclSuccess || end != ncclSuccess) {
    st = MFSDP_FAIL(MFSDP_ERR_NCCL, "ncclCommInitRank(rank %d of %d): %s", rank, world,
                    ncclGetErrorString(nr != ncclSuccess ? nr : end));
    goto fail;
  }
  t->running = 1;
  if (pthread_create(&t->watchdog, NULL, watchdog_main, t) != 0) {
    t->running = 0;
    st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "could not start the NCCL watchdog thread");
    goto fail;
  }
  *out = t;
  return MFSDP_OK;
fail:
  mfsdp_nccl_destroy(t);
  return st;
}

void mfsdp_nccl_destroy(mfsdp_nccl* t) {
  if (t == NULL) return;
  pthread_mutex_lock(&t->lock);
  int had_thread = t->running;
  t->running = 0;
  pthread_mutex_unlock(&t->lock);
  if (had_thread) pthread_join(t->watchdog, NULL);
  for (int lane = 0; lane < 2; ++lane) {
    if (t->comm[lane]) (t->failed ? ncclCommAbort : ncclCommDestroy)(t->comm[lane]);
    if (t->stream[lane]) cudaStreamDestroy(t->stream[lane]);
  }
  for (int i = 0; i < t->n_outstanding; ++i) unref(t->outstanding[i]);
  pthread_mutex_destroy(&t->lock);
  free(t);
}

const char* mfsdp_nccl_failure(const mfsdp_nccl* t) { return t->failed ? t->reason : NULL; }

/* Orders `lane` after the producer (torch's current stream) and returns the new work. */
static mfsdp_status begin(mfsdp_nccl* t, int lane, cudaStream_t* stream) {
  MFSDP_CHECK(healthy(t));
  CUDA_TRY(cudaSetDevice(t->device));
  cudaStream_t producer = (cudaStream_t)mfsdp_cuda_get_stream(t->kernels_ctx);
  cudaEvent_t ready;
  CUDA_TRY(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  cudaError_t e1 = cudaEventRecord(ready, producer);
  cudaError_t e2 = e1 == cudaSuccess ? cudaStreamWaitEvent(t->stream[lane], ready, 0) : e1;
  cudaEventDestroy(ready);
  if (e2 != cudaSuccess) return MFSDP_FAIL(MFSDP_ERR_CUDA, "ordering the NCCL stream: %s", cudaGetErrorString(e2));
  *stream = t->stream[lane];
  return MFSDP_OK;
}

static mfsdp_status finish(mfsdp_nccl* t, int lane, mfsdp_work** work) {
  mfsdp_work* w = calloc(1, sizeof *w);
  if (w == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "work");
  cudaError_t e = cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(w->done, t->stream[lane]);
  if (e != cudaSuccess) {
    free(w);
    return MFSDP_FAIL(MFSDP_ERR_CUDA, "recording a collective's event: %s", cudaGetErrorString(e));
  }
  w->issued = now_s();
  w->refs = 1;
  pthread_mutex_lock(&t->lock);
  if (t->n_outstanding < MAX_OUTSTANDING) {
    t->outstanding[t->n_outstanding++] = w;
    w->refs++;
  }
  pthread_mutex_unlock(&t->lock);
  *work = w;
  return MFSDP_OK;
}

static mfsdp_status nt_all_gather(void* ctx, const mfsdp_buffer* full, const mfsdp_buffer* shard, mfsdp_work** work) {
  mfsdp_nccl* t = ctx;
  cudaStream_t s;
  MFSDP_CHECK(begin(t, 0, &s));
  NCCL_TRY(ncclAllGather(shard->data, full->data, nccl_count(shard), nccl_dtype(shard->dtype), t->comm[0], s));
  return finish(t, 0, work);
}

static mfsdp_status nt_reduce_scatter(void* ctx, const mfsdp_buffer* shard, const mfsdp_buffer* full,
                                      mfsdp_reduce_op op, mfsdp_work** work) {
  mfsdp_nccl* t = ctx;
  cudaStream_t s;
  MFSDP_CHECK(begin(t, 1, &s));
  NCCL_TRY(ncclReduceScatter(full->data, shard->data, (size_t)shard->numel, nccl_dtype(shard->dtype),
                             op == MFSDP_REDUCE_AVG ? ncclAvg : ncclSum, t->comm[1], s));
  return finish(t, 1, work);
}

static mfsdp_status nt_all_reduce(void* ctx, const mfsdp_buffer* buf, mfsdp_reduce_op op, mfsdp_work** work) {
  mfsdp_nccl* t = ctx;
  cudaStream_t s;
  MFSDP_CHECK(begin(t, 1, &s));
  NCCL_TRY(ncclAllReduce(buf->data, buf->data, (size_t)buf->numel, nccl_dtype(buf->dtype),
                         op == MFSDP_REDUCE_AVG ? ncclAvg : ncclSum, t->comm[1], s));
  return finish(t, 1, work);
}

static mfsdp_status nt_all_to_all(void* ctx, const mfsdp_buffer* out, const mfsdp_buffer* in, mfsdp_work** work) {
  mfsdp_nccl* t = ctx;
  cudaStream_t s;
  MFSDP_CHECK(begin(t, 1, &s));
  size_t block = (size_t)(in->numel / t->world), bytes = block * (size_t)mfsdp_dtype_size(in->dtype);
  NCCL_TRY(ncclGroupStart());
  for (int r = 0; r < t->world; ++r) {
    NCCL_TRY(ncclSend((const char*)in->data + r * bytes, block, nccl_dtype(in->dtype), r, t->comm[1], s));
    NCCL_TRY(ncclRecv((char*)out->data + r * bytes, block, nccl_dtype(out->dtype), r, t->comm[1], s));
  }
  NCCL_TRY(ncclGroupEnd());
  return finish(t, 1, work);
}

static mfsdp_status nt_wait(void* ctx, mfsdp_work* w) {
  mfsdp_nccl* t = ctx;
  if (w == NULL) return MFSDP_OK;
  cudaStream_t consumer = (cudaStream_t)mfsdp_cuda_get_stream(t->kernels_ctx);
  cudaError_t e = cudaStreamWaitEvent(consumer, w->done, 0);
  pthread_mutex_lock(&t->lock);
  unref(w);
  pthread_mutex_unlock(&t->lock);
  if (e != cudaSuccess) return MFSDP_FAIL(MFSDP_ERR_CUDA, "waiting for a collective: %s", cudaGetErrorString(e));
  return healthy(t);
}

static void nt_discard(void* ctx, mfsdp_work* w) {
  mfsdp_nccl* t = ctx;
  if (w == NULL) return;
  pthread_mutex_lock(&t->lock);
  unref(w);
  pthread_mutex_unlock(&t->lock);
}

const mfsdp_transport_ops mfsdp_nccl_ops = {"nccl",        nt_all_gather, nt_reduce_scatter,
                                            nt_all_reduce, nt_all_to_all, nt_wait,
                                            nt_discard};
