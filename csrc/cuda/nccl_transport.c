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
 * Calls between group_start and group_end form one NCCL group (a unit's buckets in one launch).
 * NCCL launches a group's kernels at ncclGroupEnd, so the events of its works are recorded
 * there, not at each call: recorded earlier they would complete before the collective ran.
 *
 * [Note: collective timeout]
 * A watchdog thread polls the events of outstanding collectives and NCCL's asynchronous error.
 * A collective older than the timeout, or an NCCL error, aborts both communicators (the only way
 * to unblock a kernel waiting for a dead peer) and marks the transport failed: the next call
 * from the engine returns MFSDP_ERR_TIMEOUT / MFSDP_ERR_NCCL with the reason, never a hang.
 * Communicators are not thread-safe: the engine enqueues and the watchdog aborts under
 * comm_lock, and the engine checks `failed` under it, so it never touches an aborted one. */
#define _POSIX_C_SOURCE 200809L
#include "mfsdp_nccl.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mfsdp_cuda.h"

#define MAX_OUTSTANDING 4096
#define MAX_GROUP 256

/* Owned jointly by the engine (until wait/discard) and the watchdog's outstanding list (until
 * the event completes): the last of the two to let go frees it, under the transport's lock. */
struct mfsdp_work {
  cudaEvent_t done;
  double issued;
  int refs;
  int recorded; /* 0 while its group has not been launched */
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
  pthread_mutex_t lock;      /* the outstanding list, work references, `running` */
  pthread_mutex_t comm_lock; /* the communicators: enqueue (engine) vs abort (watchdog) */
  int running;
  _Atomic int failed; /* 0, MFSDP_ERR_TIMEOUT or MFSDP_ERR_NCCL; reason is written first */
  char reason[256];
  mfsdp_work* outstanding[MAX_OUTSTANDING];
  int n_outstanding;
  int group_depth; /* engine thread only */
  mfsdp_work* group_works[MAX_GROUP];
  int group_lanes[MAX_GROUP];
  int n_group;
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
    pthread_mutex_unlock(&t->lock);
    ncclResult_t async = ncclSuccess;
    if (!t->failed && pthread_mutex_trylock(&t->comm_lock) == 0) { /* busy: poll next round */
      for (int lane = 0; lane < 2 && async == ncclSuccess; ++lane)
        if (t->comm[lane]) ncclCommGetAsyncError(t->comm[lane], &async);
      pthread_mutex_unlock(&t->comm_lock);
    }
    if (!t->failed && (stale || (async != ncclSuccess && async != ncclInProgress))) {
      snprintf(t->reason, sizeof t->reason, "%s",
               stale ? "a collective did not finish within the timeout; communicators aborted (a peer rank died "
                       "or stalled?)"
                     : ncclGetErrorString(async));
      pthread_mutex_lock(&t->comm_lock);
      t->failed = stale ? MFSDP_ERR_TIMEOUT : MFSDP_ERR_NCCL;
      for (int lane = 0; lane < 2; ++lane)
        if (t->comm[lane]) ncclCommAbort(t->comm[lane]);
      t->comm[0] = t->comm[1] = NULL;
      pthread_mutex_unlock(&t->comm_lock);
    }
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
  pthread_mutex_init(&t->lock, NULL);
  pthread_mutex_init(&t->comm_lock, NULL);
  mfsdp_status st = mfsdp_cuda_kernel_context(device, &t->kernels_ctx);
  if (st != MFSDP_OK) goto fail;
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
  for (int i = 0; i < t->n_group; ++i) unref(t->group_works[i]); /* a group never ended */
  pthread_mutex_destroy(&t->lock);
  pthread_mutex_destroy(&t->comm_lock);
  free(t);
}

const char* mfsdp_nccl_failure(const mfsdp_nccl* t) { return t->failed ? t->reason : NULL; }

/* Orders `lane` after the producer (torch's current stream). On success the caller holds
 * comm_lock and must hand it to finish(). */
static mfsdp_status begin(mfsdp_nccl* t, int lane, cudaStream_t* stream) {
  CUDA_TRY(cudaSetDevice(t->device));
  pthread_mutex_lock(&t->comm_lock);
  mfsdp_status st = healthy(t);
  if (st != MFSDP_OK) {
    pthread_mutex_unlock(&t->comm_lock);
    return st;
  }
  if (t->group_depth > 0 && t->n_group == MAX_GROUP) {
    pthread_mutex_unlock(&t->comm_lock);
    return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "more than %d collectives in one group", MAX_GROUP);
  }
  cudaStream_t producer = (cudaStream_t)mfsdp_cuda_get_stream(t->kernels_ctx);
  cudaEvent_t ready;
  cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
  if (e == cudaSuccess) {
    e = cudaEventRecord(ready, producer);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(t->stream[lane], ready, 0);
    cudaEventDestroy(ready);
  }
  if (e != cudaSuccess) {
    pthread_mutex_unlock(&t->comm_lock);
    return MFSDP_FAIL(MFSDP_ERR_CUDA, "ordering the NCCL stream after the producer: %s (%s)", cudaGetErrorString(e),
                      cudaGetErrorName(e));
  }
  *stream = t->stream[lane];
  return MFSDP_OK;
}

/* Marks the end of a work on its lane and hands it to the watchdog. */
static mfsdp_status record(mfsdp_nccl* t, int lane, mfsdp_work* w) {
  cudaError_t e = cudaEventRecord(w->done, t->stream[lane]);
  if (e != cudaSuccess)
    return MFSDP_FAIL(MFSDP_ERR_CUDA, "recording a collective's event: %s (%s)", cudaGetErrorString(e),
                      cudaGetErrorName(e));
  w->issued = now_s();
  pthread_mutex_lock(&t->lock);
  w->recorded = 1;
  if (t->n_outstanding < MAX_OUTSTANDING) {
    t->outstanding[t->n_outstanding++] = w;
    w->refs++;
  }
  pthread_mutex_unlock(&t->lock);
  return MFSDP_OK;
}

/* Releases comm_lock taken by begin(); turns the NCCL result into a work (recorded now, or at
 * group_end inside a group). */
static mfsdp_status finish(mfsdp_nccl* t, int lane, ncclResult_t r, const char* what, int line, mfsdp_work** work) {
  *work = NULL;
  mfsdp_status st = MFSDP_OK;
  mfsdp_work* w = NULL;
  if (r != ncclSuccess) {
    st = mfsdp_set_error(MFSDP_ERR_NCCL, __FILE__, line, what, "%s (%s)", ncclGetErrorString(r),
                         ncclGetLastError(NULL));
  } else if ((w = calloc(1, sizeof *w)) == NULL) {
    st = MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "work");
  } else {
    w->refs = 1;
    cudaError_t e = cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      free(w);
      w = NULL;
      st = MFSDP_FAIL(MFSDP_ERR_CUDA, "creating a collective's event: %s (%s)", cudaGetErrorString(e),
                      cudaGetErrorName(e));
    } else if (t->group_depth > 0) {
      w->refs++; /* the group list's reference, dropped at group_end */
      t->group_works[t->n_group] = w;
      t->group_lanes[t->n_group++] = lane;
    } else {
      st = record(t, lane, w);
    }
  }
  pthread_mutex_unlock(&t->comm_lock);
  if (st != MFSDP_OK && w != NULL && t->group_depth == 0) {
    pthread_mutex_lock(&t->lock);
    unref(w);
    pthread_mutex_unlock(&t->lock);
    w = NULL;
  }
  *work = w;
  return st;
}

static mfsdp_status nt_all_gather(void* ctx, const mfsdp_buffer* full, const mfsdp_buffer* shard, mfsdp_work** work) {
  mfsdp_nccl* t = ctx;
  cudaStream_t s;
  MFSDP_CHECK(begin(t, 0, &s));
  ncclResult_t r = ncclAllGather(shard->data, full->data, nccl_count(shard), nccl_dtype(shard->dtype), t->comm[0], s);
  return finish(t, 0, r, "ncclAllGather", __LINE__, work);
}

/* Sum, average, or a sum of inputs pre-multiplied by a host scalar (float32/float64 only: the
 * scalar has the buffer's type). *custom: destroy after the enqueue (NCCL allows it then). */
static ncclResult_t reduce_op(mfsdp_nccl* t, mfsdp_reduce_op op, double premul, int dtype, ncclRedOp_t* out,
                              int* custom) {
  *custom = 0;
  *out = op == MFSDP_REDUCE_AVG ? ncclAvg : ncclSum;
  if (premul == 1.0) return ncclSuccess;
  double scale = op == MFSDP_REDUCE_AVG ? premul / t->world : premul;
  float scale32 = (float)scale;
  if (dtype != MFSDP_F32 && dtype != MFSDP_F64) return ncclInvalidArgument;
  *custom = 1;
  return ncclRedOpCreatePreMulSum(out, dtype == MFSDP_F32 ? (void*)&scale32 : (void*)&scale, nccl_dtype(dtype),
                                  ncclScalarHostImmediate, t->comm[1]);
}

/* ncclReduceScatter and ncclAllReduce take the same arguments (count: elements received). */
typedef ncclResult_t (*nccl_reduce_fn)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                                       cudaStream_t);

static mfsdp_status reduce(mfsdp_nccl* t, nccl_reduce_fn fn, const char* what, const void* send,
                           const mfsdp_buffer* recv, mfsdp_reduce_op op, double premul, mfsdp_work** work) {
  cudaStream_t s;
  MFSDP_CHECK(begin(t, 1, &s));
  ncclRedOp_t nop;
  int custom;
  ncclResult_t r = reduce_op(t, op, premul, recv->dtype, &nop, &custom);
  if (r == ncclSuccess) r = fn(send, recv->data, (size_t)recv->numel, nccl_dtype(recv->dtype), nop, t->comm[1], s);
  if (custom) ncclRedOpDestroy(nop, t->comm[1]);
  return finish(t, 1, r, what, __LINE__, work);
}

static mfsdp_status nt_reduce_scatter(void* ctx, const mfsdp_buffer* shard, const mfsdp_buffer* full,
                                      mfsdp_reduce_op op, double premul, mfsdp_work** work) {
  return reduce(ctx, ncclReduceScatter, "ncclReduceScatter", full->data, shard, op, premul, work);
}

static mfsdp_status nt_all_reduce(void* ctx, const mfsdp_buffer* buf, mfsdp_reduce_op op, double premul,
                                  mfsdp_work** work) {
  return reduce(ctx, ncclAllReduce, "ncclAllReduce", buf->data, buf, op, premul, work);
}

static mfsdp_status nt_all_to_all(void* ctx, const mfsdp_buffer* out, const mfsdp_buffer* in, mfsdp_work** work) {
  mfsdp_nccl* t = ctx;
  cudaStream_t s;
  MFSDP_CHECK(begin(t, 1, &s));
  size_t block = (size_t)(in->numel / t->world), bytes = block * (size_t)mfsdp_dtype_size(in->dtype);
  ncclResult_t r = ncclGroupStart();
  if (r == ncclSuccess) {
    for (int peer = 0; peer < t->world && r == ncclSuccess; ++peer) {
      r = ncclSend((const char*)in->data + peer * bytes, block, nccl_dtype(in->dtype), peer, t->comm[1], s);
      if (r == ncclSuccess)
        r = ncclRecv((char*)out->data + peer * bytes, block, nccl_dtype(out->dtype), peer, t->comm[1], s);
    }
    ncclResult_t end = ncclGroupEnd(); /* balanced even after a failed call */
    if (r == ncclSuccess) r = end;
  }
  return finish(t, 1, r, "ncclSend/ncclRecv (all-to-all)", __LINE__, work);
}

static mfsdp_status nt_group_start(void* ctx) {
  mfsdp_nccl* t = ctx;
  if (t->group_depth++ > 0) return MFSDP_OK; /* nested: one group */
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) {
    t->group_depth--;
    return MFSDP_FAIL(MFSDP_ERR_NCCL, "ncclGroupStart: %s", ncclGetErrorString(r));
  }
  return MFSDP_OK;
}

/* Launches the group, then records each work's event after its collective. */
static mfsdp_status nt_group_end(void* ctx) {
  mfsdp_nccl* t = ctx;
  if (t->group_depth == 0) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "group_end without group_start");
  if (--t->group_depth > 0) return MFSDP_OK;
  pthread_mutex_lock(&t->comm_lock);
  ncclResult_t r = ncclGroupEnd();
  pthread_mutex_unlock(&t->comm_lock);
  mfsdp_status st = MFSDP_OK;
  if (r != ncclSuccess)
    st = MFSDP_FAIL(MFSDP_ERR_NCCL, "ncclGroupEnd: %s (%s)", ncclGetErrorString(r), ncclGetLastError(NULL));
  for (int i = 0; i < t->n_group; ++i) {
    mfsdp_work* w = t->group_works[i];
    if (st == MFSDP_OK) st = record(t, t->group_lanes[i], w);
    pthread_mutex_lock(&t->lock);
    unref(w); /* the engine still holds its own reference */
    pthread_mutex_unlock(&t->lock);
  }
  t->n_group = 0;
  return st;
}

static void nt_discard(void* ctx, mfsdp_work* w) {
  mfsdp_nccl* t = ctx;
  if (w == NULL) return;
  pthread_mutex_lock(&t->lock);
  unref(w);
  pthread_mutex_unlock(&t->lock);
}

static mfsdp_status nt_wait(void* ctx, mfsdp_work* w) {
  mfsdp_nccl* t = ctx;
  if (w == NULL) return MFSDP_OK;
  if (!w->recorded) { /* its group never launched (group_end failed or was not called) */
    nt_discard(ctx, w);
    return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "waited for a collective whose group was not launched");
  }
  cudaStream_t consumer = (cudaStream_t)mfsdp_cuda_get_stream(t->kernels_ctx);
  cudaError_t e = cudaStreamWaitEvent(consumer, w->done, 0);
  pthread_mutex_lock(&t->lock);
  unref(w);
  pthread_mutex_unlock(&t->lock);
  if (e != cudaSuccess) return MFSDP_FAIL(MFSDP_ERR_CUDA, "waiting for a collective: %s", cudaGetErrorString(e));
  return healthy(t);
}

const mfsdp_transport_ops mfsdp_nccl_ops = {"nccl",        nt_all_gather, nt_reduce_scatter, nt_all_reduce,
                                            nt_all_to_all, nt_wait,       nt_discard,        nt_group_start,
                                            nt_group_end,  1};
