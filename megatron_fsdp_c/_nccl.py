"""Native NCCL transport set-up: rank 0 makes the unique ids (one per communicator), every rank
gets them through torch.distributed, then joins both communicators in C (csrc/cuda/).

Two different libnccl.so.2 in one process break both (NCCL keeps process-wide state): the
extension links the library torch loads (setup.py), and this checks, before any communicator
exists, that the process holds one libnccl and that it is the version torch reports."""
import datetime

import torch
import torch.distributed as dist

from . import _C


def loaded_nccl_libraries() -> list:
    """Paths of every libnccl mapped into this process (from /proc/self/maps)."""
    paths = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)  # address perms offset device inode [path]
                if len(fields) == 6 and "/libnccl" in fields[5]:
                    paths.add(fields[5].strip())
    except OSError:
        return []
    return sorted(paths)


def divmod_version(code: int) -> tuple:
    """(major, minor, patch) of an NCCL version code (X * 10000 + Y * 100 + Z since 2.9)."""
    if code < 10000:
        return code // 1000, code % 1000 // 100, code % 100
    return code // 10000, code % 10000 // 100, code % 100


def check_one_nccl(ours=None, torchs=None, libraries=None) -> None:
    """Raises unless this process uses one libnccl, the one torch uses. The arguments exist
    for tests: (major, minor, patch) of ours and torch's, and the mapped libraries."""
    ours = _C.nccl_version() if ours is None else ours
    if torchs is None and torch.cuda.is_available():
        version = torch.cuda.nccl.version()
        torchs = tuple(version) if isinstance(version, tuple) else divmod_version(version)
    libraries = loaded_nccl_libraries() if libraries is None else libraries
    if len(libraries) > 1:
        raise RuntimeError(f"two NCCL libraries are loaded in this process: {', '.join(libraries)}; megatron_fsdp_c "
                           "must use the libnccl torch loads: rebuild it (pip install --no-build-isolation .) in the "
                           "environment that runs it")
    if torchs is not None and tuple(torchs) != tuple(ours):
        raise RuntimeError(f"megatron_fsdp_c runs NCCL {'.'.join(map(str, ours))} but torch runs "
                           f"{'.'.join(map(str, torchs))}: rebuild megatron_fsdp_c against torch's NCCL")


def make_nccl_transport(group, rank: int, world: int, device: torch.device, timeout: datetime.timedelta):
    if not hasattr(_C, "NcclTransport"):
        raise RuntimeError("transport='nccl' needs a CUDA build of megatron_fsdp_c (nvcc and NCCL at build time, see "
                           "docs/setup.md); this build is CPU-only: use transport='torch'")
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"transport='nccl' needs an indexed CUDA device, got {device}")
    check_one_nccl()
    ids = [_C.nccl_unique_id(), _C.nccl_unique_id()] if rank == 0 else [None, None]
    dist.broadcast_object_list(ids, src=dist.get_global_rank(group, 0), group=group)
    return _C.NcclTransport(ids[0], ids[1], rank, world, device.index, timeout.total_seconds())
