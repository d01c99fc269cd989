"""Hugging Face checkpoints straight from the shards (megatron_fsdp_c.save_hf_checkpoint,
[Note: safetensors from the shards]): a transformers Llama, untied and with tied embeddings,
trained two steps under either API, exported by every rank writing its own rows, then read back
by transformers' from_pretrained. The proof, on rank 0: every tensor of our files is bitwise the
tensor save_pretrained writes from the gathered model (read with safetensors, not compared by
file hash), the loaded model's logits equal the trained sharded model's bit for bit, and with a
bf16 cast on the way out the tensors equal torch's own cast of the gathered ones. Also: several
shard files and their index, the refusals (an existing target, a layout that differs across
ranks) and a rank killed in the middle of an export (nothing published, the previous checkpoint
untouched)."""
import os
import signal

import pytest
import torch

import megatron_fsdp_c as mf
from megatron_fsdp_c.testing import run_on_ranks

pytest.importorskip("transformers")

from support import rank_grid
from support.checks import assert_named

VOCAB = 64
CELLS = rank_grid.Cells(__name__)
# (api, strategy): the Megatron-style API's zero_dp_strategy, the per-module API's reshard_after_forward
SETUPS = [("megatron", 0), ("megatron", 1), ("megatron", 2), ("megatron", 3), ("per_module", True),
          ("per_module", False)]


def llama(tied):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation="eager")


def tokens(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (2, 8), generator=g)


def trained(rank, world, api, strategy, tied):
    """A Llama trained two steps under `api`: (the model to save, its inner HF module)."""
    model = llama(tied)
    wrapped, opt = shard(model, api, strategy)
    for step in range(2):
        x = tokens(step, rank)
        wrapped(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return wrapped, model


def train(wrapped, opt, rank, steps):
    """One optimizer step per step of `steps` on its tokens: the losses."""
    losses = []
    for step in steps:
        x = tokens(step, rank)
        loss = wrapped(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def shard(model, api, strategy, meta=False):
    """(the sharded model, its optimizer) under `api` ("megatron", "per_module", or torch's "fsdp2");
    meta: `model` is on the meta device, materialised as each API does it."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    if api == "megatron":
        wrapped, opt = mf.fully_shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      fsdp_unit_modules=[LlamaDecoderLayer], zero_dp_strategy=strategy,
                                      init_model_with_meta_device=meta)
    else:
        if api == "fsdp2":  # torch's own, the reference
            from torch.distributed.fsdp import fully_shard
        else:
            from megatron_fsdp_c.per_module import fully_shard
        for layer in model.model.layers:
            fully_shard(layer, reshard_after_forward=strategy)
        wrapped = fully_shard(model, reshard_after_forward=strategy)
        if meta:
            model.to_empty(device="cpu")  # FSDP2's way: after fully_shard, before the optimizer
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return wrapped, opt


def gathered(wrapped, api):
    """The full state dict on every rank (the reference's tensors)."""
    if api == "megatron":
        return mf.full_state_dict(wrapped, rank0_only=False)
    from torch.distributed.tensor import DTensor
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu() for n, t in wrapped.state_dict().items()}


def load_dir(d):
    """Every tensor of the safetensors files in directory d, by name."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def compare_files(ours_dir, ref_dir, checks, what):
    ours, ref = load_dir(ours_dir), load_dir(ref_dir)
    checks[f"{what}: the names save_pretrained writes"] = (set(ours) == set(ref),
                                                         f"ours only {sorted(set(ours) - set(ref))}, "
                                                         f"save_pretrained's only {sorted(set(ref) - set(ours))}")
    bad = [n for n in set(ours) & set(ref)
           if ours[n].dtype != ref[n].dtype or ours[n].shape != ref[n].shape or not torch.equal(ours[n], ref[n])]
    checks[f"{what}: every tensor bitwise save_pretrained's"] = (not bad, f"differ: {sorted(bad)}")


def hf_names(wrapped, api):
    """The sharded model's state dict (DTensors) under the checkpoint's names: the Megatron-style
    wrapper names its tensors 'module.' + the inner model's name, as Megatron-FSDP does."""
    sd = wrapped.state_dict()
    return {k.removeprefix("module."): v for k, v in sd.items()} if api == "megatron" else sd


def dcp_hf_cell(rank, world, api, strategy):
    """torch's own Hugging Face path on our shards, side by side with FSDP2 doing the same:
    dcp.save with HuggingFaceStorageWriter, consolidated (torchtitan's last_save_in_hf), then
    from_pretrained on it, and HuggingFaceStorageReader back into a freshly sharded model of other
    weights that trains on."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from transformers import LlamaForCausalLM

    root = os.path.join(rank_grid.session_dir(), "dcp_hf", f"{api}-{strategy}-{world}")
    x = tokens(9, 0)
    out = {}
    for which in (api, "fsdp2"):
        how = strategy if which == api or api == "per_module" else True  # FSDP2 beside Megatron's: ZeRO-3
        wrapped, model = trained(rank, world, which, how, False)
        path = os.path.join(root, which)
        dcp.save(hf_names(wrapped, which), storage_writer=HuggingFaceStorageWriter(
            path, save_distributed=True, enable_consolidation=True))
        if rank == 0:
            model.config.save_pretrained(path)
        logits = wrapped(input_ids=x).logits.detach()
        dist.barrier()
        loaded = LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")
        fresh = llama(False)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in fresh.parameters():
                p.normal_()
        wrapped, opt = shard(fresh, which, how)
        sd = hf_names(wrapped, which)
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(path))
        wrapped.load_state_dict({("module." + k if which == "megatron" else k): v for k, v in sd.items()})
        losses = train(wrapped, opt, rank, range(2, 4))
        out[which] = dict(logits=logits, from_pretrained=loaded(input_ids=x).logits.detach(), losses=losses,
                          files=load_dir(path))
    ours, ref = out[api], out["fsdp2"]
    bad = sorted(n for n in ref["files"] if n not in ours["files"] or not torch.equal(ours["files"][n], ref["files"][n]))
    return {
        "consolidated files: FSDP2's names and every tensor bitwise FSDP2's": (
            set(ours["files"]) == set(ref["files"]) and not bad, f"differ or missing: {bad}"),
        "from_pretrained on them: the trained model's logits bit for bit": (
            torch.equal(ours["from_pretrained"], ours["logits"]), "logits differ"),
        "read back by HuggingFaceStorageReader: the next losses bit for bit FSDP2's": (
            all(torch.equal(a, b) for a, b in zip(ours["losses"], ref["losses"])), f"{ours['losses']} {ref['losses']}"),
    }


def async_cell(rank, world, api, strategy):
    """save_hf_checkpoint(async_save=True) ([Note: an asynchronous save]) while training goes on:
    its writes held back until two more optimizer steps changed the weights still give the files
    a synchronous save wrote before those steps (the snapshot); one not held back runs beside the
    steps' collectives; a save waits for the one before it; a rank's failed write is every rank's
    future's exception, nothing is published, and the next save warns of it."""
    import threading
    import warnings
    from concurrent.futures import Future
    import torch.distributed as dist
    from megatron_fsdp_c import hf_checkpoint

    model = llama(False)
    wrapped, opt = shard(model, api, strategy)

    def steps(first, n):
        for step in range(first, first + n):
            x = tokens(step, rank)
            wrapped(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    root = os.path.join(rank_grid.session_dir(), "async", f"{api}-{strategy}-{world}")
    d = {k: os.path.join(root, k) for k in ("sync", "async", "beside", "beside_ref", "next", "failed", "after")}
    steps(0, 2)
    mf.save_hf_checkpoint(wrapped, d["sync"], max_shard_bytes=20_000)
    write, gate = hf_checkpoint._pwrite, threading.Event()

    def held(*args):
        gate.wait()
        write(*args)
    hf_checkpoint._pwrite = held
    try:
        future = mf.save_hf_checkpoint(wrapped, d["async"], max_shard_bytes=20_000, async_save=True)
        pending = not future.done()
        steps(2, 2)  # the optimizer writes the weights while the save has written nothing
        gate.set()
        outcome = future.result(timeout=60)
    finally:
        hf_checkpoint._pwrite = write
    now = gathered(wrapped, api)
    mf.save_hf_checkpoint(wrapped, d["beside_ref"])
    beside = mf.save_hf_checkpoint(wrapped, d["beside"], async_save=True)
    steps(4, 2)  # its writes and agreements run beside these steps' collectives
    beside_ok = beside.result(timeout=60) is None
    queued = mf.save_hf_checkpoint(wrapped, d["next"], async_save=True)
    mf.save_hf_checkpoint(wrapped, d["after"])  # waits for `queued` first
    queued_done = queued.done()
    if rank == 1:
        def broken(*args):
            raise OSError("no space left on device (injected)")
        hf_checkpoint._pwrite = broken
    try:
        failing = mf.save_hf_checkpoint(wrapped, d["failed"], async_save=True)
        failure = failing.exception(timeout=60)
    finally:
        hf_checkpoint._pwrite = write
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mf.save_hf_checkpoint(wrapped, d["after"], overwrite=True)
    dist.barrier()
    snap, ref = load_dir(d["async"]), load_dir(d["sync"])
    moved = [n for n in ref if not torch.equal(ref[n], now[n])]
    return {
        "a Future, not done while its writes are held": (isinstance(future, Future) and pending, repr(future)),
        "its result is None": (outcome is None, repr(outcome)),
        "the weights moved after the snapshot": (len(moved) > 0, "the two steps changed nothing"),
        "the files hold the snapshot: bitwise the synchronous save's": (
            set(snap) == set(ref) and all(torch.equal(snap[n], ref[n]) for n in ref),
            [n for n in ref if n not in snap or not torch.equal(snap[n], ref[n])]),
        "the index of several files written": (os.path.exists(os.path.join(d["async"], "model.safetensors.index.json")),
                                              os.listdir(d["async"])),
        "beside training: published, the files the synchronous save wrote": (
            beside_ok and all(torch.equal(a, b) for a, b in zip(load_dir(d["beside"]).values(),
                                                                 load_dir(d["beside_ref"]).values())), "differ"),
        "a save waits for the one before it": (queued_done, "the earlier future was still running"),
        "a failed write: every rank's future raises, naming the rank and the error": (
            isinstance(failure, RuntimeError) and "writing the tensors" in str(failure)
            and ("no space left on device (injected)" in str(failure) if rank == 1 else "another rank failed" in str(failure)),
            repr(failure)),
        "nothing published": (not os.path.exists(d["failed"]) and not any(".failed.partial" in f for f in os.listdir(root)),
                              sorted(os.listdir(root))),
        "the next save warns of the failure": (
            any(issubclass(w.category, RuntimeWarning) and "previous asynchronous save failed" in str(w.message)
                for w in caught), [str(w.message) for w in caught]),
    }


def export_cell(rank, world, api, strategy, tied):
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    wrapped, model = trained(rank, world, api, strategy, tied)
    root = os.path.join(rank_grid.session_dir(), "hf", f"{api}-{strategy}-{tied}-{world}")
    ours, ours_bf16 = os.path.join(root, "ours"), os.path.join(root, "ours_bf16")
    mf.save_hf_checkpoint(wrapped, ours, config=model.config)
    mf.save_hf_checkpoint(wrapped, ours_bf16, dtype=torch.bfloat16, max_shard_bytes=20_000, config=model.config)
    full = gathered(wrapped, api)
    x = tokens(9, 0)
    logits = wrapped(input_ids=x).logits.detach()  # every rank: the sharded model's forward
    checks = {}
    if rank == 0:
        ref = llama(tied)
        ref.load_state_dict(full)
        ref.save_pretrained(os.path.join(root, "ref"))
        ref.to(torch.bfloat16).save_pretrained(os.path.join(root, "ref_bf16"))
        compare_files(ours, os.path.join(root, "ref"), checks, "fp32")
        compare_files(ours_bf16, os.path.join(root, "ref_bf16"), checks, "bf16 cast")
        files = sorted(os.listdir(ours_bf16))
        checks["several shard files and an index"] = (
            "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1, files)
        loaded = LlamaForCausalLM.from_pretrained(ours, attn_implementation="eager")
        if tied:
            checks["from_pretrained ties the head"] = (
                loaded.lm_head.weight is loaded.model.embed_tokens.weight, "lm_head not tied")
        same = torch.equal(loaded(input_ids=x).logits, logits)
        checks["from_pretrained's logits bit for bit the trained model's"] = (same, "logits differ")
    dist.barrier()
    return checks


def import_cell(rank, world, api, strategy, meta=False):
    """A hub-format checkpoint (save_pretrained: several shard files and an index) read into a
    sharded model whose own weights differ (another seed), or with `meta` one built on the meta
    device (its rotary embeddings' buffers made by the load: [Note: buffers no checkpoint holds]):
    the next steps' losses and the final weights equal from_pretrained + the same sharding's, bit
    for bit."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    directory = os.path.join(rank_grid.session_dir(), "hub", f"{api}-{strategy}-{world}-{meta}")
    if rank == 0:
        torch.manual_seed(1)
        hub = llama(False)
        with torch.no_grad():
            for p in hub.parameters():
                p.normal_()
        hub.save_pretrained(directory, max_shard_size="20KB")
    dist.barrier()
    out = {}
    for which in ("ours", "from_pretrained"):
        if which == "ours" and meta:
            with torch.device("meta"):
                model = llama(False)
        elif which == "ours":
            model = llama(False)
        else:
            model = LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager")
        wrapped, opt = shard(model, api, strategy, meta=meta and which == "ours")
        if which == "ours":
            mf.load_hf_checkpoint(wrapped, directory)
        losses = train(wrapped, opt, rank, range(2))
        out[which] = (losses, gathered(wrapped, api))
    (ours, ours_params), (ref, ref_params) = out["ours"], out["from_pretrained"]
    files = os.listdir(directory)
    return {
        "the hub checkpoint has several files and an index": (
            "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1, files),
        "losses bit for bit from_pretrained's": (all(torch.equal(a, b) for a, b in zip(ours, ref)), f"{ours} {ref}"),
        "final weights bit for bit": (all(torch.equal(ours_params[n], ref_params[n]) for n in ref_params),
                                      [n for n in ref_params if not torch.equal(ours_params[n], ref_params[n])]),
    }


def _register():
    for api, strategy in SETUPS:
        for tied in (False, True):
            CELLS.add(("export", api, strategy, tied), export_cell, api, strategy, tied, worlds=(2,),
                      tests=["test_export_is_what_save_pretrained_writes"],
                      match=dict(api=api, strategy=strategy, tied=tied))
    for world in (1, 4):  # one setup each API at the other world sizes
        for api, strategy in (("megatron", 3), ("per_module", True)):
            CELLS.add(("export_at", world, api, strategy), export_cell, api, strategy, world == 4,
                      worlds=(world,), tests=["test_export_at_other_world_sizes"],
                      match=dict(api=api, strategy=strategy, world=world))
    for api, strategy in SETUPS:
        CELLS.add(("import", api, strategy), import_cell, api, strategy, worlds=(2,),
                  tests=["test_import_trains_as_from_pretrained"], match=dict(api=api, strategy=strategy))
    CELLS.add(("import", "per_module", True, 4), import_cell, "per_module", True, worlds=(4,),
              tests=["test_import_at_world_4"])
    for api, strategy in (("megatron", 3), ("megatron", 1), ("per_module", True)):
        CELLS.add(("import_meta", api, strategy), import_cell, api, strategy, True, worlds=(2,),
                  tests=["test_import_into_a_meta_initialised_model"], match=dict(api=api, strategy=strategy))
    CELLS.add("refusals", refusals, tests=["test_refusals"])
    for api, strategy in (("megatron", 3), ("per_module", True)):
        CELLS.add(("async", api, strategy), async_cell, api, strategy, worlds=(2,),
                  tests=["test_async_save_while_training"], match=dict(api=api, strategy=strategy))
    for api, strategy in SETUPS:
        CELLS.add(("dcp_hf", api, strategy), dcp_hf_cell, api, strategy, worlds=(2,),
                  tests=["test_torch_hf_storage_writer_and_reader"], match=dict(api=api, strategy=strategy))


def refusals(rank, world):
    import torch.distributed as dist
    wrapped, model = trained(rank, world, "per_module", True, False)
    root = os.path.join(rank_grid.session_dir(), "hf_refusals")
    target = os.path.join(root, "ckpt")
    mf.save_hf_checkpoint(wrapped, target)
    out = {}
    try:
        mf.save_hf_checkpoint(wrapped, target)
        out["exists"] = "no error"
    except FileExistsError as e:
        out["exists"] = str(e)
    mf.save_hf_checkpoint(wrapped, target, overwrite=True, dtype=torch.bfloat16)
    from safetensors import safe_open
    with safe_open(os.path.join(target, "model.safetensors"), "pt") as f:
        out["overwritten"] = str(f.get_tensor("lm_head.weight").dtype)
    try:  # a name that only rank 1 maps: the layouts differ
        mf.save_hf_checkpoint(wrapped, os.path.join(root, "differ"),
                              name_map={"lm_head.weight": "head.weight"} if rank == 1 else None)
        out["differ"] = "no error"
    except RuntimeError as e:
        out["differ"] = str(e)
    mf.save_hf_checkpoint(wrapped, os.path.join(root, "renamed"), name_map=lambda n: "base." + n)
    with safe_open(os.path.join(root, "renamed", "model.safetensors"), "pt") as f:
        out["renamed"] = sorted(f.keys())
    out["names"] = sorted(model.state_dict())
    try:
        mf.save_hf_checkpoint(wrapped, os.path.join(root, "collide"), name_map=lambda n: "same")
        out["collide"] = "no error"
    except ValueError as e:
        out["collide"] = str(e)
    dist.barrier()
    out["left"] = sorted(os.listdir(root))
    return out


def killed_in_the_middle(rank, world, root):
    """Rank 1 dies (SIGKILL) at its first write of an export over an earlier checkpoint."""
    from megatron_fsdp_c import hf_checkpoint

    wrapped, model = trained(rank, world, "per_module", True, False)
    target = os.path.join(root, "ckpt")
    mf.save_hf_checkpoint(wrapped, target)
    if rank == 1:
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
        hf_checkpoint._pwrite = die  # the fault: this rank's process dies in the middle of the export
    try:
        mf.save_hf_checkpoint(wrapped, target, overwrite=True, dtype=torch.bfloat16)
        return "no error"
    except Exception as e:  # noqa: BLE001 - what the user sees
        return f"{type(e).__name__}: {e}"


_register()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("api,strategy", SETUPS)
def test_export_is_what_save_pretrained_writes(api, strategy, tied):
    assert_named(CELLS.result(("export", api, strategy, tied), 2))


@pytest.mark.parametrize("world,api,strategy", [(1, "megatron", 3), (1, "per_module", True),
                                                (4, "megatron", 3), (4, "per_module", True)])
def test_export_at_other_world_sizes(world, api, strategy):
    assert_named(CELLS.result(("export_at", world, api, strategy), world))


def test_refusals():
    for r in CELLS.result("refusals", 2):
        assert "exists and is not empty (pass overwrite=True" in r["exists"], r["exists"]
        assert r["overwritten"] == "torch.bfloat16", r
        assert "rank(s) [1] have another state dict" in r["differ"], r["differ"]
        assert r["renamed"] == ["base." + n for n in r["names"]], r["renamed"]
        assert "name_map gives two tensors the name 'same'" in r["collide"], r["collide"]
        assert r["left"] == ["ckpt", "renamed"], r["left"]  # nothing partial left behind by the refused calls


def test_a_rank_killed_in_the_middle_publishes_nothing(tmp_path):
    """Rank 0's call raises; the target still holds the earlier checkpoint, byte for byte; no
    directory that looks like a checkpoint appears beside it ([Note: publishing a checkpoint])."""
    outcomes = run_on_ranks(killed_in_the_middle, 2, str(tmp_path), raise_errors=False, timeout_s=120)
    assert outcomes[1][0] == "dead", outcomes[1]
    status, raised = outcomes[0]
    assert status == "ok" and raised.startswith("RuntimeError"), outcomes[0]
    from safetensors.torch import load_file
    loaded = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in loaded.values())  # the earlier (fp32) one, whole
    assert [d for d in os.listdir(tmp_path) if not d.startswith(".")] == ["ckpt"], os.listdir(tmp_path)


@pytest.mark.parametrize("api,strategy", SETUPS)
def test_import_trains_as_from_pretrained(api, strategy):
    assert_named(CELLS.result(("import", api, strategy), 2))


@pytest.mark.parametrize("api,strategy", [("megatron", 3), ("per_module", True)])
def test_async_save_while_training(api, strategy):
    assert_named(CELLS.result(("async", api, strategy), 2))


@pytest.mark.parametrize("api,strategy", SETUPS)
def test_torch_hf_storage_writer_and_reader(api, strategy):
    assert_named(CELLS.result(("dcp_hf", api, strategy), 2))


@pytest.mark.parametrize("api,strategy", [("megatron", 3), ("megatron", 1), ("per_module", True)])
def test_import_into_a_meta_initialised_model(api, strategy):
    assert_named(CELLS.result(("import_meta", api, strategy), 2))


def test_import_at_world_4():
    assert_named(CELLS.result(("import", "per_module", True, 4), 4))


def test_import_errors_name_the_tensor_and_the_file(tmp_path):
    """On a plain (unsharded) model, in this process: a missing tensor, an unexpected one, a shape
    that differs, a truncated file, a model still on the meta device, each a ValueError naming
    what and where (and the fix); strict=False loads what matches."""
    import json

    model = llama(False)
    good = tmp_path / "good"
    model.save_pretrained(good, max_shard_size="20KB")
    index = json.loads((good / "model.safetensors.index.json").read_text())
    fresh = llama(False)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    mf.load_hf_checkpoint(fresh, str(good))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))

    def broken(name, edit):
        d = tmp_path / name
        d.mkdir()
        for f in os.listdir(good):
            (d / f).write_bytes((good / f).read_bytes())
        edit(d)
        return str(d)

    head_file = index["weight_map"]["lm_head.weight"]
    with pytest.raises(ValueError, match=r"missing from the checkpoint \['lm_head.weight'\], not in the model "
                                         r"\['lm_head.weight'\]"):
        mf.load_hf_checkpoint(llama(False), str(good), name_map={"lm_head.weight": "head.weight"})
    with pytest.raises(ValueError, match="name_map gives two tensors the name 'model.norm.weight'"):
        mf.load_hf_checkpoint(llama(False), str(good), name_map={"lm_head.weight": "model.norm.weight"})
    mf.load_hf_checkpoint(llama(False), str(good), name_map={"lm_head.weight": "head.weight"}, strict=False)
    small = llama(False)
    small.lm_head = torch.nn.Linear(32, VOCAB - 1, bias=False)
    with pytest.raises(ValueError, match=rf"'lm_head.weight' in .*{head_file} has shape \[{VOCAB}, 32\], the model's"):
        mf.load_hf_checkpoint(small, str(good), strict=False)
    cut = broken("truncated", lambda d: (d / head_file).write_bytes((d / head_file).read_bytes()[:-100]))
    with pytest.raises(ValueError, match=rf"{head_file} is truncated: tensor '.*' needs bytes up to"):
        mf.load_hf_checkpoint(llama(False), cut)
    with torch.device("meta"):
        on_meta = llama(False)
    with pytest.raises(ValueError, match=r"still has tensors on the meta device \(\['model.embed_tokens.weight', .*"
                                         r"model.to_empty\(device=...\) after fully_shard"):
        mf.load_hf_checkpoint(on_meta, str(good))
