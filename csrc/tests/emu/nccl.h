/* nccl.h (emulated): the NCCL subset of csrc/cuda/nccl_transport.c, for ranks that are threads
 * of one process (see cuda_runtime.h here). A collective is queued on its stream like a kernel;
 * it meets its peers when every rank's stream reaches it, and sums in rank order. Aborting a
 * communicator breaks the meeting for everyone: peers' collectives end and report
 * ncclRemoteError through ncclCommGetAsyncError, as a dead peer does in NCCL. Non-blocking
 * communicators (ncclConfig_t.blocking = 0), the connection set up at a communicator's first
 * collective, and finalize/destroy waiting for queued collectives behave as in NCCL (see
 * emu_runtime.cpp). */
#ifndef MFSDP_EMU_NCCL_H
#define MFSDP_EMU_NCCL_H

#include <stddef.h>

#include "cuda_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct emu_comm* ncclComm_t;
typedef struct {
  char internal[128];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7
} ncclResult_t;

typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclMaxRedOp = 0x7fffffff } ncclRedOp_t;
typedef enum { ncclScalarDevice = 0, ncclScalarHostImmediate = 1 } ncclScalarResidence_t;

#define NCCL_MAJOR 2
#define NCCL_MINOR 99
#define NCCL_PATCH 0
#define NCCL_VERSION_CODE (NCCL_MAJOR * 10000 + NCCL_MINOR * 100 + NCCL_PATCH)

typedef struct {
  int blocking; /* 0: calls never block; they return ncclInProgress and finish in the background */
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER {1}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id);
ncclResult_t ncclGetVersion(int* version);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* error);
const char* ncclGetErrorString(ncclResult_t r);
const char* ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t dtype,
                                      ncclScalarResidence_t residence, ncclComm_t comm);
ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t dtype, ncclComm_t comm,
                           cudaStream_t s);
ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t dtype, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t dtype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm, cudaStream_t s);

/* Emulator control: collectives queued so far on all communicators (tests count them). */
long emu_nccl_collectives(void);
/* ... of which launched together by an ncclGroupEnd of more than one collective. */
long emu_nccl_grouped_collectives(void);
/* ... and pre-multiplied reductions, and custom operators not destroyed yet. */
long emu_nccl_premul_reductions(void);
int emu_nccl_live_ops(void);
/* Communicators destroyed (ncclCommDestroy) and aborted (ncclCommAbort) so far. */
long emu_nccl_destroys(void);
long emu_nccl_aborts(void);

#ifdef __cplusplus
}
#endif
#endif
