/* pipeline_cases.h: the pipeline's end-to-end cases (init, gather, gradients over several
 * microbatches, reduce, optimizer install, regather) at world sizes 1-4, run on a "rig": the
 * backend each rank thread builds. test_core runs them on heap memory + the thread transport +
 * CPU kernels; test_emu on the NCCL transport + CUDA kernels over the emulated device. */
#ifndef MFSDP_TEST_PIPELINE_CASES_H
#define MFSDP_TEST_PIPELINE_CASES_H

#include "harness.h"

typedef struct pipe_rig {
  const char* name;
  void* (*world_create)(int n);
  void (*world_destroy)(void* world);
  /* Builds rank `rank`'s backend; *state is handed back to sync/teardown. 0 on success. */
  int (*rank_setup)(void* world, int rank, mfsdp_backend* be, void** state);
  /* Host reads and writes of engine buffers are valid after this (device work finished). */
  void (*rank_sync)(void* state);
  void (*rank_teardown)(void* state);
  /* Makes the collective `after` calls from now fail on every rank; NULL: not supported. */
  void (*inject_failure)(void* world, int after);
} pipe_rig;

/* Elements per item the cases' plans reserve in every shard ([Note: flag tail] in
 * core/mfsdp_layout.h; default 0): with a tail, every case must give the same results. */
extern int pipeline_cases_tail;

/* force_comm: issue collectives at world size 1 too (exercises a transport on one device). */
void run_pipeline_cases(const pipe_rig* rig, int max_world, int force_comm);

/* The quantized wires ([Note: quantized communication] in csrc/comm/wire.c), checked exactly
 * against the CPU kernels: gathers, gradient exchanges of every strategy, worlds 1..max_world. */
void run_quantized_cases(const pipe_rig* rig, int max_world, int force_comm);

extern const pipe_rig loop_rig; /* heap memory, thread transport, CPU kernels */

#endif
