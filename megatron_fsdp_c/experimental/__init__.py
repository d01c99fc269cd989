"""megatron_fsdp_c.experimental: Megatron-FSDP v2's per-module `fully_shard`, a drop-in for torch's
FSDP2 `torch.distributed.fsdp.fully_shard` on megatron_fsdp_c's C engine (see _fully_shard.py).
Its FSDPModule and UnshardHandle subclass torch's (see _module.py)."""
from ._fully_shard import fully_shard
from ._module import FSDPModule, UnshardHandle
from ._torch_state import register_fsdp_forward_method

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]
