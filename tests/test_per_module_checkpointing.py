"""Activation checkpointing and several forwards before a backward with
megatron_fsdp_c.per_module.fully_shard, tested after torch's own FSDP2 suite
(test/distributed/_composable/fsdp/test_fully_shard_training.py) through public APIs only,
against DDP or a plain replica on the same data, float64 to rtol 1e-9 at world 2. The cells run
in the shared spawns (see [Note: one spawn per world size] in support/rank_grid.py).

Behaviours (cell names):
- activation checkpointing (torch.utils.checkpoint, checkpoint_wrapper, composable checkpoint) with
  a group per block, list groups ([blocks], [embeddings], [norm, head]) and tied weights: checkpointing
- two forwards before one backward, nested groups, with and without checkpointing: two_forwards
"""
import copy

import pytest

from megatron_fsdp_c.per_module import fully_shard
from megatron_fsdp_c.testing import Block

from support import rank_grid
from support.checks import recorder_cells, verify
from support.tiny_models import gpt, gpt_data, gpt_loss
from support.train_both import TrainBoth, shard_against_ddp

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)

AC_CASES = [("utils", "block", True), ("utils", "block", False), ("wrapper", "block", True),
            ("wrapper", "block", False), ("composable", "block", True), ("utils", "list", True),
            ("wrapper", "list", False), ("utils", "tied", True), ("wrapper", "tied", False)]


def checkpointing(rank, world, ck, impl, grouping, reshard):
    model = gpt(checkpoint=impl == "utils", tied=grouping == "tied")
    if impl == "wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    elif impl == "composable":
        from torch.distributed._composable import checkpoint
        for b in model.blocks:
            checkpoint(b)

    def shard(m):
        kw = {"reshard_after_forward": reshard}
        blocks = [mod for mod in m.modules() if isinstance(mod, Block)]  # inside the wrappers, as torch does
        if grouping == "list":
            fully_shard(blocks[0], **kw)
            fully_shard(blocks[1:], **kw)
            fully_shard([m.tok, m.pos], **kw)
            fully_shard([m.ln, m.head], **kw)
        elif grouping == "tied":
            fully_shard([m.tok, m.head], **kw)
            for b in blocks:
                fully_shard(b, **kw)
        else:
            for b in blocks:
                fully_shard(b, **kw)
        fully_shard(m, **kw)
    shard_against_ddp(ck, rank, world, model, shard, gpt_data, loss=gpt_loss)


for _impl, _grouping, _reshard in AC_CASES:
    cell(f"checkpointing[{_impl}-{_grouping}-{'reshard' if _reshard else 'keep'}]", impl=_impl, grouping=_grouping,
         reshard=_reshard)(checkpointing)


@cell("two_forwards[reshard]", reshard=True, ckpt=False)
@cell("two_forwards[keep]", reshard=False, ckpt=False)
@cell("two_forwards[reshard-checkpointed]", reshard=True, ckpt=True)
@cell("two_forwards[keep-checkpointed]", reshard=False, ckpt=True)
def two_forwards(rank, world, ck, reshard, ckpt):
    """Two forwards, one backward of a loss of both (as DPO does), nested groups three deep."""
    model = gpt(checkpoint=ckpt)
    ref = copy.deepcopy(model)
    kw = {"reshard_after_forward": reshard}
    for b in model.blocks:
        fully_shard(b.qkv, **kw)
        fully_shard(b.fc, **kw)
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    pair = TrainBoth(rank, world, model, ref, reference="mean", ck=ck)
    pair.run(2, lambda step, mb: (gpt_data(2 * step, rank), gpt_data(2 * step + 1, rank)),
             loss=lambda m, pairs: m(*pairs[0]) - 0.5 * m(*pairs[1]))
    pair.check_params()


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys()))
def test_training_behaviour(name, world):
    verify(CELLS, name, world)
