/* mfsdp_transport.h: what the pipeline needs from the outside world: memory and collectives.
 *
 * Two implementations: the torch.distributed transport (csrc/python/torch_transport.c: any
 * torch backend, gloo on CPU) and the native NCCL transport (csrc/cuda/nccl_transport.c, our
 * own communicators and streams). Memory is always torch's: buffers are torch tensors whose
 * storage is resized between 0 and full size, so views held by parameters and autograd stay
 * valid while the memory itself comes and goes (see [Note: storage resize] in buffers.c). */
#ifndef MFSDP_TRANSPORT_H
#define MFSDP_TRANSPORT_H

#include <stdint.h>

#include "../core/mfsdp_status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A flat run of elements. `handle` belongs to the memory implementation (the torch backend
 * keeps a torch.Tensor there); `data` is NULL while the storage is released. */
typedef struct mfsdp_buffer {
  void* data;
  int64_t numel;
  int32_t dtype;
  int32_t device; /* -1: host memory, >= 0: CUDA device ordinal */
  void* handle;
} mfsdp_buffer;

/* An in-flight collective, owned by the transport until wait() or discard(). */
typedef struct mfsdp_work mfsdp_work;

typedef enum mfsdp_reduce_op { MFSDP_REDUCE_SUM = 0, MFSDP_REDUCE_AVG = 1 } mfsdp_reduce_op;

typedef struct mfsdp_transport_ops {
  const char* name;
  /* full = concat over ranks of every rank's shard; shard may alias this rank's slice of full. */
  mfsdp_status (*all_gather)(void* ctx, const mfsdp_buffer* full, const mfsdp_buffer* shard, mfsdp_work** work);
  /* shard = op over ranks of this rank's slice of full; shard may alias that slice. Inputs are
   * multiplied by premul first (only transports with fuses_premul accept premul != 1). */
  mfsdp_status (*reduce_scatter)(void* ctx, const mfsdp_buffer* shard, const mfsdp_buffer* full,
                                 mfsdp_reduce_op op, double premul, mfsdp_work** work);
  mfsdp_status (*all_reduce)(void* ctx, const mfsdp_buffer* buf, mfsdp_reduce_op op, double premul,
                             mfsdp_work** work);
  /* out's r-th block (numel / world elements) = rank r's in's block for this rank. */
  mfsdp_status (*all_to_all)(void* ctx, const mfsdp_buffer* out, const mfsdp_buffer* in, mfsdp_work** work);
  /* Blocks (or orders the consumer after the work) and frees it. NULL work: no-op. */
  mfsdp_status (*wait)(void* ctx, mfsdp_work* work);
  /* Frees a work without waiting for it on the host: teardown, or after an error. The memory
   * the collective touches may be released right after (a stream-ordered transport orders the
   * consumer stream after the collective first). */
  void (*discard)(void* ctx, mfsdp_work* work);
  /* Optional (NULL: no grouping). Collectives issued between group_start and group_end go out
   * as one launch (ncclGroupStart/End); their works may be waited on only after group_end. */
  mfsdp_status (*group_start)(void* ctx);
  mfsdp_status (*group_end)(void* ctx);
  /* Reductions of float32/float64 buffers multiply by premul inside the collective
   * (ncclPreMulSum), saving the engine a pass over the buffer. */
  int fuses_premul;
} mfsdp_transport_ops;

typedef struct mfsdp_memory_ops {
  /* A new zero-filled storage buffer of numel elements (storage materialised). */
  mfsdp_status (*create)(void* ctx, int64_t numel, int32_t dtype, mfsdp_buffer* out);
  /* A view of `storage`'s elements [offset, offset + numel); valid across materialise/release. */
  mfsdp_status (*create_view)(void* ctx, const mfsdp_buffer* storage, int64_t offset, int64_t numel,
                              mfsdp_buffer* out);
  mfsdp_status (*materialize)(void* ctx, mfsdp_buffer* storage); /* storage back to full size; sets data */
  mfsdp_status (*release)(void* ctx, mfsdp_buffer* storage);   /* storage to 0 bytes; data = NULL */
  void (*destroy)(void* ctx, mfsdp_buffer* buf);               /* drop the handle */
  /* Keep the memory behind a caller's handle (e.g. an autograd gradient) alive / let it go. */
  void (*retain)(void* ctx, void* handle);
  void (*drop)(void* ctx, void* handle);
} mfsdp_memory_ops;

#ifdef __cplusplus
}
#endif
#endif
