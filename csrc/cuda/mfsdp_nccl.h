/* mfsdp_nccl.h: the native NCCL transport (csrc/cuda/nccl_transport.c). */
#ifndef MFSDP_NCCL_H
#define MFSDP_NCCL_H

#include <cuda_runtime.h>
#include <nccl.h>

#include "../comm/mfsdp_transport.h"
#include "../core/mfsdp_dtype.h"

typedef struct mfsdp_nccl mfsdp_nccl;

/* ids[0] for the all-gather communicator, ids[1] for reductions (from rank 0, broadcast).
 * timeout_s <= 0: no watchdog timeout (NCCL errors are still caught). Blocks until all ranks
 * joined: call without the GIL. */
mfsdp_status mfsdp_nccl_create(const ncclUniqueId* ids, int rank, int world, int device, double timeout_s,
                               mfsdp_nccl** out);
void mfsdp_nccl_destroy(mfsdp_nccl* t);
/* NULL while healthy, else why it stopped. */
const char* mfsdp_nccl_failure(const mfsdp_nccl* t);

extern const mfsdp_transport_ops mfsdp_nccl_ops;

#endif
