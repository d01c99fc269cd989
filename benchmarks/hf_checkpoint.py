"""Hugging Face checkpoints out and in, side by side in one run (issue 51): our export
(megatron_fsdp_c.save_hf_checkpoint, every rank writing its own rows into the final files)
against torch's two ways out on the same sharded model, and our import against theirs:

    torchrun --nproc_per_node 2 benchmarks/hf_checkpoint.py --dir /tmp/hf_bench

  export  ours: save_hf_checkpoint; with async_save=True, until it returns and until published
          torch: dcp.save + HuggingFaceStorageWriter(save_distributed, enable_consolidation), as
                 torchtitan's last_save_in_hf: per-rank files, then consolidated on rank 0
          torch: get_model_state_dict(full_state_dict, cpu_offload) + save_pretrained on rank 0
  import  ours: load_hf_checkpoint (each rank reads its own rows)
          torch: dcp.load + HuggingFaceStorageReader into the sharded state dict
          transformers: from_pretrained on every rank (the whole model per rank)
  disk    every rank writing its share of the model's bytes into one file, then fsync: the
          bandwidth the exports are measured against

Each is timed from a barrier to the barrier after os.sync() (what reached the disk, not the page
cache), so writes are durable in every row; before each import the page cache is emptied where
the user may (root), so reads come from the disk (the header line says which). Peak memory: each rank's resident-set peak during the
call above its resident set before it (the heap trimmed first, so freed memory cannot be reused
unseen; the peak reset through /proc/self/clear_refs), the largest over ranks, against the rank's
own shard. The model is a transformers Llama of
--hidden/--layers/--vocab (fp32), sharded by the per-module API (FSDP2's; --api megatron for the
Megatron-style one), one unit per decoder layer."""
import argparse
import ctypes
import os
import shutil
import time

import torch
import torch.distributed as dist

import megatron_fsdp_c as mf
from bench_worker import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from megatron_fsdp_c.testing import init_distributed


def drop_page_cache() -> bool:
    """Empties the kernel's page cache (root only), so that a read comes from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def measure(fn, cold=False):
    """(seconds from a barrier to the barrier after os.sync(), this rank's peak growth in bytes);
    cold: the page cache emptied first (by rank 0)."""
    dist.barrier()
    os.sync()
    if cold and dist.get_rank() == 0:
        COLD[0] = drop_page_cache()
    dist.barrier()
    ctypes.CDLL(None).malloc_trim(0)  # freed memory back to the OS: a call's peak cannot hide in a reused heap
    reset_peak_rss()
    before = current_rss_bytes()
    t0 = time.perf_counter()
    fn()
    os.sync()
    dist.barrier()
    return time.perf_counter() - t0, peak_rss_bytes() - before


COLD = [False]  # whether the imports read from the disk (the page cache could be emptied)


def llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 128, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation="eager")


def shard(model, api):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    if api == "megatron":
        wrapped, _ = mf.fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                    fsdp_unit_modules=[LlamaDecoderLayer], zero_dp_strategy=3)
        return wrapped
    from megatron_fsdp_c.per_module import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def hf_state_dict(wrapped, api):
    sd = wrapped.state_dict()
    return {k.removeprefix("module."): v for k, v in sd.items()} if api == "megatron" else sd


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="scratch directory on the disk to measure (emptied)")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--api", choices=["per_module", "megatron"], default="per_module")
    ap.add_argument("--threads", type=int, default=1, help="torch's writer/consolidation thread counts")
    args = ap.parse_args()
    rank, world, _ = init_distributed()
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import LlamaForCausalLM

    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
    dist.barrier()
    model = llama(args)
    config = model.config
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    wrapped = shard(model, args.api)
    shard_bytes = sum(t.to_local().numel() * t.element_size() for t in hf_state_dict(wrapped, args.api).values())
    path = {k: os.path.join(args.dir, k) for k in ("ours", "async", "torch_writer", "full_state_dict", "disk")}
    rows = []

    def row(group, what, fn, target=None):
        seconds, peak = measure(fn, cold=group == "import")
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        rows.append((group, what, seconds, max(peaks)))
        if target is not None and rank == 0:
            shutil.rmtree(target, ignore_errors=True) if os.path.isdir(target) else os.remove(target)
        dist.barrier()

    def disk():
        os.makedirs(args.dir, exist_ok=True)
        share = (nbytes + world - 1) // world
        block = bytearray(os.urandom(1 << 20))
        fd = os.open(path["disk"], os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            for off in range(0, min(share, nbytes - rank * share), len(block)):
                os.pwrite(fd, block, rank * share + off)
            os.fsync(fd)
        finally:
            os.close(fd)

    def torch_writer():
        dcp.save(hf_state_dict(wrapped, args.api), storage_writer=HuggingFaceStorageWriter(
            path["torch_writer"], save_distributed=True, enable_consolidation=True, thread_count=args.threads,
            thread_count_consolidation=args.threads))

    def full_state_dict():
        sd = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            model.save_pretrained(path["full_state_dict"], state_dict={k.removeprefix("module."): v for k, v in sd.items()})

    row("disk", f"{world} ranks pwrite their share + fsync", disk, path["disk"])
    row("export", "ours: save_hf_checkpoint", lambda: mf.save_hf_checkpoint(wrapped, path["ours"], config=config))
    pending = []
    row("export", "ours, async_save=True: until the call returns (the snapshot)",
        lambda: pending.append(mf.save_hf_checkpoint(wrapped, path["async"], async_save=True)))
    pending[0].result()
    row("export", "ours, async_save=True: until published (the call + result())",
        lambda: mf.save_hf_checkpoint(wrapped, path["async"], async_save=True, overwrite=True).result(), path["async"])
    row("export", "torch: HuggingFaceStorageWriter + consolidation", torch_writer, path["torch_writer"])
    row("export", "torch: full state dict + save_pretrained on rank 0", full_state_dict, path["full_state_dict"])
    row("import", "ours: load_hf_checkpoint", lambda: mf.load_hf_checkpoint(wrapped, path["ours"]))
    row("import", "torch: HuggingFaceStorageReader into the shards",
        lambda: dcp.load(hf_state_dict(wrapped, args.api), storage_reader=HuggingFaceStorageReader(path["ours"])))
    def from_pretrained():
        loaded = LlamaForCausalLM.from_pretrained(path["ours"], attn_implementation="eager")
        for p in loaded.parameters():  # touched, as a first forward would: a lazily mapped file is read
            p.sum()
    row("import", "transformers: from_pretrained on every rank, weights touched", from_pretrained)
    if rank == 0:
        print(f"{time.strftime('%Y-%m-%d')}, {os.uname().nodename}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
              f"world {world}, {args.api} API; model {nbytes / 1e9:.2f} GB fp32 ({args.layers} layers, hidden "
              f"{args.hidden}, vocab {args.vocab}), a rank's shard {shard_bytes / 1e9:.2f} GB; {args.dir}; imports "
              f"{'from the disk (page cache emptied before each)' if COLD[0] else 'from the page cache'}")
        print("| | | s | GB/s | x ours | peak growth per rank (MB, largest) | x shard |")
        print("|---|---|---|---|---|---|---|")
        ours = {g: s for g, w, s, _ in rows if w.startswith("ours:")}
        for group, what, seconds, peak in rows:
            ratio = f"{seconds / ours[group]:.2f}" if group in ours else ""
            print(f"| {group} | {what} | {seconds:.2f} | {nbytes / 1e9 / seconds:.2f} | {ratio} | "
                  f"{peak / 1e6:.0f} | {peak / shard_bytes:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
