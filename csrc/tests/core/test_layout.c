/* test_layout.c (a part of test_core, whose runner is csrc/tests/test_core.c): the layout: items
 * sharded as torch chunks them, the flag tail, plans. */
#include "../../core/mfsdp_kernels.h"
#include "../harness.h"
#include "core_tests.h"

/* layout */

/* Rank r's piece of a (outer, rows, row) tensor sharded on dim 1 as torch makes it:
 * torch.chunk(w, world, dim=1)[r].contiguous(), as the item's element indices, in order. */
static int64_t chunk_reference(int64_t outer, int64_t rows, int64_t row, int world, int r, int64_t* out) {
  int64_t c = (rows + world - 1) / world, lo = r * c < rows ? r * c : rows, hi = lo + c < rows ? lo + c : rows, n = 0;
  for (int64_t b = 0; b < outer; ++b)
    for (int64_t q = lo; q < hi; ++q)
      for (int64_t e = 0; e < row; ++e) out[n++] = (b * rows + q) * row + e;
  return n;
}

/* [Note: chunked layout]'s blocks: a parameter sharded on a dim other than 0. */
static void test_chunked_layout(void) {
  /* mfsdp_piece_runs against torch.chunk along dim 1, even and uneven, rows fewer than ranks */
  static const int64_t shapes[][3] = {{3, 4, 2}, {2, 6, 3}, {8, 1, 1}, {5, 7, 1}, {1, 9, 4}, {4, 2, 5}};
  int64_t want[512];
  for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; ++k)
    for (int world = 1; world <= 4; ++world) {
      int64_t outer = shapes[k][0], rows = shapes[k][1], row = shapes[k][2], numel = outer * rows * row;
      int64_t piece = outer * ((rows + world - 1) / world) * row;
      for (int r = 0; r < world; ++r) {
        int64_t n = chunk_reference(outer, rows, row, world, r, want), wrong = 0;
        mfsdp_runs ru;
        mfsdp_piece_runs(numel, piece, outer, r, &ru);
        CHECK(ru.count * ru.len == n && ru.count * ru.len <= piece,
              "shape (%lld, %lld, %lld) world %d rank %d: %lld x %lld elements, torch.chunk has %lld", (long long)outer,
              (long long)rows, (long long)row, world, r, (long long)ru.count, (long long)ru.len, (long long)n);
        for (int64_t q = 0; q < ru.count && ru.count * ru.len == n; ++q)
          for (int64_t e = 0; e < ru.len; ++e) wrong += ru.first + q * ru.stride + e != want[q * ru.len + e];
        CHECK(wrong == 0, "shape (%lld, %lld, %lld) world %d rank %d: %lld elements out of torch.chunk's order",
              (long long)outer, (long long)rows, (long long)row, world, r, (long long)wrong);
        if (outer == 1) { /* one block: mfsdp_piece_of's one run */
          int64_t first, len;
          mfsdp_piece_of(numel, piece, r, &first, &len);
          CHECK(ru.count * ru.len == len && (len == 0 || ru.first == first), "outer 1 is mfsdp_piece_of");
        }
      }
    }

  /* the planner: blocked pieces, a blocked item alone is never an in-place gather, validation */
  mfsdp_param_info params[] = {
      {24, 2, MFSDP_F32, 0, 1, 0, 3}, /* (3, 4, 2) on dim 1 */
      {16, 4, MFSDP_F32, 0, 1, 0, 1}, /* (4, 4) on dim 0 */
      {16, 1, MFSDP_F32, 1, 1, 0, 4}, /* (4, 4) on dim 1, alone in unit 1: evenly split, not identity */
  };
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(params, 3, 2, 0, 16, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, params, 3));
  CHECK(plan.n_buckets == 2, "two units, two buckets (%d)", plan.n_buckets);
  const mfsdp_bucket_layout* L = &plan.buckets[0].layout;
  CHECK(mfsdp_layout_outer(L, 0) == 3 && mfsdp_layout_outer(L, 1) == 1, "outers kept per item");
  CHECK(L->pieces[0] == 3 * 2 * 2, "(3, 4, 2) over 2 on dim 1: 3 blocks of 2 rows of 2, got %lld",
        (long long)L->pieces[0]);
  CHECK(!mfsdp_layout_is_identity(&plan.buckets[1].layout), "a blocked item alone still needs a copy-out");
  CHECK_OK(mfsdp_layout_validate(L, plan.buckets[0].row_sizes));
  int64_t saved = ((int64_t*)L->outers)[0];
  ((int64_t*)L->outers)[0] = 5; /* 24 elements are not 5 blocks */
  CHECK(mfsdp_layout_validate(L, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "blocks that do not divide the item refused");
  ((int64_t*)L->outers)[0] = 0;
  CHECK(mfsdp_layout_validate(L, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "0 blocks refused");
  ((int64_t*)L->outers)[0] = 2; /* divides, but the plan was made for 3 */
  CHECK(mfsdp_plan_validate(&plan, params, 3) == MFSDP_ERR_INVALID_STATE, "a plan whose blocks differ refused");
  ((int64_t*)L->outers)[0] = saved;
  mfsdp_plan_free(&plan);
  mfsdp_param_info ragged = {24, 2, MFSDP_F32, 0, 1, 0, 5};
  CHECK(mfsdp_plan_build(&ragged, 1, 2, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "24 is not 5 blocks of rows of 2");
  mfsdp_param_info negative = {24, 2, MFSDP_F32, 0, 1, 0, -1};
  CHECK(mfsdp_plan_build(&negative, 1, 2, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "negative blocks refused");
}

/* [Note: flag tail]: a tail per floating bucket, in every shard, disjoint from every item's rows in
 * both layouts; integer buckets get none; a tailed one-item bucket is no identity layout. */
static void test_flag_tail_layout(const mfsdp_param_info* block, int n, const mfsdp_param_info* mixed) {
  mfsdp_plan plain, plan;
  CHECK_OK(mfsdp_plan_build(block, n, 4, 0, 16, &plain));
  CHECK_OK(mfsdp_plan_build_tailed(block, n, 4, 0, 16, 3, 0, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, block, n));
  const mfsdp_bucket_layout *P = &plain.buckets[0].layout, *L = &plan.buckets[0].layout;
  CHECK(L->tail == 3 * n && L->tail_offset % 4 == 0, "3 elements per item, aligned (%lld at %lld)", (long long)L->tail,
        (long long)L->tail_offset);
  CHECK(L->tail_offset >= P->shard_size - 3 && L->shard_size >= L->tail_offset + L->tail && L->shard_size % 4 == 0,
        "after the last piece, inside the aligned shard");
  for (int i = 0; i < n; ++i)
    CHECK(L->shard_offsets[i] == P->shard_offsets[i] && L->param_offsets[i] == P->param_offsets[i] &&
              L->pieces[i] == P->pieces[i],
          "item %d keeps its place in both layouts", i);
  CHECK(L->weight_size == P->weight_size, "the parameter-major weights do not grow when sharded");
  mfsdp_plan_free(&plain);
  mfsdp_plan_free(&plan);

  mfsdp_param_info with_int[9];
  memcpy(with_int, mixed, 8 * sizeof *with_int);
  with_int[8] = (mfsdp_param_info){6, 1, MFSDP_I64, -1, 0, 0, 1};
  CHECK_OK(mfsdp_plan_build_tailed(with_int, 9, 4, 0, 16, 2, 0, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, with_int, 9));
  int identity = 0;
  for (int b = 0; b < plan.n_buckets; ++b) {
    const mfsdp_bucket_layout* l = &plan.buckets[b].layout;
    int floating = mfsdp_dtype_is_float(plan.buckets[b].dtype);
    CHECK(l->tail == (floating ? 2 * l->n_items : 0), "bucket %d: a tail iff floating (%lld)", b, (long long)l->tail);
    if (l->world == 1 && floating)
      CHECK(l->tail_offset + l->tail <= l->weight_size && l->shard_size == l->weight_size,
            "unsharded: the tail after the last item, one layout");
    identity += l->world > 1 && mfsdp_layout_is_identity(l);
  }
  CHECK(identity == 0, "no tailed sharded bucket gathers in place (%d)", identity);
  /* a layout whose tail overlaps an item's rows is refused */
  mfsdp_bucket_layout bad = plan.buckets[0].layout;
  bad.tail_offset = bad.shard_offsets[0];
  bad.tail = 1;
  CHECK(mfsdp_layout_validate(&bad, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "a tail over an item refused");
  bad.tail_offset = bad.shard_size;
  CHECK(mfsdp_layout_validate(&bad, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "a tail past the shard refused");
  mfsdp_plan_free(&plan);
  CHECK(mfsdp_plan_build_tailed(block, n, 4, 0, 16, -1, 0, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "negative tail refused");
  /* aligned to a quantization block of 7: the tail and the shard's end on multiples of 7 (and of 4) */
  CHECK_OK(mfsdp_plan_build_tailed(block, n, 4, 0, 16, 3, 7, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, block, n));
  L = &plan.buckets[0].layout;
  CHECK(L->tail_offset % 28 == 0 && L->shard_size % 28 == 0 && L->tail_offset >= L->shard_offsets[n - 1] + L->pieces[n - 1],
        "tail at %lld, shard of %lld: multiples of 28 after the last piece", (long long)L->tail_offset,
        (long long)L->shard_size);
  mfsdp_plan_free(&plan);
}

void test_layout(void) {
  /* A transformer block (d = 48) at world 4: one bucket; each rank holds torch.chunk rows. */
  mfsdp_param_info block[] = {
      {48, 1, MFSDP_F32, 0, 1, 0},      {48, 1, MFSDP_F32, 0, 1, 0},      /* ln */
      {144 * 48, 48, MFSDP_F32, 0, 1, 0}, {48 * 48, 48, MFSDP_F32, 0, 1, 0}, /* qkv, proj */
      {192 * 48, 48, MFSDP_F32, 0, 1, 0}, {192, 1, MFSDP_F32, 0, 1, 0},    /* fc */
      {48 * 192, 192, MFSDP_F32, 0, 1, 0}, {45, 1, MFSDP_F32, 0, 1, 0},    /* out, an odd bias */
  };
  int n = (int)(sizeof block / sizeof block[0]);
  mfsdp_plan plan;
  CHECK_OK(mfsdp_plan_build(block, n, 4, 0, 16, &plan));
  CHECK(plan.n_buckets == 1, "one bucket for one unit, got %d", plan.n_buckets);
  CHECK_OK(mfsdp_plan_validate(&plan, block, n));
  const mfsdp_bucket_layout* L = &plan.buckets[0].layout;
  for (int i = 0; i < n; ++i) CHECK(plan.buckets[0].params[i] == i, "items keep registration order");
  CHECK(L->pieces[2] == 36 * 48, "144 rows over 4 ranks: pieces of 36 rows, got %lld", (long long)L->pieces[2]);
  CHECK(L->pieces[7] == 12, "45 rows over 4: torch.chunk gives 12, got %lld", (long long)L->pieces[7]);
  int64_t first, len;
  mfsdp_piece_of(L->numels[7], L->pieces[7], 3, &first, &len);
  CHECK(first == 36 && len == 9, "rank 3 holds rows 36..44 of 45 (%lld, +%lld)", (long long)first, (long long)len);
  CHECK(L->shard_size % 4 == 0 && L->weight_size % 4 == 0, "16-byte aligned sizes");
  CHECK(!mfsdp_layout_is_identity(L), "a block has two distinct layouts");
  mfsdp_plan_free(&plan);

  /* Keys split groups; a param with fewer rows than ranks leaves empty pieces; numel 0 is fine;
   * one evenly split parameter needs no copy-out. */
  mfsdp_param_info mixed[] = {
      {10, 5, MFSDP_F32, -1, 1, 0}, {6, 3, MFSDP_F32, -1, 1, 0}, {4, 1, MFSDP_BF16, -1, 1, 0},
      {8, 4, MFSDP_F32, -1, 0, 0},  {3, 1, MFSDP_F32, 0, 1, 0},  {0, 1, MFSDP_F32, 0, 1, 0},
      {7, 1, MFSDP_F32, -1, 1, 1},  {64, 4, MFSDP_F32, 1, 1, 0},
  };
  CHECK_OK(mfsdp_plan_build(mixed, 8, 4, 0, 16, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, mixed, 8));
  int empty_pieces = 0, identity = 0;
  for (int b = 0; b < plan.n_buckets; ++b) {
    const mfsdp_bucket_layout* l = &plan.buckets[b].layout;
    if (plan.buckets[b].replicated) CHECK(l->world == 1 && mfsdp_layout_is_identity(l), "replicated: not sharded");
    identity += l->world > 1 && mfsdp_layout_is_identity(l);
    for (int i = 0; i < l->n_items; ++i)
      for (int r = 0; r < l->world; ++r) {
        mfsdp_piece_of(l->numels[i], l->pieces[i], r, &first, &len);
        empty_pieces += len == 0;
      }
  }
  CHECK(empty_pieces > 0, "small parameters leave some ranks empty");
  CHECK(identity == 1, "the 16 x 4 parameter alone in unit 1 gathers in place (%d)", identity);
  mfsdp_plan_free(&plan);

  /* The size cap splits parameters outside units, never a unit. */
  mfsdp_param_info many[6];
  for (int i = 0; i < 6; ++i) many[i] = (mfsdp_param_info){100, 1, MFSDP_F32, i < 3 ? -1 : 0, 1, 0};
  CHECK_OK(mfsdp_plan_build(many, 6, 2, 150, 16, &plan));
  CHECK(plan.n_buckets == 4, "3 capped root buckets + 1 unit bucket, got %d", plan.n_buckets);
  mfsdp_plan_free(&plan);

  /* Roles split buckets as the other keys do: one unit's ordinary, never-gathered and payload
   * parameters ([Note: extension parameters] in the wrapper) land in three buckets, and a plan
   * whose bucket mixes roles is refused. */
  mfsdp_param_info roles[] = {
      {16, 4, MFSDP_F32, 0, 1, 0, 1, 0}, {16, 4, MFSDP_F32, 0, 1, 0, 1, 1}, {8, 1, MFSDP_U8, 0, 0, 0, 1, 2},
      {12, 3, MFSDP_F32, 0, 1, 0, 1, 1}, {8, 1, MFSDP_U8, 0, 0, 0, 1, 0},  {4, 1, MFSDP_U8, 0, 0, 0, 1, 2},
  };
  CHECK_OK(mfsdp_plan_build(roles, 6, 2, 0, 16, &plan));
  CHECK_OK(mfsdp_plan_validate(&plan, roles, 6));
  CHECK(plan.n_buckets == 4, "f32 roles 0 and 1, u8 roles 0 and 2: four buckets, got %d", plan.n_buckets);
  for (int b = 0; b < plan.n_buckets; ++b)
    for (int i = 0; i < plan.buckets[b].layout.n_items; ++i)
      CHECK(roles[plan.buckets[b].params[i]].role == plan.buckets[b].role, "bucket %d item %d: its bucket's role", b, i);
  roles[1].role = 0; /* the plan was made for role 1 */
  CHECK(mfsdp_plan_validate(&plan, roles, 6) == MFSDP_ERR_INVALID_STATE, "a bucket mixing roles refused");
  mfsdp_plan_free(&plan);

  mfsdp_param_info bad = {10, 3, MFSDP_F32, 0, 1, 0};
  CHECK(mfsdp_plan_build(&bad, 1, 2, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "10 is not whole rows of 3");
  CHECK(mfsdp_plan_build(block, n, 0, 0, 16, &plan) == MFSDP_ERR_INVALID_ARGUMENT, "world 0 refused");
  test_flag_tail_layout(block, n, mixed);
  test_chunked_layout();
}
