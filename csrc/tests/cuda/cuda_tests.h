/* cuda_tests.h: what the parts of test_emu share (one file each in this folder by concern, run
 * by csrc/tests/test_emu.c): the kernel rig, the NCCL rig (nccl_rig.c), timing helpers, and the
 * parts' entry points. */
#ifndef MFSDP_TEST_CUDA_TESTS_H
#define MFSDP_TEST_CUDA_TESTS_H

#include <time.h>

#include "../../cuda/mfsdp_cuda.h"
#include "../../cuda/mfsdp_nccl.h"
#include "../harness.h"
#include "../pipeline_cases.h"

static inline void nap(double seconds) {
  struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
  nanosleep(&ts, NULL);
}

static inline double seconds_since(const struct timespec* a) {
  struct timespec b;
  clock_gettime(CLOCK_MONOTONIC, &b);
  return (double)(b.tv_sec - a->tv_sec) + 1e-9 * (double)(b.tv_nsec - a->tv_nsec);
}

/* A device's kernel context and its current stream. */
typedef struct kernel_rig {
  void* ctx;
  cudaStream_t stream;
} kernel_rig;

/* nccl_rig.c: the NCCL rig: emulated device memory, the native transport, the CUDA kernels */
typedef struct emu_world {
  int n;
  ncclUniqueId ids[2];
  double timeout_s;
  const mfsdp_nccl_hooks* hooks; /* NULL: none */
  int defer;                     /* each rank's current stream is deferred (emu_stream_defer) */
  int stream_delay_us;           /* each operation on a rank's current stream starts this much later */
  int lane_delay_us;             /* ... on the transports' lanes */
  pthread_barrier_t start;       /* the ranks make their transports together: the set-up's timeout
                                    counts from there, not from when each thread got a core */
} emu_world;

typedef struct emu_rank {
  cudaStream_t stream; /* the rank's "torch current stream" */
  void* kernels_ctx;
  mfsdp_nccl* nccl;
} emu_rank;

extern mfsdp_memory_ops dev_memory_ops; /* device memory as torch's caching allocator gives it */
extern int g_defer_streams;             /* worlds made while set defer their ranks' current streams */
extern const pipe_rig nccl_rig;
void emu_rig_init(void); /* before any rig is used */
void* emu_world_create(int n);
void emu_world_destroy(void* world);
int emu_rank_setup_on(emu_world* w, int rank, int device, mfsdp_backend* be, void** state);
int emu_rank_setup(void* world, int rank, mfsdp_backend* be, void** state);
void emu_rank_sync(void* state);
void emu_rank_teardown(void* state);

/* The unit of test_grouped.c (its buckets, their rows and columns), also the pipeline that
 * test_hangs.c destroys mid-gather. */
enum { UNIT_BUCKETS = 3, UNIT_ROWS = 10, UNIT_COLS = 6 };

/* The parts, by file. */
/* test_kernels.c */
void test_kernels(void);
/* test_emulator.c */
void test_emulator(void);
/* test_quant.c */
void test_quant_kernels(void);
/* test_grouped.c */
void test_grouped_unit(void);
/* test_hfsdp.c */
void test_hfsdp(void);
/* test_hangs.c */
void warm_up(emu_rank* r, const mfsdp_buffer* full, const mfsdp_buffer* shard);
void test_dead_peer_at_connect(void);
void test_destroy_in_flight(void);
void test_abort_inside_group(void);
void test_pipeline_destroy_in_flight(void);
void test_close(void);
void test_interrupt(void);
void test_watchdog(void);

#endif
