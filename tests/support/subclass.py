"""A weight tensor subclass of the tests' own with FSDP2's all-gather extensions (fsdp_pre_all_gather /
fsdp_post_all_gather), written from torch's protocol, to test its corners on both FSDP2 and ours
([Note: extension parameters] in megatron_fsdp_c/_extensions.py).

ScaledInt8Weight holds its values in one plain tensor (`_data`). Its gather carries something else
than its data: int8 rows and one float scale per row, two inputs of other dtypes and sizes than
the parameter. fsdp_post_all_gather dequantizes them into a plain tensor of the parameter's shape,
the compute weight (the first call returns it, later calls refill it through `out=`). Rows are
quantized on their own, so a sharded gather gives the weight a one-process model gets from
`fake_quant` of the full weight, with a straight-through gradient (QLinear's reference path).
Every call is logged in `CALLS` (kind, and what it saw) for the corner checks.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

aten = torch.ops.aten
_KEEP = {aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default, aten.slice.Tensor,
         aten.clone.default, aten._to_copy.default, aten.new_zeros.default, aten.empty_like.default,
         aten.split.Tensor, aten.as_strided.default, aten.t.default}
CALLS = []


def fake_quant(w: torch.Tensor):
    """(int8 rows, scale per row) of w, and the dequantized weight they stand for."""
    scale = (w.detach().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0).to(torch.float32)
    q = torch.round(w.detach() / scale.to(w.dtype)).clamp(-127, 127).to(torch.int8)
    return q, scale  # the scale in float32 on both paths: it crosses the wire so


class ScaledInt8Weight(torch.Tensor):
    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                   device=data.device, requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor):
        self._data = data

    def __repr__(self):
        return f"ScaledInt8Weight({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return tree_map_only(torch.Tensor, cls, out) if func in _KEEP else out

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return ScaledInt8Weight(inner["_data"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        q, scale = fake_quant(self._data)
        meta = ("scaled-int8", tuple(outer_size), id(module), len(CALLS))
        CALLS.append(("pre", dict(mesh=mesh.size(), outer_size=tuple(outer_size), outer_stride=tuple(outer_stride),
                                  module=type(module).__name__, mp=type(mp_policy).__name__, meta=meta,
                                  shard=tuple(self.shape))))
        return (q, scale), meta

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        q, scale = outputs
        w = q.to(param_dtype) * scale.to(param_dtype)
        CALLS.append(("post", dict(meta=metadata, shapes=[tuple(t.shape) for t in outputs],
                                   dtypes=[str(t.dtype) for t in outputs], out=out is not None,
                                   out_id=None if out is None else id(out))))
        if out is not None:  # autograd may hold `out` from the forward: the same values, its version kept
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(w)
            return None
        return w, (w,)


    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self):
        return True  # torch 2.15: the compute weight is a new tensor, the gathered int8 rows are not needed


class LegacyScaledInt8Weight(ScaledInt8Weight):
    """The one-argument fsdp_pre_all_gather(mesh) of torch before 2.5, which FSDP2 still calls."""

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return LegacyScaledInt8Weight(inner["_data"])

    def fsdp_pre_all_gather(self, mesh):
        q, scale = fake_quant(self._data)
        CALLS.append(("pre-legacy", dict(mesh=mesh.size())))
        return (q, scale), ("legacy",)


class QLinear(nn.Linear):
    """A linear layer whose weight computes fake-quantized: as it comes from a gather of
    ScaledInt8Weight (already dequantized), or, on the one-process reference (`reference=True`,
    a plain weight), quantized here with a straight-through gradient."""

    def __init__(self, *args, reference: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.reference = reference

    def forward(self, x):
        w = self.weight
        if self.reference:
            q, scale = fake_quant(w)
            w = w + (q.to(w.dtype) * scale.to(w.dtype) - w).detach()
        return F.linear(x, w, self.bias)


def to_scaled_int8(model: nn.Module, cls=ScaledInt8Weight) -> nn.Module:
    """Every QLinear's weight made a `cls` parameter (torchao's convert_to_float8_training does
    the same with its own subclass)."""
    for m in model.modules():
        if isinstance(m, QLinear):
            m.weight = nn.Parameter(cls(m.weight.detach()), requires_grad=m.weight.requires_grad)
    return model
