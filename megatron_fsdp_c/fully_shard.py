"""fully_shard, fully_shard_model and fully_shard_optimizer (Megatron-FSDP's entry points).

Differences from Megatron-FSDP, on purpose:
- the optimizer keeps the user's param groups and hyperparameters (Megatron-FSDP rebuilds one
  group from the defaults);
- strategy 3 without units is a clear error instead of a division by zero;
- the optimizer may be built on the original parameters: fully_shard remaps it.
"""
from __future__ import annotations

import importlib
from typing import Iterable, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from ._common import ShardingStrategy, parse_strategy
from ._distributed import make_dist_context, resolve_device
from ._megatron_experts import expert_context
from .optimizer import fully_shard_optimizer, remap_optimizer
from .megatron_fsdp import MegatronFSDP
from ._tensor_parallel import other_dims, tp_mesh_of
from .mixed_precision import MixedPrecisionPolicy, QuantizedCommPolicy

__all__ = ["close", "fully_shard", "fully_shard_model", "fully_shard_optimizer"]


def _parse_outer_strategy(value, strategy: ShardingStrategy, dp_outer_dim, hybrid_fsdp_group) -> ShardingStrategy:
    """Megatron-FSDP's checks on the hybrid sharding arguments."""
    if (dp_outer_dim is None) != (hybrid_fsdp_group is None):
        raise ValueError("hybrid_fsdp_group (a ProcessGroup over every data-parallel rank) is required exactly when "
                         "dp_outer_dim is given: pass both for hybrid sharding, or neither")
    outer = parse_strategy(value, (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM),
                           "outer_dp_sharding_strategy")
    if outer == ShardingStrategy.OPTIM and strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError("outer_dp_sharding_strategy='optim' (HFSDP) needs zero_dp_strategy='optim_grads_params' "
                         "(3) inside the replica")
    return outer


def _resolve_class(entry):
    if isinstance(entry, type):
        if not issubclass(entry, nn.Module):
            raise TypeError(f"fsdp_unit_modules entry {entry.__name__} is not an nn.Module subclass")
        return entry
    if isinstance(entry, str):
        module_name, _, cls_name = entry.rpartition(".")
        if not module_name:
            raise ValueError(f"fsdp_unit_modules entry {entry!r} must be a class or a dotted 'package.module.Class'")
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"fsdp_unit_modules entry {entry!r} cannot be imported: {e}") from e
        return _resolve_class(cls)
    raise TypeError(
        f"fsdp_unit_modules entries must be nn.Module classes or dotted strings, got {type(entry).__name__}"
    )


def find_units(module: nn.Module, classes: Sequence[type]) -> List[nn.Module]:
    """Outermost modules that are instances of `classes`, in module order."""
    units, inside = [], set()
    for sub in module.modules():
        if id(sub) in inside:
            continue
        if isinstance(sub, tuple(classes)):
            units.append(sub)
            inside.update(id(m) for m in sub.modules())
    for cls in classes:
        if not any(isinstance(u, cls) for u in units) and not any(isinstance(m, cls) for m in module.modules()):
            present = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(
                f"fsdp_unit_modules: no module of class {cls.__module__}.{cls.__qualname__} in the model; the model "
                f"contains: {', '.join(present)}"
            )
    return units


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _check_params(module: nn.Module, meta_device_init: bool = False, device=None) -> torch.device:
    devices = {}
    for name, p in module.named_parameters():
        if p.requires_grad and p.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise TypeError(
                f"parameter '{name}' has dtype {p.dtype} and requires grad: only float32/bfloat16/float16/float64 "
                "parameters can be trained (set requires_grad=False or convert the parameter)"
            )
        devices.setdefault(p.device, name)
    if not devices:
        raise ValueError("the module has no parameters to shard")
    if meta_device_init:
        target = resolve_device(device) if device is not None else _default_device()
        stray = [(d, n) for d, n in devices.items() if d.type != "meta" and d != target]
        if stray:
            raise ValueError(f"init_model_with_meta_device: parameter '{stray[0][1]}' is on {stray[0][0]}, not on the "
                             f"meta device or on {target}")
        return target
    if len(devices) > 1:
        (d1, n1), (d2, n2) = list(devices.items())[:2]
        hint = (" (meta parameters need init_model_with_meta_device=True)"
                if "meta" in (d1.type, d2.type) else "")
        raise ValueError(
            f"parameters are on different devices: '{n1}' on {d1} and '{n2}' on {d2}; move the model to one "
            f"device (model.to(device)) or pass device= to fully_shard{hint}"
        )
    device = next(iter(devices))
    if device.type == "meta":
        raise ValueError(
            "the parameters are on the meta device: pass init_model_with_meta_device=True to materialise them "
            "module by module, or initialise the model first"
        )
    return device


def fully_shard_model(
    module: nn.Module,
    device_mesh=None,
    dp_shard_dim: Optional[str] = None,
    fsdp_unit_modules: Optional[Iterable[Union[type, str]]] = None,
    zero_dp_strategy: Union[int, str] = 3,
    device: Optional[torch.device] = None,
    mixed_precision_policy: Optional[MixedPrecisionPolicy] = None,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    bucket_size: Optional[int] = None,
    reduce_queue_bytes: Optional[int] = None,
    transport: str = "auto",
    init_model_with_meta_device: bool = False,
    collective_timeout: Optional[float] = None,
    single_rank_collectives: bool = False,
    dp_outer_dim: Optional[str] = None,
    hybrid_fsdp_group=None,
    outer_dp_sharding_strategy: Union[int, str] = "no_shard",
    tp_dim: Optional[str] = None,
    quantized_comm_policy: Optional[QuantizedCommPolicy] = None,
    expt_device_mesh=None,
    hybrid_fsdp_expt_group=None,
    optimizer_cpu_offload: bool = False,
    optimizer_offload_fraction: float = 1.0,
    trains_later: Iterable[nn.Parameter] = (),
    **unsupported,
) -> MegatronFSDP:
    """Wraps `module` in a MegatronFSDP that shards it over the data-parallel ranks.

    fsdp_unit_modules: classes (or 'pkg.mod.Class' strings) whose instances are gathered and
    released as one unit; required for zero_dp_strategy 3 ('optim_grads_params', the default).
    device_mesh: None (all ranks), a 1-D DeviceMesh, an N-D mesh with dp_shard_dim, or a
    ProcessGroup. bucket_size: elements per bucket for parameters outside every unit.
    collective_timeout: seconds to wait for any collective of the engine before raising
    (a dead or stalled peer); None: the process group's own timeout.
    single_rank_collectives: on one rank, still release ZeRO-3 weights and issue every
    collective (a one-rank all-gather is a copy): tests a transport on a single GPU.
    dp_outer_dim, hybrid_fsdp_group, outer_dp_sharding_strategy: hybrid sharding (Megatron-FSDP's
    names): shard over device_mesh[dp_shard_dim], replicate over device_mesh[dp_outer_dim]
    ("no_shard": HSDP, gradients all-reduced across the replicas once per step; "optim": HFSDP,
    main weights, gradients and optimizer state sharded over every data-parallel rank, gradients
    reduce-scattered across the replicas and weights all-gathered across them once per step);
    hybrid_fsdp_group is the ProcessGroup of all data-parallel ranks, required exactly when
    dp_outer_dim is given.
    tp_dim: the tensor-parallel dim of device_mesh (Megatron-FSDP's name). Parameters may then be
    torch TP DTensors on device_mesh[tp_dim] (parallelize_module) or Megatron-core style local
    shards (plain parameters with tensor_model_parallel=True and partition_dim; the others are
    TP-duplicated, summed over tp in backward when flagged sequence_parallel=True); see [Note:
    tensor parallelism] in _tensor_parallel.py.
    quantized_comm_policy: a QuantizedCommPolicy: weights gathered and/or gradients reduced as
    block-quantized pieces (int8, fp8_e4m3, int4), and under HFSDP the gather across replicas
    (a megatron_fsdp_c extension; see [Note: quantized communication] in csrc/comm/wire.c).
    expt_device_mesh, hybrid_fsdp_expt_group: Megatron-FSDP's expert data-parallel mesh (MoE with
    expert parallelism). Expert parameters are those Megatron-core marks `allreduce=False` (or
    `is_expert=True`); they are sharded with zero_dp_strategy over expt_device_mesh[dp_shard_dim]
    (the ranks holding the same experts), with HSDP (dp_outer_dim) over expt_device_mesh's
    (dp_outer_dim, dp_shard_dim) with hybrid_fsdp_expt_group their group (required then, refused
    otherwise); dense parameters over device_mesh as usual. Expert gradients are scaled as in
    Megatron-LM: by 1/dp with dp the dense data-parallel size (they already hold every ep peer's
    tokens), expert_dp/dp with average_in_collective, 1 with calculate_per_token_loss. An expert
    mesh without marked parameters, or marked parameters without one, is an error; see [Note:
    expert data-parallel mesh] in _megatron_experts.py.
    optimizer_cpu_offload, optimizer_offload_fraction: Megatron-core's CPU offload of the
    optimizer (its OptimizerConfig names): main weights, main gradients and the optimizer's state
    live in host memory, and the optimizer steps there (megatron_fsdp_c.FusedAdamW is the fast
    one); the first buckets holding `optimizer_offload_fraction` of the parameters' elements are
    offloaded (to a bucket), the rest stay on the device; on a GPU the host buffers are pinned
    ([Note: offloaded buckets] in csrc/comm/buffers.c).
    trains_later: frozen parameters (requires_grad=False) that will train later, e.g. those an
    optimizer holds: their main weights are planned in the policy's dtype ([Note: changing
    requires_grad] in _trainable.py). fully_shard passes its optimizer's frozen parameters.
    """
    if unsupported:
        raise TypeError(f"fully_shard got unsupported arguments: {', '.join(sorted(unsupported))}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, MegatronFSDP) or getattr(module, "_megatron_fsdp_wrapper", None) is not None:
        raise RuntimeError(
            "fully_shard was already applied to this module; keep using the model it returned (calling it twice "
            "would shard the shards)"
        )
    strategy = parse_strategy(zero_dp_strategy)
    outer = _parse_outer_strategy(outer_dp_sharding_strategy, strategy, dp_outer_dim, hybrid_fsdp_group)
    policy = MixedPrecisionPolicy() if mixed_precision_policy is None else mixed_precision_policy
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mixed_precision_policy must be a megatron_fsdp_c.MixedPrecisionPolicy, got {type(policy).__name__}"
        )
    _check_quant_policy(quantized_comm_policy, policy, outer == ShardingStrategy.OPTIM)
    classes = [_resolve_class(c) for c in (fsdp_unit_modules or [])]
    if strategy == ShardingStrategy.OPTIM_GRADS_PARAMS and not classes:
        raise ValueError(
            "zero_dp_strategy='optim_grads_params' (3) needs fsdp_unit_modules: the classes gathered and released "
            "together, e.g. fsdp_unit_modules=[TransformerBlock]. Without units use zero_dp_strategy 'optim_grads' (2)"
        )
    offload_fraction = _offload_fraction(optimizer_cpu_offload, optimizer_offload_fraction)
    device = resolve_device(device)  # "cuda" means the current GPU, resolved once for every layer below
    if device is not None and not init_model_with_meta_device:
        module.to(device)
    param_device = _check_params(module, init_model_with_meta_device, device)
    units = find_units(module, classes)
    if disable_bucketing:
        bucket_size = None
    if collective_timeout is not None and not (isinstance(collective_timeout, (int, float)) and collective_timeout > 0):
        raise ValueError(f"collective_timeout must be a positive number of seconds, got {collective_timeout!r}")
    dp_dims = [d for d in (dp_shard_dim, dp_outer_dim) if d is not None]
    tp_mesh = tp_mesh_of(device_mesh, tp_dim, dp_dims)
    ctx = make_dist_context(device_mesh, dp_shard_dim, param_device, transport, collective_timeout,
                            dp_outer_dim=dp_outer_dim, hybrid_fsdp_group=hybrid_fsdp_group,
                            outer_sharded=outer == ShardingStrategy.OPTIM, with_tp=tp_mesh is not None)
    expert_ctx = expert_context(expt_device_mesh, hybrid_fsdp_expt_group, dp_shard_dim=dp_shard_dim,
                                dp_outer_dim=dp_outer_dim, tp_dim=tp_dim, device=param_device, transport=transport,
                                collective_timeout=collective_timeout, outer_sharded=outer == ShardingStrategy.OPTIM,
                                meta_init=init_model_with_meta_device)
    return MegatronFSDP(
        module, dist_ctx=ctx, zero_dp_strategy=strategy, fsdp_unit_modules=units, mixed_precision_policy=policy,
        sync_model_each_microbatch=sync_model_each_microbatch, overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather, average_in_collective=average_in_collective,
        calculate_per_token_loss=calculate_per_token_loss, report_nan_in_param_grad=report_nan_in_param_grad,
        bucket_size=bucket_size, reduce_queue_bytes=reduce_queue_bytes,
        init_model_with_meta_device=init_model_with_meta_device, single_rank_collectives=single_rank_collectives,
        tp_mesh=tp_mesh, unnamed_dims=other_dims(device_mesh, dp_dims),
        quantized_comm_policy=quantized_comm_policy, expert_ctx=expert_ctx, trains_later=trains_later,
        offload_fraction=offload_fraction,
    )


def _offload_fraction(offload, fraction) -> float:
    """The fraction of the parameters whose optimizer side is offloaded (0: none), checked."""
    if not isinstance(offload, bool):
        raise TypeError(f"optimizer_cpu_offload must be True or False, got {offload!r}")
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"optimizer_offload_fraction must be a number from 0 to 1 (the share of the parameters whose "
                         f"optimizer side lives in host memory), got {fraction!r}")
    return float(fraction) if offload else 0.0


def _check_quant_policy(quant, policy: MixedPrecisionPolicy, hfsdp: bool) -> None:
    """quantized_comm_policy against the other arguments, refused with the reason."""
    if quant is None:
        return
    if not isinstance(quant, QuantizedCommPolicy):
        raise TypeError(f"quantized_comm_policy must be a megatron_fsdp_c.QuantizedCommPolicy, got {type(quant).__name__}")
    if quant.outer_weights is not None and not hfsdp:
        raise ValueError("QuantizedCommPolicy(outer_weights=...) quantizes the gather of updated weights across replicas, "
                         "which only HFSDP has (outer_dp_sharding_strategy='optim')")
    if quant.grads is not None and policy.grad_comm_dtype is not None:
        raise ValueError(f"MixedPrecisionPolicy(grad_comm_dtype={policy.grad_comm_dtype}) and QuantizedCommPolicy(grads="
                         f"{quant.grads!r}) both say how gradients cross the wire: drop grad_comm_dtype (quantized "
                         "gradients are summed in main_grads_dtype)")


def close(model) -> None:
    """Collective: every rank calls it at the same point, after its last step, to end the
    model's communication (the native NCCL transport's communicators). A model dropped
    without close() aborts them instead, which never waits for a peer. `model`: a MegatronFSDP,
    or the root module of the per-module API (before its first forward: nothing to end)."""
    group = getattr(model, "_mfsdp_group", None)  # the per-module API's root ([Note: per-module groups])
    if group is not None:
        owners = group.owner.owners() if group.owner is not None else ()
    elif hasattr(model, "owners"):
        owners = model.owners()  # the experts' communicators too ([Note: expert data-parallel mesh])
    else:
        raise TypeError(f"close() takes a model sharded by megatron_fsdp_c (a MegatronFSDP, or a module sharded by "
                        f"the per-module fully_shard), got {type(model).__name__}")
    for owner in owners:
        owner.dist_ctx.close()


def fully_shard(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, **kwargs):
    """Shards `module` (fully_shard_model) and, if given, remaps and patches `optimizer`
    (fully_shard_optimizer). Returns (model, optimizer)."""
    preproc = kwargs.pop("preproc_state_dict_for_dcp_ckpt", True)
    # Frozen parameters the optimizer holds are expected to train later.
    later = [p for g in (optimizer.param_groups if optimizer is not None else ()) for p in g["params"]
             if isinstance(p, nn.Parameter) and not p.requires_grad]
    model = fully_shard_model(module, trains_later=later, **kwargs)
    if optimizer is not None:
        remap_optimizer(model, optimizer)
        fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=preproc)
    return model, optimizer
