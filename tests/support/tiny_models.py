"""Small models the multi-rank tests train, and how the per-module tests shard them."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_fsdp_c.testing import GPT, GPTConfig, batch

# ------------------------------------------------------------------------------------------
# a language model a user might write (tests/test_user_loops.py)

VOCAB, SEQ, D, HEADS, LAYERS, BATCH = 32, 8, 16, 2, 2, 2


class TinyBlock(nn.Module):
    """A pre-norm transformer block with causal self-attention and a GELU MLP."""

    def __init__(self, d: int = D, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embeddings, a stack of blocks, a final norm and an untied head. forward(idx, targets,
    skip=None) skips block `skip` (LayerDrop); poison=True adds an inf-gradient term."""

    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, targets, skip=None, poison=False):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if poison:  # d loss / d head.weight[0, 0] = inf (row 0 lives on the first rank's shard)
            loss = loss + self.head.weight[0, 0] * float("inf")
        return loss


def tiny_lm(seed: int = 0, layers: int = LAYERS) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(layers).to(torch.float64)


# ------------------------------------------------------------------------------------------
# the per-module API's behaviour cells (tests/test_per_module_*.py)

CFG = GPTConfig(vocab=32, seq=8, d=16, heads=2, layers=3)


class MLP(nn.Module):
    def __init__(self, dim: int, mult: int = 2, bias: bool = True):
        super().__init__()
        self.up = nn.Linear(dim, mult * dim, bias=bias)
        self.down = nn.Linear(mult * dim, dim, bias=bias)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class MLPStack(nn.Sequential):
    checkpointed = False

    def forward(self, x):
        for mlp in self:
            if self.checkpointed and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False)
            else:
                x = mlp(x)
        return x


def mlp_stack(n: int = 3, dim: int = 8) -> MLPStack:
    torch.manual_seed(42)
    return MLPStack(*[MLP(dim) for _ in range(n)]).double()


def gpt(**over) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(CFG, **over)).double()


def gpt_data(step, rank):
    return batch(CFG, 2, seed=100 * step + rank)


def gpt_loss(m, xy):
    return m(*xy)


class Named(nn.Module):
    """The reference with its parameters named as MegatronFSDP names its own ('module.' + name)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        return self.module(*args)


def shard_blocks(model, **kw):
    """The per-module API's usual grouping: every block, then the root."""
    from megatron_fsdp_c.per_module import fully_shard
    for b in model.blocks:
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model
