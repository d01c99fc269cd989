/* core_tests.h: the parts of test_core, one file each in this folder by concern, run in this
 * order by the runner (csrc/tests/test_core.c) between and after the pipeline cases. */
#ifndef MFSDP_TEST_CORE_TESTS_H
#define MFSDP_TEST_CORE_TESTS_H

/* test_kernels.c */
void test_conversions(void);
void test_kernels(void);
/* test_quant.c */
void test_quant(void);
/* test_layout.c */
void test_layout(void);
/* test_reduce.c */
void test_rank_divergent_graphs(void);
void test_narrow_sums(void);
/* test_replicas.c */
void test_hybrid_sharding(void);
void test_hfsdp_quantized(void);
/* test_trainable.c */
void test_requires_grad_changes(void);
/* test_adam.c */
void test_adam(void);
/* test_misuse.c */
void test_pipeline_misuse(void);
/* test_in_flight.c */
void test_in_flight(void);

#endif
