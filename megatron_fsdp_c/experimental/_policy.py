"""The per-module API's policies: torch's FSDP2 MixedPrecisionPolicy (or megatron_fsdp_c's) and
OffloadPolicy, checked at fully_shard time; the mixed precision turned into what the engine takes
at the lazy init, and the casts of the forward's inputs and outputs."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from ..mixed_precision import MixedPrecisionPolicy as OurPolicy
from ..mixed_precision import QuantizedCommPolicy

__all__ = ["cast_floats", "check_param_dtype", "check_policies", "check_quant_policy", "engine_policy",
           "is_torch_policy"]

_ENGINE_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what the engine casts and sums


def is_torch_policy(mp) -> bool:
    """Does `mp` carry the fields of torch's FSDP2 MixedPrecisionPolicy?"""
    return all(hasattr(mp, f) for f in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"))


def engine_policy(mp, param_dtype: torch.dtype):
    """(compute dtype, our MixedPrecisionPolicy) for parameters stored in `param_dtype`."""
    if param_dtype not in _ENGINE_FLOATS:
        # Integer (and other non-castable) parameters are frozen and never cast, as FSDP2 keeps
        # non-floating parameters; the policy is never resolved for them (no gradients).
        return param_dtype, OurPolicy(main_params_dtype=None)
    if isinstance(mp, OurPolicy):
        return param_dtype, mp
    compute = mp.param_dtype or param_dtype
    # FSDP2: sharded parameters and gradients stay in the parameter's dtype; reduce in
    # reduce_dtype (or the compute dtype). A narrower reduction still sums in the gradient
    # dtype here ([Note: exchange reduction] in csrc/comm/reduce.c).
    return compute, OurPolicy(main_params_dtype=param_dtype, main_grads_dtype=param_dtype,
                              grad_comm_dtype=mp.reduce_dtype or compute, allow_lossy_accumulation=True)


def check_param_dtype(p, what: str, mp) -> None:
    """Parameters of dtypes the engine does not compute with (integers, bool, float8, complex) are
    sharded and gathered as they are, frozen ([Note: opaque parameter dtypes] in ../param_record.py);
    refused at fully_shard: training one, or a cast the engine cannot make (float8 to param_dtype,
    which FSDP2 makes since float8 is a floating dtype)."""
    if p.dtype in _ENGINE_FLOATS:
        return
    if p.requires_grad:
        raise TypeError(f"{what} has dtype {p.dtype} and requires grad: megatron_fsdp_c trains float32/bfloat16/"
                        "float16/float64 parameters only (set requires_grad=False to shard it frozen, as it is)")
    target = getattr(mp, "param_dtype", None) if is_torch_policy(mp) else None
    if p.dtype.is_floating_point and target is not None and target != p.dtype:
        raise NotImplementedError(f"{what} has dtype {p.dtype}, which megatron_fsdp_c's engine cannot cast to "
                                  f"param_dtype={target}: shard it in a group without param_dtype, or convert it")


def cast_floats(tree, dtype):
    """The floating-point tensors of `tree` cast to `dtype` (torch's cast_forward_inputs, output_dtype)."""
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def check_policies(mp_policy, offload_policy, shard_placement_fn) -> None:
    """fully_shard's policy arguments, refused with the reason before anything is changed."""
    if not (isinstance(mp_policy, OurPolicy) or is_torch_policy(mp_policy)):
        raise TypeError("mp_policy must be torch.distributed.fsdp.MixedPrecisionPolicy or "
                        f"megatron_fsdp_c.MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if offload_policy is not None:
        if type(offload_policy).__name__ == "CPUOffloadPolicy":
            raise NotImplementedError("offload_policy=CPUOffloadPolicy() is not yet supported by megatron_fsdp_c: "
                                      "leave offload_policy at its default (OffloadPolicy() or None)")
        if type(offload_policy).__name__ != "OffloadPolicy":
            raise TypeError(f"offload_policy must be torch's OffloadPolicy() or None, got {type(offload_policy).__name__}")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError("shard_placement_fn must be a callable (parameter -> None or Shard(dim))")


def check_quant_policy(quant, mp_policy) -> None:
    """fully_shard's quantized_comm_policy (an extension beyond torch's signature, like
    zero_dp_strategy), refused with the reason before anything is changed."""
    if quant is None:
        return
    if not isinstance(quant, QuantizedCommPolicy):
        raise TypeError(f"quantized_comm_policy must be a megatron_fsdp_c.QuantizedCommPolicy, got {type(quant).__name__}")
    if quant.outer_weights is not None:
        raise ValueError("QuantizedCommPolicy(outer_weights=...) is for HFSDP, which the per-module API does not have")
    if quant.grads is not None and isinstance(mp_policy, OurPolicy) and mp_policy.grad_comm_dtype is not None:
        raise ValueError(f"MixedPrecisionPolicy(grad_comm_dtype={mp_policy.grad_comm_dtype}) and QuantizedCommPolicy("
                         f"grads={quant.grads!r}) both say how gradients cross the wire: drop grad_comm_dtype")
