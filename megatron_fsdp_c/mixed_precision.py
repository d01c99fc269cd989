"""MixedPrecisionPolicy: the dtypes of main weights, main gradients and gradient communication.

The compute dtype is the module's parameter dtype (a bf16 model computes in bf16). Gradients
are widened before they are summed: a low-precision gradient is cast up and added to the main
gradient in the wider type, and a reduction in a narrow communication dtype is accumulated into
the (wider) main gradient, rounding once (unless sum_in_comm_dtype asks for the collective's own
narrow sum, as torch's FSDP2 does).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["MixedPrecisionPolicy", "QuantizedCommPolicy"]

_FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Significand bits: a lower number loses information when a wider value is cast to it.
_PRECISION = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def _check_dtype(field: str, value) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype):
        raise TypeError(f"MixedPrecisionPolicy.{field} must be a torch.dtype or None, got {value!r}")
    if value not in _FLOATING:
        raise ValueError(
            f"MixedPrecisionPolicy.{field}={value} is not a floating dtype; use one of "
            "torch.float32, torch.bfloat16, torch.float16, torch.float64 (or None)"
        )


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the sharded training state (names and defaults follow Megatron-FSDP).

    main_params_dtype: dtype of the optimizer's weights. None: the optimizer updates the compute
        weights directly. When it equals the compute dtype no second copy is kept. Main weights
        are never narrower than the compute weights (a float64 model keeps float64 main weights
        under the float32 default).
    main_grads_dtype: dtype of gradient accumulation. None: the parameter dtype.
    grad_comm_dtype: dtype of gradient reduce-scatter / all-reduce. None: the main gradient dtype.
        A narrower communication dtype halves the traffic; the reduced values are still
        accumulated into the main gradient in its own (wider) dtype.
    allow_lossy_accumulation: main_grads_dtype narrower than grad_comm_dtype throws away bits of
        every reduced gradient; that is refused unless this is set.
    sum_in_comm_dtype: with a grad_comm_dtype narrower than the main gradients, False (default)
        sends the narrow values but sums them in the main gradient dtype, rounding each rank's
        contribution once and the sum never ([Note: exchange reduction] in csrc/comm/reduce.c);
        True lets the collective sum in grad_comm_dtype, as NCCL's reduce-scatter and torch's
        FSDP2 do (every partial sum rounded): their numbers. Quantized gradients ignore it.
    """

    main_params_dtype: Optional[torch.dtype] = torch.float32
    main_grads_dtype: Optional[torch.dtype] = None
    grad_comm_dtype: Optional[torch.dtype] = None
    allow_lossy_accumulation: bool = False
    sum_in_comm_dtype: bool = False

    def __post_init__(self):
        _check_dtype("main_params_dtype", self.main_params_dtype)
        _check_dtype("main_grads_dtype", self.main_grads_dtype)
        _check_dtype("grad_comm_dtype", self.grad_comm_dtype)
        for flag in ("allow_lossy_accumulation", "sum_in_comm_dtype"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"MixedPrecisionPolicy.{flag} must be True or False, got {getattr(self, flag)!r}")
        grads, comm = self.main_grads_dtype, self.grad_comm_dtype
        if (grads is not None and comm is not None and _PRECISION[grads] < _PRECISION[comm]
                and not self.allow_lossy_accumulation):
            raise ValueError(
                f"main_grads_dtype={grads} is narrower than grad_comm_dtype={comm}: every reduced gradient "
                "would lose bits when accumulated. Use main_grads_dtype at least as wide as grad_comm_dtype "
                "(e.g. torch.float32), or pass allow_lossy_accumulation=True if this is intended."
            )

    def main_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The main weights' dtype for parameters of `param_dtype` (never narrower than it)."""
        main = self.main_params_dtype or param_dtype
        return param_dtype if _PRECISION[main] < _PRECISION[param_dtype] else main

    def resolve(self, param_dtype: torch.dtype):
        """(main, grad, comm) dtypes for trainable parameters of `param_dtype`."""
        main = self.main_dtype(param_dtype)
        grad = self.main_grads_dtype or param_dtype
        comm = self.grad_comm_dtype or grad
        if (_PRECISION[grad] < _PRECISION[comm] and not self.allow_lossy_accumulation):
            raise ValueError(
                f"parameters of dtype {param_dtype} get main gradients in {grad} (the parameter dtype, since "
                f"main_grads_dtype is None) but grad_comm_dtype={comm} is wider: set main_grads_dtype="
                f"{comm} or allow_lossy_accumulation=True"
            )
        return main, grad, comm


_QUANT_MODES = ("int8", "fp8_e4m3", "int4")


def _check_mode(field: str, value) -> None:
    if value is not None and value not in _QUANT_MODES:
        raise ValueError(f"QuantizedCommPolicy.{field}={value!r} is not a quantization mode: use one of "
                         f"{', '.join(repr(m) for m in _QUANT_MODES)}, or None to communicate in the dtype")


@dataclasses.dataclass(frozen=True)
class QuantizedCommPolicy:
    """What crosses the wire block-quantized (ZeRO++'s qwZ / qgZ): one float32 scale per block of
    `block` elements, payload and scales in the same collective ([Note: quantized communication]
    in csrc/comm/wire.c). Main weights, main gradients and optimizer state are never quantized.

    weights: the all-gather of weights ("int8", "fp8_e4m3", "int4", or None: the compute dtype).
        Every rank computes with the dequantized gather, its own rows too.
    grads: the gradient reduction, an all-to-all of quantized pieces summed in the main gradient
        dtype ("int8", "int4", "fp8_e4m3", or None). Needs float32 (or float64) main gradients.
    block: elements per scale (>= 1; even with int4). Smaller blocks: less error, more scales
        (4 bytes per block).
    outer_weights: HFSDP only: the all-gather across replicas of the updated weights (None: the
        compute dtype).
    """

    weights: Optional[str] = None
    grads: Optional[str] = None
    block: int = 128
    outer_weights: Optional[str] = None

    def __post_init__(self):
        _check_mode("weights", self.weights)
        _check_mode("grads", self.grads)
        _check_mode("outer_weights", self.outer_weights)
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"QuantizedCommPolicy.block={self.block!r} must be a positive int (elements per scale)")
        if self.block % 2 and "int4" in (self.weights, self.grads, self.outer_weights):
            raise ValueError(f"QuantizedCommPolicy.block={self.block} is odd: int4 packs two codes a byte and a block "
                             "never shares a byte with the next, so int4 needs an even block")

    @property
    def enabled(self) -> bool:
        return any(m is not None for m in (self.weights, self.grads, self.outer_weights))
