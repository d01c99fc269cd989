"""A small expert-parallel mixture-of-experts language model for the MoE tests (tests/test_moe.py,
benchmarks/run.py's `moe` part).

Each block is a dense part (LayerNorm + Linear, no attention) and an MoE layer: a top-k router
(softmax gates, k=2), token dispatch by all-to-all over the expert-parallel (ep) group, the rank's
local experts (small MLPs, one module `LocalExperts` so fully_shard can shard them as one group),
and the combine. Built with ep_size=1 (all experts local, no collective) the same module is the
single-process reference on the global batch: the layer is token-wise, so the global batch's
result is the concatenation of the ranks' results.

Options: `skew` adds a router bias that depends on the rank a token comes from (`src`), so
different ranks send different token counts to each expert; `dead_expert` masks one expert out
of the router, so it gets no token on any rank.

Expert names are their global ids (`experts.e.3`), so a checkpoint's keys say which expert a
tensor is, whatever the ep rank that holds it.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D, HIDDEN, EXPERTS, TOP_K, LAYERS = 32, 8, 12, 4, 2, 2
# torch 2.13 deprecates it for _functional_collectives' version; this one has autograd on gloo
warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)
SKEW = 3.0  # the rank-dependent router bias: tokens of rank r lean towards expert r % EXPERTS


class Expert(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d, hidden)
        self.w2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class LocalExperts(nn.Module):
    """The experts this rank holds, keyed by global id; forward(x, local_ids) runs each on its rows.
    An expert with no rows is not called, so it gets no gradient (as under DDP)."""

    def __init__(self, d: int, hidden: int, n: int):
        super().__init__()
        self.e = nn.ModuleDict({str(i): Expert(d, hidden) for i in range(n)})
        self.ids = list(range(n))  # global ids of the local experts, in local order

    def keep(self, ids) -> None:
        for i in self.ids:
            if i not in ids:
                del self.e[str(i)]
        self.ids = list(ids)

    def forward(self, x, local_ids):
        # x * 0, not zeros: the output depends on x even when no expert runs here, so the
        # all-to-all's backward (a collective) runs on every rank of the ep group
        out = x * 0
        for j, i in enumerate(self.ids):
            rows = (local_ids == j).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_copy(0, rows, self.e[str(i)](x[rows]))
        return out


class MoE(nn.Module):
    def __init__(self, d: int, hidden: int, n_experts: int, k: int):
        super().__init__()
        self.n, self.k = n_experts, k
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = LocalExperts(d, hidden, n_experts)
        self.ep_group, self.ep_size = None, 1
        self.skew, self.dead_expert = False, None

    def forward(self, x, src):
        logits = self.router(x)
        if self.skew:
            logits = logits + SKEW * F.one_hot(src % self.n, self.n).to(logits.dtype)
        if self.dead_expert is not None:
            mask = torch.zeros(self.n, dtype=torch.bool)
            mask[self.dead_expert] = True
            logits = logits.masked_fill(mask, float("-inf"))
        gate, eid = logits.softmax(-1).topk(self.k, dim=-1)
        eid, gate = eid.reshape(-1), gate.reshape(-1)
        tok = torch.arange(x.shape[0]).repeat_interleave(self.k)
        order = torch.argsort(eid, stable=True)
        eid, gate, tok = eid[order], gate[order], tok[order]
        xs = x[tok]
        counts = torch.bincount(eid, minlength=self.n)  # rows per global expert, sent in expert order
        self.last_counts = counts
        if self.ep_size > 1:
            n_local = self.n // self.ep_size
            got = torch.empty_like(counts)  # per source rank, the rows for each of my experts
            dist.all_to_all_single(got, counts, group=self.ep_group)
            sent = counts.view(self.ep_size, n_local).sum(1).tolist()
            recv = got.view(self.ep_size, n_local).sum(1).tolist()
            xr = dist_fn.all_to_all_single(x.new_empty(sum(recv), x.shape[1]), xs, recv, sent, group=self.ep_group)
            local_ids = torch.arange(n_local).repeat(self.ep_size).repeat_interleave(got)
            y = self.experts(xr, local_ids)
            y = dist_fn.all_to_all_single(x.new_empty(sum(sent), x.shape[1]), y, sent, recv, group=self.ep_group)
        else:
            y = self.experts(xs, eid)
        return torch.zeros_like(x).index_add(0, tok, y * gate[:, None])


class MoEBlock(nn.Module):
    def __init__(self, d: int, hidden: int, n_experts: int, k: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.dense = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.moe = MoE(d, hidden, n_experts, k)

    def forward(self, x, src):
        x = x + self.dense(self.norm(x))
        b, s, d = x.shape
        return x + self.moe(self.norm2(x).reshape(b * s, d), src.repeat_interleave(s)).view(b, s, d)


class MoEModel(nn.Module):
    """Embedding, LAYERS MoE blocks, a final norm and a head; forward(idx, targets, src) returns the
    mean cross-entropy, src the rank each row of idx comes from."""

    def __init__(self, vocab: int = VOCAB, d: int = D, hidden: int = HIDDEN, n_experts: int = EXPERTS,
                 k: int = TOP_K, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(MoEBlock(d, hidden, n_experts, k) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets, src):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, src)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def configure(self, *, skew: bool = False, dead_expert: Optional[int] = None) -> "MoEModel":
        for b in self.blocks:
            b.moe.skew, b.moe.dead_expert = skew, dead_expert
        return self

    def expert_parallel(self, ep_group, ep_rank: int, ep_size: int) -> "MoEModel":
        """Keeps experts [ep_rank * n/ep_size, (ep_rank + 1) * n/ep_size) (call before sharding)."""
        for b in self.blocks:
            n_local = b.moe.n // ep_size
            b.moe.experts.keep(range(ep_rank * n_local, (ep_rank + 1) * n_local))
            b.moe.ep_group, b.moe.ep_size = ep_group, ep_size
        return self


def moe_model(seed: int = 0, dtype=torch.float64, **config) -> MoEModel:
    torch.manual_seed(seed)
    return MoEModel().to(dtype).configure(**config)


def moe_batch(step: int, rank: int, rows: int = 2, seq: int = 6, vocab: int = VOCAB):
    """(idx, targets, src) of one rank's rows at `step`."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, vocab, (rows, seq), generator=g)
    targets = torch.randint(0, vocab, (rows, seq), generator=g)
    return idx, targets, torch.full((rows,), rank, dtype=torch.long)
