// emu_runtime.cpp: the emulated CUDA runtime and NCCL of cuda_runtime.h / nccl.h (see there).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../../core/mfsdp_dtype.h"
#include "cuda_runtime.h"
#include "nccl.h"

thread_local dim3 blockIdx, threadIdx, blockDim, gridDim;

namespace {

thread_local cudaError_t g_last_error = cudaSuccess;
thread_local int g_device = 0; /* the host thread's current device, as in CUDA */
constexpr int kMaxDevices = 64;
std::atomic<int> g_device_count{8};
std::atomic<int> g_streams_alive{0};
std::atomic<long> g_allocations{0};
/* Device memory pools: what cudaMalloc/cudaMallocAsync and torch (emu_device_reserve) draw on. */
std::mutex g_pool_lock;
size_t g_pool_size[kMaxDevices];
size_t g_pool_used[kMaxDevices];
std::map<void*, std::pair<int, size_t>> g_pool_blocks; /* pointer -> (device, bytes) */
std::atomic<int> g_multiprocessors{2};
std::atomic<int> g_jitter_us{0};
thread_local int g_new_stream_delay_us = 0; /* emu_set_stream_delay_us: streams this thread makes next */
std::atomic<long> g_collectives{0};
std::atomic<long> g_grouped{0}; /* collectives launched by a group of more than one */
std::atomic<long> g_premul{0};
/* custom reduction operators: id -> pre-multiplier (read when the reduction is enqueued, as
 * NCCL reads a host-immediate scalar) */
std::mutex g_ops_lock;
std::map<int, double> g_ops;
int g_next_op = 5; /* after the built-in ones */

cudaError_t fail(cudaError_t e) {
  g_last_error = e;
  return e;
}

bool valid_device(int device) { return device >= 0 && device < g_device_count.load(); }

size_t pool_size(int device) { return g_pool_size[device] ? g_pool_size[device] : (size_t)1 << 30; }

void* pool_alloc(int device, size_t bytes) {
  std::lock_guard<std::mutex> g(g_pool_lock);
  if (g_pool_used[device] + bytes > pool_size(device)) return nullptr;
  void* mem = malloc(bytes ? bytes : 1);
  if (mem == nullptr) return nullptr;
  g_pool_used[device] += bytes;
  g_pool_blocks[mem] = {device, bytes};
  ++g_allocations;
  return mem;
}

bool pool_free(void* p) {
  std::lock_guard<std::mutex> g(g_pool_lock);
  auto it = g_pool_blocks.find(p);
  if (it == g_pool_blocks.end()) return false;
  g_pool_used[it->second.first] -= it->second.second;
  g_pool_blocks.erase(it);
  free(p);
  return true;
}

}  // namespace

/* A stream: one worker thread running queued operations in order. The operations are counted:
 * `pushed` queued so far, `done` run, `released` allowed to start while the stream is deferred
 * (emu_stream_defer). */
struct emu_stream {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool stop = false;
  bool deferred = false;
  uint64_t pushed = 0, started = 0, done = 0, released = 0;
  const int device;   /* the device current when it was made */
  const int delay_us; /* each operation starts this much later (emu_set_stream_delay_us) */
  std::thread worker;

  explicit emu_stream(int device_)
      : device(device_), delay_us(g_new_stream_delay_us), worker([this] { run(); }) {
    ++g_streams_alive;
  }
  ~emu_stream() {
    {
      std::lock_guard<std::mutex> g(m);
      stop = true;
    }
    cv.notify_all();
    worker.join();
    --g_streams_alive;
  }
  void run() {
    std::unique_lock<std::mutex> g(m);
    for (;;) {
      /* a deferred stream starts only what the host released; a stream being destroyed runs all */
      cv.wait(g, [this] { return stop || (!queue.empty() && (!deferred || started < released)); });
      if (queue.empty()) return; /* stop, and everything queued has run (CUDA finishes work too) */
      std::function<void()> op = std::move(queue.front());
      queue.pop_front();
      ++started;
      g.unlock();
      if (int j = g_jitter_us.load()) { /* shake the interleaving of streams */
        thread_local unsigned seed = static_cast<unsigned>(reinterpret_cast<uintptr_t>(this));
        seed = seed * 1103515245u + 12345u;
        std::this_thread::sleep_for(std::chrono::microseconds((seed >> 8) % static_cast<unsigned>(j + 1)));
      }
      if (delay_us) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      op();
      g.lock();
      ++done;
      cv.notify_all();
    }
  }
  /* Queues op; returns its place in the stream's count (what release() takes to let it start). */
  uint64_t push(std::function<void()> op) {
    uint64_t at;
    {
      std::lock_guard<std::mutex> g(m);
      queue.push_back(std::move(op));
      at = ++pushed;
    }
    cv.notify_all();
    return at;
  }
  /* Lets a deferred stream start its operations up to number `upto` (a host waiting for an event
   * recorded there makes the work before it run, as a host waiting for the stream does). */
  void release(uint64_t upto) {
    {
      std::lock_guard<std::mutex> g(m);
      if (released < upto) released = upto;
    }
    cv.notify_all();
  }
  /* Waits for the work queued before the call (as cudaStreamSynchronize does), releasing it
   * first if the stream is deferred: a host that waits for a stream makes it run. */
  void synchronize() {
    std::unique_lock<std::mutex> g(m);
    uint64_t target = pushed;
    if (released < target) released = target;
    cv.notify_all();
    cv.wait(g, [&] { return done >= target; });
  }
  void defer(bool on) {
    {
      std::lock_guard<std::mutex> g(m);
      deferred = on;
    }
    cv.notify_all();
  }
};

namespace {

/* The legacy default stream (handle 0) of the current device. */
emu_stream* resolve(cudaStream_t s) {
  if (s) return s;
  static std::mutex lock;
  static emu_stream* legacy[kMaxDevices];  // made on first use, live for the process
  std::lock_guard<std::mutex> g(lock);
  if (!legacy[g_device]) legacy[g_device] = new emu_stream(g_device);
  return legacy[g_device];
}

/* Work on a stream must be issued with its device current. */
bool on_current_device(cudaStream_t s) { return resolve(s)->device == g_device; }

}  // namespace

/* An event: how many records were issued, and which of them have not passed on their streams
 * yet. Each record completes on its own: a wait or query concerns one record (the latest at the
 * time of the call, as in CUDA), which a later record on a faster stream does not complete. The
 * state is shared with queued operations, so destroying a pending event is safe (as in CUDA). */
struct emu_event_state {
  std::mutex m;
  std::condition_variable cv;
  uint64_t recorded = 0;
  std::set<uint64_t> pending; /* records issued whose stream has not reached them */
  emu_stream* last_stream = nullptr; /* the latest record's stream, and its place there */
  uint64_t last_at = 0;
  bool passed(uint64_t seq) const { return pending.count(seq) == 0; }
};
struct emu_event {
  std::shared_ptr<emu_event_state> s = std::make_shared<emu_event_state>();
  int device = g_device;
};

extern "C" {

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
  }
  return "unknown error";
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
  }
  return "cudaErrorUnknown";
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = g_last_error;
  g_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaSetDevice(int device) {
  if (!valid_device(device)) return fail(cudaErrorInvalidDevice);
  g_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return fail(cudaErrorInvalidValue);
  *device = g_device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (value == nullptr) return fail(cudaErrorInvalidValue);
  if (!valid_device(device)) return fail(cudaErrorInvalidDevice);
  *value = attr == cudaDevAttrMultiProcessorCount ? g_multiprocessors.load() : 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int priority) {
  (void)flags;
  (void)priority;
  if (s == nullptr) return fail(cudaErrorInvalidValue);
  *s = new emu_stream(g_device);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (s == nullptr) return fail(cudaErrorInvalidResourceHandle);
  delete s;  // CUDA lets queued work finish first; so does the worker
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  resolve(s)->synchronize();
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  (void)flags;
  if (e == nullptr) return fail(cudaErrorInvalidValue);
  *e = new emu_event();
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  if (e == nullptr || e->device != resolve(s)->device || !on_current_device(s))
    return fail(cudaErrorInvalidResourceHandle);
  std::shared_ptr<emu_event_state> st = e->s;
  uint64_t seq;
  {
    std::lock_guard<std::mutex> g(st->m);
    seq = ++st->recorded;
    st->pending.insert(seq);
  }
  emu_stream* stream = resolve(s);
  uint64_t at = stream->push([st, seq] {
    std::lock_guard<std::mutex> g(st->m);
    st->pending.erase(seq);
    st->cv.notify_all();
  });
  {
    std::lock_guard<std::mutex> g(st->m);
    if (st->recorded == seq) {
      st->last_stream = stream;
      st->last_at = at;
    }
  }
  return cudaSuccess;
}

/* The host waits for the event's latest record (as in CUDA), from any thread; a deferred stream
 * is released up to it first. The stream must outlive the wait (the engine destroys its streams
 * only after its waits). */
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (e == nullptr) return fail(cudaErrorInvalidResourceHandle);
  std::shared_ptr<emu_event_state> st = e->s;
  std::unique_lock<std::mutex> g(st->m);
  uint64_t target = st->recorded;
  if (st->passed(target)) return cudaSuccess;
  emu_stream* stream = st->last_stream;
  uint64_t at = st->last_at;
  g.unlock();
  if (stream) stream->release(at);
  g.lock();
  st->cv.wait(g, [&] { return st->passed(target); });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (e == nullptr) return fail(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::mutex> g(e->s->m);
  return e->s->passed(e->s->recorded) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (e == nullptr) return fail(cudaErrorInvalidResourceHandle);
  delete e;
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  (void)flags;
  if (e == nullptr) return fail(cudaErrorInvalidResourceHandle);
  std::shared_ptr<emu_event_state> st = e->s;
  uint64_t target;
  {
    std::lock_guard<std::mutex> g(st->m);
    target = st->recorded;  // the latest record at the time of the call, as in CUDA
  }
  resolve(s)->push([st, target] {
    std::unique_lock<std::mutex> g(st->m);
    st->cv.wait(g, [&] { return st->passed(target); });
  });
  return cudaSuccess;
}

cudaError_t cudaMalloc(void* p, size_t bytes) {
  if (p == nullptr) return fail(cudaErrorInvalidValue);
  void* mem = pool_alloc(g_device, bytes);
  if (mem == nullptr) return fail(cudaErrorMemoryAllocation);
  *static_cast<void**>(p) = mem;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  if (p == nullptr) return cudaSuccess;
  return pool_free(p) ? cudaSuccess : fail(cudaErrorInvalidValue);
}

cudaError_t cudaMallocAsync(void* p, size_t bytes, cudaStream_t s) {
  if (p == nullptr) return fail(cudaErrorInvalidValue);
  void* mem = pool_alloc(resolve(s)->device, bytes);  // from the pool of the stream's device
  if (mem == nullptr) return fail(cudaErrorMemoryAllocation);
  *static_cast<void**>(p) = mem;
  return cudaSuccess;
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  resolve(s)->push([p] { pool_free(p); });  // stream-ordered: earlier work on s may still use it
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  if (bytes && (dst == nullptr || src == nullptr)) return fail(cudaErrorInvalidValue);
  emu_stream* q = resolve(s);
  if (kind == cudaMemcpyHostToDevice) {
    /* CUDA stages pageable host memory before returning: the caller may reuse it at once */
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + bytes);
    q->push([=] { memcpy(dst, staged->data(), bytes); });
  } else if (kind == cudaMemcpyDeviceToHost) {
    q->synchronize(); /* to pageable memory: returns once the copy is done */
    memcpy(dst, src, bytes);
  } else {
    q->push([=] { memmove(dst, src, bytes); });
  }
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  if (bytes && p == nullptr) return fail(cudaErrorInvalidValue);
  if (!on_current_device(s)) return fail(cudaErrorInvalidResourceHandle);
  resolve(s)->push([=] { memset(p, value, bytes); });
  return cudaSuccess;
}

int emu_streams_alive(void) { return g_streams_alive.load(); }
void emu_set_device_count(int n) { g_device_count = n < kMaxDevices ? n : kMaxDevices; }
void emu_set_device_memory(int device, size_t bytes) {
  std::lock_guard<std::mutex> g(g_pool_lock);
  g_pool_size[device] = bytes;
}
size_t emu_device_memory_free(int device) {
  std::lock_guard<std::mutex> g(g_pool_lock);
  size_t size = pool_size(device);
  return g_pool_used[device] < size ? size - g_pool_used[device] : 0;
}
int emu_device_reserve(int device, long long bytes) {
  std::lock_guard<std::mutex> g(g_pool_lock);
  if (bytes > 0 && g_pool_used[device] + (size_t)bytes > pool_size(device)) return 0;
  g_pool_used[device] += (size_t)bytes;  // a negative count gives back
  return 1;
}
long emu_runtime_allocations(void) { return g_allocations.load(); }
void emu_set_multiprocessors(int n) { g_multiprocessors = n; }
void emu_set_jitter_us(int max_us) { g_jitter_us = max_us; }
void emu_set_stream_delay_us(int us) { g_new_stream_delay_us = us; }
void emu_stream_defer(cudaStream_t s, int on) { resolve(s)->defer(on != 0); }
void emu_stream_host_fn(cudaStream_t s, void (*fn)(void*), void* arg) { resolve(s)->push([=] { fn(arg); }); }

}  // extern "C"

cudaError_t emu_launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t s, std::function<void()> body) {
  (void)shared_bytes;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.x * block.y * block.z > 1024 ||
      grid.y > 65535 || grid.z > 65535)
    return fail(cudaErrorInvalidValue);  // CUDA's launch limits, reported by cudaGetLastError
  if (!on_current_device(s)) return fail(cudaErrorInvalidResourceHandle);  // a stream of another device
  resolve(s)->push([=] {
    gridDim = grid;
    blockDim = block;
    for (unsigned z = 0; z < grid.z; ++z)
      for (unsigned y = 0; y < grid.y; ++y)
        for (unsigned x = 0; x < grid.x; ++x)
          for (unsigned tz = 0; tz < block.z; ++tz)
            for (unsigned ty = 0; ty < block.y; ++ty)
              for (unsigned tx = 0; tx < block.x; ++tx) {
                blockIdx = dim3(x, y, z);
                threadIdx = dim3(tx, ty, tz);
                body();
              }
  });
  return cudaSuccess;
}

/* ------------------------------------------------------------------------------------------ */
/* NCCL. A clique is the ranks of one unique id; its members meet in a two-phase barrier.
 *
 * As in NCCL: a communicator made by ncclCommInitRankConfig with blocking = 0 never blocks the
 * caller: a call that has to wait (init, the connection a communicator sets up at its first
 * collective, finalize) returns ncclInProgress and finishes in the background, and
 * ncclCommGetAsyncError reports ncclInProgress until then; a further call on the communicator
 * meanwhile is ncclInvalidUsage. A blocking communicator waits in the call instead: at its
 * first collective until every rank has reached its own first collective. ncclCommFinalize
 * (and ncclCommDestroy without it) waits until the communicator's queued collectives have run,
 * which needs their peers; ncclCommAbort breaks the clique at once. */

namespace {

struct clique {
  int n;
  std::mutex m;
  std::condition_variable cv;
  int joined = 0, connected = 0, arrived = 0;
  uint64_t generation = 0;
  bool broken = false;
  /* what each rank posted for the current collective */
  std::vector<const void*> send;
  std::vector<std::vector<std::pair<const void*, size_t>>> sends_to;  // [rank][peer]: p2p
  std::vector<int> devices;                                           // [rank]: its GPU
  explicit clique(int n_)
      : n(n_), send(n_), sends_to(n_, std::vector<std::pair<const void*, size_t>>(n_)), devices(n_, -1) {}

  /* false: the clique broke (a rank aborted) before everyone arrived */
  bool barrier() {
    std::unique_lock<std::mutex> g(m);
    if (broken) return false;
    uint64_t gen = generation;
    if (++arrived == n) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return true;
    }
    cv.wait(g, [&] { return generation != gen || broken; });
    return generation != gen;
  }
  /* Counts this rank in (joined at init, connected at its first collective) and waits for all. */
  bool meet(int clique::*counter, bool count_me) {
    std::unique_lock<std::mutex> g(m);
    if (count_me) ++(this->*counter);
    cv.notify_all();
    cv.wait(g, [&] { return this->*counter == n || broken; });
    return !broken;
  }
  void do_break() {
    std::lock_guard<std::mutex> g(m);
    broken = true;
    cv.notify_all();
  }
};

std::mutex g_registry_lock;
std::map<std::string, std::weak_ptr<clique>> g_registry;
std::atomic<uint64_t> g_next_id{1};
std::atomic<long> g_destroys{0}, g_aborts{0};

struct comm_state {
  std::shared_ptr<clique> c;
  int rank;
  int device; /* current when the communicator was made: its streams must be this device's */
  bool blocking = true;
  std::atomic<int> error{ncclSuccess};
  std::atomic<int> in_progress{0}; /* background work of a non-blocking call */
  std::atomic<bool> connected{false};
  std::atomic<bool> finalized{false};
  std::atomic<bool> released{false}; /* its handle was aborted or destroyed: NCCL freed it */
  std::mutex m;
  std::condition_variable cv;
  int inflight = 0; /* collectives queued on streams that have not run yet */

  void set_error(ncclResult_t r) {
    int ok = ncclSuccess;
    error.compare_exchange_strong(ok, r);
  }
  void drain() { /* until every queued collective has run (or ended on a broken clique) */
    std::unique_lock<std::mutex> g(m);
    cv.wait(g, [&] { return inflight == 0; });
  }
};

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    default: return 8;
  }
}

double load(const void* p, ncclDataType_t t, size_t i) {
  switch (t) {
    case ncclFloat32: return static_cast<const float*>(p)[i];
    case ncclFloat64: return static_cast<const double*>(p)[i];
    case ncclBfloat16: return mfsdp_bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case ncclFloat16: return mfsdp_f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    case ncclInt32: return static_cast<const int32_t*>(p)[i];
    case ncclInt64: return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    default: return static_cast<const uint8_t*>(p)[i];
  }
}

void store(void* p, ncclDataType_t t, size_t i, double v) {
  switch (t) {
    case ncclFloat32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case ncclFloat64: static_cast<double*>(p)[i] = v; break;
    case ncclBfloat16: static_cast<uint16_t*>(p)[i] = mfsdp_f32_to_bf16(static_cast<float>(v)); break;
    case ncclFloat16: static_cast<uint16_t*>(p)[i] = mfsdp_f32_to_f16(static_cast<float>(v)); break;
    case ncclInt32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case ncclInt64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    default: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); break;
  }
}

/* A collective ready to go on a stream; `op` runs there. */
struct launch_entry {
  std::shared_ptr<comm_state> st;
  cudaStream_t stream;
  std::function<void()> op;
};

/* A p2p operation collected between ncclGroupStart and ncclGroupEnd. */
struct p2p_op {
  bool is_send;
  void* buf;
  size_t bytes;
  int peer;
  ncclComm_t comm;
  cudaStream_t stream;
};
thread_local int g_group_depth = 0;
thread_local std::vector<p2p_op> g_group_p2p;
/* NCCL launches a group's collectives at ncclGroupEnd: until then they wait here. */
thread_local std::vector<launch_entry> g_group_collectives;
thread_local std::vector<std::shared_ptr<comm_state>> g_group_inits;

/* Queues the collectives on their streams, counting them in flight until they have run. */
void push_all(const std::vector<launch_entry>& entries) {
  for (const launch_entry& e : entries) {
    {
      std::lock_guard<std::mutex> g(e.st->m);
      ++e.st->inflight;
    }
    std::shared_ptr<comm_state> st = e.st;
    std::function<void()> op = e.op;
    resolve(e.stream)->push([st, op] {
      op();
      std::lock_guard<std::mutex> g(st->m);
      --st->inflight;
      st->cv.notify_all();
    });
  }
}

/* What a call waits for before its collectives can go: peers joining new communicators, then
 * peers reaching their first collective on communicators not yet connected. */
bool meet_peers(const std::vector<std::shared_ptr<comm_state>>& inits, const std::vector<launch_entry>& entries) {
  bool ok = true;
  for (const auto& st : inits)
    if (!st->c->meet(&clique::joined, false)) {
      st->set_error(ncclRemoteError);
      ok = false;
    }
  if (!ok) return false;
  for (const launch_entry& e : entries) {
    bool first = !e.st->connected.exchange(true);
    if (first && !e.st->c->meet(&clique::connected, true)) {
      e.st->set_error(ncclRemoteError);
      return false;
    }
  }
  return true;
}

/* Runs a call's waiting part now (blocking communicators) or in the background (non-blocking:
 * returns ncclInProgress, and each communicator involved reports it until done). */
ncclResult_t complete(std::vector<std::shared_ptr<comm_state>> inits, std::vector<launch_entry> entries) {
  std::vector<std::shared_ptr<comm_state>> comms = inits;
  for (const launch_entry& e : entries)
    if (std::find(comms.begin(), comms.end(), e.st) == comms.end()) comms.push_back(e.st);
  bool waits = !inits.empty();
  for (const launch_entry& e : entries) waits = waits || !e.st->connected.load();
  if (!waits) {
    push_all(entries);
    return ncclSuccess;
  }
  if (comms[0]->blocking) {
    if (!meet_peers(inits, entries)) return ncclRemoteError;
    push_all(entries);
    return ncclSuccess;
  }
  for (const auto& st : comms) ++st->in_progress;
  std::thread([inits, entries, comms] {
    if (meet_peers(inits, entries)) push_all(entries);
    for (const auto& st : comms) --st->in_progress;
  }).detach();
  return ncclInProgress;
}

}  // namespace

struct emu_comm {
  std::shared_ptr<comm_state> s = std::make_shared<comm_state>();
};

namespace {

ncclResult_t usable(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  if (comm->s->in_progress.load() > 0) return ncclInvalidUsage;  // a call before the last one finished
  return ncclSuccess;
}

/* Queues a collective on s: post, meet, compute this rank's part, meet again (so nobody
 * reuses a buffer a peer still reads). A broken meeting leaves the output untouched and
 * records ncclRemoteError (the rank that aborted sees its own abort instead). */
ncclResult_t enqueue(ncclComm_t comm, cudaStream_t s, const void* send, std::function<void(clique&, int)> part) {
  ncclResult_t r = usable(comm);
  if (r != ncclSuccess) return r;
  std::shared_ptr<comm_state> st = comm->s;
  if (resolve(s)->device != st->device) return ncclInvalidArgument;  // a stream of another GPU
  ++g_collectives;
  std::function<void()> op = [st, send, part] {
    clique& c = *st->c;
    c.send[st->rank] = send;
    if (!c.barrier()) {
      st->set_error(ncclRemoteError);
      return;
    }
    part(c, st->rank);
    if (!c.barrier()) st->set_error(ncclRemoteError);
  };
  if (g_group_depth > 0) {
    g_group_collectives.push_back({st, s, std::move(op)});
    return ncclSuccess;
  }
  return complete({}, {{st, s, std::move(op)}});
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (id == nullptr) return ncclInvalidArgument;
  memset(id, 0, sizeof *id);
  snprintf(id->internal, sizeof id->internal, "emu-clique-%llu", (unsigned long long)g_next_id++);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  if (comm == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  *comm = nullptr;
  std::shared_ptr<clique> c;
  {
    std::lock_guard<std::mutex> g(g_registry_lock);
    std::string key(id.internal, strnlen(id.internal, sizeof id.internal));
    c = g_registry[key].lock();
    if (!c) {
      c = std::make_shared<clique>(nranks);
      g_registry[key] = c;
    }
  }
  if (c->n != nranks) return ncclInvalidUsage;
  {
    std::lock_guard<std::mutex> g(c->m);
    for (int r = 0; r < c->n; ++r)
      if (c->devices[r] == g_device) {  // NCCL: "Duplicate GPU detected"
        c->broken = true;
        c->cv.notify_all();
        return ncclInvalidUsage;
      }
    c->devices[rank] = g_device;
    ++c->joined;
    c->cv.notify_all();
  }
  emu_comm* out = new emu_comm();
  out->s->c = c;
  out->s->rank = rank;
  out->s->device = g_device;
  out->s->blocking = config == nullptr || config->blocking != 0;
  *comm = out;
  if (g_group_depth > 0) {  // in a group: the meeting happens at ncclGroupEnd
    g_group_inits.push_back(out->s);
    return ncclSuccess;
  }
  return complete({out->s}, {});
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  ncclResult_t r = usable(comm);
  if (r != ncclSuccess) return r;
  std::shared_ptr<comm_state> st = comm->s;
  if (st->blocking) {
    st->drain();
    st->finalized = true;
    return ncclSuccess;
  }
  ++st->in_progress;
  std::thread([st] {
    st->drain();
    st->finalized = true;
    --st->in_progress;
  }).detach();
  return ncclInProgress;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  if (!comm->s->finalized) comm->s->drain();  // finalizes first: waits for the queued collectives
  ++g_destroys;
  comm->s->released = true;
  delete comm;  // queued collectives and background work keep the shared state
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  comm->s->error = ncclInvalidUsage;  // its own collectives report the abort, not a remote error
  comm->s->c->do_break();
  ++g_aborts;
  comm->s->released = true;
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error) {
  if (comm == nullptr || error == nullptr) return ncclInvalidArgument;
  int e = comm->s->error.load();
  *error = e != ncclSuccess ? static_cast<ncclResult_t>(e) : comm->s->in_progress.load() > 0 ? ncclInProgress : ncclSuccess;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

const char* ncclGetLastError(ncclComm_t comm) {
  (void)comm;
  return "(emulated NCCL)";
}

ncclResult_t ncclGroupStart(void) {
  ++g_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
  if (g_group_depth == 0) return ncclInvalidUsage;
  if (--g_group_depth > 0) return ncclSuccess;
  std::vector<std::shared_ptr<comm_state>> inits;
  inits.swap(g_group_inits);
  std::vector<launch_entry> entries;
  entries.swap(g_group_collectives);
  for (const launch_entry& e : entries)
    if (e.st->released) { /* in NCCL: a use after free, with no error to return */
      fprintf(stderr, "emulated NCCL: ncclGroupEnd launches a collective of a communicator aborted or destroyed "
                      "since it was queued in the group (a use after free in NCCL)\n");
      abort();
    }
  if (entries.size() > 1) g_grouped += static_cast<long>(entries.size());
  std::vector<p2p_op> ops;
  ops.swap(g_group_p2p);
  if (!ops.empty()) {
    /* One exchange per (communicator, stream), as NCCL fuses a group's sends and receives. */
    ncclComm_t comm = ops[0].comm;
    cudaStream_t stream = ops[0].stream;
    for (const p2p_op& op : ops)
      if (op.comm != comm || op.stream != stream) return ncclInvalidUsage;  // not needed by the engine
    int n = comm->s->c->n;
    std::vector<std::pair<const void*, size_t>> mine(n);
    std::vector<std::pair<void*, size_t>> recvs(n);
    for (const p2p_op& op : ops) {
      if (op.is_send)
        mine[op.peer] = {op.buf, op.bytes};
      else
        recvs[op.peer] = {op.buf, op.bytes};
    }
    std::shared_ptr<comm_state> st = comm->s;
    ++g_collectives;
    entries.push_back({st, stream, [st, mine, recvs] {
                         clique& c = *st->c;
                         c.sends_to[st->rank] = mine;
                         bool ok = c.barrier();
                         if (ok) {
                           for (int peer = 0; peer < c.n; ++peer) {
                             const auto& from = c.sends_to[peer][st->rank];
                             if (recvs[peer].first && from.first)
                               memcpy(recvs[peer].first, from.first, std::min(from.second, recvs[peer].second));
                           }
                           ok = c.barrier();
                         }
                         if (!ok) st->set_error(ncclRemoteError);
                       }});
  }
  if (inits.empty() && entries.empty()) return ncclSuccess;
  return complete(std::move(inits), std::move(entries));
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm, cudaStream_t s) {
  if (usable(comm) != ncclSuccess || g_group_depth == 0 || peer < 0 || peer >= comm->s->c->n) return ncclInvalidUsage;
  if (resolve(s)->device != comm->s->device) return ncclInvalidArgument;
  g_group_p2p.push_back({true, const_cast<void*>(buf), count * type_size(dtype), peer, comm, s});
  return ncclSuccess;
}

ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm, cudaStream_t s) {
  if (usable(comm) != ncclSuccess || g_group_depth == 0 || peer < 0 || peer >= comm->s->c->n) return ncclInvalidUsage;
  if (resolve(s)->device != comm->s->device) return ncclInvalidArgument;
  g_group_p2p.push_back({false, buf, count * type_size(dtype), peer, comm, s});
  return ncclSuccess;
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t dtype, ncclComm_t comm,
                           cudaStream_t s) {
  size_t bytes = count * type_size(dtype);
  return enqueue(comm, s, send, [=](clique& c, int rank) {
    (void)rank;
    for (int k = 0; k < c.n; ++k) {
      char* dst = static_cast<char*>(recv) + k * bytes;
      if (dst != c.send[k]) memcpy(dst, c.send[k], bytes);
    }
  });
}

static ncclResult_t reduce_into(ncclComm_t comm, cudaStream_t s, const void* send, void* recv, size_t count,
                                size_t first, ncclDataType_t dtype, ncclRedOp_t op) {
  double premul = 1.0;
  if (op != ncclSum && op != ncclAvg) {
    std::lock_guard<std::mutex> g(g_ops_lock);
    auto it = g_ops.find(static_cast<int>(op));
    if (it == g_ops.end()) return ncclInvalidArgument;
    premul = it->second;
    op = ncclSum;
    ++g_premul;
  }
  /* every rank multiplies its own input, then the products are summed */
  return enqueue(comm, s, send, [=](clique& c, int rank) {
    std::vector<double> acc(count, 0.0);
    for (int k = 0; k < c.n; ++k)
      for (size_t i = 0; i < count; ++i) {
        double v = load(c.send[k], dtype, first * static_cast<size_t>(rank) + i);
        acc[i] += premul == 1.0 ? v : (dtype == ncclFloat32 ? static_cast<double>(static_cast<float>(premul) * static_cast<float>(v)) : premul * v);
      }
    if (!c.barrier()) return;  // everyone has read before anyone writes: recv may alias send
    for (size_t i = 0; i < count; ++i) store(recv, dtype, i, op == ncclAvg ? acc[i] / c.n : acc[i]);
  });
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t dtype, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s) {
  return reduce_into(comm, s, send, recv, count, count, dtype, op);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t dtype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s) {
  return reduce_into(comm, s, send, recv, count, 0, dtype, op);
}

ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t dtype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  if (op == nullptr || scalar == nullptr || usable(comm) != ncclSuccess) return ncclInvalidArgument;
  if (residence != ncclScalarHostImmediate) return ncclInvalidUsage; /* device scalars: not emulated */
  double v;
  if (dtype == ncclFloat32)
    v = *static_cast<float*>(scalar);
  else if (dtype == ncclFloat64)
    v = *static_cast<double*>(scalar);
  else
    return ncclInvalidUsage; /* the engine only asks for float32/float64 */
  std::lock_guard<std::mutex> g(g_ops_lock);
  int id = g_next_op++;
  g_ops[id] = v;
  *op = static_cast<ncclRedOp_t>(id);
  return ncclSuccess;
}

ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  std::lock_guard<std::mutex> g(g_ops_lock);
  if (comm == nullptr || g_ops.erase(static_cast<int>(op)) != 1) return ncclInvalidArgument;
  return ncclSuccess;
}

long emu_nccl_premul_reductions(void) { return g_premul.load(); }
int emu_nccl_live_ops(void) {
  std::lock_guard<std::mutex> g(g_ops_lock);
  return static_cast<int>(g_ops.size());
}

long emu_nccl_collectives(void) { return g_collectives.load(); }
long emu_nccl_grouped_collectives(void) { return g_grouped.load(); }
long emu_nccl_destroys(void) { return g_destroys.load(); }
long emu_nccl_aborts(void) { return g_aborts.load(); }

}  // extern "C"
