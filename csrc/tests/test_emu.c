/* test_emu.c: the shipped CUDA kernels (csrc/cuda/kernels*.cu) and native NCCL transport
 * (csrc/cuda/nccl_*.c) on the emulated device of csrc/tests/emu, for machines without a GPU.
 * Ranks are threads, each with its own "device", current stream and communicators. The runner:
 * the parts, one file per concern, are in csrc/tests/cuda (cuda_tests.h), the end-to-end
 * pipeline cases in pipeline_cases.c.
 *
 *  - kernels: every dtype pair, aligned and misaligned, sizes around the vector width and past
 *    several grid strides, bit-identical to the CPU kernels; the one-launch pack; NaN counts;
 *    refusals with file:line.
 *  - the emulator's timing knobs and per-record events (emu/cuda_runtime.h).
 *  - quant: quantize and dequantize of every mode and float dtype, bit-identical to the CPU
 *    kernels (wire bytes and values), sizes 1 to 100003 with odd tails, blocks of 1-4100,
 *    misaligned sources, destinations and pieces; pieces of an all-to-all in one launch; the
 *    copy-out of ranges of W pieces in one launch per table, with a full memory pool.
 *  - the pipeline cases of pipeline_cases.c through NCCL transport + CUDA kernels, world 1-4,
 *    with stream-ordered frees (a buffer freed too early is an AddressSanitizer error), once as
 *    they come, once with every stream operation delayed at random (other interleavings) and
 *    once with every rank's stream deferred until its host synchronizes (a host that touches
 *    memory its stream has yet to use fails on every run).
 *  - a unit of three buckets (fp32, bf16, fp64) gathered as one NCCL group and read by the
 *    consumer stream straight after the wait.
 *  - HFSDP (2 replicas x 2 shards) over two steps of three microbatches, as it comes and with
 *    streams deferred or slowed (hf_modes): the collectives inside and across the replicas must
 *    be ordered by events, not by timing.
 *  - the watchdog: a collective a peer never joins aborts the communicators within the timeout
 *    and the next call raises MFSDP_ERR_TIMEOUT; the peer then sees MFSDP_ERR_NCCL.
 *
 * Built with AddressSanitizer and UndefinedBehaviorSanitizer by `make ctest`. */
#include "cuda/cuda_tests.h"

/* `test_emu [scenario]` runs one scenario (emulator, kernels, quant, pipeline, quant-pipeline, grouped, hfsdp,
 * watchdog, connect, destroy, group-abort, pipeline-destroy, close, interrupt); no argument runs them all. */
static int wanted(int argc, char** argv, const char* name) { return argc < 2 || strcmp(argv[1], name) == 0; }

int main(int argc, char** argv) {
  emu_rig_init();
  int streams_before = emu_streams_alive();
  if (wanted(argc, argv, "emulator")) test_emulator();
  if (wanted(argc, argv, "kernels")) test_kernels();
  if (wanted(argc, argv, "quant")) test_quant_kernels();
  long before = emu_nccl_collectives();
  if (wanted(argc, argv, "pipeline")) {
    run_pipeline_cases(&nccl_rig, 4, 0);
    run_pipeline_cases(&nccl_rig, 1, 1); /* world 1 with collectives, as tests/test_cuda.py runs on one GPU */
    /* these two with a flag tail: the used-parameter flags written on the device (the fill kernel)
     * and reduced with the gradients ([Note: used-flag tail] in csrc/comm/reduce.c) */
    pipeline_cases_tail = 3;
    emu_set_jitter_us(300); /* again with streams starting work at random moments */
    run_pipeline_cases(&nccl_rig, 4, 0);
    emu_set_jitter_us(0);
    g_defer_streams = 1; /* and with every rank's stream as far behind its host as CUDA allows */
    run_pipeline_cases(&nccl_rig, 4, 0);
    g_defer_streams = 0;
    pipeline_cases_tail = 0;
    CHECK(emu_nccl_premul_reductions() > 0, "no_shard / ZeRO-1 float32 reductions pre-multiply inside NCCL");
  }
  if (wanted(argc, argv, "quant-pipeline")) { /* the quantized wires through the native transport */
    run_quantized_cases(&nccl_rig, 4, 0);
    run_quantized_cases(&nccl_rig, 1, 1);
    g_defer_streams = 1;
    pipeline_cases_tail = 3; /* ZeRO-2/3's quantized gradients carry the used-parameter flags */
    run_quantized_cases(&nccl_rig, 4, 0);
    pipeline_cases_tail = 0;
    g_defer_streams = 0;
  }
  if (wanted(argc, argv, "grouped")) test_grouped_unit();
  if (wanted(argc, argv, "hfsdp")) test_hfsdp();
  long collectives = emu_nccl_collectives() - before;
  CHECK(emu_nccl_live_ops() == 0, "%d pre-multiply operators never destroyed", emu_nccl_live_ops());
  if (wanted(argc, argv, "watchdog")) test_watchdog();
  if (wanted(argc, argv, "connect")) test_dead_peer_at_connect();
  if (wanted(argc, argv, "destroy")) test_destroy_in_flight();
  if (wanted(argc, argv, "group-abort")) test_abort_inside_group();
  if (wanted(argc, argv, "pipeline-destroy")) test_pipeline_destroy_in_flight();
  if (wanted(argc, argv, "close")) test_close();
  if (wanted(argc, argv, "interrupt")) test_interrupt();
  CHECK(emu_streams_alive() == streams_before, "%d streams left alive", emu_streams_alive() - streams_before);
  if (test_failures) {
    fprintf(stderr, "test_emu: %d checks failed\n", test_failures);
    return test_failures > 100 ? 100 : test_failures;
  }
  printf("test_emu: all %ld checks passed (%ld NCCL collectives through the native transport, %ld pre-multiplied)\n",
         (long)test_checks, collectives, emu_nccl_premul_reductions());
  return 0;
}
