"""Helpers shared by the multi-process tests: train the same model with fully_shard and DDP."""
import contextlib
import copy

import torch
import torch.distributed as dist
import torch.distributed.device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

CFG = GPTConfig(vocab=64, seq=16, d=32, heads=4, layers=3)
STEPS = 5


def make_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def device_mesh_arg(kind, world):
    if isinstance(kind, torch.distributed.device_mesh.DeviceMesh):
        return kind  # a mesh of the caller's own (hybrid sharding)
    if kind == "group":
        return dist.group.WORLD
    if kind == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return None


def train_pair(rank, world, strategy, optim="adamw", micro=1, *, cfg=CFG, steps=STEPS, dtype=torch.float32,
               use_no_sync=True, freeze=(), alternate_set_to_none=False, mesh=None, **shard_kwargs):
    """Trains the same model with fully_shard and with DDP on the same per-rank data.

    use_no_sync: microbatches before the last run inside no_sync() on both sides (else every
    backward syncs on both). freeze: parameter-name prefixes frozen in both models."""
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)
    for name, p in model.named_parameters():
        if any(name.startswith(f) for f in freeze):
            p.requires_grad_(False)
    ref = copy.deepcopy(model)
    ddp = DDP(ref)
    ref_opt = make_optimizer(optim, [p for p in ref.parameters() if p.requires_grad])
    opt = make_optimizer(optim, [p for p in model.parameters() if p.requires_grad])
    fsdp, opt = mf.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                               device_mesh=device_mesh_arg(mesh, world), **shard_kwargs)
    losses, ref_losses, per_step = [], [], []
    for step in range(steps):
        before = fsdp.comm_stats()
        for m in range(micro):
            x, y = batch(cfg, 2, seed=10_000 * step + 100 * m + rank)
            quiet = use_no_sync and m < micro - 1
            with fsdp.no_sync() if quiet else contextlib.nullcontext():
                loss = fsdp(x, y)
                loss.backward()
            with ddp.no_sync() if quiet else contextlib.nullcontext():
                ref_loss = ddp(x, y)
                ref_loss.backward()
            losses.append(loss.item())
            ref_losses.append(ref_loss.item())
        opt.step()
        ref_opt.step()
        set_to_none = (step % 2 == 0) if alternate_set_to_none else True
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        after = fsdp.comm_stats()
        per_step.append({k: after[k] - before[k] for k in after})
    return dict(losses=losses, ref_losses=ref_losses, params=fsdp.full_parameters(),
                ref_params={n: p.detach().clone() for n, p in ref.named_parameters()}, per_step=per_step,
                memory=fsdp.memory_report(opt), model=fsdp)


def assert_match(result, exact=False, rtol=1e-5, atol=1e-6, param_atol=None):
    # python floats: a float64 tensor holds fp32 and float64 losses exactly
    losses = torch.tensor(result["losses"], dtype=torch.float64)
    ref_losses = torch.tensor(result["ref_losses"], dtype=torch.float64)
    params, ref_params = result["params"], result["ref_params"]
    assert set(params) == set(ref_params)
    if exact:
        assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
        for name in ref_params:
            assert torch.equal(params[name], ref_params[name]), name
        return
    torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=atol)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=rtol,
                                   atol=atol if param_atol is None else param_atol, msg=name)
