"""How much of the host optimizer step a backward hides: FusedAdamW(step_in_backward=True) against
the same optimizer stepping after the backward, CPU offload, ZeRO-2 and ZeRO-3, one run ([Note:
stepping in backward] in megatron_fsdp_c/_backward_step.py).

    torchrun --nproc-per-node 2 benchmarks/backward_step.py [--layers 8 --width 512 --steps 6 --strategies 2,3]
    python benchmarks/backward_step.py --single-rank    # world 1 through the collectives

Per mode, after two warm-up steps, the median over --steps of: the whole step (forward, backward,
optimizer.step()), the backward, and optimizer.step() alone (what is left of the host step after
the backward). hidden = 1 - (step's optimizer.step() with step_in_backward) / (without): the share
of the host step taken off the critical path. On a CPU mesh the step's worker and the backward share
the same cores, so this measures the mechanism, not a GPU's overlap.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch


def run(cfg, steps, strategy, step_in_backward, single_rank, rank):
    torch.manual_seed(0)
    model = GPT(cfg)
    fsdp, opt = mf.fully_shard(model, mf.FusedAdamW(model.parameters(), lr=1e-4,
                                                     step_in_backward=step_in_backward),
                               fsdp_unit_modules=[Block], zero_dp_strategy=strategy, optimizer_cpu_offload=True,
                               single_rank_collectives=single_rank)
    times = {"step": [], "backward": [], "optimizer.step()": []}
    for k in range(steps + 2):
        x, y = batch(cfg, 4, seed=100 * k + rank)
        t0 = time.perf_counter()
        loss = fsdp(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if k >= 2:
            times["step"].append(t3 - t0)
            times["backward"].append(t2 - t1)
            times["optimizer.step()"].append(t3 - t2)
    n = sum(p.numel() for p in model.parameters())
    return n, {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--single-rank", action="store_true", help="world 1, through the collectives")
    ap.add_argument("--strategies", default="2,3", help="ZeRO strategies, comma-separated")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab=1024, seq=128, d=args.width, heads=8, layers=args.layers)
    strategies = [int(s) for s in args.strategies.split(",")]
    rows = {}
    for strategy in strategies:
        for mode in (False, True):
            n, rows[strategy, mode] = run(cfg, args.steps, strategy, mode, args.single_rank or world == 1, rank)
    if rank == 0:
        print(f"world {world}, {n / 1e6:.1f}M parameters, threads {torch.get_num_threads()}, torch {torch.__version__}")
        print("| ZeRO | mode | step ms | backward ms | optimizer.step() ms |")
        print("|---|---|---|---|---|")
        for strategy in strategies:
            for mode, label in ((False, "step after the backward"), (True, "step_in_backward=True")):
                r = rows[strategy, mode]
                print(f"| {strategy} | {label} | {r['step']:.1f} | {r['backward']:.1f} | {r['optimizer.step()']:.1f} |")
        for strategy in strategies:
            on, off = rows[strategy, True], rows[strategy, False]
            print(f"ZeRO-{strategy} hidden: {1 - on['optimizer.step()'] / off['optimizer.step()']:.0%} of "
                  f"optimizer.step(); whole step {on['step'] / off['step']:.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
