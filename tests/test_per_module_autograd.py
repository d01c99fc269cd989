"""Autograd corner cases with megatron_fsdp_c.per_module.fully_shard, tested after torch's own
FSDP2 suite (test/distributed/_composable/fsdp/test_fully_shard_autograd.py) through public APIs
only, against a single-process reference on the global batch, float64 to rtol 1e-9 at world 2.
The cells run in the shared spawns (see [Note: one spawn per world size] in support/rank_grid.py).

Behaviours (cell names):
- an unused forward output: unused_output; a sharded module unused in forward: unused_module;
  list / namedtuple / tuple / dict / dataclass activations between groups: container_activations
"""
import collections
import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_c.per_module import fully_shard

from support import rank_grid
from support.checks import recorder_cells, verify
from support.data import global_batch, normal_batch
from support.train_both import TrainBoth

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)


class TwoOutputs(nn.Module):
    def __init__(self, dim: int = 8, second: bool = True):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.second = second

    def forward(self, x):
        if self.second:
            return torch.tanh(self.lin1(x)), torch.tanh(self.lin2(x))
        return torch.tanh(self.lin1(x))


def global_reference_loop(ck, rank, world, model, ref, loss_fn, steps=6, dim=8):
    """Each rank trains on its slice of a global batch; the reference trains on all of it, its
    gradients divided by the world size (the mean of the ranks' sums)."""
    pair = TrainBoth(rank, world, model, ref, reference="global", ck=ck)
    pair.run(steps, lambda step, mb: (normal_batch(step, rank, (2, dim)), step),
             ref_data=lambda step, mb: (global_batch(normal_batch, step, world, (2, dim)), step),
             loss=lambda m, batch: loss_fn(m, *batch), set_to_none=lambda step: step % 2 == 1, check_grads=False,
             params_every_step=True)


@cell("unused_output[reshard]", reshard=True)
@cell("unused_output[keep]", reshard=False)
def unused_output(rank, world, ck, reshard):
    torch.manual_seed(42)
    model = TwoOutputs().double()
    ref = copy.deepcopy(model)
    fully_shard(model.lin1, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)

    def loss(m, x, it):  # both outputs for 3 iterations, then the first one only
        o1, o2 = m(x)
        return (o1 * o2).sum() if it < 3 else o1.sum()
    global_reference_loop(ck, rank, world, model, ref, loss)


@cell("unused_module[reshard]", reshard=True)
@cell("unused_module[keep]", reshard=False)
def unused_module(rank, world, ck, reshard):
    torch.manual_seed(42)
    model = TwoOutputs(second=False).double()
    ref = copy.deepcopy(model)
    fully_shard(model.lin1, reshard_after_forward=reshard)
    fully_shard(model.lin2, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    global_reference_loop(ck, rank, world, model, ref, lambda m, x, it: m(x).sum())
    ck.true("the unused module's gradients stay None", all(p.grad is None for p in model.lin2.parameters()))


Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Activations:
    x: torch.Tensor
    y: torch.Tensor


def _pack(kind, x, y):
    return {"list": lambda: [x, y], "tuple": lambda: (x, y), "namedtuple": lambda: Pair(x, y),
            "dict": lambda: {"x": x, "y": y}, "dataclass": lambda: Activations(x, y)}[kind]()


def _unpack(kind, c):
    if kind in ("list", "tuple"):
        return c[0], c[1]
    if kind == "dict":
        return c["x"], c["y"]
    return c.x, c.y


class ToContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return _pack(self.kind, x, torch.ones_like(x))


class ContainerBlock(nn.Module):
    def __init__(self, kind, dim=8):
        super().__init__()
        self.kind = kind
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, c):
        x, y = _unpack(self.kind, c)
        return _pack(self.kind, torch.tanh(self.lin2(torch.tanh(self.lin1(x)))) + 0.1 * y, y)


class FromContainer(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, c):
        return _unpack(self.kind, c)[0]


@cell("container_activations[list]", kind="list")
@cell("container_activations[tuple]", kind="tuple")
@cell("container_activations[namedtuple]", kind="namedtuple")
@cell("container_activations[dict]", kind="dict")
@cell("container_activations[dataclass]", kind="dataclass")
def container_activations(rank, world, ck, kind):
    torch.manual_seed(42)
    model = nn.Sequential(ToContainer(kind), ContainerBlock(kind), ContainerBlock(kind), ContainerBlock(kind),
                          FromContainer(kind)).double()
    ref = copy.deepcopy(model)
    for m in model:
        fully_shard(m)
    fully_shard(model)
    global_reference_loop(ck, rank, world, model, ref, lambda m, x, it: m(x).sum(), steps=3)


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys()))
def test_training_behaviour(name, world):
    verify(CELLS, name, world)
