/* fuzz_layout.c: a time-boxed property test of the layout planner and index math.
 *
 * Random parameter lists (shapes, dtypes, units, frozen/replicated flags), world sizes, size
 * caps and alignments. For each plan: mfsdp_plan_validate (every parameter in exactly one
 * bucket, keys consistent, offsets aligned and disjoint in both layouts, pieces of whole rows
 * tiling each item), each rank's piece is exactly its torch.chunk rows, and a round trip:
 * values laid out parameter-major, cut into rank-major shards and copied back out must come
 * back exactly, with every padding element zero. Half the plans reserve a flag tail ([Note: flag
 * tail] in core/mfsdp_layout.h), which validate keeps clear of every item. Usage: fuzz_layout [seconds] [seed]. */
#include <time.h>

#include "harness.h"

static int one_case(uint64_t* rng) {
  int n = (int)rng_range(rng, 1, 40);
  mfsdp_param_info* p = calloc((size_t)n, sizeof *p);
  for (int i = 0; i < n; ++i) {
    int64_t row = rng_range(rng, 0, 3) == 0 ? 1 : rng_range(rng, 1, 300);
    int64_t rows = rng_range(rng, 0, 4) == 0 ? rng_range(rng, 0, 3) : rng_range(rng, 1, 60);
    int dtype = (int)rng_range(rng, 0, MFSDP_NUM_DTYPES - 1);
    p[i] = (mfsdp_param_info){row * rows, row, dtype, (int32_t)rng_range(rng, -1, 3), (int32_t)rng_range(rng, 0, 1),
                              rng_range(rng, 0, 7) == 0};
  }
  int world = (int)(rng_range(rng, 0, 3) == 0 ? rng_range(rng, 1, 64) : rng_range(rng, 1, 8));
  int64_t cap = rng_range(rng, 0, 1) ? 0 : rng_range(rng, 1, 5000);
  int align = 1 << rng_range(rng, 0, 6);
  mfsdp_plan plan;
  int tail = rng_range(rng, 0, 1) ? 0 : (int)rng_range(rng, 1, 4); /* [Note: flag tail] */
  int64_t tail_align = rng_range(rng, 0, 1) ? 0 : rng_range(rng, 1, 300); /* a quantization block */
  mfsdp_status s = mfsdp_plan_build_tailed(p, n, world, cap, align, tail, tail_align, &plan);
  CHECK(s == MFSDP_OK, "plan_build: %s", mfsdp_last_error());
  if (s != MFSDP_OK) {
    free(p);
    return 1;
  }
  s = mfsdp_plan_validate(&plan, p, n);
  CHECK(s == MFSDP_OK, "validate: %s", mfsdp_last_error());
  for (int b = 0; b < plan.n_buckets; ++b) {
    const mfsdp_bucket_plan* bp = &plan.buckets[b];
    const mfsdp_bucket_layout* L = &bp->layout;
    int64_t elem = mfsdp_dtype_size(bp->dtype), unit = align > elem ? align / elem : 1;
    CHECK(L->shard_size % unit == 0 && L->weight_size % unit == 0, "sizes %lld / %lld not aligned to %d bytes",
          (long long)L->shard_size, (long long)L->weight_size, align);
    CHECK(L->tail == (mfsdp_dtype_is_float(bp->dtype) ? (int64_t)tail * L->n_items : 0) && L->tail_offset % unit == 0,
          "tail %lld at %lld: %d per item of a floating bucket, aligned", (long long)L->tail, (long long)L->tail_offset,
          tail);
    CHECK(L->tail == 0 || tail_align < 2 || (L->tail_offset % tail_align == 0 && L->shard_size % tail_align == 0),
          "tail at %lld, shard of %lld: not multiples of the block %lld", (long long)L->tail_offset,
          (long long)L->shard_size, (long long)tail_align);
    /* item i's element j is the value (i + 1) * 100003 + j: lay it out parameter-major, cut it
     * into rank-major shards the way a reduce-scatter input is packed, check each piece is the
     * torch.chunk rows of its rank, then copy out as after an all-gather: exact round trip. */
    int64_t* weights = calloc((size_t)L->weight_size, sizeof *weights);
    int64_t* shards = calloc((size_t)(L->world * L->shard_size), sizeof *shards);
    for (int i = 0; i < L->n_items; ++i)
      for (int64_t j = 0; j < L->numels[i]; ++j) weights[L->param_offsets[i] + j] = (int64_t)(i + 1) * 100003 + j;
    int64_t nonzero_items = 0, nonzero = 0;
    for (int i = 0; i < L->n_items; ++i) nonzero_items += L->numels[i];
    for (int64_t k = 0; k < L->weight_size; ++k) nonzero += weights[k] != 0;
    CHECK(nonzero == nonzero_items, "items overlap or leak into padding (parameter-major)");
    for (int i = 0; i < L->n_items; ++i) {
      int64_t rows = L->numels[i] / bp->row_sizes[i], chunk = (rows + L->world - 1) / L->world, covered = 0;
      for (int r = 0; r < L->world; ++r) {
        int64_t first, n;
        mfsdp_piece_of(L->numels[i], L->pieces[i], r, &first, &n);
        int64_t lo_row = r * chunk < rows ? r * chunk : rows, hi_row = (r + 1) * chunk < rows ? (r + 1) * chunk : rows;
        CHECK(first == lo_row * bp->row_sizes[i] && n == (hi_row - lo_row) * bp->row_sizes[i],
              "bucket %d item %d rank %d: piece [%lld, +%lld) is not torch.chunk rows [%lld, %lld)", b, i, r,
              (long long)first, (long long)n, (long long)lo_row, (long long)hi_row);
        memcpy(shards + r * L->shard_size + L->shard_offsets[i], weights + L->param_offsets[i] + first,
               (size_t)n * sizeof *shards);
        covered += n;
      }
      CHECK(covered == L->numels[i], "bucket %d item %d: pieces cover %lld of %lld", b, i, (long long)covered,
            (long long)L->numels[i]);
    }
    nonzero = 0;
    for (int64_t k = 0; k < L->world * L->shard_size; ++k) nonzero += shards[k] != 0;
    CHECK(nonzero == nonzero_items, "pieces overlap or leak into padding (rank-major)");
    if (mfsdp_layout_is_identity(L))
      CHECK(L->weight_size == L->world * L->shard_size &&
                memcmp(weights, shards, (size_t)L->weight_size * sizeof *weights) == 0,
            "bucket %d: identity layout differs from its rank-major form", b);
    int64_t* back = calloc((size_t)L->weight_size, sizeof *back);
    for (int i = 0; i < L->n_items; ++i)
      for (int r = 0; r < L->world; ++r) {
        int64_t first, n;
        mfsdp_piece_of(L->numels[i], L->pieces[i], r, &first, &n);
        memcpy(back + L->param_offsets[i] + first, shards + r * L->shard_size + L->shard_offsets[i],
               (size_t)n * sizeof *back);
      }
    CHECK(memcmp(back, weights, (size_t)L->weight_size * sizeof *back) == 0, "bucket %d: copy-out round trip differs", b);
    free(back);
    free(shards);
    free(weights);
  }
  mfsdp_plan_free(&plan);
  free(p);
  return 0;
}

int main(int argc, char** argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 10.0;
  uint64_t rng = argc > 2 ? strtoull(argv[2], NULL, 10) : (uint64_t)time(NULL);
  uint64_t seed = rng;
  clock_t start = clock();
  long cases = 0;
  while ((double)(clock() - start) / CLOCKS_PER_SEC < seconds && test_failures == 0) {
    one_case(&rng);
    cases++;
  }
  if (test_failures) {
    fprintf(stderr, "fuzz_layout: failed after %ld cases (seed %llu)\n", cases, (unsigned long long)seed);
    return 1;
  }
  printf("fuzz_layout: %ld random plans checked in %.0f s (seed %llu), no violation\n", cases, seconds,
         (unsigned long long)seed);
  return 0;
}
