"""A Megatron-core style tensor-parallel GPT for the tests: megatron_fsdp_c.testing's TPGPT with
its linears split into local shards (tensor_model_parallel / partition_dim marked on them) and the
model doing its own collectives, sequence parallelism included."""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron_fsdp_c.testing import TPGPT


def _sum(x, group):
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _gather_seq(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _chunk_seq(x, group):
    return x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()


_OPS = {"id": lambda x, g: x, "sum": _sum, "gather": _gather_seq, "chunk": _chunk_seq,
        "reduce_scatter": lambda x, g: _chunk_seq(_sum(x, g), g)}


class _Region(torch.autograd.Function):
    """Megatron-LM's tensor-parallel region functions: one collective forward, its dual backward."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return _OPS[fwd](x, group)

    @staticmethod
    def backward(ctx, g):
        return _OPS[ctx.bwd](g, ctx.group), None, None, None


class MegatronLinear(nn.Module):
    """Megatron-core's ColumnParallelLinear / RowParallelLinear over a full nn.Linear's weights:
    this tp rank's shard, flagged tensor_model_parallel/partition_dim. Sequence parallel: the
    column-parallel input is all-gathered along the sequence, the row-parallel output
    reduce-scattered, and the row-parallel bias (added to a sequence shard) flagged
    sequence_parallel, as Megatron-core flags it."""

    def __init__(self, lin: nn.Linear, column: bool, group, sp: bool):
        super().__init__()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.column, self.group, self.sp = column, group, sp
        dim = 0 if column else 1
        self.weight = nn.Parameter(lin.weight.detach().chunk(size, dim)[rank].clone())
        self.weight.tensor_model_parallel, self.weight.partition_dim = True, dim
        self.bias = None
        if lin.bias is not None:
            self.bias = nn.Parameter(lin.bias.detach().chunk(size, 0)[rank].clone() if column else lin.bias.detach().clone())
            if column:
                self.bias.tensor_model_parallel, self.bias.partition_dim = True, 0
            else:
                self.bias.sequence_parallel = sp

    def forward(self, x):
        if self.column:
            x = _Region.apply(x, self.group, "gather" if self.sp else "id", "reduce_scatter" if self.sp else "sum")
            return F.linear(x, self.weight, self.bias)
        y = _Region.apply(F.linear(x, self.weight), self.group, "reduce_scatter" if self.sp else "sum",
                          "gather" if self.sp else "id")
        return y if self.bias is None else y + self.bias


class MegatronGPT(TPGPT):
    """TPGPT in Megatron-core's style: column/row-parallel local shards in the blocks, embeddings
    and head TP-duplicated, and (sequence parallel) the blocks and final norm on a sequence shard
    whose norm parameters are flagged sequence_parallel (unless `flag_norms` is False)."""

    def forward(self, idx, targets):
        x = self.embed(idx)
        if self.sp:
            x = _Region.apply(x, self.group, "chunk", "gather")
        for block in self.blocks:
            x = block(x)
        x = self.ln(x)
        if self.sp:
            x = _Region.apply(x, self.group, "gather", "chunk")
        logits = self.head(x).float() if x.dtype != torch.float64 else self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def megatronize(model: TPGPT, group, sp=True, flag_norms=True) -> MegatronGPT:
    model.__class__ = MegatronGPT
    model.group, model.sp = group, sp
    for block in model.blocks:
        for parent, name, column in ((block.attn, "q", True), (block.attn, "k", True), (block.attn, "v", True),
                                     (block.attn, "proj", False), (block.mlp, "fc", True), (block.mlp, "out", False)):
            setattr(parent, name, MegatronLinear(getattr(parent, name), column, group, sp))
    for ln in [b.ln1 for b in model.blocks] + [b.ln2 for b in model.blocks] + [model.ln]:
        for p in ln.parameters():
            p.sequence_parallel = sp and flag_norms
    return model
