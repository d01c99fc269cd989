"""fully_shard per module (Megatron-FSDP v2's second API), a drop-in for torch's FSDP2 on the C engine.

[Note: per-module groups]
Each fully_shard call forms one group: the parameters of its module(s) that are not already in
the group of a submodule (fully_shard is applied bottom-up, as with FSDP2). The call turns them
into DTensor parameters at once -- torch's Shard(0) rows (Shard(d) where shard_placement_fn
says so), or Replicate() for no_shard groups,
fsdp_no_shard marks and 0-d parameters -- so an optimizer built afterwards holds them, and it
swaps the module's class to FSDP<Class>. Nothing is communicated yet. A tensor-parallel parameter
(a DTensor from parallelize_module on another dim of the same mesh) is sharded the same way,
its TP shard standing for the whole ([Note: tensor parallelism] in ../_tensor_parallel.py).

At the first forward of a group with no sharded ancestor, the root, one engine is built for
every group under it on each mesh (a lazy init, as FSDP2 does; [Note: a mesh per group] in
_root.py). The groups become the engine's units, in module order, each with its own strategy and mixed precision. The DTensor parameters keep
their identity and their local tensors are re-pointed at the engine's buffers (FSDP2 re-points
its own after lazy init), so an optimizer made before the first forward keeps working. From then
on a step runs exactly as under fully_shard_model: the same hooks and shared collective orders
(see [Note: gather order] in ../_hooks.py), buckets, kernels and transports.

The user's optimizer steps the DTensor parameters directly, so the engine notices the update at
the next forward (the optimizer's step or the parameters' version counters, [Note: stepped
parameters] in _stepped.py) and refreshes what it keeps gathered (ZeRO-1/2 full weights, a group
that does not reshard, a cast compute copy).

This module is the entry point (fully_shard); a group's formation and DTensor conversion are in
_group.py, the root state (lazy init, the forward hooks) in _root.py, the policy checks and casts
in _policy.py, the module methods (FSDPModule, UnshardHandle) in _module.py, and what torch's own
code finds on a sharded module (its state key, register_fsdp_forward_method) in _torch_state.py.
"""
from __future__ import annotations

import functools
from typing import Iterable, List, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .._common import ShardingStrategy, parse_strategy
from ..no_shard import mark_by_name
from ._group import form_group
from ._mesh import dp_mesh_of, post_forward_world
from ._module import FSDPModule, fsdp_class, missing_overrides
from ._policy import check_policies, check_quant_policy
from ._root import post_forward, pre_forward, to_sharded_hook
from ._torch_state import register_torch_state

__all__ = ["fully_shard"]


def fully_shard(module: Union[nn.Module, List[nn.Module]], *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: Union[bool, int, None] = None, shard_placement_fn=None, mp_policy=None,
                offload_policy=None, ignored_params: Optional[Iterable[nn.Parameter]] = None, dp_mesh_dims=None,
                zero_dp_strategy: Union[int, str] = "optim_grads_params", quantized_comm_policy=None):
    """Shards `module` (or a list of modules, one group) the way torch's FSDP2 fully_shard does
    (apply it bottom-up: blocks first, then the root), on megatron_fsdp_c's C engine. Returns the
    module, whose class becomes FSDP<Class> in place, a subclass of torch's FSDPModule (see [Note:
    per-module groups] and [Note: torch's FSDPModule] in _module.py). torch 2.13's signature:

    reshard_after_forward: None (FSDP2's default) is True for every module but the root (the
    outermost sharded module, whose first forward builds the engine), False there; True/False set it. An int n (FSDP2: keep the
    weights sharded over groups of n ranks after forward, gather over them in backward) must
    divide the shard group's size, as in torch; 1 is False and the group's size is True, as in
    torch, and any other n behaves as True (see [Note: reshard to a smaller world] in _mesh.py). dp_mesh_dims (torch's DataParallelMeshDims): `mesh` is a
    full SPMD mesh and these name its data-parallel dims (shard dims are flattened into one,
    replicate dims into another: HSDP with both, a replicated group with replicate dims only);
    parameters may be DTensors replicated over it. Other dims of size > 1 (tensor parallelism)
    raise NotImplementedError in this form. Tensor parallelism composes as in torchtitan:
    parallelize_module(model, mesh["tp"], plan), then fully_shard(block, mesh=mesh["dp"]) (HSDP:
    mesh["dp_replicate", "dp_shard"]); the parameters become DTensors on the (dp..., tp) mesh
    placed as FSDP2 places them ([Note: tensor parallelism] in ../_tensor_parallel.py).
    mp_policy takes torch's MixedPrecisionPolicy (param_dtype, reduce_dtype, output_dtype,
    cast_forward_inputs) or megatron_fsdp_c's. shard_placement_fn may return None or Shard(dim) for
    any dim of the parameter, as FSDP2 checks it (a negative dim counts from the last; a dim other
    than 0 must split evenly over the shard group: NotImplementedError otherwise; a tensor-parallel
    parameter takes dim 0 only), laid out as [Note: chunked layout] in csrc/core/mfsdp_layout.h
    says, with one all-gather and one reduce-scatter per bucket as for Shard(0). offload_policy
    takes torch's OffloadPolicy() and CPUOffloadPolicy() on CPU and GPU meshes (pin_memory=True on a
    GPU: [Note: CPU offload] in _policy.py).

    Beyond torch's arguments: zero_dp_strategy (default "optim_grads_params") gives the group
    Megatron-FSDP's strategies: "no_shard" (0), "optim" (1), "optim_grads" (2); and
    quantized_comm_policy (a megatron_fsdp_c.QuantizedCommPolicy) gathers the group's weights and/or
    reduces its gradients as block-quantized pieces ([Note: quantized communication] in
    csrc/comm/wire.c)."""
    unknown = missing_overrides()
    if unknown:  # a torch past the supported range ([Note: supported torch versions] in ../_torch_compat.py)
        raise NotImplementedError(
            f"torch {torch.__version__}'s FSDPModule has methods megatron_fsdp_c's per-module API does not implement "
            f"yet: {unknown}. Frameworks that call them would reach torch's FSDP internals, which our modules do not "
            "have. Use a torch from 2.11 to 2.15")
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError("fully_shard expects an nn.Module or a non-empty list of nn.Modules")
    for m in modules:
        if isinstance(m, FSDPModule) or getattr(m, "_mfsdp_group", None) is not None:
            raise RuntimeError(f"fully_shard was already applied to this {type(m).__name__}: apply it once per module, "
                               "bottom-up (blocks first, then their parent)")
        if getattr(m, "_megatron_fsdp_wrapper", None) is not None:
            raise RuntimeError(f"this {type(m).__name__} is already sharded by megatron_fsdp_c.fully_shard (the "
                               "Megatron-FSDP API); use one API per model")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(f"reshard_after_forward should be a bool or an int representing the group size to reshard "
                         f"to, not {reshard_after_forward!r}")
    if mp_policy is None:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        mp_policy = TorchPolicy()
    check_policies(mp_policy, offload_policy, shard_placement_fn)
    check_quant_policy(quantized_comm_policy, mp_policy)
    strategy = parse_strategy(zero_dp_strategy)
    spmd_mesh = None
    if dp_mesh_dims is not None:
        spmd_mesh = mesh
        mesh, replicate_only = dp_mesh_of(mesh, dp_mesh_dims)
        if replicate_only:
            strategy = ShardingStrategy.NO_SHARD  # replicate dims alone: torch's DDP-like group
    ignored = set(ignored_params or ())
    for m in modules:
        mark_by_name(m)
    if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
        reshard_after_forward = post_forward_world(reshard_after_forward, mesh)
    group = form_group(modules, mesh, strategy, mp_policy, reshard_after_forward, ignored, shard_placement_fn,
                       spmd_mesh, quantized_comm_policy, offload_policy)
    register_torch_state(group)
    for m in group.modules:
        m.__class__ = fsdp_class(type(m))
        m.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
        m.register_forward_hook(post_forward, prepend=False)
    hook = functools.partial(to_sharded_hook, group)
    for m in {id(mod): mod for mod, _, _ in group.places}.values():
        m.register_state_dict_pre_hook(hook)
        m._register_load_state_dict_pre_hook(hook)
    return module
