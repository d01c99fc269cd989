"""Per-rank data of the multi-rank tests: every rank draws its own batch, seeded by (step, rank),
so a reference can draw any rank's batch too (the global batch). Arguments run (step, rank, ...)
everywhere."""
from __future__ import annotations

import torch


def tokens(step: int, rank: int, shape, vocab: int) -> torch.Tensor:
    """Random token ids of `shape` below `vocab`."""
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 11)
    return torch.randint(0, vocab, shape, generator=g)


def next_token_batch(step: int, rank: int, vocab: int, seq: int, batch: int):
    """(inputs, next-token targets) of `batch` random sequences of length `seq`."""
    t = tokens(step, rank, (batch, seq + 1), vocab)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def local_batch(step: int, rank: int, shape, dtype=torch.float64) -> torch.Tensor:
    """Standard normal values of `shape` (drawn in float64, then cast)."""
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 3)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def global_batch(step: int, world: int, shape, dtype=torch.float64) -> torch.Tensor:
    """Every rank's local_batch, in rank order."""
    return torch.cat([local_batch(step, r, shape, dtype) for r in range(world)])
