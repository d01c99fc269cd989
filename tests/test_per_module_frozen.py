"""Frozen parameters with megatron_fsdp_c.per_module.fully_shard, tested after torch's own FSDP2
suite (test/distributed/_composable/fsdp/test_fully_shard_frozen.py) through public APIs only,
against DDP or a plain replica whose gradients are averaged over the ranks, float64 to rtol 1e-9
at world 2. The cells run in the shared spawns (see [Note: one spawn per world size] in
support/rank_grid.py).

Behaviours (cell names):
- frozen parameters within a group (BitFit), frozen before or after fully_shard, with
  checkpointing: frozen_within_group; frozen groups without a root, a no_grad step, unfreezing:
  frozen_across_groups; a trainable and a frozen module run several times, some under no_grad:
  frozen_multi_forward; a frozen integer parameter: integer_parameter; unfreezing after the first
  forward: unfreeze_after_first_forward
"""
import copy

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_c.per_module import fully_shard

from support import rank_grid
from support.checks import full, recorder_cells, verify
from support.data import normal_batch
from support.tiny_models import mlp_stack
from support.train_both import TrainBoth, against_ddp, average_grads, shard_against_ddp

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)


def freeze_all_but_biases(m):
    for name, p in m.named_parameters():
        if "bias" not in name:
            p.requires_grad_(False)


@cell("frozen_within_group[reshard-before]", reshard=True, ckpt=False, when="before")
@cell("frozen_within_group[keep-before]", reshard=False, ckpt=False, when="before")
@cell("frozen_within_group[reshard-before-checkpointed]", reshard=True, ckpt=True, when="before")
@cell("frozen_within_group[keep-after-checkpointed]", reshard=False, ckpt=True, when="after")
@cell("frozen_within_group[reshard-after]", reshard=True, ckpt=False, when="after")
def frozen_within_group(rank, world, ck, reshard, ckpt, when):
    """BitFit: only the biases train; frozen before fully_shard, or after it (before the first
    forward)."""
    model = mlp_stack(dim=16)
    model.checkpointed = ckpt
    if when == "before":
        freeze_all_but_biases(model)
    ref = copy.deepcopy(model)
    freeze_all_but_biases(ref)
    for mlp in model:
        fully_shard(mlp, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    if when == "after":
        freeze_all_but_biases(model)
    against_ddp(ck, rank, world, model, ref, lambda s, r: normal_batch(s, r, (8, 16)))


def _interleaved_linears():
    torch.manual_seed(42)
    mods = []
    for _ in range(6):
        mods += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*mods).double()


def _set_requires_grad(seq, flag):
    for i in (0, 4, 8):  # linears 0, 2 and 4
        seq[i].requires_grad_(flag)


@cell("frozen_across_groups[reshard]", reshard=True, unfreeze=False)
@cell("frozen_across_groups[keep]", reshard=False, unfreeze=False)
@cell("frozen_across_groups[reshard-unfreeze]", reshard=True, unfreeze=True)
def frozen_across_groups(rank, world, ck, reshard, unfreeze):
    """Every Linear its own group and no root group (each is a root), frozen and trainable ones
    interleaved; a step under no_grad; optionally unfreezing before the last step."""
    model = _interleaved_linears()
    ref = copy.deepcopy(model)
    _set_requires_grad(model, False)
    _set_requires_grad(ref, False)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, reshard_after_forward=reshard)
    pair = TrainBoth(rank, world, model, ref, reference="mean", ck=ck)

    def train(step):
        pair.run(1, lambda s, mb: normal_batch(s, rank, (8, 16)), first=step, set_to_none=lambda s: s % 2 == 0)
    train(0)
    with torch.no_grad():
        x = normal_batch(1, rank, (8, 16))
        ck.close("no_grad step: loss", model(x).sum(), ref(x).sum())
    if unfreeze:
        _set_requires_grad(model, True)
        _set_requires_grad(ref, True)
    train(2)
    pair.check_params()


class MultiForwardFrozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x):
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(torch.tanh(self.layer_with_grad(x)))
            with torch.no_grad():  # the same layer again, without autograd
                x += torch.tanh(self.layer_with_grad(x))
        return x


@cell("frozen_multi_forward[reshard]", reshard=True)
@cell("frozen_multi_forward[keep]", reshard=False)
def frozen_multi_forward(rank, world, ck, reshard):
    torch.manual_seed(42)
    model = MultiForwardFrozen().double()

    def shard(m):
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                fully_shard(mod, reshard_after_forward=reshard)
        fully_shard(m, reshard_after_forward=reshard)
    shard_against_ddp(ck, rank, world, model, shard, lambda s, r: normal_batch(s, r, (8, 5)))


class WithIntegerParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.non_float = nn.Parameter(torch.arange(16, dtype=torch.int64), requires_grad=False)

    def forward(self, x):
        return self.layers(x) + self.non_float.to(x.dtype) * 0.01


@cell("integer_parameter")
def integer_parameter(rank, world, ck):
    torch.manual_seed(42)
    model = WithIntegerParameter().double()
    shard_against_ddp(ck, rank, world, model, fully_shard, lambda s, r: normal_batch(s, r, (4, 16)))
    ck.equal("the integer parameter is unchanged", full(model.non_float), torch.arange(16, dtype=torch.int64))


@cell("unfreeze_after_first_forward")
def unfreeze_after_first_forward(rank, world, ck):
    """Frozen at the first (no_grad) forward, the engine's lazy init; unfrozen afterwards."""
    torch.manual_seed(42)
    model = WithIntegerParameter().double()
    ref = copy.deepcopy(model)
    fully_shard(model)
    model.requires_grad_(False)
    x = normal_batch(0, rank, (4, 16))
    with torch.no_grad():
        model(x)
    model.layers.requires_grad_(True)
    ref.layers.requires_grad_(True)
    model(x).sum().backward()
    ref(x).sum().backward()
    average_grads(ref, world)
    ck.grads("after unfreezing", model, ref)


KNOWN_GAPS = {}  # cell -> how megatron_fsdp_c differs from FSDP2 there (strict xfails)


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys(), KNOWN_GAPS))
def test_training_behaviour(name, world):
    verify(CELLS, name, world)
