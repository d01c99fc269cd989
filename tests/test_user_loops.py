"""Training loops as users write them (issue 12), each against DistributedDataParallel on the
same seed and per-rank data, for every strategy at world sizes 2 and 4, in float64 to rtol 1e-9
(a wrong algorithm is off by ~1e-3; reduction-order rounding by ~1e-13):

- LR schedulers (LambdaLR; transformers' warmup-cosine) built after fully_shard, and LambdaLR
  built before it, with clip_grad_norm_ every step (the returned norm is compared too);
- two optimizers (AdamW on the blocks, SGD with momentum on the rest) with interleaved
  step/zero_grad; opt_a.zero_grad() must leave opt_b's gradients alone;
- an MoE-like model whose router never picks one expert on any rank (globally unused: `.grad`
  stays None, so AdamW's weight decay leaves it as DDP does) and picks another on some ranks only;
- LayerDrop with a rank-dependent skip (the graph differs across ranks), and with the same skip
  on every rank (a block globally unused on some steps only);
- optimizer protocols: test_user_loops_optimizer.py.

The cells run in the shared spawn of their world size; a rank that dies (gloo aborts the process
when collectives of different sizes meet) fails its own cell only: see [Note: crash-tolerant
grids] in support/spawns.py.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf

from support import rank_grid
from support.checks import assert_named, check_params, check_values, strip, to_full
from support.data import next_token_batch
from support.schedulers import build_scheduler
from support.tiny_models import BATCH, D, SEQ, VOCAB, TinyBlock, tiny_lm

STRATEGIES = [0, 1, 2, 3]
WORLDS = [2, 4]
COLLECTIVE_TIMEOUT = 15.0   # seconds; the library raises instead of waiting longer
STEPS = 4
CELLS = rank_grid.Cells(__name__)


def lm_batch(step, rank):
    """This rank's (inputs, targets) of a step."""
    return next_token_batch(step, rank, VOCAB, SEQ, BATCH)


def ref_params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def reference(key, run, *args):
    """A scenario's DDP run, once per spawn: it is the same for every strategy."""
    return rank_grid.once((__name__,) + key, run, *args)
MAX_NORM = 0.5   # below the gradient norms of these runs: clipping is active every step


def shard(model, optimizer, strategy, unit=TinyBlock, **kwargs):
    return mf.fully_shard(model, optimizer, fsdp_unit_modules=[unit], zero_dp_strategy=strategy,
                          collective_timeout=COLLECTIVE_TIMEOUT, **kwargs)


def adamw(params, lr=1e-2):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


# -- 1. learning-rate schedulers -------------------------------------------------------------------

def scheduler_factory(kind):
    if kind == "warmup_cosine":
        from transformers import get_cosine_schedule_with_warmup
        return lambda opt: get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=STEPS + 1)
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + step))


def scheduler_loop(model, optimizer, scheduler, rank):
    out = dict(losses=[], norms=[], lrs=[])
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
        out["norms"].append(float(to_full(norm)))
        out["lrs"].append(scheduler.get_last_lr()[0])
    return out


def ddp_scheduler(rank, kind):
    ref = tiny_lm()
    ref_opt = adamw(ref.parameters())
    out = scheduler_loop(DDP(ref), ref_opt, scheduler_factory(kind)(ref_opt), rank)
    return dict(out, params=ref_params(ref))


def scheduler_cell(rank, world, strategy, kind):
    before = kind.endswith("_before_shard")
    kind = kind.replace("_before_shard", "")
    factory = scheduler_factory(kind)
    theirs = reference(("scheduler", kind), ddp_scheduler, rank, kind)

    model = tiny_lm()
    optimizer = adamw(model.parameters())
    if before:
        scheduler = factory(optimizer)
        fsdp, optimizer = shard(model, optimizer, strategy)
        why = ""
    else:
        fsdp, optimizer = shard(model, optimizer, strategy)
        # issue 12: this raised; then the loop goes on with the same schedule applied by hand
        scheduler, why = build_scheduler(factory, optimizer)
    ours = scheduler_loop(fsdp, optimizer, scheduler, rank)
    checks = {} if before else {"the scheduler builds on the sharded optimizer": (not why, why)}
    checks.update({
        "losses": check_values("losses", ours["losses"], theirs["losses"]),
        "clip_grad_norm_ returns DDP's norm": check_values("norms", ours["norms"], theirs["norms"]),
        "learning rates": check_values("lrs", ours["lrs"], theirs["lrs"]),
        "final parameters": check_params(fsdp.full_parameters(), theirs["params"]),
    })
    return checks


# -- 2. two optimizers over disjoint parts of one model -------------------------------------------

def in_blocks(name):
    return strip(name).startswith("blocks.")


def ddp_two_optimizers(rank):
    ref = tiny_lm()
    ddp = DDP(ref)
    ref_a = adamw([p for n, p in ref.named_parameters() if in_blocks(n)])
    ref_b = torch.optim.SGD([p for n, p in ref.named_parameters() if not in_blocks(n)], lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = ddp(x, y)
        loss.backward()
        ref_a.step()
        ref_a.zero_grad()
        ref_b.step()
        ref_b.zero_grad()
        ref_losses.append(loss.item())
    return dict(losses=ref_losses, params=ref_params(ref))


def two_optimizers_cell(rank, world, strategy):
    theirs = reference(("two_optimizers",), ddp_two_optimizers, rank)
    model = tiny_lm()
    # opt_a goes through fully_shard; opt_b is built on the sharded model's parameters afterwards
    opt_a = adamw([p for n, p in model.named_parameters() if in_blocks(n)])
    fsdp, opt_a = shard(model, opt_a, strategy)
    opt_b = mf.fully_shard_optimizer(
        torch.optim.SGD([p for n, p in fsdp.named_parameters() if not in_blocks(n)], lr=0.1, momentum=0.9))
    b_params = {n: p for n, p in fsdp.named_parameters() if not in_blocks(n)}
    losses, intact_problems = [], []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = fsdp(x, y)
        loss.backward()
        before = {n: None if p.grad is None else p.grad.to_local().clone() for n, p in b_params.items()}
        opt_a.step()
        opt_a.zero_grad()
        for n, p in b_params.items():
            if before[n] is None:
                intact_problems.append(f"step {step}: {strip(n)}.grad was None already after backward")
            elif p.grad is None:
                intact_problems.append(f"step {step}: opt_a.zero_grad() set {strip(n)}.grad to None")
            elif not torch.equal(p.grad.to_local(), before[n]):
                intact_problems.append(f"step {step}: opt_a.zero_grad() changed {strip(n)}.grad "
                                       f"(max |change| {(p.grad.to_local() - before[n]).abs().max().item():.3g})")
        opt_b.step()
        opt_b.zero_grad()
        losses.append(loss.item())
    return {
        "opt_a.zero_grad() leaves opt_b's .grad intact": (not intact_problems, "; ".join(intact_problems[:3])),
        "losses": check_values("losses", losses, theirs["losses"]),
        "final parameters": check_params(fsdp.full_parameters(), theirs["params"]),
    }


def grad_none_check(ours, theirs):
    """A check entry: per step, the (stripped) names whose .grad is None after the sync, ours vs DDP's."""
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            extra, missing = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            return False, (f"step {step}: .grad None on {len(a)} parameters, DDP on {len(b)}; None only here: "
                           f"{extra[:3]}{'...' if len(extra) > 3 else ''}, only in DDP: "
                           f"{missing[:3]}{'...' if len(missing) > 3 else ''}")
    return True, ""


def grad_none_names(named_parameters):
    return sorted(strip(n) for n, p in named_parameters if p.grad is None)


# -- 3. MoE with a globally unused and a rank-locally unused expert -------------------------------

EXPERTS, NEVER, SOME_RANKS = 4, 3, 2


class MoEBlock(nn.Module):
    """Top-1 routing over small expert MLPs; an expert that gets no token is not run at all (its
    parameters are outside the graph, as in most MoE code)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
                                     for _ in range(EXPERTS))

    def forward(self, x, allowed):
        h = self.norm(x).reshape(-1, D)
        logits = self.router(h).masked_fill(~allowed, float("-inf"))
        weight, choice = F.softmax(logits, dim=-1).max(dim=-1)
        out = torch.zeros_like(h)
        counts = []
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(1)
            counts.append(idx.numel())
            if idx.numel():
                out = out.index_add(0, idx, expert(h[idx]) * weight[idx, None])
        self.counts = counts
        return x + out.view_as(x)


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, targets, allowed):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x, allowed)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def never_used(name):
    return f".experts.{NEVER}." in name


def tiny_moe():
    torch.manual_seed(0)
    return TinyMoE().to(torch.float64)


def experts_allowed(rank):
    return torch.tensor([True, True, rank % 2 == 0, False])  # expert 2: even ranks only; expert 3: none


def ddp_moe(rank):
    ref = tiny_moe()
    allowed = experts_allowed(rank)
    ddp = DDP(ref, find_unused_parameters=True)
    ref_opt = adamw(ref.parameters())
    ref_losses, ref_unused_after, usage, ref_grads_seen, ref_none = [], [], [], [], []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = ddp(x, y, allowed)
        loss.backward()
        usage.append([list(b.counts) for b in ref.blocks])
        ref_none.append(grad_none_names(ref.named_parameters()))
        ref_grads_seen += [n for n, p in ref.named_parameters() if never_used(n) and p.grad is not None]
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
        ref_unused_after.append({n: p.detach().clone() for n, p in ref.named_parameters() if never_used(n)})
    used_some = [sum(u[b][SOME_RANKS] for u in usage) for b in range(2)]
    valid = (not ref_grads_seen and all(u[b][NEVER] == 0 for u in usage for b in range(2))
             and all((c > 0) == (rank % 2 == 0) for c in used_some))
    return dict(losses=ref_losses, unused_after=ref_unused_after, none=ref_none, params=ref_params(ref),
                valid=(valid, f"expert usage per step/block {usage}; DDP grads of expert 3: {ref_grads_seen}"))


def moe_cell(rank, world, strategy):
    theirs = reference(("moe",), ddp_moe, rank)
    model = tiny_moe()
    allowed = experts_allowed(rank)
    fsdp, optimizer = shard(model, adamw(model.parameters()), strategy, unit=MoEBlock)
    losses, grad_not_none, unused_steps, none = [], [], [], []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = fsdp(x, y, allowed)
        loss.backward()
        grad_not_none += [f"step {step}: {strip(n)}" for n, p in fsdp.named_parameters()
                          if never_used(n) and p.grad is not None]
        none.append(grad_none_names(fsdp.named_parameters()))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        full = fsdp.full_parameters()
        ok, message = check_params({n: t for n, t in full.items() if never_used(n)}, theirs["unused_after"][step])
        unused_steps.append((ok, f"after step {step}: {message}"))
    first_bad = next((m for ok, m in unused_steps if not ok), "")
    return {
        "scenario valid (expert 3 unused everywhere, expert 2 on even ranks only)": theirs["valid"],
        "globally unused expert has .grad None after the sync": (not grad_not_none, "; ".join(grad_not_none[:3])),
        "the parameters with .grad None after the sync are DDP's": grad_none_check(none, theirs["none"]),
        "globally unused expert equals DDP's after every step": (not first_bad, first_bad),
        "losses": check_values("losses", losses, theirs["losses"]),
        "final parameters": check_params(fsdp.full_parameters(), theirs["params"]),
    }


# -- 4. LayerDrop with a rank-dependent skip ------------------------------------------------------

def skipped_block(step, rank, layers=2):
    """Rank r skips block (step + r) % 3 (2: none): on every step the ranks' graphs differ, and
    every block is used by some rank (no globally unused parameters here)."""
    s = (step + rank) % (layers + 1)
    return s if s < layers else None


def skipped_everywhere(step, rank, layers=2):
    """Every rank skips block 1 on odd steps: the graph is the same on all ranks, and block 1 is
    globally unused on those steps only (its .grad must be None then, and back after)."""
    return 1 if step % 2 == 1 else None


def ddp_layerdrop(rank, skip_of):
    ref = tiny_lm()
    ddp = DDP(ref, find_unused_parameters=True)
    ref_opt = adamw(ref.parameters())
    ref_losses, ref_none = [], []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = ddp(x, y, skip=skip_of(step, rank))
        loss.backward()
        ref_none.append(grad_none_names(ref.named_parameters()))
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    return dict(losses=ref_losses, none=ref_none, params=ref_params(ref))


def layerdrop_cell(rank, world, strategy, skip_of=None):
    skip_of = skip_of or skipped_block
    theirs = reference(("layerdrop", skip_of.__name__), ddp_layerdrop, rank, skip_of)
    model = tiny_lm()
    fsdp, optimizer = shard(model, adamw(model.parameters()), strategy)
    losses, none = [], []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = fsdp(x, y, skip=skip_of(step, rank))
        loss.backward()
        none.append(grad_none_names(fsdp.named_parameters()))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "the parameters with .grad None after the sync are DDP's": grad_none_check(none, theirs["none"]),
        "losses": check_values("losses", losses, theirs["losses"]),
        "final parameters": check_params(fsdp.full_parameters(), theirs["params"]),
    }


# -- the grid --------------------------------------------------------------------------------------

SCENARIOS = {
    "lambda_lr_after_shard": lambda r, w, s: scheduler_cell(r, w, s, "lambda_lr"),
    "warmup_cosine_after_shard": lambda r, w, s: scheduler_cell(r, w, s, "warmup_cosine"),
    "lambda_lr_before_shard": lambda r, w, s: scheduler_cell(r, w, s, "lambda_lr_before_shard"),
    "two_optimizers": two_optimizers_cell,
    "moe_unused_experts": moe_cell,
    "layerdrop_same_skip_on_all_ranks": lambda r, w, s: layerdrop_cell(r, w, s, skipped_everywhere),
    "layerdrop_rank_dependent": layerdrop_cell,  # last: a rank dying here costs a respawn only
}
# The order of the cells in a spawn: LayerDrop with a rank-dependent skip goes last (late), strategy
# 3 first: the others may abort the process, costing a respawn each.
for _name in SCENARIOS:
    for _strategy in (STRATEGIES if _name != "layerdrop_rank_dependent" else [3, 0, 1, 2]):
        CELLS.add((_name, _strategy), SCENARIOS[_name], _strategy, worlds=WORLDS,
                  match=dict(scenario=_name, strategy=_strategy), late=_name == "layerdrop_rank_dependent")


def prepare(keys):
    """Imports what these cells import, before they start (see support/spawns.py's _grid_worker)."""
    if any(key[0] == "warmup_cosine_after_shard" for key in keys):
        try:
            import transformers.optimization  # noqa: F401
        except ImportError:
            pass  # the cell reports it


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_user_loop_matches_ddp(scenario, strategy, world):
    assert_named(CELLS.result((scenario, strategy), world))
