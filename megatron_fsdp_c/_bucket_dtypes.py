"""A bucket's dtypes (main weights, main gradients, communication) and quantized wire, from the
user's MixedPrecisionPolicy and QuantizedCommPolicy: the engine front's reading of the public
policies (mixed_precision.py), made once per bucket by the parameter buffer."""
from __future__ import annotations

from typing import Optional

import torch

from .mixed_precision import MixedPrecisionPolicy, QuantizedCommPolicy

__all__ = ["bucket_dtypes"]


def bucket_dtypes(dtype: torch.dtype, trainable: bool, trains_later: bool, policy: MixedPrecisionPolicy,
                  quant: Optional[QuantizedCommPolicy], name: str):
    """(main, grad, comm dtypes, quantized wire (the policy, or None), why_not) of a bucket of `dtype` parameters
    (`name`: its first), trainable at sharding or not. A bad policy raises for a trainable bucket;
    for a frozen one it is why_not = (True, reason): it can never train. A frozen bucket keeps
    main weights of `dtype` unless `trains_later` (a wider main dtype would be memory for nothing
    while it stays frozen): why_not = (False, reason) then, it has gradient modes but cannot start
    training ([Note: changing requires_grad] in _trainable.py). why_not is None otherwise."""
    main = grad = comm = dtype
    why_not = None
    if dtype.is_floating_point:
        try:
            main, grad, comm = policy.resolve(dtype)
        except ValueError as e:
            if trainable:
                raise
            return dtype, dtype, dtype, None, (True, str(e))
    wire = None
    if quant is not None and quant.enabled:
        wire = quant
        if dtype.is_floating_point and quant.grads is not None:
            # [Note: quantized communication] in csrc/comm/wire.c: the pieces are quantized from, and
            # summed in, the main gradients; the wire format replaces the communication dtype
            if grad not in (torch.float32, torch.float64):
                why = (f"QuantizedCommPolicy(grads={quant.grads!r}) sums the dequantized gradients in the main "
                       f"gradient dtype, which is {grad} for parameter '{name}': use float32 main gradients "
                       "(MixedPrecisionPolicy(main_grads_dtype=torch.float32), or float32 parameters under "
                       "torch's MixedPrecisionPolicy)")
                if trainable:
                    raise ValueError(why)
                return dtype, dtype, dtype, wire, (True, why)
            comm = grad
    if dtype.is_floating_point and not trainable and main != dtype and not trains_later:
        why_not = (False, f"its main weights were planned in {dtype} (it was frozen at sharding), but training it "
                          f"needs {main} main weights: make it trainable before sharding and freeze it afterwards, "
                          "or (fully_shard) give fully_shard an optimizer that holds it")
        main = dtype
    return main, grad, comm, wire, why_not
