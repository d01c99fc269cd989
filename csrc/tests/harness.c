/* harness.c: heap memory and the thread transport for the C tests (see harness.h). */
#include "harness.h"

#include <math.h>

_Atomic int test_failures = 0;
_Atomic long test_checks = 0;

double load_as_double(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case MFSDP_F32: return ((const float*)p)[i];
    case MFSDP_F64: return ((const double*)p)[i];
    case MFSDP_BF16: return mfsdp_bf16_to_f32(((const uint16_t*)p)[i]);
    case MFSDP_F16: return mfsdp_f16_to_f32(((const uint16_t*)p)[i]);
    default: return 0.0;
  }
}

void store_from_double(void* p, int dtype, int64_t i, double v) {
  switch (dtype) {
    case MFSDP_F32: ((float*)p)[i] = (float)v; break;
    case MFSDP_F64: ((double*)p)[i] = v; break;
    case MFSDP_BF16: ((uint16_t*)p)[i] = mfsdp_f32_to_bf16((float)v); break;
    case MFSDP_F16: ((uint16_t*)p)[i] = mfsdp_f32_to_f16((float)v); break;
    default: break;
  }
}

void fill_test_values(void* p, int dtype, int64_t n, uint64_t* rng) {
  for (int64_t i = 0; i < n; ++i) {
    double v = (rng_uniform(rng) - 0.5) * 8.0;
    if (i % 97 == 3) v = NAN;
    if (i % 89 == 5) v = INFINITY;
    if (i % 71 == 9) v = -INFINITY;
    if (i % 83 == 7) v = 1e-41;    /* float32 subnormal */
    if (i % 79 == 11) v = 65519.0; /* rounds to float16 Inf */
    store_from_double(p, dtype, i, v);
  }
}

void fill_quant_values(void* p, int dtype, int64_t n, int64_t block, uint64_t* rng, int specials) {
  for (int64_t first = 0; first < n; first += block) {
    int64_t len = n - first < block ? n - first : block;
    int kind = specials ? (int)rng_range(rng, 0, 11) : 11;
    double magnitude = ldexp(1.0, (int)rng_range(rng, -12, 12)) * (0.5 + rng_uniform(rng));
    int64_t special_at = rng_range(rng, 0, len - 1);
    for (int64_t i = 0; i < len; ++i) {
      double v = (2.0 * rng_uniform(rng) - 1.0) * magnitude;
      if (kind == 0) v = i % 2 ? -0.0 : 0.0;
      if (kind == 1 && i == special_at) v = NAN;
      if (kind == 2 && i == special_at) v = rng_range(rng, 0, 1) ? INFINITY : -INFINITY;
      if (kind == 3) v = (2.0 * rng_uniform(rng) - 1.0) * 1e-39; /* float32 subnormals */
      if (kind == 4 && i == special_at) v = rng_range(rng, 0, 1) ? magnitude : -magnitude; /* the absmax itself */
      store_from_double(p, dtype, first + i, v);
    }
  }
}

int64_t count_differences(const void* a, const void* b, int dtype, int64_t n) {
  int64_t wrong = 0, size = mfsdp_dtype_size(dtype);
  for (int64_t i = 0; i < n; ++i) {
    double x = load_as_double(a, dtype, i), y = load_as_double(b, dtype, i);
    if (isnan(x) || isnan(y))
      wrong += !(isnan(x) && isnan(y));
    else
      wrong += memcmp((const char*)a + i * size, (const char*)b + i * size, (size_t)size) != 0;
  }
  return wrong;
}

/* ---- heap memory: storages hold a heap_block; views hold a heap_block whose mem is NULL ---- */

static mfsdp_status heap_create(void* ctx, int64_t numel, int32_t dtype, mfsdp_buffer* out) {
  (void)ctx;
  heap_block* b = calloc(1, sizeof *b);
  int64_t bytes = numel * mfsdp_dtype_size(dtype);
  if (b == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "block");
  b->bytes = bytes;
  b->mem = calloc(1, (size_t)(bytes ? bytes : 1));
  if (b->mem == NULL) {
    free(b);
    return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "%lld bytes", (long long)bytes);
  }
  *out = (mfsdp_buffer){b->mem, numel, dtype, -1, b};
  return MFSDP_OK;
}

static mfsdp_status heap_create_view(void* ctx, const mfsdp_buffer* storage, int64_t offset, int64_t numel,
                                     mfsdp_buffer* out) {
  (void)ctx;
  (void)offset;
  heap_block* b = calloc(1, sizeof *b);
  if (b == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "view");
  *out = (mfsdp_buffer){NULL, numel, storage->dtype, storage->device, b};
  return MFSDP_OK;
}

static mfsdp_status heap_materialize(void* ctx, mfsdp_buffer* buf) {
  (void)ctx;
  heap_block* b = buf->handle;
  if (b->mem == NULL) {
    b->mem = malloc((size_t)(b->bytes ? b->bytes : 1));
    if (b->mem == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "materialise");
    memset(b->mem, 0xA5, (size_t)b->bytes); /* poison: the engine must never rely on old contents */
  }
  buf->data = b->mem;
  return MFSDP_OK;
}

static mfsdp_status heap_release(void* ctx, mfsdp_buffer* buf) {
  (void)ctx;
  heap_block* b = buf->handle;
  free(b->mem);
  b->mem = NULL;
  buf->data = NULL;
  return MFSDP_OK;
}

static void heap_destroy(void* ctx, mfsdp_buffer* buf) {
  (void)ctx;
  heap_block* b = buf->handle;
  if (b) free(b->mem);
  free(b);
  buf->handle = NULL;
  buf->data = NULL;
}

/* Gradients in the tests are freed by the caller after end_backward: nothing to keep. */
static void heap_retain(void* ctx, void* handle) {
  (void)ctx;
  (void)handle;
}

const mfsdp_memory_ops heap_memory_ops = {heap_create,  heap_create_view, heap_materialize, heap_release,
                                          heap_destroy, heap_retain,      heap_retain};

/* ---- thread transport ---- */

void loop_world_init(loop_world* w, int n) {
  memset(w, 0, sizeof *w);
  w->n = n;
  w->fail_after = -1;
  pthread_barrier_init(&w->barrier, NULL, (unsigned)n);
  pthread_mutex_init(&w->lock, NULL);
}

void loop_world_destroy(loop_world* w) {
  pthread_barrier_destroy(&w->barrier);
  pthread_mutex_destroy(&w->lock);
}

/* Counts collectives and, past fail_after, fails this one on every rank alike. Every rank must
 * issue the same collective: kind, size and dtype are compared across ranks first. */
static mfsdp_status maybe_fail(loop_rank* r, int kind, const mfsdp_buffer* b) {
  loop_world* w = r->world;
  w->shape[r->rank][0] = kind;
  w->shape[r->rank][1] = b->numel;
  w->shape[r->rank][2] = b->dtype;
  pthread_barrier_wait(&w->barrier);
  int differ = 0;
  for (int k = 0; k < w->n; ++k)
    differ |= memcmp(w->shape[k], w->shape[0], sizeof w->shape[0]) != 0;
  pthread_barrier_wait(&w->barrier);
  if (differ) {
    if (r->rank == 0) w->mismatches++;
    return MFSDP_FAIL(MFSDP_ERR_COMM, "collective mismatch: rank %d issued kind %d of %lld elements, rank 0 kind %d "
                      "of %lld", r->rank, kind, (long long)b->numel, (int)w->shape[0][0], (long long)w->shape[0][1]);
  }
  pthread_barrier_wait(&w->barrier);
  if (r->rank == 0) w->calls++;
  pthread_barrier_wait(&w->barrier);
  int injected = w->fail_after >= 0 && w->calls > w->fail_after;
  pthread_barrier_wait(&w->barrier); /* nobody counts the next call before all have decided */
  if (injected) return MFSDP_FAIL(MFSDP_ERR_COMM, "injected collective failure");
  return MFSDP_OK;
}

static mfsdp_status loop_all_gather(void* ctx, const mfsdp_buffer* full, const mfsdp_buffer* shard, mfsdp_work** work) {
  loop_rank* r = ctx;
  loop_world* w = r->world;
  *work = NULL;
  MFSDP_CHECK(maybe_fail(r, 0, full));
  int64_t bytes = shard->numel * mfsdp_dtype_size(shard->dtype);
  w->slot[r->rank] = shard->data;
  pthread_barrier_wait(&w->barrier);
  for (int k = 0; k < w->n; ++k) {
    char* dst = (char*)full->data + k * bytes;
    if (dst != w->slot[k]) memcpy(dst, w->slot[k], (size_t)bytes);
  }
  pthread_barrier_wait(&w->barrier);
  return MFSDP_OK;
}

/* Sums slot[*][first .. first + n) in rank order into out (double accumulation, one rounding). */
static void sum_slots(loop_world* w, int dtype, int64_t first, int64_t n, mfsdp_reduce_op op, double* out) {
  for (int64_t i = 0; i < n; ++i) {
    double acc = 0.0;
    for (int k = 0; k < w->n; ++k) acc += load_as_double(w->slot[k], dtype, first + i);
    out[i] = op == MFSDP_REDUCE_AVG ? acc / w->n : acc;
  }
}

/* out = op over ranks of in[first .. first + out->numel); out may alias in. */
static mfsdp_status loop_reduce(loop_rank* r, const mfsdp_buffer* out, const mfsdp_buffer* in, int64_t first,
                                mfsdp_reduce_op op, double premul, mfsdp_work** work) {
  if (premul != 1.0) return MFSDP_FAIL(MFSDP_ERR_UNSUPPORTED, "no fused pre-multiplier");
  loop_world* w = r->world;
  *work = NULL;
  MFSDP_CHECK(maybe_fail(r, 1, in));
  double* tmp = malloc((size_t)(out->numel ? out->numel : 1) * sizeof *tmp);
  if (tmp == NULL) return MFSDP_FAIL(MFSDP_ERR_OUT_OF_MEMORY, "reduction tmp");
  w->slot[r->rank] = in->data;
  pthread_barrier_wait(&w->barrier);
  sum_slots(w, in->dtype, first, out->numel, op, tmp);
  pthread_barrier_wait(&w->barrier); /* everyone read before anyone writes */
  for (int64_t i = 0; i < out->numel; ++i) store_from_double(out->data, out->dtype, i, tmp[i]);
  pthread_barrier_wait(&w->barrier);
  free(tmp);
  return MFSDP_OK;
}

static mfsdp_status loop_reduce_scatter(void* ctx, const mfsdp_buffer* shard, const mfsdp_buffer* full,
                                        mfsdp_reduce_op op, double premul, mfsdp_work** work) {
  loop_rank* r = ctx;
  return loop_reduce(r, shard, full, (int64_t)r->rank * shard->numel, op, premul, work);
}

static mfsdp_status loop_all_reduce(void* ctx, const mfsdp_buffer* buf, mfsdp_reduce_op op, double premul,
                                    mfsdp_work** work) {
  return loop_reduce(ctx, buf, buf, 0, op, premul, work);
}

static mfsdp_status loop_all_to_all(void* ctx, const mfsdp_buffer* out, const mfsdp_buffer* in, mfsdp_work** work) {
  loop_rank* r = ctx;
  loop_world* w = r->world;
  *work = NULL;
  MFSDP_CHECK(maybe_fail(r, 2, in));
  int64_t block = in->numel / w->n, bytes = block * mfsdp_dtype_size(in->dtype);
  w->slot[r->rank] = in->data;
  pthread_barrier_wait(&w->barrier);
  for (int k = 0; k < w->n; ++k)
    memcpy((char*)out->data + k * bytes, (const char*)w->slot[k] + r->rank * bytes, (size_t)bytes);
  pthread_barrier_wait(&w->barrier);
  return MFSDP_OK;
}

static mfsdp_status loop_wait(void* ctx, mfsdp_work* work) {
  (void)ctx;
  (void)work;
  return MFSDP_OK;
}

static void loop_discard(void* ctx, mfsdp_work* work) {
  (void)ctx;
  (void)work;
}

const mfsdp_transport_ops loop_transport_ops = {"threads",       loop_all_gather, loop_reduce_scatter,
                                                loop_all_reduce, loop_all_to_all, loop_wait,
                                                loop_discard,    NULL,            NULL,
                                                0};
