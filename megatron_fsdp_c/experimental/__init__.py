"""megatron_fsdp_c.experimental: Megatron-FSDP v2's per-module `fully_shard`, a drop-in for torch's
FSDP2 `torch.distributed.fsdp.fully_shard` on megatron_fsdp_c's C engine (see _fully_shard.py)."""
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle"]
