"""CPU offload in both APIs ([Note: offloaded buckets] in csrc/comm/buffers.c): torch's
CPUOffloadPolicy under the per-module API ([Note: CPU offload] in per_module/_policy.py) and
Megatron's optimizer_cpu_offload / optimizer_offload_fraction under fully_shard. On CPU meshes the
offloaded buckets keep their main weights and optimizer gradients in host buffers of their own,
apart from every collective buffer (the staging path a GPU runs), and train as DDP does in
float64 with gradient clipping and accumulation (megatron_fsdp_c.FusedAdamW on ours, torch's
AdamW on DDP), and as torch's FSDP2 with the same policy bit for bit; on a GPU (tests/test_cuda.py) the
policy needs pinned memory."""
import copy

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

import megatron_fsdp_c as mf
from megatron_fsdp_c import _C
from megatron_fsdp_c.per_module._policy import check_offload
from megatron_fsdp_c.testing import Block

from support import rank_grid
from support.checks import full, recorder_cells, verify
from support.tiny_models import Named, gpt, gpt_data, gpt_loss, shard_blocks
from support.train_both import TrainBoth

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)
MICRO = 2
CLIP = 0.5


def staged(buf) -> list:
    """Per bucket of a ParamBuffer: its main weights and the optimizer's gradients have storage of
    their own, shared with no collective buffer (WEIGHT, GATHER, WEIGHT_SHARD, GRAD): what an
    offloaded bucket keeps in host memory ([Note: offloaded buckets])."""
    out = []
    for b in range(len(buf.specs)):
        def ptr(kind):
            t = buf.engine.tensor(b, kind)
            return None if t is None else t.untyped_storage().data_ptr()
        collective = {ptr(k) for k in (_C.BUF_WEIGHT, _C.BUF_GATHER, _C.BUF_WEIGHT_SHARD, _C.BUF_GRAD)}
        main, opt_grad = ptr(_C.BUF_MAIN_SHARD), ptr(_C.BUF_OPT_GRAD)
        out.append(main is not None and main not in collective and (opt_grad is None or opt_grad not in collective))
    return out


def train_offloaded(rank, world, ck, model, ref, opt, quiet, before_micro=None):
    """Three steps of MICRO microbatches with clipping, checked against DDP by `ck`; the largest
    gradient norms seen."""
    optimizers = (opt, torch.optim.AdamW(ref.parameters(), lr=1e-2))
    norms = []

    def clip(step):
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ck.close(f"step {step}: gradient norm", torch.tensor(norms[-1]), torch.tensor(ref_norm))

    pair = TrainBoth(rank, world, model, ref, optimizers=optimizers, ck=ck)
    pair.run(3, lambda step, mb: gpt_data(10 * step + mb, rank), micro=MICRO, loss=gpt_loss, quiet=quiet,
             before_micro=before_micro, before_optimizer=clip)
    pair.check_params()
    ck.true("clipping was active", max(norms) > CLIP, str(norms))


@cell("offload_vs_ddp[pin]", worlds=(2, 4), pin=True)
@cell("offload_vs_ddp[no_pin]", worlds=(2, 4), pin=False)
@cell("offload_vs_ddp[optim]", worlds=(2, 4), pin=False, strategy="optim")
@cell("offload_vs_ddp[no_shard]", worlds=(2, 4), pin=False, strategy="no_shard")
def offload_vs_ddp(rank, world, ck, pin, strategy="optim_grads_params"):
    model = gpt()
    ref = copy.deepcopy(model)
    shard_blocks(model, offload_policy=CPUOffloadPolicy(pin_memory=pin), zero_dp_strategy=strategy)
    opt = mf.FusedAdamW(model.parameters(), lr=1e-2)
    train_offloaded(rank, world, ck, model, ref, opt, quiet=lambda step, mb: True if mb < MICRO - 1 else None,
                    before_micro=lambda step, mb: model.set_requires_gradient_sync(mb == MICRO - 1))
    ck.true("every bucket staged through host buffers of its own",  # (the engine exists from the first forward)
            all(staged(model._mfsdp_group.owner.param_buffer)))
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


@cell("megatron[0]", worlds=(2, 4), strategy=0)
@cell("megatron[1]", worlds=(2, 4), strategy=1)
@cell("megatron[2]", worlds=(2, 4), strategy=2)
@cell("megatron[3]", worlds=(2, 4), strategy=3)
@cell("megatron[3, half]", worlds=(2,), strategy=3, fraction=0.5)
def megatron_offload_vs_ddp(rank, world, ck, strategy, fraction=1.0):
    """fully_shard(optimizer_cpu_offload=True): every strategy against DDP, float64, clipping and
    accumulation; optimizer_offload_fraction=0.5 offloads the first buckets holding half the
    parameters' elements and keeps the others as without offload."""
    model = gpt()
    ref = Named(copy.deepcopy(model))
    fsdp, opt = mf.fully_shard(model, mf.FusedAdamW(model.parameters(), lr=1e-2), fsdp_unit_modules=[Block],
                               zero_dp_strategy=strategy, optimizer_cpu_offload=True,
                               optimizer_offload_fraction=fraction)
    buf = fsdp.param_buffer
    offloaded = [bool(s["offload"]) for s in buf.specs]
    ck.true("the offloaded buckets, and only they, are staged", staged(buf) == offloaded, f"{staged(buf)} {offloaded}")
    sizes = [bp["weight_size"] for bp in buf.plan]
    share = sum(n for n, o in zip(sizes, offloaded) if o) / sum(sizes)
    if fraction == 1.0:
        ck.true("every bucket offloaded", all(offloaded), str(offloaded))
    else:  # to a bucket: the last offloaded one passes the fraction
        last = max(i for i, o in enumerate(offloaded) if o)
        ck.true(f"the first buckets up to {fraction} of the elements offloaded",
                offloaded == [i <= last for i in range(len(sizes))] and share >= fraction
                and share - sizes[last] / sum(sizes) < fraction and not all(offloaded), f"{offloaded} {share}")
    train_offloaded(rank, world, ck, fsdp, ref, opt, quiet=lambda step, mb: fsdp.no_sync() if mb < MICRO - 1 else None)


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


def test_offload_on_a_gpu_needs_pinned_memory():
    """On a GPU the offload kernels reach host memory in place ([Note: CPU offload]): pinned only."""
    check_offload(CPUOffloadPolicy(pin_memory=False), torch.device("cpu"), "a module")
    check_offload(OffloadPolicy(), torch.device("cuda", 0), "a module")
    check_offload(CPUOffloadPolicy(pin_memory=True), torch.device("cuda", 0), "a module")
    with pytest.raises(ValueError, match=r"CPUOffloadPolicy\(pin_memory=False\) for a module on cuda: .*needs pinned "
                                         r"memory; use CPUOffloadPolicy\(\)"):
        check_offload(CPUOffloadPolicy(pin_memory=False), torch.device("cuda", 0), "a module")


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(optimizer_cpu_offload=1), TypeError, "optimizer_cpu_offload must be True or False, got 1"),
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.5), ValueError,
     "optimizer_offload_fraction must be a number from 0 to 1"),
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction=True), ValueError,
     "optimizer_offload_fraction must be a number from 0 to 1"),
    (dict(optimizer_cpu_offload=True, optimizer_offload_fraction="half"), ValueError,
     "optimizer_offload_fraction must be a number from 0 to 1"),
])
def test_megatron_offload_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        mf.fully_shard(gpt(), fsdp_unit_modules=[Block], **kwargs)
