/* nccl_collectives.c: issuing collectives (the map is at the top of nccl_transport.c): each one
 * ordered after its producer and handed to NCCL at once, or kept for its group's end; the
 * transport's table, mfsdp_nccl_ops.
 *
 * [Note: groups]
 * Collectives issued between group_start and group_end are ordered after their producer at
 * once but reach NCCL only at group_end, as one ncclGroupStart..ncclGroupEnd under comm_lock:
 * the watchdog cannot abort a communicator inside an open NCCL group, and no torch call (the
 * pipeline allocates between a unit's collectives) ever runs under comm_lock. NCCL launches a
 * group's kernels at ncclGroupEnd, so the works' events are recorded after it: recorded earlier
 * they would complete before the collective ran. */
#define _POSIX_C_SOURCE 200809L
#include "nccl_internal.h"

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
mfsdp_status nt_launch(mfsdp_nccl* t, pending* ops, int n, const char* what) {
  ncclRedOp_t custom[MAX_GROUP];
  int has_custom[MAX_GROUP] = {0};
  unsigned lanes = 0;
  pthread_mutex_lock(&t->comm_lock);
  mfsdp_status st = nt_healthy(t);
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
      nt_fail_locked(t, MFSDP_ERR_NCCL, "%s: %s (%s)", what, ncclGetErrorString(r), ncclGetLastError(NULL));
      st = nt_healthy(t);
    }
  }
  pthread_mutex_unlock(&t->comm_lock);
  if (st == MFSDP_OK) st = nt_wait_until(t, nt_poll_settled, &lanes, what);
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

mfsdp_status nt_new_work(mfsdp_work** out) {
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

void nt_drop(mfsdp_nccl* t, mfsdp_work* w) {
  pthread_mutex_lock(&t->lock);
  unref(w);
  pthread_mutex_unlock(&t->lock);
}

/* The one entry of every collective: launched now, or kept for group_end. */
static mfsdp_status submit(mfsdp_nccl* t, pending* p, const char* what, mfsdp_work** work) {
  *work = NULL;
  int saved;
  MFSDP_CHECK(nt_enter_device(t, &saved));
  mfsdp_status st = nt_healthy(t);
  if (st == MFSDP_OK && t->group_depth > 0 && t->n_group == MAX_GROUP)
    st = MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "more than %d collectives in one group", MAX_GROUP);
  if (st == MFSDP_OK) st = order_after_producer(t, p->lane);
  mfsdp_work* w = NULL;
  if (st == MFSDP_OK) st = nt_new_work(&w);
  if (st == MFSDP_OK) {
    p->work = w;
    if (t->group_depth > 0) {
      w->refs++; /* the group's reference, dropped at group_end */
      t->group[t->n_group++] = *p;
    } else {
      st = nt_launch(t, p, 1, what);
      if (st != MFSDP_OK) {
        nt_drop(t, w);
        w = NULL;
      }
    }
  }
  nt_leave_device(t, saved);
  *work = w;
  return st;
}

pending nt_make(op_kind kind, int lane, const void* send, void* recv, int dtype, int64_t numel) {
  pending p = {kind, lane, send, recv, nccl_count(dtype, numel), 0, nccl_dtype(dtype), dtype, MFSDP_REDUCE_SUM,
               1.0, NULL};
  return p;
}

static mfsdp_status nt_all_gather(void* ctx, const mfsdp_buffer* full, const mfsdp_buffer* shard, mfsdp_work** work) {
  pending p = nt_make(OP_ALL_GATHER, 0, shard->data, full->data, shard->dtype, shard->numel);
  return submit(ctx, &p, "ncclAllGather", work);
}

static mfsdp_status nt_reduce_scatter(void* ctx, const mfsdp_buffer* shard, const mfsdp_buffer* full,
                                      mfsdp_reduce_op op, double premul, mfsdp_work** work) {
  pending p = nt_make(OP_REDUCE_SCATTER, 1, full->data, shard->data, shard->dtype, shard->numel);
  p.op = op;
  p.premul = premul;
  return submit(ctx, &p, "ncclReduceScatter", work);
}

static mfsdp_status nt_all_reduce(void* ctx, const mfsdp_buffer* buf, mfsdp_reduce_op op, double premul,
                                  mfsdp_work** work) {
  pending p = nt_make(OP_ALL_REDUCE, 1, buf->data, buf->data, buf->dtype, buf->numel);
  p.op = op;
  p.premul = premul;
  return submit(ctx, &p, "ncclAllReduce", work);
}

static mfsdp_status nt_all_to_all(void* ctx, const mfsdp_buffer* out, const mfsdp_buffer* in, mfsdp_work** work) {
  mfsdp_nccl* t = ctx;
  int64_t block = in->numel / t->world;
  pending p = nt_make(OP_ALL_TO_ALL, 1, in->data, out->data, in->dtype, block);
  p.block_bytes = (size_t)(block * mfsdp_dtype_size(in->dtype));
  return submit(t, &p, "ncclSend/ncclRecv (all-to-all)", work);
}

static mfsdp_status nt_group_start(void* ctx) {
  mfsdp_nccl* t = ctx;
  MFSDP_CHECK(nt_healthy(t));
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
  mfsdp_status st = nt_enter_device(t, &saved);
  if (st == MFSDP_OK && n > 0) st = nt_launch(t, t->group, n, "ncclGroupEnd (a unit's collectives)");
  for (int i = 0; i < n; ++i) nt_drop(t, t->group[i].work); /* the engine keeps its own reference */
  nt_leave_device(t, saved);
  return st;
}

/* Lets go of a work. Memory its collective touches may be released on the consumer stream next
 * (a pipeline torn down mid-collective): order that stream after the collective first. */
static void nt_discard(void* ctx, mfsdp_work* w) {
  mfsdp_nccl* t = ctx;
  if (w == NULL) return;
  if (w->recorded) {
    int saved;
    if (nt_enter_device(t, &saved) == MFSDP_OK) {
      if (cudaStreamWaitEvent((cudaStream_t)mfsdp_cuda_get_stream(t->kernels_ctx), w->done, 0) != cudaSuccess)
        cudaGetLastError();
      nt_leave_device(t, saved);
    }
  }
  nt_drop(t, w);
}

static mfsdp_status nt_wait(void* ctx, mfsdp_work* w) {
  mfsdp_nccl* t = ctx;
  if (w == NULL) return MFSDP_OK;
  if (!w->recorded) { /* its group never launched (group_end failed or was not called) */
    mfsdp_status st = nt_healthy(t);
    nt_drop(t, w);
    return st != MFSDP_OK ? st
                          : MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "waited for a collective whose group was not launched");
  }
  int saved;
  mfsdp_status st = nt_enter_device(t, &saved);
  if (st == MFSDP_OK) {
    cudaError_t e = cudaStreamWaitEvent((cudaStream_t)mfsdp_cuda_get_stream(t->kernels_ctx), w->done, 0);
    if (e != cudaSuccess) st = CUDA_FAIL(e, "waiting for a collective");
    nt_leave_device(t, saved);
  }
  nt_drop(t, w);
  return st != MFSDP_OK ? st : nt_healthy(t);
}

const mfsdp_transport_ops mfsdp_nccl_ops = {"nccl",        nt_all_gather, nt_reduce_scatter, nt_all_reduce,
                                            nt_all_to_all, nt_wait,       nt_discard,        nt_group_start,
                                            nt_group_end,  1};
