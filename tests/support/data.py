"""Per-rank data of the multi-rank tests: every rank draws its own batch, seeded by (step, rank),
so a reference can draw any rank's batch too (global_batch). Arguments run (step, rank, ...)
everywhere. Or one batch, the same at every world size, split over the ranks (rank_share)."""
from __future__ import annotations

from typing import Callable

import torch


def tokens(step: int, rank: int, shape, vocab: int) -> torch.Tensor:
    """Random token ids of `shape` below `vocab`."""
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 11)
    return torch.randint(0, vocab, shape, generator=g)


def next_token_batch(step: int, rank: int, vocab: int, seq: int, batch: int):
    """(inputs, next-token targets) of `batch` random sequences of length `seq`."""
    t = tokens(step, rank, (batch, seq + 1), vocab)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def normal_batch(step: int, rank: int, shape, dtype=torch.float64) -> torch.Tensor:
    """Standard normal values of `shape` (drawn in float64, then cast)."""
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 3)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def global_batch(per_rank: Callable, step: int, world: int, *args, **kwargs):
    """Every rank's batch per_rank(step, rank, *args, **kwargs) (a tensor or a tuple of tensors),
    concatenated in rank order: what a single-process reference trains on."""
    parts = [per_rank(step, r, *args, **kwargs) for r in range(world)]
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return tuple(torch.cat(p) for p in zip(*parts))


def rank_share(batch: tuple, rank: int, world: int) -> tuple:
    """Rank `rank`'s rows of a global batch (a tuple of tensors) split evenly over `world` ranks:
    the same global batch at any world size (a checkpoint loaded at another)."""
    n = len(batch[0]) // world
    return tuple(t[n * rank:n * (rank + 1)] for t in batch)
