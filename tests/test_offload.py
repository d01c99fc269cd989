"""torch's CPUOffloadPolicy under the per-module API ([Note: CPU offload] in
megatron_fsdp_c/per_module/_policy.py): on CPU meshes the policy is accepted and holds, against DDP
in float64 with gradient clipping and accumulation (megatron_fsdp_c.FusedAdamW on ours, torch's
AdamW on DDP) and against torch's FSDP2 with the same policy bit for bit; on a GPU it is refused."""
import copy

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

import megatron_fsdp_c as mf
from megatron_fsdp_c.per_module._policy import check_offload

from support import rank_grid
from support.checks import full, recorder_cells, verify
from support.tiny_models import gpt, gpt_data, gpt_loss, shard_blocks
from support.train_both import TrainBoth

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)
MICRO = 2
CLIP = 0.5


@cell("offload_vs_ddp[pin]", worlds=(2, 4), pin=True)
@cell("offload_vs_ddp[no_pin]", worlds=(2, 4), pin=False)
def offload_vs_ddp(rank, world, ck, pin):
    model = gpt()
    ref = copy.deepcopy(model)
    shard_blocks(model, offload_policy=CPUOffloadPolicy(pin_memory=pin))
    opt = mf.FusedAdamW(model.parameters(), lr=1e-2)
    optimizers = (opt, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    norms = []

    def clip(step):
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ck.close(f"step {step}: gradient norm", torch.tensor(norms[-1]), torch.tensor(ref_norm))

    pair = TrainBoth(rank, world, model, ref, optimizers=optimizers, ck=ck)
    pair.run(3, lambda step, mb: gpt_data(10 * step + mb, rank), micro=MICRO, loss=gpt_loss,
             before_micro=lambda step, mb: model.set_requires_gradient_sync(mb == MICRO - 1),
             quiet=lambda step, mb: True if mb < MICRO - 1 else None, before_optimizer=clip)
    pair.check_params()
    ck.true("clipping was active", max(norms) > CLIP, str(norms))
    params = list(model.parameters())
    ck.true("parameters, gradients and optimizer state are host memory",
            all(p.device.type == "cpu" and p._local_tensor.device.type == "cpu" for p in params)
            and all(t.device.type == "cpu" for s in opt.state.values() for t in s.values()))


def _offloaded_run(rank, impl):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from megatron_fsdp_c.per_module import fully_shard as our_fully_shard
    shard = torch_fully_shard if impl == "torch" else our_fully_shard
    model = gpt().float()
    policy = CPUOffloadPolicy(pin_memory=False)  # FSDP2 on a CPU mesh cannot pin
    for block in model.blocks:
        shard(block, offload_policy=policy)
    shard(model, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        loss = gpt_loss(model, gpt_data(step, rank))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), {n: full(p) for n, p in model.named_parameters()}


@cell("offload_vs_fsdp2")
def offload_vs_fsdp2(rank, world, ck):
    """The same script under torch's fully_shard and ours, float32: bit for bit (two ranks sum in
    any order to the same bits, [Note: reduction order] in test_parity.py)."""
    (theirs, their_params), (ours, our_params) = _offloaded_run(rank, "torch"), _offloaded_run(rank, "ours")
    ck.true("losses bit for bit", torch.equal(ours, theirs), f"{ours.tolist()} vs {theirs.tolist()}")
    for name, p in their_params.items():
        ck.true(f"{name} bit for bit", torch.equal(our_params[name], p))


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys(), {}))
def test_offload(name, world):
    verify(CELLS, name, world)


def test_offload_on_a_gpu_is_refused():
    check_offload(CPUOffloadPolicy(), torch.device("cpu"), "a module")
    check_offload(OffloadPolicy(), torch.device("cuda", 0), "a module")
    with pytest.raises(NotImplementedError, match="CPU offload runs on CPU meshes only"):
        check_offload(CPUOffloadPolicy(pin_memory=True), torch.device("cuda", 0), "a module")
