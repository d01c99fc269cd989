"""torchtitan 0.3.0's parallelize_llama (a tiny llama3: 2 layers, dim 32, vocab 64) with torch's
fully_shard swapped for megatron_fsdp_c.per_module.fully_shard (torchtitan.distributed.fsdp's
name), trained 3 steps of 2 microbatches with torchtitan's summed loss over the global tokens
(it calls set_gradient_divide_factor(1.0) on every FSDPModule) and its clip_grad_norm_. Not a test:
torchtitan imports triton (a 285 MB wheel, ~1 GB installed, 46 s to install from PyPI) and costs
~25 s of imports per rank. Run each backend with both implementations in one process group:

    pip install --no-deps torchtitan==0.3.0 spmd-types==0.2.3 triton==3.9.0
    torchrun --nproc_per_node 2 examples/dropin_torchtitan.py partial_dtensor torch ours
    torchrun --nproc_per_node 2 examples/dropin_torchtitan.py full_dtensor torch ours
    torchrun --nproc_per_node 2 examples/dropin_torchtitan.py spmd_types ours

Backends (parallelism.spmd_backend): partial_dtensor passes the data-parallel submesh; full_dtensor
and spmd_types (torchtitan's default) pass the full SPMD mesh with
dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"). full_dtensor makes every parameter, buffer and
input a DTensor on that mesh; spmd_types keeps plain tensors with spmd_types annotations, which
torch 2.13's FSDP2 refuses ("When dp_mesh_dims is provided, all parameters must be DTensors on the
full SPMD mesh"): a newer torch translates the annotations. Ours takes plain parameters there.

Measured 2026-11-24 (CPU, gloo, world 2, fp32; torch 2.13.0, torchtitan 0.3.0, spmd-types 0.2.3,
triton 3.9.0), each line of RESULTs the same on both implementations, bit for bit (losses are each
rank's summed microbatch losses, grad norms torchtitan's clip_grad_norm_ over the whole model):
    partial_dtensor  torch, ours        rank 0 losses [2.2727495431900024, 2.321541905403137, 2.3370420932769775]
                                        rank 1 losses [2.296660542488098, 2.2891849279403687, 2.29755437374115]
                                        grad norms    [0.5714467167854309, 0.5680993795394897, 0.5489861369132996]
    full_dtensor     torch, ours        the same (before the SPMD compute parameters of
                                        megatron_fsdp_c/per_module/_root.py, ours raised "mixed torch.Tensor
                                        and DTensor" in the first RMSNorm)
    spmd_types       ours               the same; torch raises the ValueError above
Each command took 25-27 s on an otherwise idle machine (2 ranks, both implementations, ~20 s of
it imports); before the
isinstance fix (our modules are torch FSDPModules) ours gave half these gradient norms: torchtitan's
set_gradient_divide_factor(1.0) never reached us."""
import sys

import torch
import torch.distributed as dist

import torchtitan.distributed.parallel_dims as parallel_dims_module

parallel_dims_module.device_type = "cpu"  # torchtitan falls back to "cuda" otherwise


def run(impl, backend, steps=3, micro=2, dim=32, vocab=64, seq=16, bs=2):
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, full_dtensor
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers,
                                          _output_linear_init, parallelize_llama)
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    import spmd_types as spmd

    if impl == "ours":
        from megatron_fsdp_c.per_module import fully_shard
        titan_fsdp.fully_shard = fully_shard
    else:
        titan_fsdp.fully_shard = torch_fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    dist_utils.set_spmd_backend(backend)
    cfg = Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(n_layers=2, dim=dim, n_heads=4, hidden_dim=64,
                                    rope=ComplexRoPE.Config(dim=dim // 4, max_seq_len=seq, theta=500000,
                                                            scaling="llama"),
                                    attn_backend="flex"))
    for layer in cfg.layers:  # SDPA: FlexAttention needs torch.compile
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    parallelism = ParallelismConfig(spmd_backend=backend)
    training = TrainingConfig(local_batch_size=bs, seq_len=seq, mixed_precision_param="float32", max_norm=1.0)
    # What the Trainer's update_from_config does to a dense llama3 config (the Trainer itself imports
    # tensorboard and datasets).
    set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    pdims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, world_size=world,
                         spmd_backend=backend)
    pdims.build_mesh()
    with torch.device("meta"):
        model = cfg.build()
    model = parallelize_llama(model, parallel_dims=pdims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in sharded:  # gloo has no PREMUL_SUM, which torch's FSDP2 uses for a divide factor of 1
        m.set_force_sum_reduction_for_comms(True)
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    opts = default_adamw(lr=1e-2).build(model_parts=[model])
    loss_fn = CrossEntropyLoss.Config().build(compile_config=CompileConfig())
    ctx = dist_utils.get_spmd_context(parallel_dims=pdims)
    losses, norms = [], []
    for step in range(steps):
        opts.zero_grad()
        g = torch.Generator().manual_seed(1000 * step + rank)
        batches = [torch.randint(0, vocab, (bs, seq + 1), generator=g) for _ in range(micro)]
        local_tokens = torch.tensor(sum(b[:, 1:].numel() for b in batches), dtype=torch.int64)
        global_tokens = dist_utils.dist_sum_tensor(local_tokens, pdims.get_mesh("batch"))
        total = 0.0
        for b in batches:
            inputs, labels, kw = b[:, :-1], b[:, 1:], {}
            if backend == "full_dtensor":
                inputs, labels, kw = full_dtensor.parallelize_inputs(pdims, inputs, labels, kw)
            elif backend == "spmd_types":
                inputs, labels, kw = annotate_input_spmd_types(pdims, inputs, labels, kw)
            with ctx():
                loss, _ = loss_fn(model(inputs, **kw), labels, global_tokens)  # sum / global tokens
                with spmd.no_typecheck():
                    loss.backward()
            loss = loss.detach()
            total += float(loss.to_local() if hasattr(loss, "to_local") else loss)
        norm = dist_utils.clip_grad_norm_(list(model.parameters()), training.max_norm, foreach=True)
        opts.step()
        losses.append(total)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    return losses, norms, sorted({type(m).__name__ for m in sharded})


if __name__ == "__main__":
    dist.init_process_group("gloo")
    backend = sys.argv[1]
    for impl in sys.argv[2:]:
        losses, norms, kinds = run(impl, backend)
        print(f"RESULT {backend} {impl} rank {dist.get_rank()} losses {losses} grad norms {norms} modules {kinds}",
              flush=True)
    dist.destroy_process_group()

