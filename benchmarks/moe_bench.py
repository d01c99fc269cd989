"""The MoE benchmark (benchmarks/run.py's `moe` part), under torchrun at 4 CPU ranks: the
expert-parallel MoE of tests/support/moe_model.py at a benchmark size, ep 2, the experts sharded over
dp_mod_ep (2 ranks), the dense part over all 4, with megatron_fsdp_c's per-module fully_shard,
with torch's FSDP2 on the same meshes and script, and with megatron_fsdp_c's Megatron-style
fully_shard(expt_device_mesh=...) on the same rank sets (experts marked allreduce=False, ZeRO-3,
the blocks as units), one after the other in this process (the same data, AdamW). Rank 0 writes
a markdown table: step time, the bytes a rank holds (parameter, gradient and AdamW state shards),
and for ours the bytes per communicator and step (the dense engine's and the experts' engine's
counters, [Note: a mesh per group], [Note: expert data-parallel mesh]).

    torchrun --nproc_per_node 4 benchmarks/moe_bench.py --steps 10 --out bench_out/moe.md
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.moe_model import MoEBlock, MoEModel, moe_batch  # noqa: E402

CONFIG = dict(vocab=2048, d=256, hidden=512, n_experts=8, k=2, layers=4)
ROWS, SEQ, EP = 8, 64, 2


def local_bytes(t):
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def held_bytes(model, opt):
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p.grad) for p in model.parameters())
    states = sum(local_bytes(v) for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    return params, grads, states


def megatron_style(world):
    """The Megatron-style API on the same rank sets: (model, optimizer, its engines' owners)."""
    import megatron_fsdp_c as mfsdp
    expt = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("dp_shard", "ep"))
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = MoEModel(**CONFIG).expert_parallel(expt["ep"].get_group(), expt["ep"].get_local_rank(), EP)
    for block in model.blocks:
        for p in block.moe.experts.parameters():
            p.allreduce = False  # Megatron-core's mark of expert-parallel parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model, opt = mfsdp.fully_shard(model, opt, device_mesh=dense, dp_shard_dim="dp_shard", expt_device_mesh=expt,
                                   fsdp_unit_modules=[MoEBlock], zero_dp_strategy="optim_grads_params")
    return model, opt, model.owners


def run(impl_name, steps, world, rank):
    if impl_name == "megatron":
        model, opt, owners = megatron_style(world)
        return measure(model, opt, owners, steps, rank)
    if impl_name == "ours":
        from megatron_fsdp_c.per_module import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("dp_mod_ep", "ep"))
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = MoEModel(**CONFIG).expert_parallel(mesh["ep"].get_group(), mesh["ep"].get_local_rank(), EP)
    for block in model.blocks:
        fully_shard(block.moe.experts, mesh=mesh["dp_mod_ep"])
        block.moe.experts.set_gradient_divide_factor(float(world))
        fully_shard(block, mesh=dense)
    fully_shard(model, mesh=dense)
    if impl_name == "fsdp2":
        for m in model.modules():
            if hasattr(m, "set_force_sum_reduction_for_comms"):
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    owners = (lambda: model._mfsdp_group.owner.owners()) if impl_name == "ours" else None  # made at the 1st forward
    return measure(model, opt, owners, steps, rank)


def measure(model, opt, owners, steps, rank):
    """Median step time, the bytes held after backward, bytes per step on each engine's communicators
    (`owners`: None, or what returns the engines' owners)."""
    times, before = [], None
    for step in range(steps + 2):
        if step == 2 and owners:
            before = [s.comm_stats() for s in owners()]
        dist.barrier()
        start = time.perf_counter()
        loss = model(*moe_batch(step, rank, rows=ROWS, seq=SEQ, vocab=CONFIG["vocab"]))
        loss.backward()
        held = held_bytes(model, opt)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
    per_comm = None
    if owners:
        after = [s.comm_stats() for s in owners()]
        per_comm = [{k: (a[k] - b[k]) / steps for k in a if k.endswith("_bytes")} for a, b in zip(after, before)]
    params = sum(p.numel() for p in model.parameters())
    return dict(step_ms=1000 * statistics.median(times), held=held, per_comm=per_comm, params=params)


def mib(n):
    return f"{n / 2**20:.2f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="bench_out/moe.md")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    rows = {name: run(name, args.steps, world, rank) for name in ("fsdp2", "ours", "megatron")}
    if rank != 0:
        dist.destroy_process_group()
        return
    base = rows["fsdp2"]["step_ms"]
    lines = [f"#### MoE, {world} ranks, ep {EP} (cpu, fp32): experts sharded over dp_mod_ep ({world // EP} ranks), "
             f"the dense part over {world}; {CONFIG['n_experts']} experts, top-{CONFIG['k']}, d {CONFIG['d']}, "
             f"{CONFIG['layers']} layers, {ROWS}x{SEQ} tokens a rank", "",
             "| configuration | step ms | x FSDP2 | params MiB | grads MiB | optimizer MiB | held MiB | "
             "dense all-gather MiB/step | dense reduce-scatter MiB/step | experts all-gather MiB/step | "
             "experts reduce-scatter MiB/step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, label in (("fsdp2", "FSDP2"), ("ours", "megatron_fsdp_c per-module"),
                        ("megatron", "megatron_fsdp_c fully_shard(expt_device_mesh=)")):
        r = rows[name]
        p, g, s = r["held"]
        comm = ["-"] * 4
        if r["per_comm"]:
            d, e = r["per_comm"][0], r["per_comm"][1]
            comm = [mib(d.get("all_gather_bytes", 0)), mib(d.get("reduce_scatter_bytes", 0)),
                    mib(e.get("all_gather_bytes", 0)), mib(e.get("reduce_scatter_bytes", 0))]
        lines.append(f"| {label} | {r['step_ms']:.1f} | {r['step_ms'] / base:.2f} | {mib(p)} | {mib(g)} | {mib(s)} | "
                     f"{mib(p + g + s)} | " + " | ".join(comm) + " |")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
