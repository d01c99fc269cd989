"""Tensor-subclass parameters with FSDP2's all-gather extensions on the Megatron-style API
([Note: extension parameters under MegatronFSDP] in megatron_fsdp_c/_megatron_extensions.py): the
models of support/lowp_models.py sharded by megatron_fsdp_c.fully_shard(model, optimizer,
fsdp_unit_modules=[Block]) under every zero_dp_strategy, against a one-process model that runs
every rank's batch in turn, float64 to rtol 1e-9, with uneven shards (67 and 134 rows over 2 and
4 ranks). The per-module API's tests are in test_per_module_extensions.py. The cells run in the
shared spawns (see [Note: one spawn per world size] in support/rank_grid.py).

Behaviours (cell names):
- the tests' subclass (int8 rows and per-row scales on the wire) under ZeRO-3, ZeRO-2, ZeRO-1 and
  no_shard, at worlds 1, 2 and 4: megatron[scaled-<strategy>]
- torchao's float8 (fp8 gather, scales precomputed after each step) under ZeRO-3 and ZeRO-2, and
  int8 mixed precision under ZeRO-3: megatron[float8-...], megatron[int8-...]
- the distributed parameters are DTensors whose local tensors are the subclass, as FSDP2's, and
  the optimizer's states are of the values' shape: in every cell
"""
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import megatron_fsdp_c

from support import rank_grid
from support.checks import recorder_cells, strip, verify

torchao = pytest.importorskip("torchao")
from support.lowp_models import Block, build, train  # noqa: E402

CELLS = rank_grid.Cells(__name__)
cell = recorder_cells(CELLS)


@cell("megatron[scaled-optim_grads_params]", worlds=(1, 2, 4), kind="scaled", strategy="optim_grads_params")
@cell("megatron[scaled-optim_grads]", worlds=(2, 4), kind="scaled", strategy="optim_grads")
@cell("megatron[scaled-optim]", kind="scaled", strategy="optim")
@cell("megatron[scaled-no_shard]", kind="scaled", strategy="no_shard")
@cell("megatron[float8-optim_grads_params]", worlds=(2, 4), kind="float8", strategy="optim_grads_params")
@cell("megatron[float8-optim_grads]", kind="float8", strategy="optim_grads")
@cell("megatron[int8-optim_grads_params]", kind="int8", strategy="optim_grads_params")
def megatron(rank, world, ck, kind, strategy):
    dim = 67
    mesh = rank_grid.device_mesh("cpu", (world,))
    model = build(kind, dim, torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = megatron_fsdp_c.fully_shard(model, opt, device_mesh=mesh, fsdp_unit_modules=[Block],
                                             zero_dp_strategy=strategy)
    up = model.module[1].up.weight
    ck.true("a subclass weight's distributed parameter: a DTensor over the subclass",
            isinstance(up, DTensor) and type(up.to_local()) is not torch.Tensor, type(up).__name__)
    ref = build(kind, dim, torch.float64, reference=True)
    ol, op = train(model, kind, rank, world, dtype=torch.float64, opt=opt)
    rl, rp = train(ref, kind, rank, world, dtype=torch.float64, every_rank=True)
    for step, (a, b) in enumerate(zip(ol, rl)):
        mean = a.clone()
        torch.distributed.all_reduce(mean)
        ck.close(f"step {step}: loss (the mean over ranks) against the reference's", mean / world, b)
    for step, (a, b) in enumerate(zip(op, rp)):
        ck.equal(f"step {step}: parameter names", sorted(strip(n) for n in a), sorted(b))
        for name, v in a.items():
            ck.close(f"step {step}: {strip(name)}", v, b[strip(name)])
    state = opt.state[up]
    ck.true("AdamW's states are the values' shape", state["exp_avg"].shape == up.shape, str(state["exp_avg"].shape))


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys()))
def test_megatron_extension_parameters(name, world):
    verify(CELLS, name, world)
