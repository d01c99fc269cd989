"""The small models of the extension-parameter tests (tests/test_per_module_extensions.py,
tests/test_megatron_extensions.py): an MLP stack whose blocks' linears are converted to torchao's
float8 or int8 training or to the tests' own subclass (support/subclass.py), the training loop
both APIs run, and a parameter's full values as a plain tensor."""
import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchao import quantize_
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.prototype.quantized_training import int8_mixed_precision_training

from megatron_fsdp_c._extensions import values_of

from .subclass import LegacyScaledInt8Weight, QLinear, ScaledInt8Weight, to_scaled_int8

BATCH = 8  # rows per rank


class Block(nn.Module):
    def __init__(self, d, make):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = make(d, 2 * d, bias=False)
        self.down = make(2 * d, d, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def build(kind: str, dim: int, dtype=torch.float32, reference=False, fp8_gather=True) -> nn.Module:
    """The test model (in 32 -> dim -> two blocks -> 16), its blocks' linears converted to `kind`:
    'float8' (torchao, emulated), 'int8' (torchao's int8 mixed precision), 'scaled'/'legacy' (the
    tests' subclass, 5- or 1-argument pre_all_gather; `reference`: plain weights quantized in
    forward instead)."""
    torch.manual_seed(0)
    make = functools.partial(QLinear, reference=reference) if kind in ("scaled", "legacy") else nn.Linear
    model = nn.Sequential(nn.Linear(32, dim), Block(dim, make), Block(dim, make), nn.Linear(dim, 16)).to(dtype)
    if kind == "float8":
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_gather,
                                                                     emulate=True),
                                   module_filter_fn=lambda mod, fqn: fqn.startswith(("1.", "2.")))
    elif kind == "int8":
        quantize_(model, int8_mixed_precision_training(),
                  filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear) and fqn.startswith(("1.", "2.")))
    elif not reference:
        to_scaled_int8(model, ScaledInt8Weight if kind == "scaled" else LegacyScaledInt8Weight)
    return model


def values(t: torch.Tensor) -> torch.Tensor:
    """A parameter's full values as a plain tensor (collective for a DTensor)."""
    if isinstance(t, DTensor):
        local = values_of(t.to_local())
        t = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                               stride=t.stride()).full_tensor()
    return values_of(t).detach().clone()


def train(model, kind, rank, world, steps=3, dtype=torch.float32, every_rank=False, opt=None):
    """Steps of AdamW on random data: this rank's rows, or (`every_rank`, the one-process
    reference) every rank's rows, one rank's at a time with the loss divided by the world (float8
    scales activations per tensor, so a rank's rows must stay a batch of their own); the losses
    and the parameters' full values after each step. `opt`: the optimizer (default: AdamW)."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, params = [], []
    for step in range(steps):
        x = torch.randn(BATCH * world, 32, generator=torch.Generator().manual_seed(100 + step), dtype=dtype)
        loss = 0
        for r in range(world) if every_rank else (rank,):
            part = model(x[r * BATCH:(r + 1) * BATCH]).square().mean() / (world if every_rank else 1)
            part.backward()
            loss = loss + part.detach()
        opt.step()
        opt.zero_grad()
        if kind == "float8":  # torchtitan's order: one all-reduce of every weight's amax after the step
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.clone())
        params.append({n: values(p) for n, p in model.named_parameters()})
    return losses, params


def check_against_reference(ck, ours, ref, world: int, name=lambda n: n) -> None:
    """Records, per step, the mean over ranks of `ours`' losses against the reference's and every
    parameter (float64, rtol 1e-9): `ours`, `ref` are train()'s (losses, params); `name` maps our
    parameter names to the reference's (the Megatron-style wrapper prefixes 'module.')."""
    (ol, op), (rl, rp) = ours, ref
    for step, (a, b) in enumerate(zip(ol, rl)):
        mean = a.clone()
        torch.distributed.all_reduce(mean)
        ck.close(f"step {step}: loss (the mean over ranks) against the reference's", mean / world, b)
    for step, (a, b) in enumerate(zip(op, rp)):
        ck.equal(f"step {step}: parameter names", sorted(name(n) for n in a), sorted(b))
        for n, v in a.items():
            ck.close(f"step {step}: {name(n)}", v, b[name(n)])
