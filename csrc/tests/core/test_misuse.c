/* test_misuse.c (a part of test_core, whose runner is csrc/tests/test_core.c): the pipeline
 * refusing misuse. */
#include "../../core/mfsdp_kernels.h"
#include "../harness.h"
#include "core_tests.h"

/* pipeline misuse (the cases at world sizes 1-4 are in pipeline_cases.c) */

void test_pipeline_misuse(void) {
  mfsdp_pipeline_config cfg = {2, 0, 0.5, MFSDP_REDUCE_SUM, 1 << 20, 0};
  mfsdp_backend be = {&heap_memory_ops, NULL, &loop_transport_ops, NULL, &mfsdp_cpu_kernels, NULL};
  int64_t offsets[1] = {0}, numels[1] = {8}, pieces[1] = {4}, small[1] = {1};
  mfsdp_bucket_layout too_small = {2, 1, numels, small, offsets, offsets, 8, 2}; /* pieces cannot cover 8 */
  mfsdp_bucket_spec bad = {too_small, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0,
                           MFSDP_GRAD_SCATTER_ACCUMULATE};
  mfsdp_pipeline* p = NULL;
  CHECK(mfsdp_pipeline_create(&cfg, &be, &bad, 1, &p) == MFSDP_ERR_INVALID_ARGUMENT && p == NULL,
        "pieces that do not cover the item refused");
  mfsdp_bucket_layout never_gathered = {2, 1, numels, pieces, offsets, offsets, 8, 4};
  bad = (mfsdp_bucket_spec){never_gathered, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 0, 0,
                            MFSDP_GRAD_SCATTER_ACCUMULATE};
  CHECK(mfsdp_pipeline_create(&cfg, &be, &bad, 1, &p) == MFSDP_ERR_INVALID_ARGUMENT && p == NULL,
        "sharded weights that are never gathered refused");
  mfsdp_bucket_layout whole = {1, 1, numels, numels, offsets, offsets, 8, 8};
  mfsdp_bucket_spec ok = {whole, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 0, 0, MFSDP_GRAD_ALL_REDUCE};
  cfg.dp_world = 1;
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &ok, 1, &p));
  float g[8] = {0};
  CHECK(mfsdp_pipeline_grad_ready(p, 0, 0, g, MFSDP_F32, 8, NULL) == MFSDP_ERR_INVALID_STATE, "grad outside backward");
  CHECK(mfsdp_pipeline_end_backward(p) == MFSDP_ERR_INVALID_STATE, "end without begin");
  CHECK_OK(mfsdp_pipeline_begin_backward(p, 1));
  CHECK(mfsdp_pipeline_grad_ready(p, 0, 0, g, MFSDP_F32, 7, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "wrong numel");
  CHECK(mfsdp_pipeline_grad_ready(p, 3, 0, g, MFSDP_F32, 8, NULL) == MFSDP_ERR_INVALID_ARGUMENT, "bad bucket");
  CHECK(mfsdp_pipeline_sync_grads(p) == MFSDP_ERR_INVALID_STATE, "sync inside backward");
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  mfsdp_pipeline_destroy(p);

  /* a drain inside a backward is refused and the backward goes on (once it ended the backward,
   * leaving gradients in the pending table: the next backward added them to its own and wrote
   * its arrivals past the table, an ASan heap-buffer-overflow in mfsdp_pipeline_grad_ready) */
  int64_t two_off[2] = {0, 4}, two_numels[2] = {4, 4};
  mfsdp_bucket_layout two = {1, 2, two_numels, two_numels, two_off, two_off, 8, 8};
  mfsdp_bucket_spec pair = {two, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 0, 0, MFSDP_GRAD_ALL_REDUCE};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &pair, 1, &p));
  float first[4] = {100, 100, 100, 100}, a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
  CHECK_OK(mfsdp_pipeline_begin_backward(p, 1));
  CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, 0, first, MFSDP_F32, 4, NULL)); /* item 1 never comes */
  CHECK(mfsdp_pipeline_drain(p) == MFSDP_ERR_INVALID_STATE && strstr(mfsdp_last_error(), "inside a backward"),
        "drain inside a backward refused: %s", mfsdp_last_error());
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  CHECK_OK(mfsdp_pipeline_zero_grads(p));
  CHECK_OK(mfsdp_pipeline_begin_backward(p, 1));
  CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, 0, a, MFSDP_F32, 4, NULL));
  CHECK_OK(mfsdp_pipeline_grad_ready(p, 0, 1, b, MFSDP_F32, 4, NULL));
  CHECK_OK(mfsdp_pipeline_end_backward(p));
  CHECK_OK(mfsdp_pipeline_sync_grads(p));
  const float* summed = mfsdp_pipeline_buffer(p, 0, MFSDP_BUF_GRAD)->data;
  int same = 1;
  for (int k = 0; k < 4; ++k) same &= summed[k] == 0.5f * a[k] && summed[4 + k] == 0.5f * b[k]; /* cfg's 0.5 */
  CHECK(same, "the drained backward's gradient left out of the next: %g %g ... %g", summed[0], summed[1], summed[4]);
  mfsdp_pipeline_destroy(p);

  /* quantized wires ([Note: quantized communication] in csrc/comm/wire.c): refused with the reason */
  cfg.dp_world = 2;
  mfsdp_bucket_layout halves = {2, 1, numels, pieces, offsets, offsets, 8, 4};
  mfsdp_bucket_spec q = {halves, 0, MFSDP_F32, MFSDP_F32, MFSDP_F32, MFSDP_F32, 1, 0, MFSDP_GRAD_SCATTER_ACCUMULATE,
                         {MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), MFSDP_WIRE_QUANT(MFSDP_QUANT_INT4), 0, 0}};
  CHECK_OK(mfsdp_pipeline_create(&cfg, &be, &q, 1, &p)); /* the default block */
  mfsdp_pipeline_destroy(p);
  p = NULL;
  struct {
    const char* what;
    mfsdp_wire_spec wire;
    int grad_dtype, comm_dtype;
    const char* says;
  } refused[] = {
      {"unknown mode", {7, 0, 0, 16}, MFSDP_F32, MFSDP_F32, "unknown quantization"},
      {"int4 odd block", {0, MFSDP_WIRE_QUANT(MFSDP_QUANT_INT4), 0, 33}, MFSDP_F32, MFSDP_F32, "and even"},
      {"negative block", {MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), 0, 0, -2}, MFSDP_F32, MFSDP_F32, "blocks of -2"},
      {"bf16 main gradients", {0, MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), 0, 0}, MFSDP_BF16, MFSDP_BF16,
       "must be float32 or float64"},
      {"comm dtype", {0, MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), 0, 0}, MFSDP_F32, MFSDP_BF16, "staged in"},
      {"outer without HFSDP", {0, 0, MFSDP_WIRE_QUANT(MFSDP_QUANT_INT8), 0}, MFSDP_F32, MFSDP_F32, "need HFSDP"},
  };
  for (size_t k = 0; k < sizeof refused / sizeof refused[0]; ++k) {
    mfsdp_bucket_spec bad_q = q;
    bad_q.wire = refused[k].wire;
    bad_q.grad_dtype = refused[k].grad_dtype;
    bad_q.comm_dtype = refused[k].comm_dtype;
    bad_q.main_dtype = MFSDP_F32;
    mfsdp_status s = mfsdp_pipeline_create(&cfg, &be, &bad_q, 1, &p);
    CHECK(s == MFSDP_ERR_INVALID_ARGUMENT && p == NULL && strstr(mfsdp_last_error(), refused[k].says),
          "%s refused: %s", refused[k].what, mfsdp_last_error());
  }
  mfsdp_transport_ops no_a2a = loop_transport_ops;
  no_a2a.all_to_all = NULL;
  mfsdp_backend be_no_a2a = be;
  be_no_a2a.transport = &no_a2a;
  CHECK(mfsdp_pipeline_create(&cfg, &be_no_a2a, &q, 1, &p) == MFSDP_ERR_UNSUPPORTED && p == NULL &&
            strstr(mfsdp_last_error(), "need an all-to-all"),
        "quantized gradients on a transport without an all-to-all refused: %s", mfsdp_last_error());
}
