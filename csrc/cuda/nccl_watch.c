/* nccl_watch.c: the floor of the NCCL transport (the map is at the top of nccl_transport.c): its
 * device made current per entry point, its health, failing it (which aborts the communicators),
 * the watchdog that fails it, and the waits bounded by the timeout.
 *
 * [Note: NCCL never blocks the engine]
 * The communicators are non-blocking (ncclConfig_t.blocking = 0): a call that has to wait (the
 * set-up, the connection NCCL makes the first time an algorithm runs, finalize) returns
 * ncclInProgress and completes in the background. The transport then polls
 * ncclCommGetAsyncError (nt_wait_until) with the timeout as a deadline, the GIL released and
 * Ctrl-C checked through the caller's hooks: a peer that died at that moment costs the timeout,
 * not a hang. comm_lock guards each NCCL call against the watchdog's abort (communicators are
 * not thread-safe) and is held only around calls that return at once, never while waiting.
 *
 * [Note: collective timeout]
 * A watchdog thread polls the events of outstanding collectives and NCCL's asynchronous error.
 * A collective older than the timeout, or an NCCL error, aborts both communicators (the only way
 * to unblock a kernel waiting for a dead peer) and marks the transport failed: the next call
 * from the engine returns MFSDP_ERR_TIMEOUT / MFSDP_ERR_NCCL with the reason, never a hang. */
#define _POSIX_C_SOURCE 200809L
#include "nccl_internal.h"

#include <stdarg.h>
#include <stdio.h>

/* Makes the transport's device current for an entry point; nt_leave_device gives the caller's
 * back. */
mfsdp_status nt_enter_device(const mfsdp_nccl* t, int* saved) {
  cudaError_t e = cudaGetDevice(saved);
  if (e == cudaSuccess && *saved != t->device) e = cudaSetDevice(t->device);
  if (e != cudaSuccess) {
    *saved = -1;
    return CUDA_FAIL(e, "making the NCCL transport's device current");
  }
  return MFSDP_OK;
}

void nt_leave_device(const mfsdp_nccl* t, int saved) {
  if (saved >= 0 && saved != t->device) cudaSetDevice(saved);
}

mfsdp_status nt_healthy(const mfsdp_nccl* t) {
  if (t->failed) return MFSDP_FAIL((mfsdp_status)t->failed, "NCCL transport stopped: %s", t->reason);
  if (t->closed) return MFSDP_FAIL(MFSDP_ERR_INVALID_STATE, "the NCCL transport was closed");
  return MFSDP_OK;
}

/* Stops the transport: records why (the first failure wins) and aborts both communicators,
 * the only way to end kernels that wait for a dead peer. Call with comm_lock held. */
void nt_fail_locked(mfsdp_nccl* t, mfsdp_status why, const char* fmt, ...) {
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

void* nt_watchdog_main(void* arg) {
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
        nt_fail_locked(t, MFSDP_ERR_TIMEOUT,
                    "a collective did not finish within the timeout (%.1f s); communicators aborted (a peer rank died "
                    "or stalled?)",
                    t->timeout_s);
      else
        nt_fail_locked(t, MFSDP_ERR_NCCL, "%s", ncclGetErrorString(async));
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

void nt_stop_watchdog(mfsdp_nccl* t) {
  pthread_mutex_lock(&t->lock);
  int had_thread = t->running;
  t->running = 0;
  pthread_cond_signal(&t->wake);
  pthread_mutex_unlock(&t->lock);
  if (had_thread) pthread_join(t->watchdog, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* waiting without blocking anyone: see [Note: NCCL never blocks the engine] */

static void nap(double seconds) {
  struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
  nanosleep(&ts, NULL);
}

mfsdp_status nt_wait_until(mfsdp_nccl* t, poll_fn poll, void* arg, const char* what) {
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
      nt_fail_locked(t, MFSDP_ERR_TIMEOUT,
                  "%s did not complete within the timeout (%.1f s); communicators aborted (a peer rank died or "
                  "stalled?)",
                  what, t->timeout_s);
      pthread_mutex_unlock(&t->comm_lock);
      st = nt_healthy(t);
      break;
    }
    if (!blocked) {
      token = t->hooks.block_begin ? t->hooks.block_begin(t->hooks.arg) : NULL;
      blocked = 1;
    }
    if (t->hooks.interrupted && t->hooks.interrupted(t->hooks.arg)) {
      pthread_mutex_lock(&t->comm_lock);
      nt_fail_locked(t, MFSDP_ERR_COMM, "interrupted while waiting: %s; communicators aborted", what);
      pthread_mutex_unlock(&t->comm_lock);
      st = nt_healthy(t);
      break;
    }
    nap(polls < 100 ? 20e-6 : 1e-3);
  }
  if (blocked && t->hooks.block_end) t->hooks.block_end(t->hooks.arg, token);
  return st;
}

/* NCCL has finished the calls made on the lanes in *(unsigned*)arg (a bit mask). */
int nt_poll_settled(mfsdp_nccl* t, void* arg, mfsdp_status* st) {
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
    nt_fail_locked(t, MFSDP_ERR_NCCL, "%s (%s)", ncclGetErrorString(worst), ncclGetLastError(NULL));
    result = -1;
  }
  pthread_mutex_unlock(&t->comm_lock);
  if (result < 0) *st = nt_healthy(t);
  return result;
}

/* The collective of the work in arg has run. */
int nt_poll_event(mfsdp_nccl* t, void* arg, mfsdp_status* st) {
  mfsdp_work* w = arg;
  if (t->failed) {
    *st = nt_healthy(t);
    return -1;
  }
  cudaError_t q = cudaEventQuery(w->done);
  if (q == cudaSuccess) return 1;
  if (q == cudaErrorNotReady) return 0;
  cudaGetLastError();
  pthread_mutex_lock(&t->comm_lock);
  nt_fail_locked(t, MFSDP_ERR_CUDA, "waiting for a collective: %s", cudaGetErrorString(q));
  pthread_mutex_unlock(&t->comm_lock);
  *st = nt_healthy(t);
  return -1;
}
