"""The torch releases megatron_fsdp_c supports, checked at import, and what differs between them.
A leaf: it imports only torch (tests/test_structure.py checks).

[Note: supported torch versions]
megatron_fsdp_c supports torch 2.11 through 2.15 (pyproject.toml's dependency says the same), and
CI tests both ends (.ci/run: make test on the pinned torch, then tests/compat/run.sh on 2.11 and
2.15). Below the range the package refuses to import, naming the range; above it, it warns once:
a newer torch may add FSDPModule methods or change FSDP2 semantics the per-module drop-in has
not learnt (fully_shard itself refuses a torch whose FSDPModule has public methods ours does not
override, see [Note: torch's FSDPModule] in per_module/_module.py).
What differs inside the range is probed here once, by feature where torch has one to probe, by
version where only the meaning changed, and each difference is used where its comment says:
- UntypedStorage._swap_data_ptr_ (2.12+): [Note: local shards keep their storage] in _common.py.
- MixedPrecisionPolicy(reduce_dtype=None) reduces in the parameter's gradient dtype from 2.15, in
  param_dtype before: [Note: reduce dtype by torch version] in per_module/_policy.py.
- FSDPModule's public methods, and the fully_shard arguments of each release (dp_mesh_dims from
  2.12, param_dtype_override_fn from 2.15): ours implement all of them on every release in the
  range, so a script written for 2.15 runs on 2.11 where our engine does the work itself.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Optional, Tuple, Union

import torch

__all__ = ["DataParallelMeshDims", "OLDEST", "NEWEST", "SUPPORTED", "STORAGE_SWAP", "TORCH",
           "REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE", "check_torch_version", "parse_version"]

OLDEST, NEWEST = (2, 11), (2, 15)
SUPPORTED = "torch>=2.11,<2.16"  # pyproject.toml's dependency, as pip takes it


def parse_version(version: str) -> tuple:
    """(major, minor) of a torch version string: '2.11.0+cu130' -> (2, 11), '2.16.0.dev20261101' -> (2, 16)."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if m is None:
        raise ImportError(f"megatron_fsdp_c cannot read the torch version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(version: str) -> tuple:
    """(major, minor) of `version` when megatron_fsdp_c supports it; an ImportError naming the range
    below it, a warning above it ([Note: supported torch versions])."""
    v = parse_version(version)
    span = f"{OLDEST[0]}.{OLDEST[1]} through {NEWEST[0]}.{NEWEST[1]}"
    if v < OLDEST:
        raise ImportError(f"megatron_fsdp_c supports torch {span}, but this is torch {version}. Install a supported "
                          f"torch first: pip install '{SUPPORTED}'")
    if v > NEWEST:
        warnings.warn(f"megatron_fsdp_c is tested with torch {span}; this is torch {version}, which may change what "
                      "the per-module API mirrors of FSDP2", RuntimeWarning, stacklevel=3)
    return v


TORCH = check_torch_version(torch.__version__)

# [Note: local shards keep their storage] needs torch to swap two storages' memory (2.12+).
STORAGE_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

# torch 2.15: MixedPrecisionPolicy(reduce_dtype=None) follows the parameter's grad dtype, not param_dtype.
REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE = TORCH >= (2, 15)


try:  # torch 2.12+: fully_shard(dp_mesh_dims=...)'s argument
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch 2.11: the same class, for our fully_shard, which implements dp_mesh_dims itself
    @dataclasses.dataclass
    class DataParallelMeshDims:
        """Which dims of a full SPMD DeviceMesh are data-parallel (torch 2.12's class, which torch 2.11
        lacks): `shard` dims are flattened into one shard dim, `replicate` dims into one replicate dim."""
        shard: Optional[Union[str, Tuple[str, ...]]] = None
        replicate: Optional[Union[str, Tuple[str, ...]]] = None

        def __post_init__(self):
            if self.shard is None and self.replicate is None:
                raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

        @property
        def shard_names(self) -> Tuple[str, ...]:
            return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

        @property
        def replicate_names(self) -> Tuple[str, ...]:
            return () if self.replicate is None else (self.replicate,) if isinstance(self.replicate, str) \
                else tuple(self.replicate)
