"""megatron_fsdp_c: Fully Sharded Data Parallel for PyTorch with a C engine.

A mirror of NVIDIA Megatron-FSDP's API (fully_shard, MixedPrecisionPolicy, the MegatronFSDP
wrapper) whose layout planner, kernels and collective pipeline are C (megatron_fsdp_c._C).
"""
# torch first: a CUDA build of _C needs the CUDA libraries torch loads (libnccl.so.2 is resolved
# by name, so torch's copy is the one _C binds to), and _C's module init imports torch anyway.
import torch  # noqa: F401

from . import _torch_compat  # noqa: F401 - first: an unsupported torch stops the import here, naming the range
from . import _C  # noqa: F401 - the engine, importable as megatron_fsdp_c._C
from .checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from ._common import ShardingStrategy
from .fused_adam import FusedAdam, FusedAdamW
from .hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from .fully_shard import close, fully_shard, fully_shard_model, fully_shard_optimizer
from .megatron_fsdp import MegatronFSDP
from .mixed_precision import MixedPrecisionPolicy, QuantizedCommPolicy
from .no_shard import fsdp_no_shard

__version__ = "0.1.0"

__all__ = [
    "FusedAdam",
    "FusedAdamW",
    "MegatronFSDP",
    "MixedPrecisionPolicy",
    "QuantizedCommPolicy",
    "ShardingStrategy",
    "close",
    "fully_shard",
    "fully_shard_model",
    "fully_shard_optimizer",
    "fsdp_no_shard",
    "save_checkpoint",
    "load_checkpoint",
    "full_state_dict",
    "save_hf_checkpoint",
    "load_hf_checkpoint",
]
