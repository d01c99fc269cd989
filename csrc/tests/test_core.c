/* test_core.c: the C engine without Python: conversions, kernels, the quantized wire format,
 * layout and the pipeline (on a thread transport at world sizes 1-4). Built with
 * AddressSanitizer and UndefinedBehaviorSanitizer by `make ctest`. Exit status = number of
 * failed checks (capped). The runner: the parts, one file per concern, are in csrc/tests/core
 * (core_tests.h), the end-to-end pipeline cases in pipeline_cases.c. */
#include "core/core_tests.h"
#include "harness.h"
#include "pipeline_cases.h"

int main(void) {
  test_conversions();
  test_kernels();
  test_quant();
  test_layout();
  test_rank_divergent_graphs();
  test_narrow_sums();
  test_hybrid_sharding();
  test_requires_grad_changes();
  test_adam();
  run_pipeline_cases(&loop_rig, 4, 0);
  run_quantized_cases(&loop_rig, 4, 0);
  pipeline_cases_tail = 3; /* [Note: flag tail]: a reserved tail changes no result */
  run_pipeline_cases(&loop_rig, 4, 0);
  run_quantized_cases(&loop_rig, 4, 0);
  pipeline_cases_tail = 0;
  test_hfsdp_quantized();
  test_pipeline_misuse();
  test_in_flight();
  if (test_failures) {
    fprintf(stderr, "test_core: %d checks failed\n", test_failures);
    return test_failures > 100 ? 100 : test_failures;
  }
  printf("test_core: all %ld checks passed\n", (long)test_checks);
  return 0;
}
