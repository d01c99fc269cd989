/* test_emulator.c (a part of test_emu, whose runner is csrc/tests/test_emu.c): the emulator's own
 * promises. */
#include "cuda_tests.h"

/* the emulator's own promises: the timing knobs the stress runs rely on, and events that
 * concern one record each (as in CUDA) */

static void set_flag(void* arg) { *(_Atomic int*)arg = 1; }

void test_emulator(void) {
  cudaStream_t deferred, other, fast;
  cudaStreamCreateWithPriority(&deferred, cudaStreamNonBlocking, 0);
  cudaStreamCreateWithPriority(&other, cudaStreamNonBlocking, 0);
  cudaStreamCreateWithPriority(&fast, cudaStreamNonBlocking, 0);
  emu_stream_defer(deferred, 1);
  /* a deferred stream runs nothing until the host waits for it, and holds back its waiters */
  _Atomic int ran = 0, waiter_ran = 0;
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  emu_stream_host_fn(deferred, set_flag, (void*)&ran);
  cudaEventRecord(e, deferred);
  cudaStreamWaitEvent(other, e, 0);
  emu_stream_host_fn(other, set_flag, (void*)&waiter_ran);
  nap(0.02);
  CHECK(!ran && !waiter_ran && cudaEventQuery(e) == cudaErrorNotReady,
        "a deferred stream ran before the host waited for it (ran %d, its waiter %d)", (int)ran, (int)waiter_ran);
  /* the waiter waits for the record it saw: a later record of the same event on a stream that
   * runs at once completes the event, not that record */
  cudaEventRecord(e, fast);
  cudaStreamSynchronize(fast);
  nap(0.01);
  CHECK(cudaEventQuery(e) == cudaSuccess, "an event whose latest record passed is complete");
  CHECK(!waiter_ran, "a wait for an event's first record was released by its second");
  cudaStreamSynchronize(deferred);
  cudaStreamSynchronize(other);
  CHECK(ran && waiter_ran, "synchronizing a deferred stream runs it and releases its waiters (ran %d, waiter %d)",
        (int)ran, (int)waiter_ran);
  /* work queued after a synchronize stays deferred; switching deferral off lets it go */
  ran = 0;
  emu_stream_host_fn(deferred, set_flag, (void*)&ran);
  nap(0.01);
  CHECK(!ran, "work queued after a synchronize ran without one");
  /* a host waiting for an event runs the deferred stream up to its record, and no further */
  _Atomic int before = 0, after = 0;
  emu_stream_host_fn(deferred, set_flag, (void*)&before);
  cudaEventRecord(e, deferred);
  emu_stream_host_fn(deferred, set_flag, (void*)&after);
  CHECK(cudaEventSynchronize(e) == cudaSuccess && before, "cudaEventSynchronize returned before its record passed");
  nap(0.01);
  CHECK(!after, "cudaEventSynchronize ran the deferred stream past its record");
  emu_stream_defer(deferred, 0);
  cudaStreamSynchronize(deferred);
  CHECK(ran && after, "deferral off: the queued work ran");
  /* a slowed stream starts each operation at least its delay later */
  emu_set_stream_delay_us(2000);
  cudaStream_t slow;
  cudaStreamCreateWithPriority(&slow, cudaStreamNonBlocking, 0);
  emu_set_stream_delay_us(0);
  struct timespec a;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (int k = 0; k < 5; ++k) emu_stream_host_fn(slow, set_flag, (void*)&ran);
  cudaStreamSynchronize(slow);
  double took = seconds_since(&a);
  CHECK(took >= 0.01, "5 operations on a stream slowed by 2 ms each took %.4f s", took);
  cudaEventDestroy(e);
  cudaStream_t made[] = {deferred, other, fast, slow};
  for (size_t k = 0; k < sizeof made / sizeof made[0]; ++k) cudaStreamDestroy(made[k]);
}
