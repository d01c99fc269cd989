"""Machinery of the per-module behaviour tests (test_per_module_training.py,
test_per_module_precision.py, test_per_module_state.py): the behaviours torch's own FSDP2 suite
(test/distributed/_composable/fsdp/) checks, tested on megatron_fsdp_c.experimental.fully_shard
through its public API, against DDP or a single-process reference on the same data.

[Note: one grid per world size]
A spawn costs seconds of imports per rank, a cell a fraction of one. So each test module lists its
cells in CELLS (name -> function, world sizes), and `grid` runs the cells of all three modules in
one run_on_ranks spawn per world size, memoised by conftest.get_run for the session. A cell gets a
`Checks` recorder; what it records (pairs of tensors with their tolerance, facts) is compared in
the pytest process by the cell's own test, so a failure names the check, the rank and the numbers.
A cell that raises is reported by its own test; a per-cell watchdog makes a hung rank exit with
its stack dumped (the spawn then fails, every test of that world size with it, naming the cell).

Tolerances: float64 everywhere exactness matters. At world 2 the library's reduction (each rank's
gradient pre-scaled by 1/2, then summed) and DDP's (summed, then halved) give the same bits; at
world 4 the summation order may differ, so float64 comparisons use rtol 1e-9 (a wrong algorithm is
off by ~1e-3, reduction-order rounding by ~1e-14).
"""
from __future__ import annotations

import builtins
import copy
import faulthandler
import functools
import importlib
import os
import sys
import tempfile
import traceback
from typing import Callable, Dict, Iterable, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

RTOL, ATOL = 1e-9, 1e-12
CELL_TIMEOUT_S = float(os.environ.get("PER_MODULE_CELL_TIMEOUT_S", 90))
CASE_MODULES = ("test_per_module_training", "test_per_module_precision", "test_per_module_state")


# ------------------------------------------------------------------------------------------
# cells and checks

def registry() -> Tuple[Dict[str, tuple], Callable]:
    """(CELLS, cell): `@cell("name", worlds=(2, 4), **kwargs)` registers fn(rank, world, ck, ckdir,
    **kwargs) under "name" for those world sizes."""
    cells: Dict[str, tuple] = {}

    def cell(name: str, worlds: Iterable[int] = (2,), **kwargs):
        def register(fn):
            assert name not in cells, name
            cells[name] = (functools.partial(fn, **kwargs) if kwargs else fn, tuple(worlds))
            return fn
        return register
    return cells, cell


def full(t):
    """A DTensor's full value (collective: every rank calls it for the same tensors)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(t):
    if isinstance(t, torch.Tensor):
        return full(t).detach().cpu().clone()
    if isinstance(t, (list, tuple)) and t and all(isinstance(v, (int, float)) for v in t):
        return torch.tensor(t, dtype=torch.float64)
    return t


class Checks:
    """What a cell asserts, recorded on every rank and asserted in the pytest process."""

    def __init__(self):
        self.items: List[tuple] = []

    def close(self, label: str, ours, ref, rtol: float = RTOL, atol: float = ATOL) -> None:
        self.items.append(("close", label, _snapshot(ours), _snapshot(ref), rtol, atol))

    def equal(self, label: str, ours, ref) -> None:
        self.items.append(("equal", label, _snapshot(ours), _snapshot(ref), 0.0, 0.0))

    def true(self, label: str, cond: bool, detail: str = "") -> None:
        self.items.append(("true", label, bool(cond), detail, 0.0, 0.0))

    def raised(self, label: str, fn: Callable) -> None:
        """Runs fn and records what it raised (its type's name and message), for pytest.raises
        in the parent (see reraise)."""
        try:
            fn()
            self.items.append(("raised", label, "no error", "", 0.0, 0.0))
        except Exception as e:  # noqa: BLE001 - what the user sees
            self.items.append(("raised", label, type(e).__name__, str(e), 0.0, 0.0))

    def grads(self, label: str, model: nn.Module, ref: nn.Module, rtol: float = RTOL, atol: float = ATOL,
              ref_scale: float = 1.0) -> None:
        """Every parameter's gradient (gathered) against the reference's by name; None where the
        reference has None."""
        refs = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            r = refs[name]
            if r.grad is None or p.grad is None:
                self.true(f"{label}: {name}.grad is None in both", r.grad is None and p.grad is None,
                          f"ours {'None' if p.grad is None else 'set'}, reference {'None' if r.grad is None else 'set'}")
            else:
                self.close(f"{label}: {name}.grad", p.grad, r.grad * ref_scale, rtol, atol)

    def params(self, label: str, model: nn.Module, ref: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
        refs = dict(ref.named_parameters())
        names = [n for n, _ in model.named_parameters()]
        self.equal(f"{label}: parameter names", sorted(names), sorted(refs))
        for name, p in model.named_parameters():
            if name in refs:
                self.close(f"{label}: {name}", p, refs[name], rtol, atol)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {value.dtype} {value.flatten()[:6].tolist()}"
    return repr(value)


def failures_of(items) -> List[str]:
    out = []
    for kind, label, ours, ref, rtol, atol in items:
        if kind == "raised":
            continue  # asserted by the cell's test (see raised_by)
        if kind == "true":
            if not ours:
                out.append(f"{label}{': ' + ref if ref else ''}")
            continue
        if isinstance(ours, torch.Tensor) and isinstance(ref, torch.Tensor):
            if kind == "equal":
                if ours.shape != ref.shape or ours.dtype != ref.dtype or not torch.equal(ours, ref):
                    out.append(f"{label}: not bit-identical: ours {_describe(ours)} vs reference {_describe(ref)}")
                continue
            try:
                torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol, check_dtype=True)
            except AssertionError as e:
                out.append(f"{label} (rtol {rtol}, atol {atol}): {str(e).strip()}")
        elif ours != ref:
            out.append(f"{label}: ours {ours!r} != reference {ref!r}")
    return out


# ------------------------------------------------------------------------------------------
# the grid (see [Note: one grid per world size])

def grid(rank: int, world: int, ckdir: str) -> dict:
    torch.set_num_threads(1)
    faulthandler.enable()  # a crashing rank dumps its stack
    out = {}
    for modname in CASE_MODULES:
        mod = importlib.import_module(modname)
        for name, (fn, worlds) in mod.CELLS.items():
            if world not in worlds:
                continue
            key = f"{modname}::{name}"
            ck = Checks()
            faulthandler.dump_traceback_later(CELL_TIMEOUT_S, exit=True)
            if os.environ.get("PER_MODULE_TRACE"):
                print(f"[rank {rank}] cell {key}", file=sys.stderr, flush=True)
            try:
                torch.manual_seed(0)
                fn(rank, world, ck, ckdir)
                out[key] = ("ok", ck.items)
            except Exception:  # noqa: BLE001 - reported by the cell's own test
                out[key] = ("error", traceback.format_exc())
            finally:
                faulthandler.cancel_dump_traceback_later()
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001
                pass
    return out


@functools.lru_cache(maxsize=None)
def checkpoint_dir() -> str:
    """One directory per pytest session, shared by the spawns (DCP across world sizes)."""
    return tempfile.mkdtemp(prefix="mfsdp_per_module_")


def results(world: int) -> list:
    from conftest import cached_run, get_run
    if world == 4:  # the world-4 grid loads the DCP checkpoint the world-2 grid wrote
        cached_run(grid, 2, checkpoint_dir())
    return get_run(grid, world, checkpoint_dir())


def verify(modname: str, name: str, world: int) -> None:
    key = f"{modname}::{name}"
    problems = []
    for rank, cells in enumerate(results(world)):
        if key not in cells:
            problems.append(f"rank {rank}: cell {key} did not run at world {world}")
            continue
        status, value = cells[key]
        if status == "error":
            problems.append(f"rank {rank} raised:\n{value}")
            continue
        for f in failures_of(value):
            problems.append(f"rank {rank}: {f}")
    if problems:
        raise AssertionError(f"{name} at world {world}:\n" + "\n".join(problems[:24])
                             + (f"\n... and {len(problems) - 24} more" if len(problems) > 24 else ""))


def raised_by(modname: str, name: str, world: int, label: str) -> List[Tuple[str, str]]:
    """(exception type name, message) that each rank recorded under `label` with Checks.raised."""
    verify(modname, name, world)
    out = []
    for cells in results(world):
        found = [(i[2], i[3]) for i in cells[f"{modname}::{name}"][1] if i[0] == "raised" and i[1] == label]
        assert found, f"{label}: not recorded"
        out.append(found[0])
    return out


def cell_ids(cells: Dict[str, tuple], gaps: Dict[str, str] = None) -> List:
    """(name, world) for every registered cell: the parameters of a module's test. A cell named
    in `gaps` is a known difference from FSDP2 (the reason says which): a strict xfail, so the
    day it passes the mark has to go."""
    import pytest
    gaps = gaps or {}
    return [pytest.param(name, w, marks=pytest.mark.xfail(strict=True, reason=gaps[name])) if name in gaps
            else (name, w) for name, (_, worlds) in cells.items() for w in worlds]


def reraise(kind: str, message: str):
    """Raises the exception a rank reported (for pytest.raises in the parent)."""
    exc = getattr(builtins, kind, None)
    if not (isinstance(exc, type) and issubclass(exc, BaseException)):
        raise AssertionError(f"expected an exception, got {kind}: {message}")
    raise exc(message)


# ------------------------------------------------------------------------------------------
# data and references

def local_batch(step: int, rank: int, shape, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 3)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def global_batch(step: int, world: int, shape, dtype=torch.float64) -> torch.Tensor:
    return torch.cat([local_batch(step, r, shape, dtype) for r in range(world)])


def tokens(step: int, rank: int, shape, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + 31 * rank + 11)
    return torch.randint(0, vocab, shape, generator=g)


@torch.no_grad()
def average_grads(module: nn.Module, world: int) -> None:
    """What data parallelism does to a plain replica's gradients: the mean over ranks."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def replica(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
