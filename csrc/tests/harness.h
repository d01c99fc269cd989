/* harness.h: what the C tests need to run the engine without Python.
 *
 * - heap memory ops: buffers are calloc'd blocks (storages) or offsets into them (views);
 * - a thread transport: every rank of a world is a thread of this process, collectives meet at
 *   a barrier and sum in rank order (like a single-node gloo, minus the sockets);
 * - a tiny check framework and a deterministic PRNG. */
#ifndef MFSDP_TEST_HARNESS_H
#define MFSDP_TEST_HARNESS_H


#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../comm/mfsdp_pipeline.h"
#include "../core/mfsdp_dtype.h"
#include "../core/mfsdp_layout.h"

extern _Atomic int test_failures; /* checks fail on several rank threads */
extern _Atomic long test_checks;  /* checks run: a split or a refactor must not lose any */

#define CHECK(cond, ...)                                                  \
  do {                                                                    \
    test_checks++;                                                        \
    if (!(cond)) {                                                        \
      test_failures++;                                                    \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);     \
      fprintf(stderr, __VA_ARGS__);                                       \
      fprintf(stderr, "\n");                                              \
    }                                                                     \
  } while (0)

#define CHECK_OK(call)                                                                        \
  do {                                                                                        \
    mfsdp_status s__ = (call);                                                                \
    CHECK(s__ == MFSDP_OK, "%s -> %s: %s", #call, mfsdp_status_name(s__), mfsdp_last_error()); \
  } while (0)

/* splitmix64 */
static inline uint64_t rng_next(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static inline double rng_uniform(uint64_t* s) { return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }
static inline int64_t rng_range(uint64_t* s, int64_t lo, int64_t hi) { /* [lo, hi] */
  return lo + (int64_t)(rng_next(s) % (uint64_t)(hi - lo + 1));
}

/* ---- heap memory ---- */
typedef struct heap_block {
  void* mem;
  int64_t bytes;
} heap_block;

extern const mfsdp_memory_ops heap_memory_ops;

/* ---- thread transport ---- */
#define LOOP_MAX_WORLD 16
typedef struct loop_world {
  int n;
  pthread_barrier_t barrier;
  const void* slot[LOOP_MAX_WORLD];
  int64_t shape[LOOP_MAX_WORLD][3]; /* (kind, numel, dtype) each rank issued: must agree */
  int mismatches;                   /* collectives whose ranks disagreed (a real transport would hang or abort) */
  int fail_after; /* collectives before an injected failure; < 0: never */
  int calls;
  pthread_mutex_t lock;
} loop_world;

typedef struct loop_rank {
  loop_world* world;
  int rank;
} loop_rank;

extern const mfsdp_transport_ops loop_transport_ops;
void loop_world_init(loop_world* w, int n);
void loop_world_destroy(loop_world* w);

double load_as_double(const void* p, int dtype, int64_t i);
void store_from_double(void* p, int dtype, int64_t i, double v);
/* Random values in [-4, 4) of a floating dtype, with NaN, +-Inf, float32 subnormals and values
 * that overflow float16 sprinkled in: the kernels' test inputs. */
void fill_test_values(void* p, int dtype, int64_t n, uint64_t* rng);
/* Inputs of the quantization kernels, block by block (blocks of `block` elements): most blocks
 * random values of a random magnitude 2^-12 .. 2^12 (some holding their +-absmax exactly), and,
 * when `specials`, whole zero blocks (+0 and -0), blocks holding one NaN, +Inf or -Inf, and
 * blocks of float32 subnormals. */
void fill_quant_values(void* p, int dtype, int64_t n, int64_t block, uint64_t* rng, int specials);
/* Elements of a and b that differ bit for bit (a NaN equals any NaN). */
int64_t count_differences(const void* a, const void* b, int dtype, int64_t n);

#endif
