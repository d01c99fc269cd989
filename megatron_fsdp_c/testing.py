"""Shared by the tests, the example and the benchmarks, not the library's API: a plain GPT model
(and the VLM and tensor-parallel variants the tests use) and a helper that runs a function on N
real processes (gloo on CPU) and returns what each rank returned."""
from __future__ import annotations

import dataclasses
import os
import pickle
import time
import tempfile
import traceback
from typing import Any, Callable, List, Optional

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "Block", "VLM", "TPGPT", "TPBlock", "init_distributed", "parallelize_tp", "run_on_ranks"]


@dataclasses.dataclass
class GPTConfig:
    vocab: int = 256
    seq: int = 32
    d: int = 64
    heads: int = 4
    layers: int = 2
    tied: bool = False          # share the token embedding with the output head
    checkpoint: bool = False    # torch.utils.checkpoint around every block


class Block(nn.Module):
    """Pre-norm transformer block: LN, fused qkv, causal SDPA, out proj, LN, 4x GELU MLP.

    The qkv projection has no bias: the key bias has an exactly-zero true gradient (softmax is
    shift invariant), so its computed gradient is pure rounding noise that Adam would amplify
    into lr-sized steps, and no two reduction orders (DDP's or anyone's) would agree on it."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d)
        self.qkv = nn.Linear(cfg.d, 3 * cfg.d, bias=False)
        self.proj = nn.Linear(cfg.d, cfg.d)
        self.ln2 = nn.LayerNorm(cfg.d)
        self.fc = nn.Linear(cfg.d, 4 * cfg.d)
        self.out = nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            if self.cfg.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the loss in fp32 or wider
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TowerBlock(nn.Module):
    """One of the many small layers of a vision tower."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.mix(self.norm(x)))


class VLM(nn.Module):
    """A vision-language model: a tower of small blocks (usually frozen and replicated with
    fsdp_no_shard), a projector, and a GPT language model conditioned on the pooled image."""

    def __init__(self, cfg: GPTConfig, image_dim: int = 16, tower_layers: int = 6):
        super().__init__()
        self.tower = nn.Sequential(*[TowerBlock(image_dim) for _ in range(tower_layers)])
        self.proj = nn.Linear(image_dim, cfg.d)
        self.lm = GPT(cfg)

    def forward(self, image, idx, targets):
        lm = self.lm
        t = idx.shape[1]
        picture = self.proj(self.tower(image)).mean(dim=1, keepdim=True)
        x = lm.tok(idx) + lm.pos(torch.arange(t, device=idx.device)) + picture
        for block in lm.blocks:
            x = block(x)
        logits = lm.head(lm.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TPAttention(nn.Module):
    """Causal self-attention with separate q, k, v projections, so that torch's ColwiseParallel
    splits them by heads; the number of heads is read from the (local) shapes."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.d // cfg.heads
        self.q = nn.Linear(cfg.d, cfg.d, bias=False)  # no q, k bias: see Block's docstring
        self.k = nn.Linear(cfg.d, cfg.d, bias=False)
        self.v = nn.Linear(cfg.d, cfg.d)
        self.proj = nn.Linear(cfg.d, cfg.d)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, t = q.shape[:2]  # the projections' (a sequence-parallel input may be a shard of the sequence)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, t, -1))


class TPMLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d, 4 * cfg.d)
        self.out = nn.Linear(4 * cfg.d, cfg.d)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class TPBlock(nn.Module):
    """GPT's pre-norm block shaped for tensor parallelism as torchtitan's Llama is: the norms
    outside the attention and MLP modules, whose linears torch's TP styles split."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d)
        self.attn = TPAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d)
        self.mlp = TPMLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TPEmbedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d)
        self.pos = nn.Embedding(cfg.seq, cfg.d)

    def forward(self, idx):
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class TPGPT(nn.Module):
    """The GPT above with TPBlock blocks: a model torch's tensor-parallel plans apply to
    (parallelize_tp). Unparallelised, it is a plain single-device model (the reference)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = TPEmbedding(cfg)
        self.blocks = nn.ModuleList(TPBlock(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d)
        self.head = nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for block in self.blocks:
            if self.cfg.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln(x))
        if targets is None:
            return logits
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parallelize_tp(model: TPGPT, tp_mesh, sequence_parallel: bool = True) -> TPGPT:
    """torch's tensor-parallel plan for TPGPT on `tp_mesh` (torchtitan's for Llama). With
    sequence_parallel, every parameter becomes a DTensor: embeddings row-wise with
    sequence-sharded outputs, the norms SequenceParallel (Replicate() weights whose gradients
    come back Partial()), the head column-wise gathering the logits. Without it, only the
    blocks' linears are split and the norms and embeddings stay plain (TP-duplicated)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    sp = sequence_parallel
    for block in model.blocks:
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                "mlp.fc": ColwiseParallel(),
                "mlp.out": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
        if sp:
            plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(block, tp_mesh, plan)
    if sp:
        parallelize_module(model, tp_mesh, {
            "embed.tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "embed.pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "ln": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    return model


def image_batch(batch_size: int, seed: int, patches: int = 4, image_dim: int = 16, device="cpu"):
    g = torch.Generator().manual_seed(seed + 7919)
    return torch.randn(batch_size, patches, image_dim, generator=g).to(device)


def batch(cfg: GPTConfig, batch_size: int, seed: int, device="cpu"):
    """(inputs, targets) of a learnable synthetic language: each next token is 5 * token + 3
    (mod vocab), except for 10% random tokens. Seeded, so every rank can draw its own."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.empty(batch_size, cfg.seq + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, cfg.vocab, (batch_size,), generator=g)
    noise = torch.rand(batch_size, cfg.seq, generator=g) < 0.1
    random_tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq), generator=g)
    for t in range(cfg.seq):
        rule = (5 * seq[:, t] + 3) % cfg.vocab
        seq[:, t + 1] = torch.where(noise[:, t], random_tokens[:, t], rule)
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def init_distributed():
    """Under torchrun: NCCL on the local GPU when CUDA is available, else gloo on the CPU.
    Returns (rank, world, device)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


# ------------------------------------------------------------------------------------------
# multi-process runner


# [Note: the rendezvous port]
# Rank 0 opens the group's store on a port the kernel picks (port 0) and publishes it as a file in
# the run's directory; the other ranks read it there. (It was a port probed and closed by the
# parent and bound by rank 0 seconds later: in that window another run's gloo, whose listeners
# take ports the same way, could bind it, and that run's ranks would then talk to the wrong
# process -- a race open whenever two runs start side by side, [Note: spawns side by side] in
# tests/support/spawns.py.)
def _rendezvous(rank: int, world: int, out_dir: str, timeout_s: float):
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    path = os.path.join(out_dir, "port")
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
        with open(path + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(path + ".tmp", path)  # whole or absent: a reader never sees half a number
        return store
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 published no rendezvous port in {timeout_s:.0f} s")
        time.sleep(0.01)
    with open(path) as f:
        port = int(f.read())
    return dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)


# [Note: ranks start from a forkserver]
# Each rank is forked from one forkserver process per parent that has imported torch and this
# package once (`_RANK_PRELOAD`), instead of being spawned: a spawned rank imports torch again, ~4
# CPU-seconds each (the test suite starts ~40 ranks). The forkserver starts as a fresh
# interpreter (it is not a fork of the caller), holds no process group, runs no torch op and
# starts no thread of its own, so forking it is safe. Its children get the caller's sys.path and
# main module as spawned ones do; the environment is the forkserver's, from its start, so each
# rank takes the caller's current one (`env` of _worker) before it does anything else.
_RANK_PRELOAD = ["torch", "torch.distributed", "megatron_fsdp_c", "megatron_fsdp_c.testing"]
_rank_context = None


def _ranks_context():
    global _rank_context
    if _rank_context is None:
        if "forkserver" in mp.get_all_start_methods():
            _rank_context = mp.get_context("forkserver")
            _rank_context.set_forkserver_preload(_RANK_PRELOAD)
        else:
            _rank_context = mp.get_context("spawn")
    return _rank_context


def _worker(rank: int, world: int, out_dir: str, fn: Callable, args: tuple, kwargs: dict,
            timeout_s: float, env: Optional[dict] = None):
    import datetime

    import torch.distributed as dist

    if env is not None:  # the caller's environment now, not the forkserver's ([Note: ranks start from a forkserver])
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result: Any
    try:
        store = _rendezvous(rank, world, out_dir, timeout_s)  # [Note: the rendezvous port]
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = ("ok", fn(rank, world, *args, **kwargs))
    except BaseException as e:  # reported to the parent, which raises
        result = ("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    try:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        if dist.is_initialized():
            try:
                if result[0] == "ok":
                    dist.barrier()  # no rank tears gloo down while a peer still talks to it
                dist.destroy_process_group()
            except Exception:
                pass


def run_on_ranks(fn: Callable, world: int, *args, timeout_s: float = 240.0, raise_errors: bool = True,
                 **kwargs) -> List[Any]:
    """Runs fn(rank, world, *args) on `world` processes (forked from a forkserver, [Note: ranks start
    from a forkserver]) in one gloo group; returns the
    per-rank results. Any rank's exception is re-raised here; a hang is killed after timeout_s.
    raise_errors=False returns (status, value) per rank instead: 'ok', 'error' (the traceback
    text) or 'dead' (no result: the exit code)."""
    ctx = _ranks_context()
    with tempfile.TemporaryDirectory() as out_dir:
        env = dict(os.environ)
        procs = [ctx.Process(target=_worker, args=(r, world, out_dir, fn, args, kwargs, timeout_s, env),
                             daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s + 30)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors, outcomes = [], [], []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}{', hung' if r in hung else ''})")
                results.append(None)
                outcomes.append(("dead", procs[r].exitcode))
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(value)
            results.append(value)
            outcomes.append((status, value))
        if not raise_errors:
            return outcomes
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
