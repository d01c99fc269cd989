"""Native NCCL transport set-up: rank 0 makes the unique ids (one per communicator), every rank
gets them through torch.distributed, then joins both communicators in C (csrc/cuda/)."""
import torch
import torch.distributed as dist

from . import _C


def make_nccl_transport(group, rank: int, world: int, device: torch.device, timeout=None):
    if not hasattr(_C, "NcclTransport"):
        raise RuntimeError("transport='nccl' needs a CUDA build of megatron_fsdp_c (nvcc and the nvidia-nccl-cu13 "
                           "wheel at build time); this build is CPU-only: use transport='torch'")
    ids = [_C.nccl_unique_id(), _C.nccl_unique_id()] if rank == 0 else [None, None]
    dist.broadcast_object_list(ids, src=dist.get_global_rank(group, 0), group=group)
    seconds = None if timeout is None else timeout.total_seconds()
    return _C.NcclTransport(ids[0], ids[1], rank, world, device.index or 0, seconds)
