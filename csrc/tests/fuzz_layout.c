/* fuzz_layout.c: a time-boxed property test of the layout planner and index math.
 *
 * Random parameter lists (shapes, dtypes, units, frozen/replicated flags), world sizes, size
 * caps and alignments. For each plan: mfsdp_plan_validate (every parameter in exactly one
 * bucket, keys consistent, items aligned and disjoint, shards a multiple of the chunk, every
 * slice whole rows, shards tile each item), then a round trip: values packed at the item
 * offsets, cut into per-rank shards and reassembled from each rank's slices must come back
 * exactly, and every padding element must stay zero. Usage: fuzz_layout [seconds] [seed]. */
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
  mfsdp_status s = mfsdp_plan_build(p, n, world, cap, align, &plan);
  CHECK(s == MFSDP_OK, "plan_build: %s", mfsdp_last_error());
  if (s != MFSDP_OK) {
    free(p);
    return 1;
  }
  s = mfsdp_plan_validate(&plan, p, n);
  CHECK(s == MFSDP_OK, "validate: %s", mfsdp_last_error());
  for (int b = 0; b < plan.n_buckets; ++b) {
    const mfsdp_bucket_plan* bp = &plan.buckets[b];
    int64_t elem = mfsdp_dtype_size(bp->dtype);
    CHECK((bp->shard_size * elem) % (align < elem ? elem : align) == 0 || align > bp->chunk * elem,
          "shard of %lld elements not aligned to %d bytes", (long long)bp->shard_size, align);
    /* pack item i's element j as the value (i + 1) * 100003 + j into a zeroed bucket */
    int64_t* bucket = calloc((size_t)bp->bucket_size, sizeof *bucket);
    for (int i = 0; i < bp->n_items; ++i)
      for (int64_t j = 0; j < bp->numels[i]; ++j) bucket[bp->offsets[i] + j] = (int64_t)(i + 1) * 100003 + j;
    int64_t nonzero_items = 0, nonzero_bucket = 0;
    for (int i = 0; i < bp->n_items; ++i) nonzero_items += bp->numels[i];
    for (int64_t k = 0; k < bp->bucket_size; ++k) nonzero_bucket += bucket[k] != 0;
    CHECK(nonzero_bucket == nonzero_items, "items overlap or leak into padding");
    for (int i = 0; i < bp->n_items; ++i) {
      int64_t* back = calloc((size_t)(bp->numels[i] ? bp->numels[i] : 1), sizeof *back);
      for (int r = 0; r < bp->world; ++r) {
        int64_t lo, hi, off;
        mfsdp_item_shard_slice(bp, i, r, &lo, &hi, &off);
        const int64_t* shard = bucket + (int64_t)r * bp->shard_size;
        for (int64_t j = lo; j < hi; ++j) back[j] = shard[off + (j - lo)];
      }
      int wrong = 0;
      for (int64_t j = 0; j < bp->numels[i]; ++j) wrong += back[j] != (int64_t)(i + 1) * 100003 + j;
      CHECK(wrong == 0, "bucket %d item %d: %d elements lost between shards", b, i, wrong);
      free(back);
    }
    free(bucket);
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
