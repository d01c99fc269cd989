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
- a subclass with two value tensors (TwoTensor), whose second the optimizer would not step, is
  refused at fully_shard: refusals
"""
import pytest
import torch
from torch.distributed.tensor import DTensor

import megatron_fsdp_c

from support import rank_grid
from support.checks import recorder_cells, strip, verify

torchao = pytest.importorskip("torchao")
from support.lowp_models import Block, build, check_against_reference, train  # noqa: E402

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
    check_against_reference(ck, train(model, kind, rank, world, dtype=torch.float64, opt=opt),
                            train(ref, kind, rank, world, dtype=torch.float64, every_rank=True), world, strip)
    state = opt.state[up]
    ck.true("AdamW's states are the values' shape", state["exp_avg"].shape == up.shape, str(state["exp_avg"].shape))


@cell("refusals")
def refusals(rank, world, ck):
    """A subclass with two value tensors (TwoTensor, given the extensions as torch's own tests do):
    the Megatron-style optimizer would step one of them only, so it is refused at fully_shard."""
    from support.checks import outcome
    from torch.testing._internal.two_tensor import TwoTensor
    mesh = rank_grid.device_mesh("cpu", (world,))
    model = build("scaled", 64, reference=True)
    for b in (model[1], model[2]):
        b.up.weight = torch.nn.Parameter(TwoTensor(b.up.weight.detach(), b.up.weight.detach().clone()))
    TwoTensor.fsdp_pre_all_gather = lambda self, mesh: ((self.a, self.b), None)
    TwoTensor.fsdp_post_all_gather = lambda self, outs, meta, dtype, *, out=None: None if out is not None else (
        TwoTensor(*outs), outs)
    try:
        got = outcome(lambda: megatron_fsdp_c.fully_shard(model, fsdp_unit_modules=[Block], device_mesh=mesh))
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather
    ck.true("TwoTensor weights on the Megatron-style API: NotImplementedError naming them",
            got.startswith("NotImplementedError") and "several value tensors" in got and "1.up.weight" in got, got)


@pytest.mark.parametrize("name,world", rank_grid.params(CELLS, CELLS.keys()))
def test_megatron_extension_parameters(name, world):
    verify(CELLS, name, world)
