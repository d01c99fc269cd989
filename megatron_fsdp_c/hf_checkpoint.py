"""Hugging Face checkpoints straight from the shards: save_hf_checkpoint writes the safetensors
files (and their index) that transformers' from_pretrained loads, every rank writing its own rows
into the final files, with no gather and no consolidation pass; load_hf_checkpoint reads such a
checkpoint (or one from the hub) into a sharded model, every rank reading only its own rows.

[Note: safetensors from the shards]
A safetensors file is an 8-byte little-endian header length, a JSON header ({name: {dtype,
shape, data_offsets}}, the offsets relative to the data's start, contiguous in order) and each
tensor's row-major bytes. Every rank computes the same layout from the state dict's names, shapes
and dtypes (the same on every rank: one all_gather_object of the layout's digest checks it, so a
rank that differs raises instead of writing bytes at another rank's offsets). A sharded parameter
of either API is a Shard(0) DTensor (checkpoint.py): its local piece is rows [o, o + n) of the
full tensor, one contiguous byte range of it, which the rank writes with os.pwrite at its place
in the final file. On a mesh dim the tensor is replicated over, only the ranks at coordinate 0
write (the others hold the same bytes). Anything else -- a Shard on another dim (tensor
parallelism after the data-parallel shard, shard_placement_fn's), a Partial, a plain tensor (a
buffer, an unsharded parameter) -- is written whole by one rank, tensor k by rank k % world,
after DTensor.full_tensor() where it is sharded (a collective: every rank makes them in the
layout's order). No rank holds more than its shards plus one such tensor.

[Note: publishing a checkpoint]
The files are written under a hidden directory beside the target (`.<name>.partial-<id>`) and
renamed to the target by rank 0 when every rank has written and fsynced its bytes (an all_reduce
of the ranks' outcomes), so a crash, a killed rank or an error leaves no directory that looks like
a checkpoint, and an existing target is replaced only then (overwrite=True), by two renames.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
import uuid
import warnings
from concurrent.futures import Future
from typing import Callable, Dict, List, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._common import transformers_initialiser
from ._distributed import own_group
from .megatron_fsdp import MegatronFSDP

__all__ = ["save_hf_checkpoint", "load_hf_checkpoint"]

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class _Entry:
    """One tensor of the checkpoint: its name, full shape and output dtype, where its bytes go
    (file, offset in the file), and how this rank contributes ([Note: safetensors from the shards])."""

    def __init__(self, name: str, value: torch.Tensor, dtype: torch.dtype):
        self.name, self.value, self.dtype = name, value, dtype
        self.shape = tuple(value.shape)
        self.nbytes = _numel(self.shape) * dtype.itemsize
        self.file = ""
        self.offset = 0  # of its first byte in its file

    def describe(self) -> tuple:
        return (self.name, self.shape, str(self.dtype), self.file, self.offset)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _row_range(t: DTensor):
    """(first row, local tensor) when t's local piece is a range of rows of the full tensor (its
    placements Shard(0) and Replicate only); None otherwise, or where this rank holds no piece."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) and (not isinstance(p, Shard) or p.dim == 0) for p in t.placements):
        return None
    if t.device_mesh.get_coordinate() is None:
        return None
    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(local_shape[1:]) != tuple(t.shape[1:]) or tuple(t._local_tensor.shape) != tuple(local_shape):
        return None
    return (offset[0] if t.dim() else 0), t._local_tensor


def _rows_of(t: DTensor):
    """For writing: (first row, local tensor) when this rank writes its piece as rows; (None, None)
    when another rank writes it (a replica at another coordinate of a Replicate dim, or no piece
    here); False when the piece is not a row range ([Note: safetensors from the shards])."""
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None, None
    rows = _row_range(t)
    if rows is None:
        return False
    if any(isinstance(p, Replicate) and c != 0 for p, c in zip(t.placements, coord)):
        return None, None
    return rows


def _output_dtype(name: str, t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.dtype:
    out = dtype if dtype is not None and t.is_floating_point() else t.dtype
    if out not in _SAFETENSORS_DTYPES:
        raise TypeError(f"save_hf_checkpoint: tensor '{name}' has dtype {out}, which safetensors cannot hold "
                        f"(it holds {', '.join(str(d) for d in _SAFETENSORS_DTYPES)})")
    return out


def _state_of(model) -> Dict[str, torch.Tensor]:
    """The tensors to write: the model's state dict (the Megatron-style wrapper's inner module's
    names), each tied weight once under the name transformers keeps (its _tied_weights_keys name
    the copies it drops)."""
    module = model.module if isinstance(model, MegatronFSDP) else model
    state = module.state_dict()
    names = {}  # id(parameter) -> its names, in module order
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    tied = getattr(module, "_tied_weights_keys", None) or ()
    dropped = set(tied.keys() if isinstance(tied, Mapping) else tied)
    for aliases in names.values():
        present = [n for n in aliases if n in state]
        if len(present) < 2:
            continue
        keep = next((n for n in present if n not in dropped), present[0])
        for n in present:
            if n != keep:
                del state[n]
    return state


def _checkpoint_names(state: dict, name_map, caller: str) -> Dict[str, str]:
    """{checkpoint name: state-dict name}, through name_map (a dict, names it lacks kept, or a
    callable); two state-dict names mapped to one checkpoint name raise."""
    rename = (lambda n: n) if name_map is None else name_map if callable(name_map) else (lambda n: name_map.get(n, n))
    out: Dict[str, str] = {}
    for n in state:
        c = rename(n)
        if c in out:
            raise ValueError(f"{caller}: name_map gives two tensors the name '{c}'")
        out[c] = n
    return out


def _plan_files(entries: List[_Entry], max_shard_bytes: int) -> List[tuple]:
    """Cuts the entries into files in order (a new file when the next tensor would pass
    max_shard_bytes), sets each entry's file and offset; returns (file name, header bytes, size)."""
    parts: List[List[_Entry]] = [[]]
    size = 0
    for e in entries:
        if parts[-1] and size + e.nbytes > max_shard_bytes:
            parts.append([])
            size = 0
        parts[-1].append(e)
        size += e.nbytes
    files = []
    for i, part in enumerate(parts):
        fname = SINGLE_FILE if len(parts) == 1 else f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        header, at = {"__metadata__": {"format": "pt"}}, 0
        for e in part:
            header[e.name] = {"dtype": _SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [at, at + e.nbytes]}
            at += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        start = 8 + len(text)
        for e in part:
            e.file, e.offset = fname, start
            start += e.nbytes
        files.append((fname, struct.pack("<Q", len(text)) + text, start))
    return files


def _bytes(t: torch.Tensor, dtype: torch.dtype, copy: bool = False):
    """t's row-major bytes in `dtype`, on the host (a buffer os.pwrite takes); a copy of its own
    when `copy` (an asynchronous save's snapshot), else possibly t's memory."""
    t = t.detach().to(device="cpu", dtype=dtype, copy=copy).contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def save_hf_checkpoint(model, path: str, *, dtype: Optional[torch.dtype] = None,
                       max_shard_bytes: int = 5 * 2 ** 30, name_map: Union[None, Mapping[str, str],
                                                                               Callable[[str], str]] = None,
                       config=None, overwrite: bool = False, async_save: bool = False) -> Optional[Future]:
    """Writes `model` (a per-module fully_shard root or the Megatron-style wrapper, or any module
    with DTensor or plain parameters) as a Hugging Face checkpoint directory at `path`: safetensors
    files of at most `max_shard_bytes` each (one tensor may pass it alone) and, with several, the
    model.safetensors.index.json that from_pretrained reads. Every rank calls it; every rank writes
    its own rows ([Note: safetensors from the shards]); the directory appears whole or not at all
    ([Note: publishing a checkpoint]).

    dtype: floating tensors are cast to it on the way out (say torch.bfloat16 of float32 main
    weights); others keep theirs. name_map: the checkpoint's name of each state-dict name (a dict,
    names it lacks kept, or a callable). config: written beside the weights, by its
    save_pretrained (a transformers config) or as config.json (a dict). overwrite: replace an
    existing non-empty `path` (refused otherwise). async_save: return a concurrent.futures.Future
    as soon as this rank's bytes are copied to host memory, and write them in the background while
    training goes on ([Note: an asynchronous save]); its result() is None once the checkpoint is
    published, or raises why it was not. A save waits for the one before it; wait for the last
    one before destroy_process_group."""
    _wait_for_previous_save()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    if max_shard_bytes <= 0:
        raise ValueError(f"save_hf_checkpoint: max_shard_bytes must be positive, not {max_shard_bytes}")
    state = _state_of(model)
    names = _checkpoint_names(state, name_map, "save_hf_checkpoint")
    entries = [_Entry(c, state[n], _output_dtype(c, state[n], dtype)) for c, n in names.items()]
    files = _plan_files(entries, max_shard_bytes)
    target = os.path.abspath(path)
    parent, base = os.path.split(target)
    # the layout and the target's state, the same on every rank, or one error on every rank
    digest = hashlib.sha256(repr([e.describe() for e in entries]).encode()).hexdigest()
    if rank == 0:
        exists = os.path.isdir(target) and bool(os.listdir(target))
        if os.path.exists(target) and not os.path.isdir(target):
            problem = f"{target} exists and is not a directory"
        elif exists and not overwrite:
            problem = f"{target} exists and is not empty (pass overwrite=True to replace it)"
        else:
            problem = ""
        token = uuid.uuid4().hex[:12]
    else:
        problem, token = "", ""
    seen = [None] * world
    if world > 1:
        dist.all_gather_object(seen, (digest, problem, token))
    else:
        seen = [(digest, problem, token)]
    if any(d != digest for d, _, _ in seen):
        bad = [r for r, (d, _, _) in enumerate(seen) if d != seen[0][0]]
        raise RuntimeError(f"save_hf_checkpoint: rank(s) {bad} have another state dict (names, shapes or dtypes) "
                           "than rank 0: every rank must save the same model")
    if seen[0][1]:
        raise FileExistsError(f"save_hf_checkpoint: {seen[0][1]}")
    token = seen[0][2]
    partial = os.path.join(parent, f".{base}.partial-{token}")
    error = None
    try:
        if rank == 0:
            _create_files(partial, parent, files, entries, config)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = e
    if _agree_failed(world, error):
        return _fail(rank, partial, error, "creating the files")
    pieces = _pieces(entries, world, rank, copy=async_save)
    if not async_save:
        return _write_and_publish(pieces, partial, target, token, world, rank, None)
    try:  # the snapshot: full_tensor's collectives run here, on the caller's thread, in every rank's order
        pieces = list(pieces)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = e
    if _agree_failed(world, error):
        return _fail(rank, partial, error, "copying the tensors to host memory")
    group = own_group("hf checkpoint", range(world), backend="gloo") if world > 1 else None
    future: Future = Future()

    def run():
        try:
            future.set_result(_write_and_publish(pieces, partial, target, token, world, rank, group))
        except BaseException as e:  # noqa: BLE001 - the future carries it to whoever waits
            future.set_exception(e)
    future.set_running_or_notify_cancel()
    threading.Thread(target=run, name="mfsdp-hf-save", daemon=False).start()
    _IN_FLIGHT[0] = future
    return future


# [Note: an asynchronous save]
# save_hf_checkpoint(async_save=True) does on the caller's thread everything that needs the
# model or the training's process groups: the layout agreed, the files created (headers, index,
# config), and a snapshot of this rank's bytes in host memory, each its own copy (cast where
# asked), so the optimizer may change the weights at once; full_tensor's collectives for the
# tensors one rank writes whole run there too. A thread (non-daemon: the interpreter's exit
# waits for it) then writes and fsyncs the bytes and publishes the directory; its two agreements
# (did every rank write? was it published?) go over a gloo group of their own ("hf checkpoint",
# _distributed.own_group), never a group the training's collectives use, so no collective of the
# training and of the save can meet out of order. Host memory: one copy of the rank's bytes until
# the thread ends, as torch's dcp.async_save stages. A save first waits for the one before it
# (the gloo group serves one at a time); a failure is the future's exception, and also a warning
# at the next save, so that a future nobody asked does not fail silently.
_IN_FLIGHT: List[Optional[Future]] = [None]


def _wait_for_previous_save() -> None:
    previous, _IN_FLIGHT[0] = _IN_FLIGHT[0], None
    if previous is None:
        return
    error = previous.exception()
    if error is not None:
        warnings.warn(f"save_hf_checkpoint: the previous asynchronous save failed: {error}", RuntimeWarning,
                      stacklevel=3)


def _create_files(partial: str, parent: str, files: List[tuple], entries: List[_Entry], config) -> None:
    """Rank 0: the hidden directory with each file's header and size, the index and the config."""
    os.makedirs(parent, exist_ok=True)
    os.mkdir(partial)
    for fname, header, size in files:
        with open(os.path.join(partial, fname), "wb") as f:
            f.write(header)
            f.truncate(size)
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.name: e.file for e in entries}}
        with open(os.path.join(partial, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
    if config is not None:
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(partial)
        else:
            with open(os.path.join(partial, "config.json"), "w") as f:
                json.dump(dict(config), f, indent=2)


def _pieces(entries: List[_Entry], world: int, rank: int, copy: bool):
    """What this rank writes: (file, offset, bytes), entry by entry ([Note: safetensors from the
    shards]); a generator, so that a synchronous save holds one tensor's bytes at a time."""
    for k, e in enumerate(entries):
        v = e.value
        if isinstance(v, DTensor):
            rows = _rows_of(v)
            if rows is not False:
                first, local = rows
                if local is not None and local.numel():
                    row_bytes = _numel(e.shape[1:]) * e.dtype.itemsize
                    yield e.file, e.offset + first * row_bytes, _bytes(local, e.dtype, copy)
                continue
            v = v.full_tensor()  # collective: every rank, in the layout's order
        if k % world == rank and e.nbytes:
            yield e.file, e.offset, _bytes(v, e.dtype, copy)


def _write_and_publish(pieces, partial: str, target: str, token: str, world: int, rank: int, group) -> None:
    """Every rank writes and fsyncs its pieces; rank 0 publishes when all did; one outcome on every
    rank. group: the agreements' process group (None: the default one)."""
    error = None
    fds = {}
    try:
        for fname, offset, data in pieces:  # drawn to the end after a failed write: its collectives
            if error is None:
                try:
                    _pwrite(fds, partial, fname, data, offset)
                except Exception as e:  # noqa: BLE001 - every rank learns of it below
                    error = e
        if error is None:
            for fd in fds.values():
                os.fsync(fd)
    except Exception as e:  # noqa: BLE001 - a collective of full_tensor failed: every rank learns of it below
        error = e
    finally:
        for fd in fds.values():
            os.close(fd)
    if _agree_failed(world, error, group):
        return _fail(rank, partial, error, "writing the tensors")
    try:
        if rank == 0:
            _publish(partial, target, token)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        error = e
    if _agree_failed(world, error, group):
        return _fail(rank, partial, error, "publishing the directory")
    return None


def _pwrite(fds: dict, directory: str, fname: str, data, offset: int) -> None:
    fd = fds.get(fname)
    if fd is None:
        fd = fds[fname] = os.open(os.path.join(directory, fname), os.O_WRONLY)
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _publish(partial: str, target: str, token: str) -> None:
    """[Note: publishing a checkpoint]: the finished directory renamed to the target (an old one
    moved aside first, removed after)."""
    old = None
    if os.path.isdir(target):
        old = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.old-{token}")
        os.rename(target, old)
    os.rename(partial, target)
    fd = os.open(os.path.dirname(target), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _agree_failed(world: int, error, group=None) -> bool:
    """Whether any rank failed (one all_reduce over `group`: every rank takes the same branch)."""
    if world == 1:
        return error is not None
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _fail(rank: int, partial: str, error, what: str):
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    if error is not None:
        raise RuntimeError(f"save_hf_checkpoint failed {what} on rank {rank}: {type(error).__name__}: {error}") \
            from error
    raise RuntimeError(f"save_hf_checkpoint: another rank failed {what} (its error says why); nothing was "
                       "published")


# -- loading ---------------------------------------------------------------------------------------

_TORCH_DTYPES = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}


class _Stored:
    """One tensor of a checkpoint on disk: its file, dtype, shape and absolute byte range."""

    def __init__(self, name: str, file: str, meta: dict, data_start: int, file_size: int):
        self.name, self.file = name, file
        code = meta.get("dtype")
        if code not in _TORCH_DTYPES:
            raise ValueError(f"load_hf_checkpoint: tensor '{name}' in {file} has dtype {code!r}, which "
                             f"megatron_fsdp_c cannot read (it reads {', '.join(_TORCH_DTYPES)})")
        self.dtype, self.shape = _TORCH_DTYPES[code], tuple(meta["shape"])
        begin, end = meta["data_offsets"]
        self.begin, self.end = data_start + begin, data_start + end
        if end - begin != _numel(self.shape) * self.dtype.itemsize:
            raise ValueError(f"load_hf_checkpoint: tensor '{name}' in {file} holds {end - begin} bytes, but its "
                             f"shape {list(self.shape)} and dtype {code} need {_numel(self.shape) * self.dtype.itemsize}")
        if self.end > file_size:
            raise ValueError(f"load_hf_checkpoint: {file} is truncated: tensor '{name}' needs bytes up to "
                             f"{self.end}, the file has {file_size}")

    def read(self, fd: int, first_row: int = 0, rows: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows [first_row, first_row + rows) (default: all), in the stored dtype; read straight
        into `out` when given (a contiguous host tensor of the stored dtype and as many elements)."""
        row_shape = self.shape[1:]
        row_bytes = _numel(row_shape) * self.dtype.itemsize
        rows = (self.shape[0] if self.shape else 1) - first_row if rows is None else rows
        n = rows * row_bytes if self.shape else self.dtype.itemsize
        if out is None:
            out = torch.empty((rows,) + row_shape if self.shape else (), dtype=self.dtype)
        if not n:
            return out
        view, at = memoryview(out.reshape(-1).view(torch.uint8).numpy()), self.begin + first_row * row_bytes
        while view:
            got = os.preadv(fd, [view], at)
            if got == 0:
                raise ValueError(f"load_hf_checkpoint: {self.file} ended inside tensor '{self.name}'")
            view, at = view[got:], at + got
        return out


def _stored_tensors(path: str) -> Dict[str, _Stored]:
    """Every tensor of the checkpoint directory `path` (an index and its files, or one file)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"load_hf_checkpoint: {path} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    out = {}
    for fname in files:
        full = os.path.join(path, fname)
        size = os.path.getsize(full)
        with open(full, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"load_hf_checkpoint: {full} is truncated (no header)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise ValueError(f"load_hf_checkpoint: {full} is truncated: its header needs {8 + n} bytes, "
                                 f"the file has {size}")
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = _Stored(name, full, meta, 8 + n, size)
    return out


def _local_of_full(full: torch.Tensor, t: DTensor) -> torch.Tensor:
    """This rank's piece of `full` for DTensor t (any mix of Shard and Replicate)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not all(type(p) in (Shard, Replicate) for p in t.placements):
        raise NotImplementedError(f"load_hf_checkpoint: a DTensor with placements {t.placements} (only Shard and "
                                  "Replicate are read)")
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def _remake_buffers(module: torch.nn.Module) -> None:
    """Makes the buffers of a transformers model that no checkpoint holds.

    [Note: buffers no checkpoint holds]
    A transformers model keeps some buffers out of its state dict (non-persistent: the rotary embeddings' inv_freq, computed from the config), so
    no checkpoint restores them, and a model materialised from the meta device (to_empty) holds
    garbage there. from_pretrained makes them with the model's _init_weights; so does the load,
    for each module that holds such buffers and no parameters of its own (_init_weights would
    re-draw a module's parameters too; the rotary embeddings have none). Recomputing them on a
    model built eagerly gives the same values."""
    init = transformers_initialiser(module)
    if init is None:
        return
    with torch.no_grad():
        for mod in module.modules():
            if mod._non_persistent_buffers_set and all(p is None for p in mod._parameters.values()):
                init(mod)


def load_hf_checkpoint(model, path: str, *, strict: bool = True,
                       name_map: Union[None, Mapping[str, str], Callable[[str], str]] = None) -> None:
    """Reads the Hugging Face checkpoint directory `path` (safetensors files and their index, as
    save_pretrained or save_hf_checkpoint wrote them) into `model` (a per-module fully_shard root
    or the Megatron-style wrapper): every rank reads only its own rows of each sharded parameter
    (positioned reads, straight into the state dict's tensors where the dtype is the model's: no
    copy of the model is held), casts them to the model's dtype and loads them through the model's
    load_state_dict, which installs the main weights and refreshes the compute weights. Every rank
    calls it. name_map: the checkpoint's name of each state-dict name (a dict or a callable), as
    for save_hf_checkpoint. strict: names of the model missing from the checkpoint, or of the
    checkpoint missing from the model, raise one ValueError listing them (strict=False loads what
    matches; a tied weight counts once, under the name save_hf_checkpoint writes). A shape that
    differs, a truncated file or a dtype safetensors does not have raise a ValueError naming the
    tensor and its file. An asynchronous save still running is waited for first. A model
    initialised on the meta device loads once materialised (the per-module API: to_empty after
    fully_shard; the Megatron-style API: init_model_with_meta_device=True); a transformers
    model's buffers that no checkpoint holds are made as from_pretrained makes them ([Note:
    buffers no checkpoint holds])."""
    _wait_for_previous_save()
    stored = _stored_tensors(os.path.abspath(path))
    module = model.module if isinstance(model, MegatronFSDP) else model
    on_meta = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if on_meta:
        raise ValueError(f"load_hf_checkpoint: the model still has tensors on the meta device ({on_meta[:4]}"
                         f"{' ...' if len(on_meta) > 4 else ''}): materialise it first, model.to_empty(device=...) "
                         "after fully_shard (the Megatron-style API does it with init_model_with_meta_device=True)")
    _remake_buffers(module)
    state = _state_of(model)
    wanted = _checkpoint_names(state, name_map, "load_hf_checkpoint")
    missing = sorted(n for c, n in wanted.items() if c not in stored)
    unexpected = sorted(c for c in stored if c not in wanted)
    if strict and (missing or unexpected):
        raise ValueError(f"load_hf_checkpoint: {path} does not match the model: missing from the checkpoint "
                         f"{missing}, not in the model {unexpected} (strict=False loads what matches; name_map "
                         "renames)")
    pairs = [(name, stored[c]) for c, name in wanted.items() if c in stored]
    for name, s in pairs:  # every check before a byte of the model changes
        if tuple(state[name].shape) != s.shape:
            raise ValueError(f"load_hf_checkpoint: tensor '{s.name}' in {s.file} has shape {list(s.shape)}, "
                             f"the model's '{name}' {list(state[name].shape)}")
    loaded = {}
    fds: Dict[str, int] = {}
    try:
        for name, s in pairs:  # each into the state dict's own tensor, then load_state_dict installs them
            target = state[name]
            fd = fds.get(s.file)
            if fd is None:
                fd = fds[s.file] = os.open(s.file, os.O_RDONLY)
            if isinstance(target, DTensor):
                if target.device_mesh.get_coordinate() is None:
                    continue  # this rank holds no piece of it
                local, rows = target._local_tensor, _row_range(target)
            else:
                local, rows = target, (0, target)
            if rows is not None:  # its own rows only, straight into place where the bytes fit
                first = rows[0]
                count = local.shape[0] if local.dim() else None
                if local.device.type == "cpu" and local.dtype == s.dtype and local.is_contiguous():
                    s.read(fd, first, count, out=local)
                else:
                    local.copy_(s.read(fd, first, count).reshape(local.shape))
            else:  # another placement: its piece of the whole tensor
                local.copy_(_local_of_full(s.read(fd), target).reshape(local.shape))
            loaded[name] = target
    finally:
        for fd in fds.values():
            os.close(fd)
    module.load_state_dict(loaded, strict=False)
