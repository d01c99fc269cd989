"""Held memory and step time of the benchmark GPT with a frozen backbone (embeddings and every
block frozen, the final norm and the head training), the two designs of [Note: changing
requires_grad] (megatron_fsdp_c/_trainable.py) side by side:

    torchrun --nproc_per_node 2 benchmarks/frozen_backbone.py --strategy 3

- lazy (what the library does): frozen parameters get buckets of their own without gradient
  memory; a bucket gets its gradient buffers when a parameter of it starts training.
- eager (the alternative, emulated): every floating parameter planned as trainable (gradient
  buffers allocated, frozen parameters share buckets with trainable ones), the frozen ones then
  a cheap path (the engine expects no gradient of them; a bucket with no trainable parameter
  reduces nothing, one with some packs the frozen ones as zeros).
Then the lazy model's backbone is unfrozen, and frozen again (memory after zero_grad and the
next forward). Rank 0 prints held bytes (memory_report) and the median step time, and the
median cost of the per-forward requires_grad check."""
import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist

import megatron_fsdp_c as mfsdp
from bench_worker import MODELS
from megatron_fsdp_c import _C, _param_buffer
from megatron_fsdp_c.testing import GPT, Block, batch, init_distributed

BACKBONE = ("tok.", "pos.", "blocks.")
_PLAN = _C.plan  # the planner itself: the eager design patches _C.plan


def set_backbone(named, flag):
    for n, p in named.items():
        if n.startswith(BACKBONE):
            p.requires_grad_(flag)


def plan_all_trainable(params, *args):
    """_C.plan with every floating parameter marked trainable (the eager design)."""
    floating = {code for dt, code in _C.DTYPE_CODES.items() if dt.is_floating_point}
    return _PLAN([p[:4] + (1 if p[2] in floating else p[4],) + p[5:] for p in params], *args)


def run(spec, strategy, eager, steps, rank):
    torch.manual_seed(0)
    model = GPT(spec["cfg"])
    set_backbone(dict(model.named_parameters()), False)
    with mock.patch.object(_param_buffer._C, "plan", plan_all_trainable) if eager else contextlib.nullcontext():
        fsdp, opt = mfsdp.fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    named = {n[len("module."):]: p for n, p in fsdp.named_parameters()}
    if eager:  # the engine and the hooks expect no gradient of the frozen parameters
        buf = fsdp.param_buffer
        for b, recs in buf.records_by_bucket().items():
            frozen = [r.item for r in recs if not r.requires_grad]
            if frozen and buf.specs[b]["grad_mode"] != _C.GRAD_NONE:
                buf.engine.set_trainable(b, frozen, False)
                buf.trainable_items[b] -= len(frozen)
        fsdp.hooks.retrain()

    def train(n, seed):
        times = []
        for s in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            x, y = batch(spec["cfg"], spec["batch"], seed=seed + 1000 * s + rank)
            fsdp(x, y).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:]) * 1e3, fsdp.memory_report(opt)

    out = {"frozen": train(steps, 0)}
    if not eager:
        set_backbone(named, True)
        out["unfrozen"] = train(steps, 1)
        set_backbone(named, False)
        out["refrozen"] = train(steps, 2)
        tracker = fsdp._trainable_tracker
        checks = []
        for _ in range(200):
            t0 = time.perf_counter()
            tracker.sync()
            checks.append(time.perf_counter() - t0)
        out["check_us"] = statistics.median(checks) * 1e6
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    rank, world, device = init_distributed()
    torch.set_num_threads(1)
    spec = MODELS["gpt"]
    for eager in (False, True):
        out = run(spec, args.strategy, eager, args.steps, rank)
        if rank == 0:
            for phase, value in out.items():
                if phase == "check_us":
                    print(f"{'eager' if eager else 'lazy'}: requires_grad check per forward {value:.1f} us")
                    continue
                ms, mem = value
                print(f"{'eager' if eager else 'lazy'} {phase:9s} strategy {args.strategy} world {world}: step "
                      f"{ms:7.1f} ms, held {mem['total_bytes'] / 2**20:6.2f} MiB (params "
                      f"{mem['param_bytes'] / 2**20:.2f}, grads {mem['grad_bytes'] / 2**20:.2f}, optimizer "
                      f"{mem['optimizer_state_bytes'] / 2**20:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
