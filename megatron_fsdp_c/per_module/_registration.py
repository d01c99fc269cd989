"""Which parameters each per-module group's modules hold, as FSDP2 registers them
([Note: per-group registration]): the Registration a RootState (_root.py) owns, and the state-dict
pre-hook that fully_shard puts on each sharded module.
"""
from __future__ import annotations

from typing import Dict, List

import torch.nn as nn

from ._group import ShardGroup

__all__ = ["Registration", "to_sharded_hook"]


class Registration:
    """What one engine's groups' modules hold: complete when made, from the records of each group
    (by unit index) and the SPMD compute parameters ([Note: SPMD compute parameters] in _root.py),
    with every group's sharded parameters registered (fully_shard left them so)."""

    def __init__(self, unit_records: List[list], spmd_params: Dict[int, nn.Parameter]):
        self.unit_records = unit_records  # the records of each unit
        self.spmd_params = spmd_params  # record index -> its DTensor compute parameter
        self.unsharded = [False] * len(unit_records)  # per unit: its compute parameters are registered

    def register(self, u: int, unsharded: bool) -> None:
        """[Note: per-group registration]
        As FSDP2 does, each group's modules hold its compute (unsharded) parameters only while
        the group is gathered for its compute, and its sharded DTensor parameters otherwise:
        the compute ones from the group's pre-forward (and pre-backward, and an explicit
        unshard()) on, the sharded ones again when the group reshards -- after its forward if
        reshard_after_forward, after its backward if reshard_after_backward, at reshard(), and
        when a state dict is taken or loaded (FSDP2's state-dict pre-hooks; the gathered
        weights stay, the group's next pre-backward registers the compute ones again). So a
        forward without its backward leaves the resharding groups' DTensors on the modules (a
        released compute parameter is never left registered), and a group that keeps its
        weights (reshard_after_forward=False) holds plain tensors until it reshards, as under
        FSDP2. The same applies to groups whose weights persist (ZeRO-1/2, one rank): they
        reshard by the same flags, without releasing anything. Gradients do not depend on it:
        autograd keeps the compute parameters it used, and the gradient hooks are on them."""
        if self.unsharded[u] == unsharded:
            return
        self.unsharded[u] = unsharded
        for r in self.unit_records[u]:
            p = r.param if unsharded else r.dist_param
            sp = self.spmd_params.get(r.index) if unsharded else None
            if sp is not None:  # [Note: SPMD compute parameters]
                if sp._local_tensor.data_ptr() != r.param.data_ptr():
                    sp._local_tensor = r.param.detach()  # the compute parameter was pointed elsewhere
                p = sp
            for mod, attr in r.places:
                mod._parameters[attr] = p

    def register_all(self, unsharded: bool) -> None:
        for u in range(len(self.unsharded)):
            self.register(u, unsharded)


def to_sharded_hook(group: ShardGroup, *args, **kwargs) -> None:
    """The state-dict (save and load) pre-hook fully_shard puts on each module holding a
    parameter of `group`: its sharded parameters are registered, so a state dict taken or
    loaded between a forward and its backward sees the DTensors ([Note: per-group
    registration]; FSDP2's to_sharded_hook)."""
    if group.owner is not None:
        group.owner.registration.register(group.unit_state.index, False)
