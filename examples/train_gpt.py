"""Train a small GPT with DDP and with megatron_fsdp_c.fully_shard side by side.

    torchrun --nproc_per_node 2 examples/train_gpt.py [--strategy optim_grads_params] [--steps 20]

Both models start from the same weights and see the same per-rank batches; rank 0 prints the
loss of each per step and, at the end, what one rank of the sharded model holds in memory.
Runs on CPU with gloo (or on GPUs with NCCL when CUDA is available).
"""
import argparse
import copy
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mfsdp
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch, init_distributed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="optim_grads_params",
                    choices=["no_shard", "optim", "optim_grads", "optim_grads_params"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()

    rank, world, device = init_distributed()

    cfg = GPTConfig(vocab=512, seq=64, d=args.d, heads=4, layers=args.layers)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    reference = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, opt = mfsdp.fully_shard(model, opt, fsdp_unit_modules=[Block], zero_dp_strategy=args.strategy)

    if rank == 0:
        n_params = sum(p.numel() for p in reference.parameters())
        print(f"GPT: {args.layers} layers, d={args.d}, {n_params / 1e6:.2f}M parameters; {world} ranks on "
              f"{device.type}; strategy {args.strategy}")
        print(f"{'step':>4} {'DDP loss':>10} {'fully_shard loss':>17} {'|diff|':>9} {'DDP ms':>7} {'FSDP ms':>8}")
    for step in range(args.steps):
        x, y = batch(cfg, args.batch, seed=1000 * step + rank, device=device)
        t0 = time.perf_counter()
        ref_loss = reference(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        t1 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        losses = torch.stack([ref_loss.detach(), loss.detach()]).float()
        dist.all_reduce(losses)  # mean over ranks, as a data-parallel job would log it
        losses /= world
        if rank == 0:
            print(f"{step:>4} {losses[0].item():>10.5f} {losses[1].item():>17.5f} "
                  f"{abs(losses[0] - losses[1]).item():>9.2e} {1e3 * (t1 - t0):>7.1f} {1e3 * (t2 - t1):>8.1f}")
    report = model.memory_report(opt)
    if rank == 0:
        mib = {k: f"{v / 2**20:.2f} MiB" for k, v in report.items()}
        print(f"rank 0 holds: {mib}")
        print(f"collectives so far: {model.comm_stats()}")
    mfsdp.close(model)  # every rank, same point: ends the model's communication
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
