"""The per-module fully_shard (megatron_fsdp_c.per_module) is a drop-in for torch's FSDP2: the same
training script, changing only the import, gives the same losses and parameters.

One script (`train`), run with torch.distributed.fsdp.fully_shard and with ours, at world sizes 1, 2
and 4 on the test GPT and a transformers Llama, over: fp32; bf16 param_dtype with fp32 reduce_dtype;
gradient accumulation with set_requires_gradient_sync(False); reshard_after_forward False;
activation checkpointing; meta-device initialisation (to_empty + reset_parameters after
fully_shard). Our ZeRO-1/2 and no_shard groups (zero_dp_strategy) run the same script too.

[Note: same reduction order as FSDP2]
Both libraries reduce-scatter the same rank-major layout with gloo (each rank's torch.chunk rows
of every parameter, padded alike), so the sums run in the same order: fp32 and bf16-compute runs
match FSDP2 bit for bit at every world size, and so do our ZeRO-1/2 groups (they reduce-scatter
that layout too). Our no_shard groups all-reduce instead: at world 1 and 2 that is the same sum
(a sum of two terms is the same in either order), at world 4 it is not, and an fp32 comparison
there would measure the CPU's kernels (Adam turns last-bit differences of near-zero gradients
into lr-sized steps), not the algorithm. So at world 4 no_shard is checked in float64 against
FSDP2's float64 run to rtol 1e-9 (a wrong algorithm is off by ~1e-3, reduction order by ~1e-15),
and its fp32 run must be bit-identical run to run. float64 runs of the same order match to rtol
1e-12. Against DDP, gradient accumulation with sync off is bit-identical in fp32 at world 2 (DDP's
summation order).
"""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from megatron_fsdp_c.testing import GPT, Block, GPTConfig, batch

from support import rank_grid
from support.checks import ATOL, RTOL

CFG = GPTConfig(vocab=67, seq=8, d=36, heads=4, layers=3)
STEPS = 3
CELLS = rank_grid.Cells(__name__)
CASES = ["fp32", "float64", "bf16", "accumulate", "keep_unsharded", "checkpointing", "meta_init",
         "optim_grads", "optim", "no_shard"]


def _llama(meta=False):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    cfg = LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      attn_implementation="eager", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg), LlamaDecoderLayer, "model.layers"


def build(kind, meta=False):
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        if kind == "gpt":
            return GPT(CFG), Block, "blocks"
        return _llama()


def loss_of(kind, model, x, y):
    return model(x, y) if kind == "gpt" else model(input_ids=x, labels=y).loss


def blocks_of(model, path):
    mod = model
    for part in path.split("."):
        mod = getattr(mod, part)
    return list(mod)


def train(rank, world, impl, kind, case, dtype=torch.float32):
    """One user's FSDP2 training script; `impl` picks the fully_shard it imports. The "float64"
    case is the fp32 one with a float64 model (so is dtype=torch.float64 for the other cases)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
        extra = {}
    else:
        from megatron_fsdp_c.per_module import fully_shard
        extra = {"zero_dp_strategy": {"optim_grads": 2, "optim": 1, "no_shard": 0}.get(case, 3)}
    meta = case == "meta_init"
    model, block_cls, path = build(kind, meta=meta)
    if case == "float64" or dtype == torch.float64:
        model = model.double()
    if case == "checkpointing" and kind == "llama":  # transformers' own switch (its layers take kwargs)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif case == "checkpointing":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        parent = model if kind == "gpt" else model.model
        layers = parent.blocks if kind == "gpt" else parent.layers
        for i in range(len(layers)):
            layers[i] = checkpoint_wrapper(layers[i])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if case == "bf16" \
        else MixedPrecisionPolicy()
    for block in blocks_of(model, path):
        fully_shard(block, mp_policy=mp, reshard_after_forward=case != "keep_unsharded", **extra)
    fully_shard(model, mp_policy=mp, **extra)
    if meta:  # torchtitan's way: shard on meta, then materialise and initialise
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        if kind == "llama":
            model.init_weights()  # transformers' initialisation, rotary buffers included
        else:
            for m in model.modules():
                if hasattr(m, "reset_parameters") and m is not model:
                    m.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = GPTConfig(vocab=CFG.vocab if kind == "gpt" else 61, seq=8)
    micro = 3 if case == "accumulate" else 1
    losses = []
    for step in range(STEPS):
        for m in range(micro):
            if case == "accumulate":
                model.set_requires_gradient_sync(m == micro - 1)
            x, y = batch(cfg, 2, seed=1000 * step + 10 * m + rank)
            loss = loss_of(kind, model, x, y)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, params=params)


def ddp_accumulate(rank, world, kind):
    """DDP on the same data, accumulation with no_sync, for the fp32 bit-identity check."""
    model, _, _ = build(kind)
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = GPTConfig(vocab=CFG.vocab if kind == "gpt" else 61, seq=8)
    losses = []
    for step in range(STEPS):
        for m in range(3):
            x, y = batch(cfg, 2, seed=1000 * step + 10 * m + rank)
            ctx = ddp.no_sync() if m < 2 else torch.enable_grad()
            with ctx:
                loss = loss_of(kind, ddp, x, y)
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


def no_shard_order_differs(world):
    """See [Note: same reduction order as FSDP2]."""
    return world > 2


MEGATRON = ("optim_grads", "optim", "no_shard")
SAME_SCRIPT, MEGATRON_TEST, DDP_TEST = ("test_same_script_as_fsdp2", "test_megatron_strategies_in_the_fsdp2_script",
                                        "test_accumulation_with_sync_off_is_ddp_bit_for_bit")
for _kind in ("gpt", "llama"):
    for _case in CASES:
        if _case in MEGATRON:
            CELLS.add((_kind, _case, "ours"), train, "ours", _kind, _case, worlds=(1, 2, 4), tests=[MEGATRON_TEST],
                      match=dict(kind=_kind, case=_case))
            continue
        # FSDP2's fp32 and float64 runs are also what the Megatron strategies are compared with
        reference = _case in ("fp32", "float64")
        CELLS.add((_kind, _case, "torch"), train, "torch", _kind, _case, worlds=(1, 2, 4),
                  tests=[SAME_SCRIPT] + ([MEGATRON_TEST] if reference else []),
                  match=dict(kind=_kind) if reference else dict(kind=_kind, case=_case))
        CELLS.add((_kind, _case, "ours"), train, "ours", _kind, _case, worlds=(1, 2, 4),
                  tests=[SAME_SCRIPT] + ([DDP_TEST] if _case == "accumulate" else []), match=dict(kind=_kind, case=_case))
    for _variant, _dtype in (("float64", torch.float64), ("again", torch.float32)):  # see no_shard_order_differs
        CELLS.add((_kind, "no_shard", "ours", _variant), train, "ours", _kind, "no_shard", _dtype, worlds=(4,),
                  tests=[MEGATRON_TEST], match=dict(kind=_kind, case="no_shard"))
    CELLS.add((_kind, "ddp"), ddp_accumulate, _kind, tests=[DDP_TEST], match=dict(kind=_kind))


def _cells(world, *keys):
    """Every rank's values of the cells `keys` (one tuple a rank)."""
    return zip(*(CELLS.result(key, world) for key in keys))


def _close(a, b, rtol, atol, what):
    assert set(a) == set(b), f"{what}: parameter names differ"
    for name in a:
        torch.testing.assert_close(a[name].double(), b[name].double(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} {name}: {m}")


def _same(ours, theirs, what):
    assert ours["losses"] == theirs["losses"], (what, ours["losses"], theirs["losses"])
    _close(ours["params"], theirs["params"], 0, 0, what)


def _float64_close(ours, theirs, rtol, atol, what):
    torch.testing.assert_close(torch.tensor(ours["losses"], dtype=torch.float64),
                               torch.tensor(theirs["losses"], dtype=torch.float64), rtol=rtol, atol=atol)
    _close(ours["params"], theirs["params"], rtol, atol, what)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("case", [c for c in CASES if c not in ("optim_grads", "optim", "no_shard")])
def test_same_script_as_fsdp2(world, kind, case):
    """See [Note: same reduction order as FSDP2]: bit for bit (float64: rtol 1e-12)."""
    for theirs, ours in _cells(world, (kind, case, "torch"), (kind, case, "ours")):
        if case == "float64":
            _float64_close(ours, theirs, 1e-12, 1e-15, "params")
        else:
            _same(ours, theirs, "params")


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("case", ["optim_grads", "optim", "no_shard"])
def test_megatron_strategies_in_the_fsdp2_script(world, kind, case):
    """zero_dp_strategy 0-2 per call: the same numbers as FSDP2's (ZeRO-3) run of the script, bit
    for bit where the reduction order is the same, else in float64 to rtol 1e-9 (see [Note: same
    reduction order as FSDP2])."""
    if case == "no_shard" and no_shard_order_differs(world):
        for ours, again, ours64, theirs64 in _cells(world, (kind, case, "ours"), (kind, case, "ours", "again"),
                                                   (kind, case, "ours", "float64"), (kind, "float64", "torch")):
            _float64_close(ours64, theirs64, RTOL, ATOL, "float64 params")
            _same(again, ours, "fp32 run to run")
    else:
        for theirs, ours in _cells(world, (kind, "fp32", "torch"), (kind, case, "ours")):
            _same(ours, theirs, "params")


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_accumulation_with_sync_off_is_ddp_bit_for_bit(kind):
    for ddp, ours in _cells(2, (kind, "ddp"), (kind, "accumulate", "ours")):
        assert ours["losses"] == ddp["losses"]
        _close({k: v for k, v in ours["params"].items()}, ddp["params"], 0, 0, "params")
