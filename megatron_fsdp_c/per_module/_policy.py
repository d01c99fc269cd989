"""The per-module API's policies: torch's FSDP2 MixedPrecisionPolicy (or megatron_fsdp_c's) and
OffloadPolicy, checked at fully_shard time; the parameters the engine takes (dtypes, plain
tensors); the mixed precision turned into what the engine takes at the lazy init, and the casts of
the forward's inputs and outputs."""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from .._torch_compat import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE
from ..mixed_precision import MixedPrecisionPolicy as OurPolicy
from ..mixed_precision import QuantizedCommPolicy

__all__ = ["cast_floats", "check_offload", "check_param_dtype", "check_policies", "check_quant_policy",
           "compute_dtype", "engine_policy", "is_cpu_offload", "is_torch_policy", "param_policy", "sharded_dtype"]

_ENGINE_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what the engine casts and sums


def is_torch_policy(mp) -> bool:
    """Does `mp` carry the fields of torch's FSDP2 MixedPrecisionPolicy?"""
    return all(hasattr(mp, f) for f in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"))


def param_policy(mp, p: nn.Parameter):
    """The policy of one parameter: torch 2.15's MixedPrecisionPolicy(param_dtype_override_fn=...)
    resolved for `p` (torch's own resolution and checks, once, at fully_shard as torch does), else
    `mp` itself."""
    if getattr(mp, "param_dtype_override_fn", None) is None:
        return mp
    return mp._resolve_for_param(p)


def reduce_dtype(mp, param_dtype: torch.dtype, compute: torch.dtype, dp) -> torch.dtype:
    """[Note: reduce dtype by torch version]
    The dtype torch's MixedPrecisionPolicy reduces gradients in, as the installed torch's FSDP2
    does: reduce_dtype when set. With reduce_dtype=None, up to torch 2.14 the compute dtype
    (param_dtype, or the parameter's dtype); from 2.15 the parameter's gradient dtype instead,
    whatever param_dtype is: the parameter's dtype, or the grad_dtype set on the sharded parameter
    before the lazy init (None: the gradient's own dtype, the compute dtype); e.g. fp32 for fp32
    parameters under param_dtype=bf16, where 2.13 reduced in bf16. Summed in that dtype by the
    collective (sum_in_comm_dtype), as FSDP2's are. The sharded gradient keeps the parameter's
    dtype here; torch 2.15 gives it the grad_dtype instead (the reduce dtype for grad_dtype=None):
    where that differs from the parameter's, refused, naming the setting to change."""
    override = getattr(dp, "_has_grad_dtype_override", False)  # torch 2.15's Tensor.grad_dtype set by the user
    wanted = dp.grad_dtype if override else param_dtype
    if mp.reduce_dtype is not None:
        out = mp.reduce_dtype
    elif not REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE or wanted is None:
        out = compute
    else:
        out = wanted
    sharded = out if wanted is None else wanted  # the dtype of FSDP2's sharded gradient
    if sharded != param_dtype:
        raise NotImplementedError(
            f"a {param_dtype} parameter with grad_dtype={wanted}: torch's FSDP2 gives it {sharded} sharded "
            f"gradients, but megatron_fsdp_c keeps a parameter's sharded gradient in the parameter's dtype. Leave "
            "grad_dtype unset (or set it to the parameter's dtype) and choose the wire with "
            "MixedPrecisionPolicy(reduce_dtype=...)")
    return out


def engine_policy(mp, param_dtype: torch.dtype, dp=None):
    """(compute dtype, our MixedPrecisionPolicy) of a parameter whose dtype at fully_shard was
    `param_dtype` (torch's policy: the sharded parameter's, which becomes the main dtype; ours: the
    compute dtype ShardGroup.compute_dtypes recorded) (`dp`: the sharded parameter, whose
    grad_dtype torch 2.15's policy may follow)."""
    if param_dtype not in _ENGINE_FLOATS:
        # Integer (and other non-castable) parameters are frozen and never cast, as FSDP2 keeps
        # non-floating parameters; the policy is never resolved for them (no gradients).
        return param_dtype, OurPolicy(main_params_dtype=None)
    if isinstance(mp, OurPolicy):
        return param_dtype, mp
    compute = mp.param_dtype or param_dtype
    # FSDP2: sharded parameters and gradients stay in the parameter's dtype; reduce in
    # reduce_dtype ([Note: reduce dtype by torch version]), summed in it by the collective as
    # FSDP2's reduce-scatter sums (sum_in_comm_dtype; megatron_fsdp_c's own policy sums wide by
    # default, [Note: exchange reduction] in csrc/comm/reduce.c).
    return compute, OurPolicy(main_params_dtype=param_dtype, main_grads_dtype=param_dtype,
                              grad_comm_dtype=reduce_dtype(mp, param_dtype, compute, dp),
                              allow_lossy_accumulation=True, sum_in_comm_dtype=True)


def sharded_dtype(mp, dtype: torch.dtype) -> torch.dtype:
    """[Note: main-weight parameters]
    The dtype of the sharded DTensor parameter fully_shard makes of a parameter of `dtype`: what
    optimizers, state dicts and checkpoints see. Under torch's MixedPrecisionPolicy it is the
    parameter's own dtype (FSDP2 keeps sharded parameters so; param_dtype only casts the
    gathered copy). Under megatron_fsdp_c's MixedPrecisionPolicy the sharded parameters are the
    main weights, as in Megatron-FSDP: a bf16 module under main_params_dtype=float32 gets float32
    DTensor parameters at fully_shard (its local shard cast once, exactly), so an optimizer or a
    state dict made at any time holds the float32 main weights and their float32 gradients,
    while the module computes in its own dtype at fully_shard (ShardGroup.compute_dtypes; the
    engine casts the main weights into each gather). Attaching a float32 gradient to a bf16
    parameter instead would need Tensor.grad_dtype (torch 2.15's) but leave the optimizer
    stepping bf16 weights: not what the policy asks for."""
    if isinstance(mp, OurPolicy) and dtype in _ENGINE_FLOATS:
        return mp.main_dtype(dtype)
    return dtype


def compute_dtype(mp, recorded, dtype: torch.dtype, what: str) -> torch.dtype:
    """The dtype `what` computes in at the lazy init ([Note: main-weight parameters]): the module's
    dtype at fully_shard (`recorded`, None when fully_shard kept the parameter's dtype) while the
    sharded parameter still has the dtype fully_shard gave it, else (a .to() since) its own dtype,
    which must then be its main weights' too. A ValueError names the call to change otherwise."""
    if recorded is not None and sharded_dtype(mp, recorded) == dtype:
        return recorded
    main = sharded_dtype(mp, dtype)
    if main != dtype:
        raise ValueError(
            f"{what} is a {dtype} DTensor, but its group's megatron_fsdp_c.MixedPrecisionPolicy(main_params_dtype="
            f"{mp.main_params_dtype}) keeps {main} main weights, and under that policy the sharded parameters are the "
            f"main weights (fully_shard made them {main}; a .to()/.half()/.bfloat16() or an assignment after "
            f"fully_shard made this one {dtype}). Convert the module to its compute dtype before fully_shard (it "
            f"computes in the dtype it had then), or use torch's MixedPrecisionPolicy(param_dtype={dtype}) to compute "
            f"in {dtype} with {dtype} sharded parameters")
    return dtype


def check_param_dtype(p, what: str, mp) -> None:
    """Parameters of dtypes the engine does not compute with (integers, bool, float8, complex) are
    sharded and gathered as they are, frozen ([Note: opaque parameter dtypes] in ../_engine_dtypes.py);
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
    if offload_policy is not None and type(offload_policy).__name__ not in ("OffloadPolicy", "CPUOffloadPolicy"):
        raise TypeError("offload_policy must be torch's OffloadPolicy(), CPUOffloadPolicy() or None, got "
                        f"{type(offload_policy).__name__}")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError("shard_placement_fn must be a callable (parameter -> None or Shard(dim))")


def is_cpu_offload(offload_policy) -> bool:
    return type(offload_policy).__name__ == "CPUOffloadPolicy"


def check_offload(offload_policy, device: torch.device, what: str) -> None:
    """[Note: CPU offload]
    torch's CPUOffloadPolicy keeps the sharded parameters, their gradients and the optimizer state
    in host memory and steps the optimizer there. The policy marks the group's buckets offloaded
    ([Note: offloaded buckets] in csrc/comm/buffers.c): the main weights, main gradients and the
    optimizer's gradients are host memory (buffers of their own, or views of the host main gradients
    where the dtypes agree), the sharded parameters and their .grad views of them, and the gathers and reductions copy between them and the device's collective
    buffers. On a GPU those copies are kernels that read and write the host memory in place, which
    must be pinned: pin_memory=False is refused there (FSDP2 would stage through pageable memory
    with synchronous copies). On a CPU mesh both are host memory and the same copies run
    (pin_memory has no accelerator to pin for, and is ignored where FSDP2 raises). The step runs
    when the user calls optimizer.step(), after the whole backward, as FSDP2's: gradient clipping
    (which needs the global norm before any step) and accumulation over microbatches (which must
    wait for the last one) hold as without offload. FusedAdamW(step_in_backward=True) steps each
    bucket as its gradients land instead ([Note: stepping in backward] in _backward_step.py)."""
    if is_cpu_offload(offload_policy) and device.type != "cpu" and not offload_policy.pin_memory:
        raise ValueError(
            f"offload_policy=CPUOffloadPolicy(pin_memory=False) for {what} on {device.type}: megatron_fsdp_c's "
            "offload copies between the GPU and host memory with kernels that reach the host memory in place, which "
            "needs pinned memory; use CPUOffloadPolicy() (pin_memory=True)")


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
