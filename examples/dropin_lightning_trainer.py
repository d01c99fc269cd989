"""Lightning 2.6.6 Trainer, ModelParallelStrategy, accumulate_grad_batches=2, with the per-module
fully_shard swapped in for torch's (configure_model). The Trainer blocks backward sync for DDP only,
so both FSDP2 and ours reduce every microbatch here (Fabric's no_backward_sync is the isinstance
gate: examples/dropin_lightning_fabric.py). Run:

    pip install --no-deps lightning==2.6.6 lightning-utilities torchmetrics
    torchrun --nproc_per_node 2 examples/dropin_lightning_trainer.py torch   # or: ours

Measured 2026-11-23 (CPU, gloo, world 2, fp32): losses and gradient norms identical to FSDP2
(norms 1.3510125875473022, 1.0720731019973755); ours: 8 reduce-scatters (4 microbatches x 2 buckets).
tests/test_frameworks.py calls run() with each implementation in one process group."""
import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.strategies import ModelParallelStrategy


def fully_shard_of(impl):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from megatron_fsdp_c.per_module import fully_shard
    return fully_shard


class M(pl.LightningModule):
    def __init__(self, fully_shard):
        super().__init__()
        torch.manual_seed(0)
        self.fully_shard = fully_shard
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.norms, self.losses = [], []

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        self.fully_shard(self.net[0], mesh=mesh)
        self.fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, i):
        x, y = batch
        loss = (self.net(x) - y).square().mean()
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, opt):
        self.norms.append(torch.sqrt(sum(p.grad.full_tensor().square().sum() for p in self.parameters())).item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(impl):
    """Trains 2 steps of 2 microbatches with `impl`'s fully_shard ("torch" or "ours"); returns this
    rank's losses and gradient norms and the sharded model."""
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g),
                                                                      torch.randn(16, 2, generator=g)), batch_size=4)
    m = M(fully_shard_of(impl))
    tr = pl.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    max_steps=2, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    tr.fit(m, data)
    return dict(rank=tr.global_rank, losses=m.losses, norms=m.norms, model=m.net)


if __name__ == "__main__":
    impl = sys.argv[1]
    out = run(impl)
    stats = out["model"].comm_stats() if impl == "ours" else None
    print(f"RESULT {impl} rank {out['rank']} losses {out['losses']} norms {out['norms']} stats "
          f"{stats and {k: stats[k] for k in ('reduce_scatters', 'all_gathers')}}", flush=True)
