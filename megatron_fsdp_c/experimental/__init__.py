"""megatron_fsdp_c.experimental: the per-module API under Megatron-FSDP's import path
(`megatron_fsdp.experimental.fully_shard`), so code written for it finds ours by swapping the
package name. The API itself is megatron_fsdp_c.per_module: this module only re-exports it."""
from ..per_module import (DataParallelMeshDims, FSDPModule, GradientReductionHandle, UnshardHandle, fully_shard,
                          register_fsdp_forward_method)

__all__ = ["fully_shard", "DataParallelMeshDims", "FSDPModule", "GradientReductionHandle", "UnshardHandle",
           "register_fsdp_forward_method"]
