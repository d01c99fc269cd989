"""The Megatron-style wrapper's state-dict hooks: a full tensor loaded into a sharded parameter
keeps this rank's rows, and a load installs the main weights (MegatronFSDP's constructor registers
them; checkpoint.py is the public save and load)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["register_model_hooks"]


def register_model_hooks(model) -> None:
    """State-dict hooks on the wrapped module (they run for model.state_dict() and for
    model.module.state_dict() alike)."""
    # every engine's records (the experts' too: [Note: expert data-parallel mesh] in _megatron_experts.py), each
    # with the data-parallel placement that shards it (a TP one may follow) on its engine's mesh
    records = [(r, o.dist_ctx.mesh.ndim - 1) for o in model.owners() for r in o.param_buffer.records]

    def before_load(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # A full (unsharded) tensor, e.g. from a plain model's checkpoint: keep this rank's rows
        # (of its TP shard, for a tensor-parallel parameter: [Note: tensor parallelism]).
        for r, shard_dim in records:
            for name in r.aliases:
                key = prefix + name
                value = state_dict.get(key)
                if value is None or isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                    continue
                if tuple(value.shape) != tuple(r.dist_param.shape):
                    continue  # load_state_dict reports the size mismatch
                local = r.dist_param.to_local()
                first, n = r.local
                full = value.detach() if r.tp is None else r.tp.local_of_full(value.detach())
                flat = full.reshape(-1)
                sharded = not isinstance(r.dist_param.placements[shard_dim], Replicate)
                rows = flat[first:first + n] if sharded else flat
                state_dict[key] = DTensor.from_local(rows.reshape(local.shape).to(local.dtype),
                                                     r.dist_param.device_mesh, r.dist_param.placements,
                                                     run_check=False, shape=r.shape, stride=r.dist_param.stride())

    def after_load(module, incompatible_keys):
        for o in model.owners():
            o.param_buffer.engine.install_main_weights(True)  # compute weights follow at once

    model.module._register_load_state_dict_pre_hook(before_load, with_module=True)
    model.module.register_load_state_dict_post_hook(after_load)
