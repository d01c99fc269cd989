"""One benchmark configuration, under torchrun: DDP, torch FSDP2 or megatron_fsdp_c (a strategy)
on the same GPT; rank 0 writes a JSON line of what it measured. Started by benchmarks/run.py,
one process group per configuration so that peak memory is per configuration."""
import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_c as mfsdp
from megatron_fsdp_c.testing import GPT, TPGPT, Block, GPTConfig, TPBlock, batch, init_distributed, parallelize_tp

MODELS = {
    # the training benchmark: a plain GPT of pre-norm blocks (CPU size)
    "gpt": dict(cfg=GPTConfig(vocab=2048, seq=128, d=256, heads=8, layers=6), batch=8),
    # the one-GPU comparison of the CUDA issue (bf16 compute, fp32 main weights, AdamW)
    "gpt-small": dict(cfg=GPTConfig(vocab=8192, seq=256, d=512, heads=8, layers=12), batch=4),
    "gpt-large": dict(cfg=GPTConfig(vocab=32768, seq=1024, d=2048, heads=16, layers=16), batch=4),
    # the hook-overhead benchmark: many tiny units, where Python hooks dominate
    "tiny": dict(layers=64, width=32, batch=4),
}


class TinyLayer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class TinyStack(nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.layers = nn.Sequential(*[TinyLayer(width) for _ in range(layers)])

    def forward(self, x, y):
        return ((self.layers(x) - y) ** 2).mean()


def reset_peak_rss():
    """Linux lets a process reset its resident high-water mark (VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t._local_tensor if hasattr(t, "_local_tensor") else t
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def is_gpt(name):
    return name.startswith("gpt")


def build(args, device):
    torch.manual_seed(0)
    spec = MODELS[args.model]
    if args.tp:  # the same GPT with separate q, k, v (torch's TP plans split them by heads)
        return TPGPT(spec["cfg"]).to(device), TPBlock
    if is_gpt(args.model):
        model = GPT(spec["cfg"]).to(device)
        unit_cls = Block
    else:
        model = TinyStack(spec["layers"], spec["width"]).to(device)
        unit_cls = TinyLayer
    return model, unit_cls


def make_batch(args, step, rank, device):
    spec = MODELS[args.model]
    if is_gpt(args.model):
        return batch(spec["cfg"], spec["batch"], seed=1000 * step + rank, device=device)
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(spec["batch"], spec["width"], generator=g).to(device)
    return x, torch.randn(spec["batch"], spec["width"], generator=g).to(device)


def theoretical_bytes(model_obj, strategy, micro, grad_elem, gathered_once=()):
    """Collective bytes per optimisation step implied by the strategy, without padding (the
    all-gather/reduce-scatter full size S, as nccl-tests report algbw = S / t). Gradients are
    communicated with grad_elem bytes an element. Units in `gathered_once` stay gathered from
    forward to backward (the per-module root group, as FSDP2 keeps its root's)."""
    buf = model_obj.param_buffer
    elem = {r.name: r.param.element_size() for r in buf.records}
    numel = {r.name: math.prod(r.shape) for r in buf.records}  # a TP parameter's: its TP shard's
    unit_bytes = sum(numel[r.name] * elem[r.name] for r in buf.records if r.unit >= 0 and r.unit not in gathered_once)
    root_bytes = sum(numel[r.name] * elem[r.name] for r in buf.records if r.unit < 0 or r.unit in gathered_once)
    grad_bytes = sum(numel[r.name] * grad_elem for r in buf.records if r.requires_grad)
    if strategy == 0:
        return {"all_reduce": grad_bytes}
    if strategy == 1:
        return {"reduce_scatter": grad_bytes, "all_gather": unit_bytes + root_bytes}
    if strategy == 2:
        return {"reduce_scatter": micro * grad_bytes, "all_gather": unit_bytes + root_bytes}
    return {"reduce_scatter": micro * grad_bytes, "all_gather": micro * (2 * unit_bytes + root_bytes)}


def theoretical_wire_bytes(model_obj, micro, specs):
    """Bytes per optimisation step of ZeRO-3 with quantized wires, from the bucket plan: every
    gather moves W pieces of quant_wire_bytes(mode, shard_size, block) (two gathers a step for a
    unit's buckets, forward and backward; one for the root's), every reduction W pieces of the
    gradients' mode ([Note: quantized communication] in csrc/comm/wire.c); a plain wire moves
    W * shard_size elements of its dtype."""
    from megatron_fsdp_c import _C
    buf = model_obj.param_buffer
    out = {"all_gather": 0, "reduce_scatter": 0}
    for bp, spec in zip(buf.plan, buf.specs):
        w, n = bp["shards"], bp["shard_size"]
        gathers = 2 * micro if bp["unit"] >= 0 else micro
        elem = {0: 4, 1: 2, 2: 2, 3: 8}[spec["param_dtype"]]
        wq, gq, block = spec.get("wire_weights", 0), spec.get("wire_grads", 0), spec.get("wire_block", 128)
        out["all_gather"] += gathers * w * (_C.quant_wire_bytes(wq - 1, n, block) if wq else n * elem)
        if spec["grad_mode"] != _C.GRAD_NONE:
            celem = {0: 4, 1: 2, 2: 2, 3: 8}[spec["comm_dtype"]]
            out["reduce_scatter"] += micro * w * (_C.quant_wire_bytes(gq - 1, n, block) if gq else n * celem)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=["ddp", "fsdp2", "mfsdp", "mfsdp2"], required=True,
                    help="mfsdp: fully_shard (Megatron-FSDP API); mfsdp2: per_module.fully_shard")
    ap.add_argument("--strategy", type=int, default=3)
    ap.add_argument("--model", choices=list(MODELS), default="gpt")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: DDP under bf16 autocast, FSDP2 with bf16 params and fp32 reduction, "
                         "megatron_fsdp_c with a bf16 model and fp32 main weights and gradients")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--transport", choices=["auto", "torch", "nccl"], default="auto",
                    help="megatron_fsdp_c's transport (nccl: the native one, CUDA builds)")
    ap.add_argument("--mesh", default=None,
                    help="OUTERxSHARD (e.g. 2x2): hybrid sharding (HSDP) on a 2-D (replicate, shard) mesh")
    ap.add_argument("--outer", choices=["no_shard", "optim"], default="no_shard",
                    help="megatron_fsdp_c's outer_dp_sharding_strategy on --mesh (optim: HFSDP)")
    ap.add_argument("--tp", type=int, default=0,
                    help="N > 0: 2-D parallelism, a (world/N data-parallel, N tensor-parallel) mesh: torch's "
                         "sequence-parallel plan (parallelize_tp), then FSDP over the data-parallel dim")
    ap.add_argument("--quant", default=None,
                    help="WEIGHTS,GRADS[,BLOCK]: megatron_fsdp_c's QuantizedCommPolicy (each a mode or none)")
    ap.add_argument("--grad-comm", choices=["fp32", "bf16"], default="fp32",
                    help="megatron_fsdp_c's gradient communication dtype (unquantized gradients)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    quant = None
    if args.quant:
        parts = args.quant.split(",")
        mode = lambda v: None if v == "none" else v  # noqa: E731
        quant = mfsdp.QuantizedCommPolicy(weights=mode(parts[0]), grads=mode(parts[1]),
                                          block=int(parts[2]) if len(parts) > 2 else 128)

    rank, world, device = init_distributed()
    cuda = device.type == "cuda"
    torch.set_num_threads(1)

    model, unit_cls = build(args, device)
    mesh = None
    dp_rank, tp_kw = rank, {}
    if args.tp:
        from torch.distributed.device_mesh import init_device_mesh
        mesh_2d = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        parallelize_tp(model, mesh_2d["tp"], sequence_parallel=True)
        dp_rank = mesh_2d["dp"].get_local_rank()  # the tp ranks of a dp rank read the same batch
        tp_kw = dict(mesh=mesh_2d["dp"]) if args.framework in ("fsdp2", "mfsdp2") else \
            dict(device_mesh=mesh_2d, dp_shard_dim="dp", tp_dim="tp")
    if args.mesh:
        from torch.distributed.device_mesh import init_device_mesh
        outer, inner = (int(v) for v in args.mesh.split("x"))
        mesh = init_device_mesh(device.type, (outer, inner), mesh_dim_names=("dp_outer", "dp_shard"))
    n_params = sum(p.numel() for p in model.parameters())
    train = is_gpt(args.model)
    bf16 = args.precision == "bf16"
    sharded = None
    autocast = None
    if args.framework == "ddp":
        runner = nn.parallel.DistributedDataParallel(model)
        params = list(runner.parameters())
        if bf16:
            autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    elif args.framework in ("fsdp2", "mfsdp2"):  # the same script; only the import differs
        from torch.distributed.fsdp import MixedPrecisionPolicy as Fsdp2Policy
        if args.framework == "fsdp2":
            from torch.distributed.fsdp import fully_shard as fsdp2
            extra = {}
        else:
            from megatron_fsdp_c.per_module import fully_shard as fsdp2
            extra = dict(zero_dp_strategy=args.strategy)

        policy = Fsdp2Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else Fsdp2Policy()
        if mesh is not None:
            extra["mesh"] = mesh  # 2-D: HSDP in both
        extra.update(tp_kw)
        for m in model.modules():
            if isinstance(m, unit_cls):
                fsdp2(m, mp_policy=policy, **extra)
        runner = fsdp2(model, mp_policy=policy, **extra)
        params = list(runner.parameters())
    else:
        comm = None if quant is not None and quant.grads else (
            torch.bfloat16 if args.grad_comm == "bf16" else torch.float32)
        policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32,
                                            grad_comm_dtype=comm)
        if bf16:
            model = model.to(torch.bfloat16)  # compute weights bf16; fp32 main weights in the engine
        # One rank still issues every collective (a one-rank NCCL collective is a copy): the
        # one-GPU benchmark measures the communication path, not an engine that skips it.
        hybrid = dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                      hybrid_fsdp_group=dist.group.WORLD, outer_dp_sharding_strategy=args.outer) \
            if mesh is not None else {}
        runner, _ = mfsdp.fully_shard(model, None, fsdp_unit_modules=[unit_cls], zero_dp_strategy=args.strategy,
                                      mixed_precision_policy=policy, transport=args.transport,
                                      single_rank_collectives=world == 1 and train, quantized_comm_policy=quant,
                                      **hybrid, **tp_kw)
        sharded = runner
        params = list(runner.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4) if train else None
    if opt is not None and sharded is not None and args.framework == "mfsdp":
        mfsdp.fully_shard_optimizer(opt)

    def loss_of(i):
        x, y = make_batch(args, i, dp_rank, device)
        with autocast if autocast is not None else contextlib.nullcontext():
            return runner(x, y)

    def step(i):
        loss = loss_of(i)
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        elif args.framework == "mfsdp":
            sharded.zero_grad_buffer()
        else:
            runner.zero_grad(set_to_none=True)
        return loss

    for i in range(args.warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    rss_at_start = current_rss_bytes() if not cuda else 0
    if args.framework == "mfsdp2":
        sharded = runner._mfsdp_group.owner  # the engine of the root, built at the first forward
    before = sharded.comm_stats() if sharded is not None else None
    times = []
    for i in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step(args.warmup + i)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    comm_after = sharded.comm_stats() if sharded is not None else None
    flag_sync_ms = None
    if sharded is not None and train:  # the unused-parameter flags, once per gradient sync: read from the
        flag_times = []                 # reductions' tails, or their all-reduce ([Note: unused parameters])
        records = [r for r in sharded.param_buffer.records if r.grad_dtensor is not None]
        for _ in range(30):
            dist.barrier()
            t0 = time.perf_counter()
            if sharded._reduced_flags(records) is None:
                sharded._used_anywhere()
            flag_times.append(time.perf_counter() - t0)
        flag_sync_ms = 1e3 * statistics.median(flag_times)
    # Held bytes, taken between backward and the optimizer step, when gradients exist for every
    # framework: parameters (+ main weights), gradients, optimizer states.
    loss_of(10_000).backward()
    if sharded is not None:
        report = sharded.memory_report(opt)
        held = dict(param=report["param_bytes"], grad=report["grad_bytes"], optim=report["optimizer_state_bytes"])
    else:
        grads = [p.grad for p in params]
        states = [v for s in (opt.state.values() if opt else []) for v in s.values() if isinstance(v, torch.Tensor)]
        held = dict(param=storage_bytes(params), grad=storage_bytes(grads), optim=storage_bytes(states))
    if opt is not None:
        opt.zero_grad()
    ours = args.framework in ("mfsdp", "mfsdp2")
    result = dict(framework=args.framework, strategy=args.strategy if ours else None,
                  transport=args.transport if args.framework == "mfsdp" else None,
                  model=args.model, precision=args.precision, world=world, device=device.type, params=n_params,
                  step_ms=1e3 * statistics.median(times), step_ms_all=[1e3 * t for t in times],
                  peak_bytes=(torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()),
                  peak_kind="cuda max_memory_allocated" if cuda else "peak RSS (VmHWM) during timed steps",
                  transient_bytes=(0 if cuda else peak_rss_bytes() - rss_at_start),
                  held=held, flag_sync_ms=flag_sync_ms, mesh=args.mesh, tp=args.tp,
                  outer=args.outer if args.mesh and args.framework == "mfsdp" else None,
                  grad_bytes=sum(p.numel() * 4 for p in model.parameters() if p.requires_grad),
                  quant=args.quant, grad_comm=args.grad_comm if args.framework == "mfsdp" else None)
    if args.model == "tiny":
        result["units"] = MODELS["tiny"]["layers"]
    if sharded is not None:
        per_step = {k: (comm_after[k] - before[k]) / args.steps for k in comm_after}
        result["comm_per_step"] = per_step
        if train and args.framework == "mfsdp" and args.strategy == 3 and not args.mesh:
            result["wire_theory"] = theoretical_wire_bytes(sharded, 1, sharded.param_buffer.specs)
        if train and quant is None and args.grad_comm == "fp32":
            once = (runner._mfsdp_group.unit_state.index,) if args.framework == "mfsdp2" else ()
            result["comm_theory"] = theoretical_bytes(sharded, args.strategy, 1, grad_elem=4,  # fp32 reductions
                                                      gathered_once=once)
    if rank == 0:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    if sharded is not None:
        mfsdp.close(sharded)  # every rank, same point: the native transport's collective end
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
