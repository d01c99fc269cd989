# The surface of the C extension megatron_fsdp_c._C (csrc/python/*.c), for readers and type
# checkers. Signatures follow the PyArg_Parse* formats and kwlists; docstrings follow the C doc
# strings. A name whose docstring starts "CUDA build only" exists only when the extension was
# built with CUDA (MFSDP_WITH_CUDA). tests/test_engine_stub.py checks this file against the
# built module and the C sources: add a name here when you add it there.
import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeAlias

import torch
from torch.distributed import ProcessGroup

# One parameter for plan(): (numel, row, dtype_code, unit, requires_grad, replicated[, outer[, role]]).
_PlanEntry: TypeAlias = (tuple[int, int, int, int, int, int] | tuple[int, int, int, int, int, int, int]
                         | tuple[int, int, int, int, int, int, int, int])
_Transport: TypeAlias = TorchTransport | NcclTransport

# ------------------------------------------------------------------------------------------------
# glue.c

class EngineError(RuntimeError):
    """A failure inside the C engine; the message names the C file and line."""

DTYPE_CODES: dict[torch.dtype, int]
"""torch.dtype -> the engine's dtype code: float32, bfloat16, float16, float64, uint8, int8, int16,
int32, int64, bool (0-9)."""

# ------------------------------------------------------------------------------------------------
# plan.c

def plan(
    params: Sequence[_PlanEntry],
    shard_world: int,
    rank: int,
    bucket_cap: int,
    align_bytes: int,
    flag_tail: int = 0,
    tail_align: int = 0,
    /,
) -> list[dict[str, Any]]:
    """Groups parameters into buckets and lays each out (csrc/core/mfsdp_layout.h); one dict per
    bucket (key, role, item indices, both layouts, `local` rows, flag tail). A bucket holds one
    role only (0: ordinary parameters). The plan is validated."""

# ------------------------------------------------------------------------------------------------
# kernels.c: CPU kernels on CPU tensors (either build), CUDA kernels on torch's current stream

def copy_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0, /) -> None:
    """dst = alpha * src, cast once (CPU kernel)."""

def accumulate_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0, /) -> None:
    """dst += alpha * src in the wider type, rounded once (CPU kernel)."""

def scale_(x: torch.Tensor, alpha: float, /) -> None:
    """x *= alpha (CPU kernel)."""

def count_nonfinite(x: torch.Tensor, /) -> int:
    """Number of NaN/Inf elements (CPU kernel)."""

def quantize_(wire: torch.Tensor, src: torch.Tensor, mode: int, block: int, /) -> None:
    """src into one piece of the quantized wire format (uint8 wire; either device). CUDA tensors
    need the CUDA build (ValueError in a CPU build)."""

def dequantize_(
    dst: torch.Tensor, wire: torch.Tensor, mode: int, block: int, alpha: float = 1.0, accumulate: bool = False, /
) -> None:
    """One piece of the quantized wire back into dst (either device). CUDA tensors need the CUDA
    build (ValueError in a CPU build)."""

def cuda_copy_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0, /) -> None:
    """CUDA build only: the CUDA cast-copy kernel."""

def cuda_accumulate_(dst: torch.Tensor, src: torch.Tensor, alpha: float = 1.0, /) -> None:
    """CUDA build only: the CUDA accumulate kernel."""

def cuda_scale_(x: torch.Tensor, alpha: float, /) -> None:
    """CUDA build only: x *= alpha, the CUDA scale kernel."""

def cuda_pack_(
    dst: torch.Tensor, srcs: Sequence[torch.Tensor], offsets: Sequence[int], alpha: float = 1.0,
    accumulate: bool = False, /
) -> None:
    """CUDA build only: the one-launch bucket pack, dst[offsets[i]:][:srcs[i].numel()] = alpha *
    srcs[i] (or +=)."""

# ------------------------------------------------------------------------------------------------
# optim.c ([Note: fused Adam] in csrc/core/mfsdp_adam.h)

def adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor] | None,
    steps: Sequence[torch.Tensor],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled: bool,
    threads: int,
    computes: Sequence[torch.Tensor | None] | None = None,
    recheck: bool = False,
    /,
) -> None:
    """adam_step_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, beta1, beta2, eps,
    weight_decay, amsgrad, maximize, decoupled, threads, computes=None, recheck=False): one fused
    Adam/AdamW step of a parameter group in place ([Note: fused Adam] in csrc/core/mfsdp_adam.h);
    steps[i] is tensor i's count (state["step"], a one-element float tensor), advanced by one when the
    step succeeded. recheck: raise if a tensor's memory was freed or replaced while the step ran
    without the GIL ([Note: memory under the step] in csrc/python/optim.c)."""

def adam_isa() -> str:
    """adam_isa() -> the fused Adam's SIMD path: avx512, avx2 or portable."""

# ------------------------------------------------------------------------------------------------
# host_heap.c ([Note: host heap trim])

def keep_host_heap() -> int:
    """1: glibc keeps freed blocks up to 32 MiB for reuse (process-wide, once; -1: not glibc).
    Pair it with trim_host_heap."""

def trim_host_heap(bound: int, /) -> int:
    """Resident bytes given back to the OS: trims the heap once resident memory grew by more than
    bound since the last trim (0: not yet, -1: not glibc/Linux)."""

# ------------------------------------------------------------------------------------------------
# fault_trace.c ([Note: native fault trace])

def native_fault_trace() -> int:
    """1: on a fatal signal the faulting thread's native stack goes to stderr, then the handlers
    installed before this call run (faulthandler's: enable it first); process-wide, once (-1: not
    glibc)."""

# ------------------------------------------------------------------------------------------------
# torch_transport.c

class TorchTransport:
    """Collectives through torch.distributed (any backend; gloo on CPU), called from C, with one
    process group for all-gathers and one for reductions over the same ranks."""

    def __init__(
        self,
        all_gather_group: ProcessGroup,
        reduce_group: ProcessGroup,
        device: int = -1,
        timeout: datetime.timedelta | None = None,
        alias_safe_reduce: bool = False,
    ) -> None:
        """timeout: waiting for a collective raises after it (None: the group's), on host buffers
        (device -1) only. alias_safe_reduce: reduce-scatter into a copy (torch's threaded group)."""

# ------------------------------------------------------------------------------------------------
# nccl_transport_type.c

class NcclTransport:
    """CUDA build only: our own NCCL communicators (one for all-gathers, one for reductions) and
    streams."""

    def __init__(
        self, gather_id: bytes, reduce_id: bytes, rank: int, world: int, device: int, timeout: float | None = None
    ) -> None:
        """The ids come from nccl_unique_id() on rank 0, broadcast to all ranks. timeout: seconds
        after which an unfinished collective aborts the communicators and raises (None: never)."""

    def close(self) -> None:
        """Collective: every rank calls it at the same point; waits for every rank, then destroys
        the communicators. Raises if a peer never closes or the transport had failed."""

    @property
    def failure(self) -> str | None:
        """Why the transport stopped (timeout, NCCL error), or None."""

def nccl_unique_id() -> bytes:
    """CUDA build only: a new NCCL unique id."""

def nccl_version() -> tuple[int, int, int]:
    """CUDA build only: (major, minor, patch) of the libnccl this process loaded (ncclGetVersion)."""

NCCL_BUILD_VERSION: tuple[int, int, int]
"""CUDA build only: (major, minor, patch) of the nccl.h this build compiled against."""

# ------------------------------------------------------------------------------------------------
# bucket_spec.c

def quant_wire_bytes(mode: int, n: int, block: int, /) -> int:
    """Bytes of one rank's piece of n elements on a quantized wire ([Note: quantized wire format]
    in csrc/core/mfsdp_quant.h); mode is a QUANT_MODES code."""

QUANT_MODES: dict[str, int]
"""Quantized wire mode name -> code: int8, fp8_e4m3, int4."""
QUANT_DEFAULT_BLOCK: int
"""Elements per quantization block when a spec's wire_block is 0."""
FLAG_TAIL: int
"""Elements per item of a bucket's flag tail (MFSDP_FLAG_TAIL): the planner's flag_tail."""

# A bucket spec's grad_mode (csrc/comm/mfsdp_pipeline.h).
GRAD_NONE: int  # frozen bucket: no gradient memory at all
GRAD_ALL_REDUCE: int  # no_shard, replicated: all-reduce once per step
GRAD_SCATTER_IN_PLACE: int  # ZeRO-1: reduce-scatter the local sum once per step
GRAD_SCATTER_ACCUMULATE: int  # ZeRO-2/3: reduce-scatter every backward, += shard

# Buffer kinds for Engine.tensor and Engine.local_piece (each described in mfsdp_pipeline.h).
BUF_WEIGHT: int
BUF_GATHER: int
BUF_WEIGHT_SHARD: int
BUF_MAIN_SHARD: int
BUF_GRAD: int
BUF_GRAD_SLICE: int
BUF_GRAD_SHARD: int
BUF_OPT_GRAD: int
BUF_COMM: int
BUF_COMM_SLICE: int
BUF_EXCHANGE: int
BUF_WEIGHT_SUB: int
BUF_GRAD_SUB: int
BUF_GATHER_WIRE: int
BUF_GATHER_WIRE_SHARD: int
BUF_GRAD_WIRE: int
BUF_OUTER_WIRE: int
BUF_OUTER_WIRE_SUB: int
BUF_FLAGS: int

# ------------------------------------------------------------------------------------------------
# engine.c ([Note: engine calls]: which methods may run while another call is in flight)

class Engine:
    """One collective pipeline over the given bucket specs (csrc/comm/mfsdp_pipeline.h). On a
    CUDA device (CUDA build only) it launches on torch's current stream."""

    def __init__(
        self,
        buckets: Sequence[Mapping[str, Any]],
        dp_world: int,
        dp_rank: int,
        grad_prescale: float,
        reduce_op: Literal["sum", "avg"],
        reduce_queue_bytes: int,
        device: torch.device,
        transport: _Transport,
        force_comm: bool = False,
        outer_transport: _Transport | None = None,
        outer_world: int = 1,
        outer_sharded: bool = False,
        pin_host: bool = False,
    ) -> None:
        """device: torch.device of every buffer (a CUDA device needs the CUDA build); transport
        over the data-parallel ranks; outer_*: hybrid sharding across replicas (HFSDP: sharded);
        pin_host: a CUDA engine's host buffers of offloaded buckets (a spec's "offload") are pinned
        ([Note: offloaded buckets] in csrc/comm/buffers.c)."""

    # loading parameters
    def init_begin(self, bucket: int, direct: bool = False, /) -> None:
        """Start loading parameters (direct: write only this rank's rows)."""
    def set_item(self, bucket: int, item: int, tensor: torch.Tensor, /) -> None:
        """Copy a parameter's values into the bucket."""
    def set_local(self, bucket: int, item: int, tensor: torch.Tensor, /) -> None:
        """This rank's rows of a parameter (direct initialisation)."""
    def init_end(self, bucket: int, /) -> None:
        """Derive shard and main weights, release temporaries."""

    # per-bucket settings
    def set_hold(self, buckets: Sequence[int], hold: bool, /) -> None:
        """ZeRO-2/3 buckets on hold accumulate local gradients and do not reduce."""
    def set_outer_hold(self, buckets: Sequence[int], hold: bool, /) -> None:
        """Skip the all-reduce across replicas (hybrid sharding) for these buckets."""
    def set_prescale(self, buckets: Sequence[int], factor: float, /) -> None:
        """Gradients of these buckets are multiplied by factor before the sum."""
    def set_trainable(self, bucket: int, items: Sequence[int], trainable: bool, /) -> None:
        """Which items train (the first creates the bucket's gradient buffers)."""
    def release_grads(self, buckets: Sequence[int], /) -> None:
        """Free the gradient buffers of buckets none of whose items trains."""
    def set_keep_weights(self, buckets: Sequence[int], keep: bool, /) -> None:
        """ZeRO-3 buckets keep their full weights' memory when resharded (stale)."""
    def set_reduce_order(self, buckets: Sequence[int], /) -> None:
        """The order every rank launches gradient reductions in (a permutation)."""
    def set_comm_dtype(self, dtype: torch.dtype | None, /) -> None:
        """Communicate gradients in `dtype` (None: the main gradient dtype)."""

    # weights
    def unshard(self, buckets: Sequence[int], /) -> None:
        """Start all-gathers of the full weights."""
    def wait_unshard(self, buckets: Sequence[int], /) -> None:
        """Full weights usable after this."""
    def reshard(self, buckets: Sequence[int], /) -> None:
        """Release full weights (ZeRO-3 buckets)."""
    def install_main_weights(self, include_frozen: bool = False, /) -> None:
        """Main -> compute weights; full weights become stale."""

    # gradients
    def begin_backward(self, sync: bool, /) -> None:
        """A backward pass starts."""
    def grad_ready(self, bucket: int, item: int, grad: torch.Tensor, /) -> None:
        """One parameter's gradient of this backward."""
    def seal(self, buckets: Sequence[int], /) -> None:
        """These buckets get no more gradients in this backward (their unit did not run here)."""
    def end_backward(self) -> None:
        """Flush and finish this backward's reductions."""
    def sync_grads(self) -> None:
        """Reduce pending no_shard/ZeRO-1 gradients once, finish all reductions, fill OPT_GRAD."""
    def finish_grads(self, bucket: int, /) -> bool:
        """True when the bucket's optimizer gradient of this syncing backward is final and the host's
        to read before sync_grads ([Note: a bucket's gradients before the sync] in csrc/comm/backward.c)."""
    def wait_grads(self, bucket: int, /) -> None:
        """Wait until what finish_grads made final has landed in host memory (an offloaded bucket on a
        GPU; at once otherwise). Callable from another thread while the engine runs; lets go of the GIL."""
    def zero_grads(self) -> None:
        """Zero the main gradient buffers."""
    def zero_item_grads(self, bucket: int, items: Sequence[int], /) -> None:
        """Zero the main gradients of some items of a bucket."""
    def drain(self) -> None:
        """Finish every in-flight collective."""

    # reading state (const accessors)
    def tensor(self, bucket: int, kind: int, /) -> torch.Tensor | None:
        """The buffer's torch tensor (kind: a BUF_* code), or None."""
    def local_piece(self, bucket: int, item: int, kind: int, /) -> tuple[int, int, int]:
        """(buffer kind, offset, n): where this rank's rows of the item live."""
    def weight_state(self, bucket: int, /) -> Literal["empty", "gathering", "ready", "stale"]:
        """The bucket's weight state."""
    def grad_state(self, bucket: int, /) -> Literal["clean", "dirty", "reducing", "reduced"]:
        """The bucket's gradient state."""
    def stats(self, bucket: int = -1, /) -> dict[str, int]:
        """Collective counts and bytes ("<kind>s", "<kind>_bytes"); bucket -1: the total."""
    def read_flags(self, bucket: int, /) -> tuple[bytes, bytes] | None:
        """(used, split), decoded: used[i] 1 where some rank used item i since its gradient was
        last zeroed, split[i] 1 where ranks disagreed on whether it trains ([Note: used-flag
        tail]); None: the bucket carries none. One synchronous copy to the host."""
    def count_nonfinite_grad(self, bucket: int, item: int, /) -> int:
        """NaN/Inf count in this rank's main gradient of the item."""
    @property
    def broken(self) -> str | None:
        """Text of the collective failure that stopped the engine, or None."""
    @property
    def num_buckets(self) -> int:
        """Number of buckets."""

    def close(self) -> None:
        """Free every buffer now."""
