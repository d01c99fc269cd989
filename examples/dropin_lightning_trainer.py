"""Lightning 2.6.6 Trainer, ModelParallelStrategy, accumulate_grad_batches=2, with the per-module
fully_shard swapped in for torch's (configure_model). The Trainer blocks backward sync for DDP only,
so both FSDP2 and ours reduce every microbatch here (Fabric's no_backward_sync is the isinstance
gate: examples/dropin_lightning_fabric.py). Run:

    pip install --no-deps lightning==2.6.6 lightning-utilities torchmetrics
    torchrun --nproc_per_node 2 examples/dropin_lightning_trainer.py torch   # or: ours

Measured 2026-11-23 (CPU, gloo, world 2, fp32): losses and gradient norms identical to FSDP2
(norms 1.3510125875473022, 1.0720731019973755); ours: 8 reduce-scatters (4 microbatches x 2 buckets)."""
import os, sys, torch, torch.nn as nn
import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy

IMPL = sys.argv[1]
if IMPL == "torch":
    from torch.distributed.fsdp import fully_shard
else:
    from megatron_fsdp_c.per_module import fully_shard

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.norms, self.losses = [], []
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self.net, mesh=mesh)
    def training_step(self, batch, i):
        x, y = batch
        loss = (self.net(x) - y).square().mean()
        self.losses.append(loss.item())
        return loss
    def on_before_optimizer_step(self, opt):
        self.norms.append(torch.sqrt(sum(p.grad.full_tensor().square().sum() for p in self.parameters())).item())
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)), batch_size=4)
m = M()
tr = pl.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                max_steps=2, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
tr.fit(m, data)
stats = m.net.comm_stats() if IMPL == "ours" else None
print(f"RESULT {IMPL} rank {tr.global_rank} losses {m.losses} norms {m.norms} stats {stats and {k: stats[k] for k in ('reduce_scatters', 'all_gathers')}}", flush=True)
