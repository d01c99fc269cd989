"""megatron_fsdp_c.per_module: Megatron-FSDP v2's per-module `fully_shard`, a drop-in for torch's
FSDP2 `torch.distributed.fsdp.fully_shard` on megatron_fsdp_c's C engine (see _fully_shard.py).
Its FSDPModule and UnshardHandle subclass torch's (see _module.py); DataParallelMeshDims is torch's
where torch has it (2.12+), else the same class of ours (_torch_compat.py)."""
from .._torch_compat import DataParallelMeshDims
from ._fully_shard import fully_shard
from ._module import FSDPModule, GradientReductionHandle, UnshardHandle
from ._torch_state import register_fsdp_forward_method

__all__ = ["fully_shard", "DataParallelMeshDims", "FSDPModule", "GradientReductionHandle", "UnshardHandle",
           "register_fsdp_forward_method"]
