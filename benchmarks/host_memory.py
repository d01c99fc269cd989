"""CPU resident memory and step time over many steps of one configuration (2 ranks, the
benchmark GPT), to see the heap growth of [Note: host heap trim] (csrc/python/host_heap.c):

    torchrun --nproc_per_node 2 benchmarks/host_memory.py --strategy 1 --steps 150
    MFSDP_HOST_TRIM_BYTES=0 torchrun --nproc_per_node 2 benchmarks/host_memory.py --strategy 1 --steps 150

Rank 0 prints its resident memory every --every steps and the median step time."""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import megatron_fsdp_c as mfsdp
from bench_worker import MODELS, current_rss_bytes
from megatron_fsdp_c.testing import GPT, Block, batch, init_distributed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", type=int, default=1)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=15)
    args = ap.parse_args()
    rank, world, device = init_distributed()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = MODELS["gpt"]
    model = GPT(spec["cfg"])
    model, opt = mfsdp.fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                   fsdp_unit_modules=[Block], zero_dp_strategy=args.strategy)
    marks, times = [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = batch(spec["cfg"], spec["batch"], seed=1000 * step + rank, device=device)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if step % args.every == 0 or step == args.steps - 1:
            marks.append(f"{step}:{current_rss_bytes() / 2**20:.0f}")
    if rank == 0:
        print(f"strategy {args.strategy}, {world} ranks, trim bound {model._host_trim_bytes} B: "
              f"median step {1e3 * statistics.median(times[5:]):.1f} ms; RSS MiB by step: {' '.join(marks)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
