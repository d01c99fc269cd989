"""State dicts, checkpoints and ignored parameters of megatron_fsdp_c.per_module.fully_shard,
tested after torch's own FSDP2 suite (test/distributed/_composable/fsdp/test_fully_shard_state_dict.py,
_ignore_params.py), through public APIs only (bad input: test_per_module_bad_input.py). The cells
run in the shared spawns (see [Note: one spawn per world size] in support/rank_grid.py).

Behaviours (cell names):
- state_dict(): DTensor values under the parameters' names, aliasing the parameters' local
  shards; load_state_dict() of other DTensors writes into the parameters in place, before and
  after the first forward, and the next forward computes with the loaded weights; a state dict
  taken after a forward (before its backward) equals the one before, with reshard_after_forward
  True/False; uneven and empty shards: state_dict_roundtrip
- a state dict taken once keeps tracking the parameters through training: cached_state_dict
- full state dict gathered on rank 0 only: full_state_dict_on_rank0
- DCP save/load of model and optimizer (torch.distributed.checkpoint.state_dict's
  get_state_dict/set_state_dict) into a fresh model, training on identically: dcp_roundtrip;
  saved at world 2, loaded at world 4: dcp_save_for_world_4 / dcp_load_from_world_2
- ignored_params stay plain, replicated and unreduced, composed with DDP for them:
  ignored_params_with_ddp; their gradient is the rank's own: ignored_params_stay_local
"""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp_c.per_module import fully_shard
from megatron_fsdp_c.testing import GPT, GPTConfig, batch

from support import rank_grid
from support.checks import cached_alias, full, recorder_cells, verify
from support.data import normal_batch
from support.train_both import average_grads

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS, tests=["test_state_behaviour"])


def checkpoints(name: str) -> str:
    """A path for this session's checkpoints (spawns of every world size see it)."""
    return os.path.join(rank_grid.session_dir(), "per_module_state", name)


CFG = GPTConfig(vocab=32, seq=8, d=16, heads=2, layers=3)


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def nested(dim: int) -> nn.Module:
    torch.manual_seed(42)
    return nn.Sequential(MLP(dim), nn.Sequential(MLP(dim), nn.Linear(dim, dim)), MLP(dim)).double()


def random_values(model, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters()}


def distributed_like(sd, values):
    """New DTensors (storage of their own) with `values`, placed like the state dict's."""
    return {k: distribute_tensor(values[k], v.device_mesh, list(v.placements)) for k, v in sd.items()}


@cell("state_dict_roundtrip[dim2]", worlds=(2, 4), dim=2, reshard=True)
@cell("state_dict_roundtrip[dim3]", worlds=(2, 4), dim=3, reshard=True)
@cell("state_dict_roundtrip[dim5]", worlds=(2, 4), dim=5, reshard=True)
@cell("state_dict_roundtrip[dim3-keep]", worlds=(2, 4), dim=3, reshard=False)
def state_dict_roundtrip(rank, world, ck, dim, reshard):
    model = nested(dim)
    plain = copy.deepcopy(model)
    for m in model:
        fully_shard(m, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    ptrs = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    sd = model.state_dict()
    ck.equal("state dict keys are the parameter names", sorted(sd), sorted(names))
    for k, v in sd.items():
        ck.true(f"{k}: a DTensor aliasing the parameter's local shard", isinstance(v, DTensor)
                and (v.to_local().numel() == 0 or v.to_local().data_ptr() == ptrs[k]))
    x = normal_batch(0, rank, (2, dim))
    for when, seed in (("before the first forward", 1), ("after a forward", 2)):
        values = random_values(model, seed)
        # through the state dict: after a forward that keeps the weights (reshard False) the modules
        # hold the unsharded parameters, as under FSDP2, and state_dict() registers the sharded ones
        ptrs = {k: v.to_local().data_ptr() for k, v in model.state_dict().items()}
        model.load_state_dict(distributed_like(sd, values))
        plain.load_state_dict(values)
        for n, p in model.named_parameters():
            ck.close(f"{when}: {n} loaded", p, values[n])
            if p.to_local().numel():
                ck.true(f"{when}: {n} loaded in place", p.to_local().data_ptr() == ptrs[n])
        with torch.no_grad():
            ck.close(f"{when}: the forward computes with the loaded weights", model(x), plain(x))
    sd_before = {k: full(v).clone() for k, v in model.state_dict().items()}
    out = model(x)  # a forward with autograd on, its backward not yet run
    sd_after = model.state_dict()
    ck.true("a state dict taken after a forward holds DTensors",
            all(isinstance(v, DTensor) for v in sd_after.values()),
            str(sorted({type(v).__name__ for v in sd_after.values()})))
    ck.true("a state dict taken after a forward has the parameters' shapes",
            all(tuple(sd_after[k].shape) == tuple(sd_before[k].shape) for k in sd_before),
            str({k: tuple(v.shape) for k, v in sd_after.items()}))
    ck.true("the parameters after a forward are DTensors", all(isinstance(p, DTensor) for p in model.parameters()),
            str(sorted({type(p).__name__ for p in model.parameters()})))
    out.sum().backward()
    for k, v in model.state_dict().items():
        ck.close(f"{k}: the state dict after forward and backward is unchanged", v, sd_before[k])


@cell("cached_state_dict[dim3]", worlds=(2, 4), dim=3)
@cell("cached_state_dict[dim8]", worlds=(2, 4), dim=8)
def cached_state_dict(rank, world, ck, dim):
    """torch's test: call state_dict() once (to save CPU time) and keep using it while training; also
    across a .double() after the first forward, which hands the shards back and re-initialises the
    engine ([Note: local shards keep their storage] in megatron_fsdp_c/_common.py; on torch 2.11,
    which cannot move storages, using it raises instead, naming the cause: checks.cached_alias)."""
    torch.manual_seed(42)
    model = nn.Linear(dim, dim, bias=False).double()
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = model.state_dict()
    for step in range(4):
        if step == 3:
            model.double()  # (already float64: only the engine's release and re-initialisation)
        opt.zero_grad()
        model(normal_batch(step, rank, (dim, dim))).sum().backward()
        opt.step()
        cached_alias(ck, f"step {step}: the cached state dict", sd["weight"], model.weight)


def gpt(seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG).double()


def shard_blocks(model):
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model, opt, rank, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = batch(CFG, 2, seed=100 * step + rank)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses)


@cell("full_state_dict_on_rank0")
def full_state_dict_on_rank0(rank, world, ck):
    model = gpt()
    ref = copy.deepcopy(model)
    shard_blocks(model)
    ddp = DDP(ref)
    opt, ref_opt = adamw(model), adamw(ref)
    for when in ("before training", "after training"):
        full_sd = {}
        for k, v in model.state_dict().items():
            t = full(v)  # collective on every rank
            if rank == 0:
                full_sd[k] = t.cpu()
        if rank == 0:
            ref_sd = ref.state_dict()
            ck.equal(f"{when}: keys in order", list(full_sd), list(ref_sd))
            for k in ref_sd:
                ck.close(f"{when}: {k}", full_sd[k], ref_sd[k])
        else:
            ck.true(f"{when}: nothing kept off rank 0", not full_sd)
        train(model, opt, rank, 2)
        train(ddp, ref_opt, rank, 2)


def _fresh_optimizer_state(model, opt):
    return get_state_dict(model, opt)  # initialises the optimizer's states, as a restore does


@cell("dcp_roundtrip")
def dcp_roundtrip(rank, world, ck):
    model = shard_blocks(gpt())
    opt = adamw(model)
    train(model, opt, rank, 2)
    msd, osd = get_state_dict(model, opt)
    path = checkpoints("same_world")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    restored = shard_blocks(gpt(seed=7))
    ropt = adamw(restored)
    rmsd, rosd = _fresh_optimizer_state(restored, ropt)
    dcp.load({"model": rmsd, "optim": rosd}, checkpoint_id=path)
    set_state_dict(restored, ropt, model_state_dict=rmsd, optim_state_dict=rosd)
    ck.params("restored", restored, model, 0.0, 0.0)
    ck.equal("training on: losses", train(restored, ropt, rank, 2, first=2), train(model, opt, rank, 2, first=2))
    ck.params("training on", restored, model, 0.0, 0.0)
    for (name, p), q in zip(model.named_parameters(), restored.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            ck.equal(f"training on: {name} {key}", ropt.state[q][key], opt.state[p][key])


@cell("dcp_save_for_world_4", worlds=(2,))
def dcp_save_for_world_4(rank, world, ck):
    model = shard_blocks(gpt())
    opt = adamw(model)
    train(model, opt, rank, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=checkpoints("from_world_2"))
    expected = {"params": {n: full(p).clone() for n, p in model.named_parameters()},
                "exp_avg": {n: full(opt.state[p]["exp_avg"]).clone() for n, p in model.named_parameters()},
                "exp_avg_sq": {n: full(opt.state[p]["exp_avg_sq"]).clone() for n, p in model.named_parameters()}}
    if rank == 0:
        torch.save(expected, checkpoints("from_world_2_full.pt"))
    dist.barrier()
    ck.true("written", os.path.exists(checkpoints("from_world_2_full.pt")))


@cell("dcp_load_from_world_2", worlds=(4,), needs=[(__name__, "dcp_save_for_world_4", 2)])
def dcp_load_from_world_2(rank, world, ck):
    expected = torch.load(checkpoints("from_world_2_full.pt"))
    model = shard_blocks(gpt(seed=7))
    opt = adamw(model)
    msd, osd = _fresh_optimizer_state(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=checkpoints("from_world_2"))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    for n, p in model.named_parameters():
        ck.equal(f"{n}", p, expected["params"][n])
        for key in ("exp_avg", "exp_avg_sq"):
            ck.equal(f"{n} {key}", opt.state[p][key], expected[key][n])
    plain = gpt()
    plain.load_state_dict(expected["params"])
    x, y = batch(CFG, 2, seed=rank)
    loss = model(x, y)
    ck.close("a forward after the load", loss, plain(x, y))
    loss.backward()
    opt.step()


# ------------------------------------------------------------------------------------------
# test_fully_shard_ignore_params.py

class C(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin_c(x)


class B(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin_b = nn.Linear(dim, dim)
        self.module_c = C(dim)
        self.subtrahend = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x):
        return self.lin_b(self.module_c(x)) - self.subtrahend


class A(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.module_b = B(dim)
        self.addend = nn.Parameter(torch.randn(dim, dim))

    def forward(self, x):
        return (torch.tanh(self.module_b(x)) + self.addend).pow(2).sum()


def _abc(dim=8):
    torch.manual_seed(42)
    return A(dim).double()


@cell("ignored_params_with_ddp")
def ignored_params_with_ddp(rank, world, ck):
    """module_b sharded, its module_c ignored; DDP around the whole model for everything the
    sharding does not manage (module_c and the root's own parameter)."""
    ref = DDP(_abc())
    model = _abc()
    ignored = set(model.module_b.module_c.parameters())
    fully_shard(model.module_b.lin_b, ignored_params=ignored)
    fully_shard(model.module_b, ignored_params=ignored)
    managed = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    ck.equal("the parameters the sharding manages", managed,
             ["module_b.lin_b.bias", "module_b.lin_b.weight", "module_b.subtrahend"])
    ck.true("ignored parameters stay plain tensors", all(not isinstance(p, DTensor) for p in ignored))
    DDP._set_params_and_buffers_to_ignore_for_model(model, managed)
    test = DDP(model, broadcast_buffers=False)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(test.parameters(), lr=1e-2)
    for step in range(3):
        x = normal_batch(step, rank, (8, 8))  # the batch is as wide as subtrahend (torch: inp (dim, dim))
        ref_loss, loss = ref(x), test(x)
        ck.close(f"step {step}: loss", loss, ref_loss)
        ref_loss.backward()
        loss.backward()
        with implicit_replication():  # the optimizer steps DTensors and plain tensors together
            ref_opt.step()
            ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
        ck.params(f"step {step}", model, ref.module)


@cell("ignored_params_stay_local")
def ignored_params_stay_local(rank, world, ck):
    model = _abc()
    ref = copy.deepcopy(model)
    ignored = {model.addend, model.module_b.module_c.lin_c.weight}
    fully_shard(model.module_b, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    for name in ("addend", "module_b.module_c.lin_c.weight"):
        p = model.get_parameter(name)
        ck.true(f"{name}: a plain Parameter", isinstance(p, nn.Parameter) and not isinstance(p, DTensor))
    x = normal_batch(0, rank, (8, 8))
    model(x).backward()
    ref(x).backward()
    local = {n: p.grad.clone() for n, p in ref.named_parameters()}
    average_grads(ref, world)
    for n, p in model.named_parameters():
        expected = local[n] if n in ("addend", "module_b.module_c.lin_c.weight") else dict(ref.named_parameters())[n].grad
        what = "the mean" if isinstance(p, DTensor) else "this rank's own"
        ck.close(f"{n}: gradient ({what})", p.grad, expected)


# ------------------------------------------------------------------------------------------

KNOWN_GAPS = {}  # cell -> how megatron_fsdp_c differs from FSDP2 there (strict xfails)


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys(), KNOWN_GAPS))
def test_state_behaviour(name, world):
    verify(CELLS, name, world)
