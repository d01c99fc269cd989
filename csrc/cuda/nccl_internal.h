/* nccl_internal.h: the state the NCCL transport's files share (the map is at the top of
 * nccl_transport.c) and the helpers they call across files. Not installed: the API is
 * mfsdp_nccl.h. Helpers shared between the files are prefixed nt_ and have hidden visibility,
 * so the extension exports none of them; helpers of one file stay static there. */
#ifndef MFSDP_NCCL_INTERNAL_H
#define MFSDP_NCCL_INTERNAL_H

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "mfsdp_cuda.h"
#include "mfsdp_nccl.h"

#if defined(__GNUC__)
#define NT_INTERNAL __attribute__((visibility("hidden")))
#else
#define NT_INTERNAL
#endif

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

static inline void unref(mfsdp_work* w) { /* call with the lock held */
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

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define CUDA_FAIL(e, what) \
  MFSDP_FAIL(MFSDP_ERR_CUDA, "%s: %s (%s)", (what), cudaGetErrorString(e), cudaGetErrorName(e))

/* One look: 1 done, 0 not yet, -1 failed (*st says why). */
typedef int (*poll_fn)(mfsdp_nccl* t, void* arg, mfsdp_status* st);

/* Shared helpers, by the file that defines them, from the floor up (each documented at its
 * definition). */

/* nccl_watch.c */
NT_INTERNAL mfsdp_status nt_enter_device(const mfsdp_nccl* t, int* saved);
NT_INTERNAL void nt_leave_device(const mfsdp_nccl* t, int saved);
NT_INTERNAL mfsdp_status nt_healthy(const mfsdp_nccl* t);
NT_INTERNAL void nt_fail_locked(mfsdp_nccl* t, mfsdp_status why, const char* fmt, ...);
NT_INTERNAL void* nt_watchdog_main(void* arg);
NT_INTERNAL void nt_stop_watchdog(mfsdp_nccl* t);
NT_INTERNAL mfsdp_status nt_wait_until(mfsdp_nccl* t, poll_fn poll, void* arg, const char* what);
NT_INTERNAL int nt_poll_settled(mfsdp_nccl* t, void* arg, mfsdp_status* st);
NT_INTERNAL int nt_poll_event(mfsdp_nccl* t, void* arg, mfsdp_status* st);

/* nccl_collectives.c */
NT_INTERNAL mfsdp_status nt_launch(mfsdp_nccl* t, pending* ops, int n, const char* what);
NT_INTERNAL mfsdp_status nt_new_work(mfsdp_work** out);
NT_INTERNAL void nt_drop(mfsdp_nccl* t, mfsdp_work* w);
NT_INTERNAL pending nt_make(op_kind kind, int lane, const void* send, void* recv, int dtype, int64_t numel);

#endif
