/* cuda_runtime.h (emulated): the subset of the CUDA runtime that csrc/cuda uses, on the host.
 *
 * Only for csrc/tests/test_emu.c, on machines without a GPU. "Device" memory is host memory;
 * every stream is a worker thread running its queue in order; events and cross-stream waits
 * behave as in CUDA (recorded work completes asynchronously, waits block the waiting stream,
 * not the host, and concern the event's latest record at the time of the call); a kernel launch
 * queues the kernel body, run once per (block, thread) in turn. The tests can slow streams
 * down or defer them until the host synchronizes (emu_set_stream_delay_us, emu_stream_defer):
 * CUDA gives no timing guarantees, so orderings that only timing provides show up as wrong
 * values there.
 * As in CUDA, each host thread has a current device (0 until cudaSetDevice); a stream and an
 * event belong to the device current when they were made, and a launch, memset or event record
 * on a stream of another device fails with cudaErrorInvalidResourceHandle. Each device has a
 * memory pool of bounded size (emu_set_device_memory) shared by cudaMalloc, cudaMallocAsync and
 * what the tests reserve in torch's name (emu_device_reserve): a pool torch has filled makes
 * the runtime's own allocations fail, as on a real GPU.
 * What it proves: the host logic of kernels.cu and nccl_transport.c (indexing, vector heads
 * and tails, stream ordering, event lifetimes, device identity, the watchdog). What it cannot:
 * real GPU timing, memory models or NCCL itself -- those wait for a lent GPU
 * (benchmarks/gpu_check.sh). */
#ifndef MFSDP_EMU_CUDA_RUNTIME_H
#define MFSDP_EMU_CUDA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
} cudaError_t;

typedef struct emu_stream* cudaStream_t;
typedef struct emu_event* cudaEvent_t;

typedef enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
} cudaMemcpyKind;

enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
#define cudaStreamNonBlocking 0x01
#define cudaEventDisableTiming 0x02

const char* cudaGetErrorString(cudaError_t e);
const char* cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaMalloc(void* p, size_t bytes); /* void** in CUDA */
cudaError_t cudaFree(void* p);
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest);
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int priority);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags);
cudaError_t cudaMallocAsync(void* p, size_t bytes, cudaStream_t s); /* void** in CUDA */
cudaError_t cudaFreeAsync(void* p, cudaStream_t s);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s);

/* Emulator controls for the tests. */
int emu_streams_alive(void);          /* streams created and not destroyed */
void emu_set_device_count(int n);     /* devices cudaSetDevice accepts (default 8) */
/* Size of a device's memory pool (default 1 GiB each); what is in use stays in use. */
void emu_set_device_memory(int device, size_t bytes);
size_t emu_device_memory_free(int device);
/* Takes (bytes > 0) or gives back (bytes < 0) pool memory in torch's name, as its caching
 * allocator does; 0 when the pool has not that much free. */
int emu_device_reserve(int device, long long bytes);
/* cudaMalloc/cudaMallocAsync calls so far (the engine's hot paths must make none). */
long emu_runtime_allocations(void);
void emu_set_multiprocessors(int n);  /* what cudaDevAttrMultiProcessorCount reports (default 2) */
void emu_set_jitter_us(int max_us);   /* each stream operation starts after a random 0..max_us delay */
/* Streams the calling host thread creates from now on start each operation `us` later: a slow
 * or busy engine, for the streams a test cannot reach (an NCCL transport's lanes). */
void emu_set_stream_delay_us(int us);
/* A deferred stream is a device arbitrarily far behind the host: its queued work starts only
 * when the host waits for the stream (cudaStreamSynchronize, a copy to host memory) or destroys
 * it; streams waiting on its events wait as they would behind a busy GPU. CUDA promises no
 * progress earlier, so a host that touches memory the stream has yet to read or write, or
 * waits on no event for it, is caught at once, whatever the machine's load. (A host that waits
 * only by polling cudaEventQuery would wait until its timeout: the engine's hosts synchronize.)
 * Off: the queued work goes. */
void emu_stream_defer(cudaStream_t s, int on);
/* Queues a host function on a stream: the tests' stand-in for torch freeing into its
 * stream-ordered caching allocator. */
void emu_stream_host_fn(cudaStream_t s, void (*fn)(void*), void* arg);

#ifdef __cplusplus
}  // extern "C"

/* ---- kernels compiled for the host (csrc/tests/emu/host_kernels.py rewrites the launches) ---- */
#include <functional>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__

/* Rounded arithmetic that nvcc never contracts into an FMA; on the host plain operators, built
 * without contraction (-ffp-contract=off), as the CPU kernels are. */
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
extern thread_local dim3 blockIdx, threadIdx, blockDim, gridDim;

/* Runs `body` once per (block, thread) of the grid, in order, on stream s's worker. */
cudaError_t emu_launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t s, std::function<void()> body);

/* The body runs one thread at a time: a plain add is atomic. */
template <typename T>
inline T atomicAdd(T* p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
#endif

#endif
