"""Training loops as users write them (test_user_loops.py's grid: against DistributedDataParallel
on the same seed and per-rank data, for every strategy at world sizes 2 and 4, float64 to rtol
1e-9): the optimizer's protocols, step pre/post hooks, add_param_group after fully_shard,
torch.save of the optimizer and model state dicts (round trip), GradScaler with an inf gradient on
one rank only.
"""
import io

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from support import rank_grid
from support.checks import assert_named, check_params, check_values, to_full
from support.tiny_models import tiny_lm
from test_user_loops import STEPS, STRATEGIES, WORLDS, adamw, in_blocks, lm_batch, ref_params, reference, shard

CELLS = rank_grid.Cells(__name__)


def ddp_plain(rank):
    """AdamW on the whole model: the reference of the hook and the save/load scenarios."""
    ref = tiny_lm()
    ddp = DDP(ref)
    ref_opt = adamw(ref.parameters())
    ref_grads, ref_losses = [], []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = ddp(x, y)
        loss.backward()
        ref_grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    return dict(losses=ref_losses, grads=ref_grads, params=ref_params(ref))


def step_hooks_cell(rank, world, strategy):
    theirs = reference(("plain",), ddp_plain, rank)
    model = tiny_lm()
    fsdp, optimizer = shard(model, adamw(model.parameters()), strategy)
    name_of = {id(p): n for n, p in fsdp.named_parameters()}
    seen = dict(pre=0, post=0, not_dtensor=[], grad_none=[], grads=[])

    def pre_hook(opt, args, kwargs):
        seen["pre"] += 1
        params = [p for g in opt.param_groups for p in g["params"]]
        seen["not_dtensor"] += [f"{type(p).__name__} {tuple(p.shape)}" for p in params if not isinstance(p, DTensor)]
        seen["grad_none"] += [name_of.get(id(p), "?") for p in params if p.grad is None]
        if all(isinstance(p, DTensor) and p.grad is not None for p in params):
            seen["grads"].append({name_of.get(id(p), "?"): to_full(p.grad) for p in params})

    def post_hook(opt, args, kwargs):
        seen["post"] += 1

    optimizer.register_step_pre_hook(pre_hook)
    optimizer.register_step_post_hook(post_hook)
    losses = []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = fsdp(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    grad_checks = [check_params(g, theirs["grads"][s]) for s, g in enumerate(seen["grads"])]
    bad_grads = next((f"step {s}: {m}" for s, (ok, m) in enumerate(grad_checks) if not ok), "")
    if len(seen["grads"]) < STEPS and not bad_grads:
        bad_grads = (f".grad is None on {sorted(set(seen['grad_none']))[:3]}" if seen["grad_none"] else
                     "the hook saw no DTensor parameters whose .grad it could compare")
    return {
        "pre-hook called once per step": (seen["pre"] == STEPS, f"{seen['pre']} calls in {STEPS} steps"),
        "post-hook called once per step": (seen["post"] == STEPS, f"{seen['post']} calls in {STEPS} steps"),
        "pre-hook sees DTensor parameters": (not seen["not_dtensor"],
                                             f"it saw {sorted(set(seen['not_dtensor']))[:3]}"),
        "pre-hook sees synced .grad (= DDP's)": (not bad_grads, bad_grads),
        "losses": check_values("losses", losses, theirs["losses"]),
        "final parameters": check_params(fsdp.full_parameters(), theirs["params"]),
    }


def ddp_add_param_group(rank):
    ref = tiny_lm()
    ddp = DDP(ref)
    ref_opt = adamw([p for n, p in ref.named_parameters() if in_blocks(n)])
    ref_opt.add_param_group({"params": [p for n, p in ref.named_parameters() if not in_blocks(n)],
                             "lr": 5e-3, "weight_decay": 0.0})
    ref_losses = []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = ddp(x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    return dict(losses=ref_losses, params=ref_params(ref))


def add_param_group_cell(rank, world, strategy):
    theirs = reference(("add_param_group",), ddp_add_param_group, rank)
    model = tiny_lm()
    fsdp, optimizer = shard(model, adamw([p for n, p in model.named_parameters() if in_blocks(n)]), strategy)
    optimizer.add_param_group({"params": [p for n, p in fsdp.named_parameters() if not in_blocks(n)],
                               "lr": 5e-3, "weight_decay": 0.0})
    losses = []
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = fsdp(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": check_values("losses", losses, theirs["losses"]),
        "final parameters": check_params(fsdp.full_parameters(), theirs["params"]),
    }


def _bytes_round_trip(what, state):
    """torch.save into memory and torch.load back, as a checkpointing loop does: (problems, loaded
    state or None). torch.load runs with its default (weights_only=True); if only that refuses,
    the state is loaded with weights_only=False so the round trip can still be checked."""
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
    except Exception as e:  # noqa: BLE001 - reported as a check
        return [f"torch.save({what}) raised {type(e).__name__}: {str(e).splitlines()[0][:300]}"], None
    problems = []
    buf.seek(0)
    try:
        return problems, torch.load(buf)
    except Exception as e:  # noqa: BLE001 - reported as a check
        problems.append(f"torch.load of {what} (weights_only default) raised {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:300]}")
    buf.seek(0)
    try:
        return problems, torch.load(buf, weights_only=False)
    except Exception as e:  # noqa: BLE001
        return problems + [f"torch.load(weights_only=False) of {what} raised {type(e).__name__}: {e}"], None


def save_load_cell(rank, world, strategy):
    theirs = reference(("plain",), ddp_plain, rank)
    model = tiny_lm()
    fsdp, optimizer = shard(model, adamw(model.parameters()), strategy)
    losses, problems = [], {}
    for step in range(STEPS):
        if step == STEPS // 2:  # save and reload both state dicts half-way, as a checkpointing loop would
            for what, obj in (("optimizer", optimizer), ("model", fsdp)):
                problems[what], state = _bytes_round_trip(f"{what}.state_dict()", obj.state_dict())
                if state is not None:
                    try:
                        obj.load_state_dict(state)
                    except Exception as e:  # noqa: BLE001 - reported as a check
                        problems[what].append(f"{what}.load_state_dict raised {type(e).__name__}: {e}")
        x, y = lm_batch(step, rank)
        loss = fsdp(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "optimizer.state_dict() survives torch.save/torch.load": (not problems["optimizer"],
                                                                 "; ".join(problems["optimizer"])),
        "model.state_dict() survives torch.save/torch.load": (not problems["model"], "; ".join(problems["model"])),
        "losses (training goes on after the reload)": check_values("losses", losses, theirs["losses"]),
        "final parameters": check_params(fsdp.full_parameters(), theirs["params"]),
    }


INF_STEP = 2


def scaler_loop(model, optimizer, rank, world, params_of, after_backward=lambda step: None):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=1)
    out = dict(losses=[], scales=[], params=[])
    for step in range(STEPS):
        x, y = lm_batch(step, rank)
        loss = model(x, y, poison=(step == INF_STEP and rank == world - 1))  # an inf gradient on one rank only
        scaler.scale(loss).backward()
        after_backward(step)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
        out["scales"].append(scaler.get_scale())
        out["params"].append(params_of())
    return out


def ddp_scaler(rank, world):
    ref = tiny_lm()
    return scaler_loop(DDP(ref), adamw(ref.parameters()), rank, world, lambda: ref_params(ref))


def grad_scaler_cell(rank, world, strategy):
    theirs = reference(("grad_scaler",), ddp_scaler, rank, world)
    model = tiny_lm()
    fsdp, optimizer = shard(model, adamw(model.parameters()), strategy)
    inf_here = []

    def note_inf(step):  # does this rank's own gradient shard hold the inf?
        if step == INF_STEP:
            inf_here.append(any(p.grad is not None and not torch.isfinite(p.grad.to_local()).all()
                                for p in fsdp.parameters()))

    ours = scaler_loop(fsdp, optimizer, rank, world, fsdp.full_parameters, note_inf)
    holders = [None] * world
    torch.distributed.all_gather_object(holders, inf_here[0])
    # With sharded gradients only the owner of the poisoned element sees the inf locally; the
    # other ranks must learn it from the scaler (DDP: every rank sees the all-reduced inf).
    valid = any(holders) and (all(holders) if strategy == 0 else not all(holders))
    per_step = [check_params(ours["params"][s], theirs["params"][s]) for s in range(STEPS)]
    first_bad = next((f"after step {s}{' (the inf step)' if s == INF_STEP else ''}: {m}"
                      for s, (ok, m) in enumerate(per_step) if not ok), "")
    skipped = check_params(ours["params"][INF_STEP], ours["params"][INF_STEP - 1], rtol=0, atol=0)
    return {
        "scenario valid (the inf is in some ranks' gradient shards only)":
            (valid, f"ranks whose local gradient holds the inf: {[r for r, h in enumerate(holders) if h]}"),
        "the inf step is skipped on every rank": (skipped[0], f"parameters changed on this rank: {skipped[1]}"),
        "scale follows DDP's": (ours["scales"] == theirs["scales"], f"ours {ours['scales']} vs DDP {theirs['scales']}"),
        "parameters equal DDP's after every step": (not first_bad, first_bad),
        "losses": check_values("losses", ours["losses"], theirs["losses"]),
    }


SCENARIOS = {
    "step_pre_post_hooks": step_hooks_cell,
    "add_param_group": add_param_group_cell,
    "torch_save_round_trip": save_load_cell,
    "grad_scaler_inf_on_one_rank": grad_scaler_cell,
}
for _name in SCENARIOS:
    for _strategy in STRATEGIES:
        CELLS.add((_name, _strategy), SCENARIOS[_name], _strategy, worlds=WORLDS,
                  match=dict(scenario=_name, strategy=_strategy))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_user_loop_matches_ddp(scenario, strategy, world):
    assert_named(CELLS.result((scenario, strategy), world))
