"""The engine's element types for parameters and payloads ([Note: opaque parameter dtypes])."""
from __future__ import annotations

import torch

from . import _C

__all__ = ["engine_dtype", "opaque_dtype"]

# [Note: opaque parameter dtypes]
# A frozen parameter of a dtype the engine has no code for (float8_e4m3fn, complex, uint16, ...)
# is carried as the opaque integer type of its element size: its buckets are never cast or
# reduced, only copied and gathered (csrc/core/mfsdp_dtype.h), so its bits travel unchanged.
# Tensors going into the engine are viewed as that type, and the engine's memory is viewed back
# as the parameter's dtype wherever a compute parameter or a DTensor shard is made of it. An
# extension parameter's payloads (_extensions.py) always travel so, whatever their dtype.
_OPAQUE_BY_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def opaque_dtype(dtype: torch.dtype) -> torch.dtype:
    """The opaque integer type of `dtype`'s element size."""
    size = torch.empty((), dtype=dtype).element_size()
    if size not in _OPAQUE_BY_SIZE:
        raise TypeError(f"parameters of dtype {dtype} ({size}-byte elements) cannot be sharded by megatron_fsdp_c")
    return _OPAQUE_BY_SIZE[size]


def engine_dtype(dtype: torch.dtype) -> torch.dtype:
    """The engine's element type for parameters of `dtype`: itself where the engine has code for it,
    else its opaque type."""
    return dtype if dtype in _C.DTYPE_CODES else opaque_dtype(dtype)
