/* nccl_rig.c (a part of test_emu, whose runner is csrc/tests/test_emu.c): the NCCL rig: emulated
 * device memory, the native transport, the CUDA kernels, as the pipeline cases and the parts here
 * run them. */
#include "cuda_tests.h"

/* Device memory as torch's caching allocator gives it: allocation at once, freeing ordered
 * after the work already queued on the current stream. */
static mfsdp_status dev_create(void* ctx, int64_t numel, int32_t dtype, mfsdp_buffer* out) {
  MFSDP_CHECK(heap_memory_ops.create(ctx, numel, dtype, out));
  out->device = 0;
  return MFSDP_OK;
}

static void stream_free(void* mem) { free(mem); }

static mfsdp_status dev_release(void* ctx, mfsdp_buffer* buf) {
  emu_rank* r = ctx;
  heap_block* b = buf->handle;
  if (b->mem) emu_stream_host_fn(r->stream, stream_free, b->mem);
  b->mem = NULL;
  buf->data = NULL;
  return MFSDP_OK;
}

static void dev_destroy(void* ctx, mfsdp_buffer* buf) {
  dev_release(ctx, buf);
  free(buf->handle);
  buf->handle = NULL;
}

mfsdp_memory_ops dev_memory_ops; /* heap ops with the two above: emu_rig_init */

int g_defer_streams = 0;

void emu_rig_init(void) {
  dev_memory_ops = heap_memory_ops;
  dev_memory_ops.create = dev_create;
  dev_memory_ops.release = dev_release;
  dev_memory_ops.destroy = dev_destroy;
}

void* emu_world_create(int n) {
  emu_world* w = calloc(1, sizeof *w);
  w->n = n;
  w->timeout_s = 30.0;
  w->defer = g_defer_streams;
  pthread_barrier_init(&w->start, NULL, (unsigned)n);
  ncclGetUniqueId(&w->ids[0]);
  ncclGetUniqueId(&w->ids[1]);
  return w;
}

void emu_world_destroy(void* world) {
  emu_world* w = world;
  pthread_barrier_destroy(&w->start);
  free(w);
}

/* Rank `rank` of `world` on device `device`. */
int emu_rank_setup_on(emu_world* w, int rank, int device, mfsdp_backend* be, void** state) {
  emu_rank* r = calloc(1, sizeof *r);
  /* One device per rank, with torch's current stream on it; the thread's current device stays
   * 0, as on a rank that never called torch.cuda.set_device: the engine must not depend on it. */
  cudaSetDevice(device);
  emu_set_stream_delay_us(w->stream_delay_us);
  cudaStreamCreateWithPriority(&r->stream, cudaStreamNonBlocking, 0);
  emu_set_stream_delay_us(0);
  if (w->defer) emu_stream_defer(r->stream, 1);
  cudaSetDevice(0);
  if (mfsdp_cuda_kernel_context(device, &r->kernels_ctx) != MFSDP_OK) return -1;
  mfsdp_cuda_set_stream(r->kernels_ctx, r->stream);
  *state = r;
  pthread_barrier_wait(&w->start);
  emu_set_stream_delay_us(w->lane_delay_us); /* the lanes the transport makes now */
  mfsdp_status made = mfsdp_nccl_create(w->ids, rank, w->n, device, w->timeout_s, w->hooks, &r->nccl);
  emu_set_stream_delay_us(0);
  if (made != MFSDP_OK) return -1;
  int current = -1;
  cudaGetDevice(&current);
  CHECK(current == 0, "creating the transport left device %d current (the caller's was 0)", current);
  *be = (mfsdp_backend){&dev_memory_ops, r, &mfsdp_nccl_ops, r->nccl, mfsdp_cuda_kernels, r->kernels_ctx};
  return 0;
}

int emu_rank_setup(void* world, int rank, mfsdp_backend* be, void** state) {
  return emu_rank_setup_on(world, rank, rank, be, state);
}

void emu_rank_sync(void* state) { cudaStreamSynchronize(((emu_rank*)state)->stream); }

/* Every rank tears down at the same point: the collective close, then the local destroy
 * (which only aborts what close could not end). */
void emu_rank_teardown(void* state) {
  emu_rank* r = state;
  if (r == NULL) return;
  cudaStreamSynchronize(r->stream);
  if (r->nccl) mfsdp_nccl_close(r->nccl); /* fails fast after a failure; the destroy below still frees */
  mfsdp_nccl_destroy(r->nccl);
  mfsdp_cuda_set_stream(r->kernels_ctx, NULL);
  cudaStreamDestroy(r->stream);
  free(r);
}

const pipe_rig nccl_rig = {"emulated NCCL + CUDA kernels", emu_world_create, emu_world_destroy,
                                  emu_rank_setup, emu_rank_sync, emu_rank_teardown, NULL};
