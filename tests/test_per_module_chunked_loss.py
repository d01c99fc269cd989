"""Chunked losses through a module of a list group, and training on after an exception, with
megatron_fsdp_c.per_module.fully_shard, tested after torch's own FSDP2 suite
(test/distributed/_composable/fsdp/test_fully_shard_training.py) through public APIs only,
against a plain replica whose gradients are averaged over the ranks, float64 to rtol 1e-9 at
world 2. The cells run in the shared spawns (see [Note: one spawn per world size] in
support/rank_grid.py).

Behaviours (cell names):
- a chunked loss: the model runs without its head, then the head (a member of a list group, or its
  own group, or sharing its weight with the embedding) runs per chunk with its own backward:
  chunked_head; with gradient accumulation (set_requires_gradient_sync, set_is_last_backward):
  chunked_head_accumulation; set_reshard_after_forward/backward(False) around the chunk loop, then
  reshard(): head_reshard_toggle; two partial forwards, then one backward (the head unused):
  two_partial_forwards
- an exception inside a forward, then training goes on: exception_then_train
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron_fsdp_c.per_module import fully_shard

from support import rank_grid
from support.checks import full, recorder_cells, verify
from support.data import normal_batch, tokens
from support.train_both import TrainBoth, average_grads

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)


VOCAB, SEQ, NCHUNK = 24, 8, 4


class ChunkedHead(nn.Module):
    def __init__(self, dim: int = 16, vocab: int = VOCAB, tie: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, toks, skip_head: bool = False):
        h = self.norm(torch.tanh(self.body(self.embed(toks))))
        return h if skip_head else self.head(h)


def chunked_model(tie: bool = False) -> ChunkedHead:
    torch.manual_seed(42)
    return ChunkedHead(tie=tie).double()


def shard_chunked(m, grouping, **kw):
    if grouping == "tied":
        fully_shard(m.body, **kw)
        fully_shard([m.embed, m.norm, m.head], **kw)
    else:
        fully_shard(m.embed, **kw)
        fully_shard(m.body, **kw)
        if grouping == "grouped":
            fully_shard([m.norm, m.head], **kw)
        else:
            fully_shard(m.norm, **kw)
            fully_shard(m.head, **kw)
    fully_shard(m, **kw)


def run_chunked(m, toks, targets, snapshot=None, around_chunks=None):
    """The model without its head, then the head per chunk of the sequence with a backward each,
    then the backward of the rest from the chunks' input gradients."""
    h = m(toks, skip_head=True)
    if around_chunks:
        around_chunks[0]()
    grads, total, snaps = [], 0.0, []
    for c, t in zip(h.detach().chunk(NCHUNK, dim=1), targets.chunk(NCHUNK, dim=1)):
        c = c.contiguous().requires_grad_(True)
        loss = F.cross_entropy(m.head(c).flatten(0, 1), t.flatten(), reduction="sum")
        loss.backward()
        total = total + loss.detach()
        grads.append(c.grad)
        if snapshot:
            snaps.append(snapshot(m.head.weight.grad))
    if around_chunks:
        around_chunks[1]()
    h.backward(torch.cat(grads, dim=1))
    return total, snaps


def _averaged(t, world):
    t = t.clone()
    dist.all_reduce(t)
    return t / world


def chunk_batch(rank):
    """This rank's (tokens, targets) of a step."""
    return lambda step, mb: (tokens(step, rank, (2, SEQ), VOCAB), tokens(step + 50, rank, (2, SEQ), VOCAB))


def chunked(snapshot=None, around_chunks=None, snaps=None):
    """run_chunked as a TrainBoth forward_backward: the loss; the snapshots go to snaps[:]."""
    def forward_backward(m, batch):
        loss, taken = run_chunked(m, *batch, snapshot=snapshot, around_chunks=around_chunks)
        if snaps is not None:
            snaps[:] = taken
        return loss
    return forward_backward


@cell("chunked_head[grouped-reshard]", grouping="grouped", reshard=True)
@cell("chunked_head[grouped-keep]", grouping="grouped", reshard=False)
@cell("chunked_head[ungrouped-reshard]", grouping="ungrouped", reshard=True)
@cell("chunked_head[tied-reshard]", grouping="tied", reshard=True)
@cell("chunked_head[tied-keep]", grouping="tied", reshard=False)
def chunked_head(rank, world, ck, grouping, reshard):
    model = chunked_model(grouping == "tied")
    ref = copy.deepcopy(model)
    shard_chunked(model, grouping, reshard_after_forward=reshard)
    ours, theirs = [], []

    def every_chunk_adds_its_share(step):
        for i, (a, b) in enumerate(zip(ours, theirs)):
            ck.close(f"step {step}: head.weight.grad after chunk {i}", a, _averaged(b, world))
    pair = TrainBoth(rank, world, model, ref, reference="mean", ck=ck)
    pair.run(3, chunk_batch(rank), forward_backward=chunked(lambda g: full(g).clone(), snaps=ours),
             ref_forward_backward=chunked(lambda g: g.clone(), snaps=theirs), set_to_none=lambda step: step % 2 == 0,
             after_step=every_chunk_adds_its_share)
    pair.check_params()


@cell("chunked_head_accumulation[reshard]", reshard=True)
@cell("chunked_head_accumulation[keep]", reshard=False)
def chunked_head_accumulation(rank, world, ck, reshard):
    model = chunked_model()
    ref = copy.deepcopy(model)
    shard_chunked(model, "grouped", reshard_after_forward=reshard)

    def flags(step, mb):
        model.set_requires_gradient_sync(mb == 2)
        model.set_is_last_backward(mb == 2)
    pair = TrainBoth(rank, world, model, ref, reference="mean", ck=ck)
    pair.run(2, lambda step, mb: chunk_batch(rank)(10 * step + mb, 0), micro=3, forward_backward=chunked(),
             before_micro=flags, check_loss=False)
    pair.check_params()


@cell("head_reshard_toggle[untied-kept]", tie=False, initial=False)
@cell("head_reshard_toggle[untied-resharded]", tie=False, initial=True)
@cell("head_reshard_toggle[tied-kept]", tie=True, initial=False)
@cell("head_reshard_toggle[tied-resharded]", tie=True, initial=True)
def head_reshard_toggle(rank, world, ck, tie, initial):
    """torchtitan's chunked cross-entropy: the head group stays gathered through the chunk loop
    (reshard after forward/backward off), then is released explicitly."""
    model = chunked_model(tie)
    ref = copy.deepcopy(model)
    if tie:
        fully_shard(model.body)
        fully_shard([model.embed, model.norm, model.head], reshard_after_forward=initial)
    else:
        fully_shard(model.embed)
        fully_shard(model.body)
        fully_shard([model.norm, model.head], reshard_after_forward=initial)
    fully_shard(model)

    def keep():
        model.head.set_reshard_after_forward(False)
        model.head.set_reshard_after_backward(False)

    def release():
        model.head.set_reshard_after_forward(True)
        model.head.set_reshard_after_backward(True)
        model.head.reshard()
    pair = TrainBoth(rank, world, model, ref, reference="mean", ck=ck)
    pair.run(3, chunk_batch(rank), forward_backward=chunked(around_chunks=(keep, release)),
             ref_forward_backward=chunked(), set_to_none=lambda step: step % 2 == 0)
    pair.check_params()


@cell("two_partial_forwards")
def two_partial_forwards(rank, world, ck):
    model = chunked_model()
    ref = copy.deepcopy(model)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    t1, t2 = tokens(1, rank, (2, SEQ), VOCAB), tokens(2, rank, (2, SEQ), VOCAB)
    w1, w2 = normal_batch(3, 0, (2, SEQ, 16)), normal_batch(4, 0, (2, SEQ, 16))
    for m in (model, ref):
        h1 = m(t1, skip_head=True)
        h2 = m(t2, skip_head=True)
        ((h1 * w1).sum() + (h2 * w2).sum()).backward()
    average_grads(ref, world)
    ck.grads("two partial forwards, one backward", model, ref)  # head.weight.grad None in both
    ck.true("head unused: its gradient is None", model.head.weight.grad is None)


class Raiser(nn.Module):
    def __init__(self, wrapped):
        super().__init__()
        self.wrapped = wrapped
        self.armed = False

    def forward(self, x):
        if self.armed:
            raise RuntimeError("boom")
        return self.wrapped(x)


@cell("exception_then_train[first-forward]", sharded_raiser=False, after_step=False)
@cell("exception_then_train[inside-a-group-after-a-step]", sharded_raiser=True, after_step=True)
def exception_then_train(rank, world, ck, sharded_raiser, after_step):
    model = chunked_model()
    model.body = Raiser(model.body)
    ref = copy.deepcopy(model)
    if sharded_raiser:
        fully_shard(model.body)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    pair = TrainBoth(rank, world, model, ref, reference="mean", ck=ck)

    def train(first, steps):
        pair.run(steps, chunk_batch(rank), first=first,
                 loss=lambda m, batch: F.cross_entropy(m(batch[0]).flatten(0, 1), batch[1].flatten()))
    if after_step:
        train(0, 1)
    model.body.armed = True
    try:
        model(tokens(9, rank, (2, SEQ), VOCAB), skip_head=True)
        raised = False
    except RuntimeError as e:
        raised = "boom" in str(e)
    model.body.armed = False
    ck.true("the armed forward raised", raised)
    train(1, 2)
    pair.check_params()


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys()))
def test_training_behaviour(name, world):
    verify(CELLS, name, world)
