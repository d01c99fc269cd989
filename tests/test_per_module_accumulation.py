"""Gradient accumulation and microbatching with megatron_fsdp_c.per_module.fully_shard, tested
after torch's own FSDP2 suite (test/distributed/_composable/fsdp/test_fully_shard_training.py)
through public APIs only, against a plain replica whose gradients are averaged over the ranks,
float64 to rtol 1e-9 at world 2 (and 4). The cells run in the shared spawns (see [Note: one spawn
per world size] in support/rank_grid.py).

Behaviours (cell names):
- gradient accumulation with sync off for all groups, the root group only (recurse=False) or some
  groups, reshard_after_backward off, zero_grad(set_to_none=False) between steps: accumulation
- 1F1B-style microbatching: explicit unshard(async_op=True), reshard_after_backward off until the
  last microbatch: one_f_one_b
"""
import copy

import pytest
import torch
import torch.nn as nn

from megatron_fsdp_c.per_module import FSDPModule, fully_shard

from support import rank_grid
from support.checks import recorder_cells, verify
from support.data import normal_batch
from support.tiny_models import MLP, gpt, gpt_data, gpt_loss, shard_blocks
from support.train_both import TrainBoth

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)

ACCUMULATION = [("all", True, True), ("all", False, True), ("all", False, False), ("root_only", True, True),
                ("root_only", False, True), ("root_only", False, False), ("some", True, True), ("some", False, True)]


def accumulation(rank, world, ck, mode, reshard, reshard_after_backward):
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(8, 8), MLP(8), MLP(8), MLP(8)).double()
    ref = copy.deepcopy(model)
    for mlp in model[1:]:
        fully_shard(mlp, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)  # the root's group: the first Linear

    def flags(step, mb):
        is_last = mb == 2
        if mode == "all":
            model.set_requires_gradient_sync(is_last)
            if not reshard_after_backward:
                model.set_reshard_after_backward(is_last)
        elif mode == "root_only":
            model.set_requires_gradient_sync(is_last, recurse=False)
            if not reshard_after_backward:
                model.set_reshard_after_backward(is_last, recurse=False)
        else:
            for mlp in model[1:3]:
                mlp.set_requires_gradient_sync(is_last)
                if not reshard_after_backward:
                    mlp.set_reshard_after_backward(is_last)
    pair = TrainBoth(rank, world, model, ref, reference="mean", ck=ck)
    # set_to_none=False on odd steps: the next step accumulates onto zeroed gradients
    pair.run(3, lambda step, mb: normal_batch(10 * step + mb, rank, (2, 8)), micro=3, before_micro=flags,
             set_to_none=lambda step: step % 2 == 1)
    pair.check_params()


for _mode, _raf, _rab in ACCUMULATION:
    cell(f"accumulation[{_mode}-{'reshard' if _raf else 'keep'}{'' if _rab else '-keep_after_backward'}]",
         worlds=(2, 4) if (_mode, _raf, _rab) == ("all", True, True) else (2,), mode=_mode, reshard=_raf,
         reshard_after_backward=_rab)(accumulation)


@cell("one_f_one_b[implicit]", explicit=False, reshard_after_backward=True)
@cell("one_f_one_b[implicit-keep_after_backward]", explicit=False, reshard_after_backward=False)
@cell("one_f_one_b[explicit_unshard]", explicit=True, reshard_after_backward=True)
@cell("one_f_one_b[explicit_unshard-keep_after_backward]", explicit=True, reshard_after_backward=False)
def one_f_one_b(rank, world, ck, explicit, reshard_after_backward):
    model = gpt()
    ref = copy.deepcopy(model)
    shard_blocks(model, reshard_after_forward=False)
    if explicit:  # issue every all-gather ahead (no extra memory when nothing reshards after forward)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.unshard(async_op=True)

    def flags(step, mb):
        is_last = mb == 2
        model.set_requires_gradient_sync(is_last)
        model.set_is_last_backward(is_last)
        if not reshard_after_backward:
            model.set_reshard_after_backward(is_last)
    pair = TrainBoth(rank, world, model, ref, reference="mean", ck=ck,
                     optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    pair.run(1, lambda step, mb: gpt_data(mb, rank), micro=3, loss=gpt_loss, before_micro=flags)
    pair.check_params("after the step")


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys()))
def test_training_behaviour(name, world):
    verify(CELLS, name, world)
