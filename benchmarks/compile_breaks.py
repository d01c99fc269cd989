"""Graph breaks under torch.compile: FSDP2 and megatron_fsdp_c (every strategy) on the test GPT.

    python benchmarks/compile_breaks.py [--world 2]

Each configuration compiles `torch.compile(model)` and runs two training steps (forward and
backward) on `--world` gloo ranks; it prints the graph breaks Dynamo counted while compiling the
first step (`torch._dynamo.utils.counters["graph_break"]`, the same counter `torch._dynamo.explain`
reads) with their reasons, and the number of graphs compiled. The second step must compile
nothing new.
"""
import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import megatron_fsdp_c as mfsdp  # noqa: E402
from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch, run_on_ranks  # noqa: E402

NAMES = {0: "no_shard", 1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def count(rank, world, which):
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    cfg = GPTConfig(vocab=64, seq=8, d=32, heads=4, layers=3)
    torch.manual_seed(0)
    model = GPT(cfg)
    if which == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        model = fully_shard(model)
    else:
        model, _ = mfsdp.fully_shard(model, None, fsdp_unit_modules=[Block], zero_dp_strategy=which)
    compiled = torch.compile(model)
    dynamo.reset()
    counters.clear()
    first = None
    for step in range(2):
        x, y = batch(cfg, 2, seed=rank + 10 * step)
        compiled(x, y).backward()
        if step == 0:
            first = collections.Counter(counters["graph_break"])
            graphs = counters["stats"]["unique_graphs"]
    later = collections.Counter(counters["graph_break"]) - first
    reasons = [(n, reason.split("\n")[0][:110]) for reason, n in first.most_common()]
    return dict(breaks=sum(first.values()), graphs=graphs, new_breaks_step2=sum(later.values()), reasons=reasons)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    rows = ["| configuration | graph breaks (first step) | graphs compiled | new breaks in step 2 |", "|---|---|---|---|"]
    for which in ["fsdp2", 0, 1, 2, 3]:
        r = run_on_ranks(count, args.world, which)[0]
        label = "FSDP2" if which == "fsdp2" else f"megatron_fsdp_c {NAMES[which]}"
        rows.append(f"| {label} | {r['breaks']} | {r['graphs']} | {r['new_breaks_step2']} |")
        for n, reason in r["reasons"]:
            print(f"[{label}] {n} x {reason}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
