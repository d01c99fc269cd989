"""torch.distributed.pipelining over the per-module API: PipelineStage with ScheduleGPipe and
Schedule1F1B at world 4 (pp 2 x dp 2), each stage a model sharded over its dp ranks. The stage
recognises our modules as FSDPModule, runs the microbatches' backwards with gradient sync off and
asks for the reduction through torch's state key ([Note: torch's state key] in
per_module/_torch_state.py, [Note: reductions outside a backward] in per_module/_root.py).
The same script with torch's FSDP2: float64 losses and parameters to rtol 1e-9."""
import pytest
import torch
import torch.nn as nn

from support import rank_grid
from support.checks import RTOL

STEPS, MICRO, D = 2, 4, 8
CELLS = rank_grid.Cells(__name__)


def stage_model(pp):
    torch.manual_seed(10 + pp)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2)]).double()


def train(rank, world, impl, schedule):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from megatron_fsdp_c.per_module import fully_shard
    mesh = rank_grid.device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = stage_model(pp)
    for block in model:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    stage = PipelineStage(model, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=MICRO, loss_fn=lambda out, y: (out - y).square().mean())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, reductions = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + dp)
        x = torch.randn(2 * MICRO, D, generator=g, dtype=torch.float64)
        y = torch.randn(2 * MICRO, D, generator=g, dtype=torch.float64)
        if pp == 0:
            sched.step(x)
        else:
            step_losses = []
            sched.step(target=y, losses=step_losses)
            losses += [loss.item() for loss in step_losses]
        opt.step()
        opt.zero_grad()
        if impl == "ours":
            reductions.append(model.comm_stats()["reduce_scatters"])
    return dict(losses=losses, params={n: p.full_tensor().clone() for n, p in model.named_parameters()},
                reductions=reductions)


for _schedule in ("gpipe", "1f1b"):
    for _impl in ("torch", "ours"):
        CELLS.add((_impl, _schedule), train, _impl, _schedule, worlds=(4,), match={"schedule": _schedule})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_schedules_match_fsdp2(schedule):
    for rank, (theirs, ours) in enumerate(zip(CELLS.result(("torch", schedule), 4),
                                              CELLS.result(("ours", schedule), 4))):
        assert len(ours["losses"]) == (STEPS * MICRO if rank >= 2 else 0)
        torch.testing.assert_close(torch.tensor(ours["losses"], dtype=torch.float64),
                                   torch.tensor(theirs["losses"], dtype=torch.float64), rtol=RTOL, atol=0)
        for name, p in theirs["params"].items():
            torch.testing.assert_close(ours["params"][name], p, rtol=RTOL, atol=0, msg=name)
        # the last step: one reduce-scatter per gradient bucket (the two blocks'; the stage root has
        # no parameters of its own), not one per microbatch
        assert ours["reductions"][-1] - ours["reductions"][-2] == 2, ours["reductions"]
