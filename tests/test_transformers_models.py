"""Hugging Face transformers models trained the way their users train them (issue 12): tiny
configs (no downloads), eager attention, no dropout, float64; AdamW, clip_grad_norm_ and a
transformers scheduler (get_linear_schedule_with_warmup) built after fully_shard; against DDP on
the same per-rank data, for every strategy at world sizes 2 and 4, to rtol 1e-9.

- GPT-2 with tied input/output embeddings (unit GPT2Block);
- Llama (unit LlamaDecoderLayer);
- Mixtral, an MoE with top-2 routing over 4 experts (unit MixtralDecoderLayer). transformers
  keeps the experts in fused 3-D parameters, so an expert without tokens gets a zero gradient
  slice rather than an unused parameter: DDP needs no find_unused_parameters here;
- T5, an encoder-decoder whose shared embedding is tied to the encoder, the decoder and the
  head (unit T5Block).

If the scheduler cannot be built on the sharded optimizer (issue 12), that check fails and the
loop goes on with the same schedule applied by hand, so the model's own checks still say
whether the model trains like DDP.
"""
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import megatron_fsdp_c as mf

pytest.importorskip("transformers")

from support import rank_grid
from support.checks import assert_named, check_params, check_values, to_full
from support.data import next_token_batch
from support.schedulers import build_scheduler
from test_user_loops import COLLECTIVE_TIMEOUT, STRATEGIES, WORLDS, ref_params

STEPS = 4
VOCAB = 64
CELLS = rank_grid.Cells(__name__)


def gpt2():
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                      bos_token_id=0, eos_token_id=0), GPT2Block


def llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                       bos_token_id=0, eos_token_id=0, pad_token_id=0), LlamaDecoderLayer


def mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
    return MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0), MixtralDecoderLayer


def t5():
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Block
    return T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                    dropout_rate=0.0, relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0,
                    eos_token_id=1), T5Block


MODELS = {"gpt2_tied": gpt2, "llama": llama, "mixtral_moe": mixtral, "t5_encoder_decoder": t5}


def build(name):
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
    config, unit = MODELS[name]()
    auto = AutoModelForSeq2SeqLM if name.startswith("t5") else AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(config, attn_implementation="eager", experts_implementation="eager")
    return model.to(torch.float64), unit


def linear_warmup(optimizer):
    from transformers import get_linear_schedule_with_warmup
    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=STEPS + 1)


def train(model, optimizer, scheduler, rank, name):
    out = dict(losses=[], norms=[], lrs=[])
    for step in range(STEPS):
        x, y = next_token_batch(step, rank, VOCAB, seq=8, batch=2)
        # causal LMs shift the labels themselves; T5 maps inputs to targets
        loss = model(input_ids=x, labels=y if name.startswith("t5") else x).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        out["losses"].append(loss.item())
        out["norms"].append(float(to_full(norm)))
        out["lrs"].append(scheduler.get_last_lr()[0])
    return out


def ddp_run(rank, name):
    ref, _ = build(name)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    return dict(train(DDP(ref), ref_opt, linear_warmup(ref_opt), rank, name), params=ref_params(ref))


def prepare(keys):
    """Imports the model code before the cells start (see support/spawns.py's _grid_worker)."""
    for name, _ in keys:
        MODELS[name]()
    import transformers.optimization  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM  # noqa: F401


def cell(rank, world, name, strategy):
    theirs = rank_grid.once((__name__, name), ddp_run, rank, name)
    model, unit = build(name)
    fsdp, optimizer = mf.fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
                                     fsdp_unit_modules=[unit], zero_dp_strategy=strategy,
                                     collective_timeout=COLLECTIVE_TIMEOUT)
    scheduler, why = build_scheduler(linear_warmup, optimizer)
    ours = train(fsdp, optimizer, scheduler, rank, name)
    checks = {
        "get_linear_schedule_with_warmup builds on the sharded optimizer": (not why, why),
        "losses": check_values("losses", ours["losses"], theirs["losses"]),
        "clip_grad_norm_ returns DDP's norm": check_values("norms", ours["norms"], theirs["norms"]),
        "learning rates": check_values("lrs", ours["lrs"], theirs["lrs"]),
        "final parameters": check_params(fsdp.full_parameters(), theirs["params"]),
    }
    if name in ("gpt2_tied", "t5_encoder_decoder"):
        inner = fsdp.module
        tied = inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
        checks["embeddings stay tied"] = (tied, "the output head no longer shares the input embedding")
    return checks


for _name in MODELS:
    for _strategy in STRATEGIES:
        CELLS.add((_name, _strategy), cell, _name, _strategy, worlds=WORLDS, match=dict(scenario=_name, strategy=_strategy))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", list(MODELS))
def test_transformers_model_matches_ddp(scenario, strategy, world):
    assert_named(CELLS.result((scenario, strategy), world))
