/* nccl_transport.c: the native NCCL transport (see mfsdp_transport.h, mfsdp_nccl.h), in C.
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
 * [Note: NCCL never blocks the engine]
 * The communicators are non-blocking (ncclConfig_t.blocking = 0): a call that has to wait (the
 * set-up, the connection NCCL makes the first time an algorithm runs, finalize) returns
 * ncclInProgress and completes in the background. The transport then polls
 * ncclCommGetAsyncError (wait_until) with the timeout as a deadline, the GIL released and
 * Ctrl-C checked through the caller's hooks: a peer that died at that moment costs the timeout,
 * not a hang. comm_lock guards each NCCL call against the watchdog's abort (communicators are
 * not thread-safe) and is held only around calls that return at once, never while waiting.
 *
 * [Note: groups]
 * Collectives issued between group_start and group_end are ordered after their producer at
 * once but reach NCCL only at group_end, as one ncclGroupStart..ncclGroupEnd under comm_lock:
 * the watchdog cannot abort a communicator inside an open NCCL group, and no torch call (the
 * pipeline allocates between a unit's collectives) ever runs under comm_lock. NCCL launches a
 * group's kernels at ncclGroupEnd, so the works' events are recorded after it: recorded earlier
 * they would complete before the collective ran.
 *
 * [Note: collective timeout]
 * A watchdog thread polls the events of outstanding collectives and NCCL's asynchronous error.
 * A collective older than the timeout, or an NCCL error, aborts both communicators (the only way
 * to unblock a kernel waiting for a dead peer) and marks the transport failed: the next call
 * from the engine returns MFSDP_ERR_TIMEOUT / MFSDP_ERR_NCCL with the reason, never a hang.
 *
 * [Note: closing]
 * ncclCommDestroy waits for the communicator's queued collectives, which need their peers: a
 * rank that destroys while its peers are elsewhere hangs. close() is the collective end: a
 * barrier every rank must reach within the timeout, then ncclCommFinalize (non-blocking,
 * polled) and ncclCommDestroy. destroy() without close (a garbage-collected transport) stops
 * the watchdog and aborts, which never waits for a peer. */
#define _POSIX_C_SOURCE 200809L
#include "mfsdp_nccl.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mfsdp_cuda.h"

#define MAX_OUTSTANDING 4096
#define MAX_GROUP 256

/* Owned jointly by the engine (until wait/discard), the open group (until group_end) and the
 * watchdog's outstanding list (until the event completes): the last to let go frees it, under
 * the transport's lock. */
struct mfsdp_work {
  cudaEvent_t done;
  double issued;
  int refs;
  int recorded; /* 0 until its collective is on the lane and the event after it */
};

static void unref(mfsdp_work* w) { /* call with the lock held */
  if (--w->refs == 0) {
    cudaEventDestroy(w->done);
    free(w);
  }
}

typedef enum op_kind { OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_REDUCE, OP_ALL_TO_ALL } op_kind;

/* A collective on its way to NCCL: handed over at once, or at group_end inside a group. */
typedef struct pending {
  op_kind kind;
  int lane;
  const void* send;
  void* recv;
  size_t count;        /* elements received; all-to-all: elements per peer */
  size_t block_bytes;  /* all-to-all: bytes per peer */
  ncclDataType_t type;
  int dtype;           /* mfsdp dtype: the pre-multiplier's type */
  mfsdp_reduce_op op;
  double premul;
  mfsdp_work* work;
} pending;

struct mfsdp_nccl {
  ncclComm_t comm[2];
  cudaStream_t stream[2];
  int device, rank, world;
  double timeout_s;
  void* kernels_ctx; /* holds torch's current stream */
  int32_t* barrier;  /* one element of device memory for close()'s barrier */
  mfsdp_nccl_hooks hooks;
  pthread_t watchdog;
  pthread_mutex_t lock;      /* the outstanding list, work references, `running` */
  pthread_cond_t wake;       /* stops the watchdog's nap */
  pthread_mutex_t comm_lock; /* NCCL calls on comm[] (engine) vs abort (watchdog): never held while waiting */
  int running;
  _Atomic int failed; /* 0, MFSDP_ERR_TIMEOUT, MFSDP_ERR_NCCL, ...; reason is written first */
  char reason[256];
  mfsdp_work* outstanding[MAX_OUTSTANDING];
  int n_outstanding;
  /* engine thread only */
  int group_depth;
  pending group[MAX_GROUP];
  int n_group;
  int closed;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void nap(double seconds) {
  struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
  nanosleep(&ts, NULL);
}

#define CUDA_FAIL(e, what) \
  MFSDP_FAIL(MFSDP_ERR_CUDA, "%s: %s (%s)", (what), cudaGetErrorString(e), cudaGetErrorName(e))

static ncclDataType_t nccl_dtype(int dtype) {
  switch (dtype) {
    case MFSDP_F32: return ncclFloat32;
    case MFSDP_BF16: return ncclBfloat16;
    case MFSDP_F16: return ncclFloat16;
    case MFSDP_F64: return ncclFloat64;
    case MFSDP_I32: return ncclInt32;
    case MFSDP_I64: return ncclInt64;
    case MFSDP_I8: return ncclInt8;
    default: return ncclUint8; /* bytes: u8, bool, and int16 (no NCCL type; counts doubled) */
  }
}

static size_t nccl_count(int dtype, int64_t numel) { return dtype == MFSDP_I16 ? (size_t)numel * 2 : (size_t)numel; }

/* Makes the transport's device current for an entry point; leave_device gives the caller's back. */
static mfsdp_status enter_device(const mfsdp_nccl* t, int* saved) {
  cudaError_t e = cudaGetDevice(saved);
  if (e == cudaSuccess && *saved != t->device) e = cudaSetDevice(t->device);
  if (e != cudaSuccess) {
    *saved = -1;
    return CUDA_FAIL(e, "making the NCCL transport's device current");
  }
  return MFSDP_OK;
}

static void leave_device(const mfsdp_nccl* t, int saved) {
  if (saved >= 0 && saved != t->device) cudaSetDevice(saved);
}

static mfsdp_status healthy(const mfsdp_nccl* t) {
  if (t->failed) return MFSDP_FAIL((mfsdp_status)t->failed, "NCCL transport stopped: %s", t->reason);
  if (t->closed) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "the NCCL transport was closed");
  return MFSDP_OK;
}

/* Stops the transport: records why (the first failure wins) and aborts both communicators,
 * the only way to end kernels that wait for a dead peer. Call with comm_lock held. */
static void fail_locked(mfsdp_nccl* t, mfsdp_status why, const char* fmt, ...) {
  if (!t->failed) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->reason, sizeof t->reason, fmt, ap);
    va_end(ap);
    t->failed = why;
  }
  for (int lane = 0; lane < 2; ++lane)
    if (t->comm[lane]) {
      ncclCommAbort(t->comm[lane]);
      t->comm[lane] = NULL;
    }
}

static void* watchdog_main(void* arg) {
  mfsdp_nccl* t = arg;
  cudaSetDevice(t->device);
  pthread_mutex_lock(&t->lock);
  while (t->running) {
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
      for (int lane = 0; lane < 2 && (async == ncclSuccess || async == ncclInProgress); ++lane)
        if (t->comm[lane]) ncclCommGetAsyncError(t->comm[lane], &async);
      pthread_mutex_unlock(&t->comm_lock);
    }
    if (!t->failed && (stale || (async != ncclSuccess && async != ncclInProgress))) {
      pthread_mutex_lock(&t->comm_lock); /* held only briefly by the engine: see [Note: NCCL never blocks the engine] */
      if (stale)
        fail_locked(t, MFSDP_ERR_TIMEOUT,
                    "a collective did not finish within the timeout (%.1f s); communicators aborted (a peer rank died "
                    "or stalled?)",
                    t->timeout_s);
      else
        fail_locked(t, MFSDP_ERR_NCCL, "%s", ncclGetErrorString(async));
      pthread_mutex_unlock(&t->comm_lock);
    }
    pthread_mutex_lock(&t->lock);
    if (t->running) {
      struct timespec until;
      clock_gettime(CLOCK_REALTIME, &until);
      until.tv_nsec += 50 * 1000 * 1000;
      if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
      }
      pthread_cond_timedwait(&t->wake, &t->lock, &until);
    }
  }
  pthread_mutex_unlock(&t->lock);
  return NULL;
}

static void stop_watchdog(mfsdp_nccl* t) {
  pthread_mutex_lock(&t->lock);
  int had_thread = t->running;
  t->running = 0;
  pthread_cond_signal(&t->wake);
  pthread_mutex_unlock(&t->lock);
  if (had_thread) pthread_join(t->watchdog, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* waiting without blocking anyone: see [Note: NCCL never blocks the engine] */

/* One look: 1 done, 0 not yet, -1 failed (*st says why). */
typedef int (*poll_fn)(mfsdp_nccl* t, void* arg, mfsdp_status* st);

static mfsdp_status wait_until(mfsdp_nccl* t, poll_fn poll, void* arg, const char* what) {
  const double start = now_s();
  void* token = NULL;
  int blocked = 0;
  mfsdp_status st = MFSDP_OK;
  for (int polls = 0;; ++polls) {
    int r = poll(t, arg, &st);
    if (r != 0) {
      if (r > 0) st = MFSDP_OK;
      break;
    }
    if (t->timeout_s > 0 && now_s() - start > t->timeout_s) {
      pthread_mutex_lock(&t->comm_lock);
      fail_locked(t, MFSDP_ERR_TIMEOUT,
                  "%s did not complete within the timeout (%.1f s); communicators aborted (a peer rank died or "
                  "stalled?)",
                  what, t->timeout_s);
      pthread_mutex_unlock(&t->comm_lock);
      st = healthy(t);
      break;
    }
    if (!blocked) {
      token = t->hooks.block_begin ? t->hooks.block_begin(t->hooks.arg) : NULL;
      blocked = 1;
    }
    if (t->hooks.interrupted && t->hooks.interrupted(t->hooks.arg)) {
      pthread_mutex_lock(&t->comm_lock);
      fail_locked(t, MFSDP_ERR_COMM, "interrupted while waiting: %s; communicators aborted", what);
      pthread_mutex_unlock(&t->comm_lock);
      st = healthy(t);
      break;
    }
    nap(polls < 100 ? 20e-6 : 1e-3);
  }
  if (blocked && t->hooks.block_end) t->hooks.block_end(t->hooks.arg, token);
  return st;
}

/* NCCL has finished the calls made on the lanes in *(unsigned*)arg (a bit mask). */
static int poll_settled(mfsdp_nccl* t, void* arg, mfsdp_status* st) {
  unsigned lanes = *(const unsigned*)arg;
  pthread_mutex_lock(&t->comm_lock);
  ncclResult_t worst = ncclSuccess;
  for (int lane = 0; lane < 2 && !t->failed; ++lane) {
    if (!(lanes & (1u << lane)) || t->comm[lane] == NULL) continue;
    ncclResult_t r = ncclSuccess, q = ncclCommGetAsyncError(t->comm[lane], &r);
    if (q != ncclSuccess) r = q;
    if (r != ncclSuccess && (worst == ncclSuccess || worst == ncclInProgress)) worst = r;
  }
  int result = 1;
  if (t->failed) {
    result = -1;
  } else if (worst == ncclInProgress) {
    result = 0;
  } else if (worst != ncclSuccess) {
    fail_locked(t, MFSDP_ERR_NCCL, "%s (%s)", ncclGetErrorString(worst), ncclGetLastError(NULL));
    result = -1;
  }
  pthread_mutex_unlock(&t->comm_lock);
  if (result < 0) *st = healthy(t);
  return result;
}

/* The collective of the work in arg has run. */
static int poll_event(mfsdp_nccl* t, void* arg, mfsdp_status* st) {
  mfsdp_work* w = arg;
  if (t->failed) {
    *st = healthy(t);
    return -1;
  }
  cudaError_t q = cudaEventQuery(w->done);
  if (q == cudaSuccess) return 1;
  if (q == cudaErrorNotReady) return 0;
  cudaGetLastError();
  pthread_mutex_lock(&t->comm_lock);
  fail_locked(t, MFSDP_ERR_CUDA, "waiting for a collective: %s", cudaGetErrorString(q));
  pthread_mutex_unlock(&t->comm_lock);
  *st = healthy(t);
  return -1;
}

/* ------------------------------------------------------------------------------------------ */
/* issuing collectives */

/* Sum, average, or a sum of inputs pre-multiplied by a host scalar (float32/float64 only: the
 * scalar has the buffer's type). *custom: an operator to destroy once NCCL has the call. */
static ncclResult_t reduce_op(mfsdp_nccl* t, const pending* p, ncclRedOp_t* out, int* custom) {
  *custom = 0;
  *out = p->op == MFSDP_REDUCE_AVG ? ncclAvg : ncclSum;
  if (p->premul == 1.0) return ncclSuccess;
  double scale = p->op == MFSDP_REDUCE_AVG ? p->premul / t->world : p->premul;
  float scale32 = (float)scale;
  if (p->dtype != MFSDP_F32 && p->dtype != MFSDP_F64) return ncclInvalidArgument;
  *custom = 1;
  return ncclRedOpCreatePreMulSum(out, p->dtype == MFSDP_F32 ? (void*)&scale32 : (void*)&scale, p->type,
                                  ncclScalarHostImmediate, t->comm[1]);
}

/* Hands one collective to NCCL: inside an NCCL group, with comm_lock held. */
static ncclResult_t issue_one(mfsdp_nccl* t, const pending* p, ncclRedOp_t* custom, int* has_custom) {
  ncclComm_t comm = t->comm[p->lane];
  cudaStream_t s = t->stream[p->lane];
  *has_custom = 0;
  switch (p->kind) {
    case OP_ALL_GATHER: return ncclAllGather(p->send, p->recv, p->count, p->type, comm, s);
    case OP_ALL_TO_ALL: {
      ncclResult_t r = ncclSuccess;
      for (int peer = 0; peer < t->world && r == ncclSuccess; ++peer) {
        r = ncclSend((const char*)p->send + peer * p->block_bytes, p->count, p->type, peer, comm, s);
        if (r == ncclSuccess) r = ncclRecv((char*)p->recv + peer * p->block_bytes, p->count, p->type, peer, comm, s);
      }
      return r;
    }
    default: {
      ncclRedOp_t op;
      ncclResult_t r = reduce_op(t, p, &op, has_custom);
      if (r != ncclSuccess) return r;
      if (*has_custom) *custom = op;
      return p->kind == OP_ALL_REDUCE ? ncclAllReduce(p->send, p->recv, p->count, p->type, op, comm, s)
                                      : ncclReduceScatter(p->send, p->recv, p->count, p->type, op, comm, s);
    }
  }
}

/* Marks the end of a work on its lane and hands it to the watchdog. */
static mfsdp_status record(mfsdp_nccl* t, int lane, mfsdp_work* w) {
  cudaError_t e = cudaEventRecord(w->done, t->stream[lane]);
  if (e != cudaSuccess) return CUDA_FAIL(e, "recording a collective's event");
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

/* Issues n collectives as one NCCL group, waits until NCCL has taken them (non-blocking
 * communicators may still be connecting), and records each work's event after its
 * collective. The caller keeps its references to the works either way. */
static mfsdp_status launch(mfsdp_nccl* t, pending* ops, int n, const char* what) {
  ncclRedOp_t custom[MAX_GROUP];
  int has_custom[MAX_GROUP] = {0};
  unsigned lanes = 0;
  pthread_mutex_lock(&t->comm_lock);
  mfsdp_status st = healthy(t);
  if (st == MFSDP_OK) {
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess) {
      for (int i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); ++i) {
        r = issue_one(t, &ops[i], &custom[i], &has_custom[i]);
        lanes |= 1u << ops[i].lane;
      }
      ncclResult_t end = ncclGroupEnd(); /* balanced even after a failed call */
      if (r == ncclSuccess) r = end;
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      /* the ranks' collectives no longer match: nothing can continue */
      fail_locked(t, MFSDP_ERR_NCCL, "%s: %s (%s)", what, ncclGetErrorString(r), ncclGetLastError(NULL));
      st = healthy(t);
    }
  }
  pthread_mutex_unlock(&t->comm_lock);
  if (st == MFSDP_OK) st = wait_until(t, poll_settled, &lanes, what);
  pthread_mutex_lock(&t->comm_lock); /* aborted communicators took their operators with them */
  for (int i = 0; i < n; ++i)
    if (has_custom[i] && t->comm[1]) ncclRedOpDestroy(custom[i], t->comm[1]);
  pthread_mutex_unlock(&t->comm_lock);
  for (int i = 0; i < n && st == MFSDP_OK; ++i) st = record(t, ops[i].lane, ops[i].work);
  return st;
}

/* Orders `lane` after the producer (torch's current stream). */
static mfsdp_status order_after_producer(mfsdp_nccl* t, int lane) {
  cudaStream_t producer = (cudaStream_t)mfsdp_cuda_get_stream(t->kernels_ctx);
  cudaEvent_t ready;
  cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
  if (e == cudaSuccess) {
    e = cudaEventRecord(ready, producer);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(t->stream[lane], ready, 0);
    cudaEventDestroy(ready);
  }
  if (e != cudaSuccess) return CUDA_FAIL(e, "ordering the NCCL stream after the producer");
  return MFSDP_OK;
}

static mfsdp_status new_work(mfsdp_work** out) {
  mfsdp_work* w = calloc(1, sizeof *w);
  if (w == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "work");
  cudaError_t e = cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    free(w);
    return CUDA_FAIL(e, "creating a collective's event");
  }
  w->refs = 1;
  *out = w;
  return MFSDP_OK;
}

static void drop(mfsdp_nccl* t, mfsdp_work* w) {
  pthread_mutex_lock(&t->lock);
  unref(w);
  pthread_mutex_unlock(&t->lock);
}

/* The one entry of every collective: launched now, or kept for group_end. */
static mfsdp_status submit(mfsdp_nccl* t, pending* p, const char* what, mfsdp_work** work) {
  *work = NULL;
  int saved;
  MFSDP_CHECK(enter_device(t, &saved));
  mfsdp_status st = healthy(t);
  if (st == MFSDP_OK && t->group_depth > 0 && t->n_group == MAX_GROUP)
    st = MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "more than %d collectives in one group", MAX_GROUP);
  if (st == MFSDP_OK) st = order_after_producer(t, p->lane);
  mfsdp_work* w = NULL;
  if (st == MFSDP_OK) st = new_work(&w);
  if (st == MFSDP_OK) {
    p->work = w;
    if (t->group_depth > 0) {
      w->refs++; /* the group's reference, dropped at group_end */
      t->group[t->n_group++] = *p;
    } else {
      st = launch(t, p, 1, what);
      if (st != MFSDP_OK) {
        drop(t, w);
        w = NULL;
      }
    }
  }
  leave_device(t, saved);
  *work = w;
  return st;
}

static pending make(op_kind kind, int lane, const void* send, void* recv, int dtype, int64_t numel) {
  pending p = {kind, lane, send, recv, nccl_count(dtype, numel), 0, nccl_dtype(dtype), dtype, MFSDP_REDUCE_SUM,
               1.0, NULL};
  return p;
}

static mfsdp_status nt_all_gather(void* ctx, const mfsdp_buffer* full, const mfsdp_buffer* shard, mfsdp_work** work) {
  pending p = make(OP_ALL_GATHER, 0, shard->data, full->data, shard->dtype, shard->numel);
  return submit(ctx, &p, "ncclAllGather", work);
}

static mfsdp_status nt_reduce_scatter(void* ctx, const mfsdp_buffer* shard, const mfsdp_buffer* full,
                                      mfsdp_reduce_op op, double premul, mfsdp_work** work) {
  pending p = make(OP_REDUCE_SCATTER, 1, full->data, shard->data, shard->dtype, shard->numel);
  p.op = op;
  p.premul = premul;
  return submit(ctx, &p, "ncclReduceScatter", work);
}

static mfsdp_status nt_all_reduce(void* ctx, const mfsdp_buffer* buf, mfsdp_reduce_op op, double premul,
                                  mfsdp_work** work) {
  pending p = make(OP_ALL_REDUCE, 1, buf->data, buf->data, buf->dtype, buf->numel);
  p.op = op;
  p.premul = premul;
  return submit(ctx, &p, "ncclAllReduce", work);
}

static mfsdp_status nt_all_to_all(void* ctx, const mfsdp_buffer* out, const mfsdp_buffer* in, mfsdp_work** work) {
  mfsdp_nccl* t = ctx;
  int64_t block = in->numel / t->world;
  pending p = make(OP_ALL_TO_ALL, 1, in->data, out->data, in->dtype, block);
  p.block_bytes = (size_t)(block * mfsdp_dtype_size(in->dtype));
  return submit(t, &p, "ncclSend/ncclRecv (all-to-all)", work);
}

static mfsdp_status nt_group_start(void* ctx) {
  mfsdp_nccl* t = ctx;
  MFSDP_CHECK(healthy(t));
  t->group_depth++; /* nested: one group */
  return MFSDP_OK;
}

/* Launches the group's collectives as one NCCL group (see [Note: groups]). */
static mfsdp_status nt_group_end(void* ctx) {
  mfsdp_nccl* t = ctx;
  if (t->group_depth == 0) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "group_end without group_start");
  if (--t->group_depth > 0) return MFSDP_OK;
  int n = t->n_group;
  t->n_group = 0;
  int saved;
  mfsdp_status st = enter_device(t, &saved);
  if (st == MFSDP_OK && n > 0) st = launch(t, t->group, n, "ncclGroupEnd (a unit's collectives)");
  for (int i = 0; i < n; ++i) drop(t, t->group[i].work); /* the engine keeps its own reference */
  leave_device(t, saved);
  return st;
}

/* Lets go of a work. Memory its collective touches may be released on the consumer stream next
 * (a pipeline torn down mid-collective): order that stream after the collective first. */
static void nt_discard(void* ctx, mfsdp_work* w) {
  mfsdp_nccl* t = ctx;
  if (w == NULL) return;
  if (w->recorded) {
    int saved;
    if (enter_device(t, &saved) == MFSDP_OK) {
      if (cudaStreamWaitEvent((cudaStream_t)mfsdp_cuda_get_stream(t->kernels_ctx), w->done, 0) != cudaSuccess)
        cudaGetLastError();
      leave_device(t, saved);
    }
  }
  drop(t, w);
}

static mfsdp_status nt_wait(void* ctx, mfsdp_work* w) {
  mfsdp_nccl* t = ctx;
  if (w == NULL) return MFSDP_OK;
  if (!w->recorded) { /* its group never launched (group_end failed or was not called) */
    mfsdp_status st = healthy(t);
    drop(t, w);
    return st != MFSDP_OK ? st
                          : MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "waited for a collective whose group was not launched");
  }
  int saved;
  mfsdp_status st = enter_device(t, &saved);
  if (st == MFSDP_OK) {
    cudaError_t e = cudaStreamWaitEvent((cudaStream_t)mfsdp_cuda_get_stream(t->kernels_ctx), w->done, 0);
    if (e != cudaSuccess) st = CUDA_FAIL(e, "waiting for a collective");
    leave_device(t, saved);
  }
  drop(t, w);
  return st != MFSDP_OK ? st : healthy(t);
}

const mfsdp_transport_ops mfsdp_nccl_ops = {"nccl",        nt_all_gather, nt_reduce_scatter, nt_all_reduce,
                                            nt_all_to_all, nt_wait,       nt_discard,        nt_group_start,
                                            nt_group_end,  1};

/* ------------------------------------------------------------------------------------------ */
/* lifetime */

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
  mfsdp_status st = enter_device(t, &saved);
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
    config.blocking = 0; /* see [Note: NCCL never blocks the engine] */
    pthread_mutex_lock(&t->comm_lock);
    ncclResult_t r = ncclGroupStart();
    for (int lane = 0; lane < 2 && (r == ncclSuccess || r == ncclInProgress); ++lane)
      r = ncclCommInitRankConfig(&t->comm[lane], world, ids[lane], rank, &config);
    ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    if (r != ncclSuccess && r != ncclInProgress) {
      fail_locked(t, MFSDP_ERR_NCCL, "ncclCommInitRankConfig(rank %d of %d, device %d): %s (%s)", rank, world, device,
                  ncclGetErrorString(r), ncclGetLastError(NULL));
      st = healthy(t);
    }
    pthread_mutex_unlock(&t->comm_lock);
  }
  unsigned both = 3;
  if (st == MFSDP_OK) st = wait_until(t, poll_settled, &both, "setting up the NCCL communicators (every rank joins)");
  if (st == MFSDP_OK) {
    t->running = 1;
    if (pthread_create(&t->watchdog, NULL, watchdog_main, t) != 0) {
      t->running = 0;
      st = MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "could not start the NCCL watchdog thread");
    }
  }
  leave_device(t, saved);
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
  MFSDP_CHECK(enter_device(t, &saved));
  mfsdp_status st = healthy(t);
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
  if (st == MFSDP_OK) st = new_work(&w);
  if (st == MFSDP_OK) {
    pending p = make(OP_ALL_REDUCE, 1, t->barrier, t->barrier, MFSDP_I32, 1);
    p.work = w;
    st = launch(t, &p, 1, "close (a barrier every rank joins)");
  }
  if (st == MFSDP_OK) st = wait_until(t, poll_event, w, "close (waiting for every rank to close)");
  if (w) drop(t, w);
  /* 2. nothing of ours is in flight: no watchdog from here on */
  stop_watchdog(t);
  /* 3. finalize (polled, bounded by the timeout), then destroy, which is local after it */
  if (st == MFSDP_OK) {
    pthread_mutex_lock(&t->comm_lock);
    ncclResult_t r = ncclSuccess;
    for (int lane = 0; lane < 2 && (r == ncclSuccess || r == ncclInProgress); ++lane)
      r = ncclCommFinalize(t->comm[lane]);
    if (r != ncclSuccess && r != ncclInProgress) {
      fail_locked(t, MFSDP_ERR_NCCL, "ncclCommFinalize: %s (%s)", ncclGetErrorString(r), ncclGetLastError(NULL));
      st = healthy(t);
    }
    pthread_mutex_unlock(&t->comm_lock);
    unsigned both = 3;
    if (st == MFSDP_OK) st = wait_until(t, poll_settled, &both, "ncclCommFinalize");
  }
  pthread_mutex_lock(&t->comm_lock);
  for (int lane = 0; lane < 2; ++lane)
    if (t->comm[lane]) {
      (st == MFSDP_OK ? ncclCommDestroy : ncclCommAbort)(t->comm[lane]);
      t->comm[lane] = NULL;
    }
  pthread_mutex_unlock(&t->comm_lock);
  t->closed = 1;
  leave_device(t, saved);
  return st;
}

void mfsdp_nccl_destroy(mfsdp_nccl* t) {
  if (t == NULL) return;
  stop_watchdog(t);
  int saved;
  int on_device = enter_device(t, &saved) == MFSDP_OK;
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
  if (on_device) leave_device(t, saved);
  pthread_mutex_destroy(&t->lock);
  pthread_cond_destroy(&t->wake);
  pthread_mutex_destroy(&t->comm_lock);
  free(t);
}

const char* mfsdp_nccl_failure(const mfsdp_nccl* t) { return t->failed ? t->reason : NULL; }
