"""Lightning Fabric 2.6.6 ModelParallelStrategy with the per-module fully_shard swapped in for
torch's, gradient accumulation through fabric.no_backward_sync (Fabric gates it on isinstance of
torch's FSDPModule). Run each side and compare:

    pip install --no-deps lightning==2.6.6 lightning-utilities torchmetrics
    torchrun --nproc_per_node 2 examples/dropin_lightning_fabric.py torch
    torchrun --nproc_per_node 2 examples/dropin_lightning_fabric.py ours

Measured 2026-11-23 (CPU, gloo, world 2, fp32): losses and gradient norms identical to FSDP2
(norms 1.5413975715637207, 1.7814909219741821); ours issued 4 reduce-scatters in 2 steps of 2
microbatches (2 buckets x 1 syncing backward a step: the no-sync is ours).
tests/test_frameworks.py calls run() with each implementation in one process group."""
import sys

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy


def fully_shard_of(impl):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from megatron_fsdp_c.per_module import fully_shard
    return fully_shard


def run(impl):
    """Trains 2 steps of 2 microbatches with `impl`'s fully_shard ("torch" or "ours"); returns this
    rank's losses and gradient norms and the sharded model."""
    fully_shard = fully_shard_of(impl)

    def parallelize(model, mesh):
        dp = mesh["data_parallel"]
        fully_shard(model[0], mesh=dp)
        fully_shard(model, mesh=dp)
        return model

    fabric = Fabric(accelerator="cpu", devices=2,
                    strategy=ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1))
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(fabric.global_rank)
    losses, norms = [], []
    for step in range(2):
        for micro in range(2):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = (model(x) - y).square().mean()
                fabric.backward(loss)
            losses.append(loss.item())
        norms.append(torch.sqrt(sum(p.grad.full_tensor().square().sum() for p in model.parameters())).item())
        opt.step()
        opt.zero_grad()
    return dict(rank=fabric.global_rank, losses=losses, norms=norms,
                model=model.module if hasattr(model, "module") else model)


if __name__ == "__main__":
    impl = sys.argv[1]
    out = run(impl)
    stats = out["model"].comm_stats() if impl == "ours" else None
    print(f"RESULT {impl} rank {out['rank']} losses {out['losses']} norms {out['norms']} stats "
          f"{stats and {k: stats[k] for k in ('reduce_scatters', 'all_gathers')}}", flush=True)
