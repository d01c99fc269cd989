"""The one harness of the multi-rank tests: cells and grids (their spawns: support/spawns.py).

[Note: one spawn per world size]
Spawning ranks costs seconds of imports per rank (torch, the library, transformers) while most
multi-rank checks take a fraction of a second. So test modules register their multi-rank work as
cells -- `CELLS = rank_grid.Cells(__name__)`, then `CELLS.add(key, fn, *args, worlds=...)` or the
`@CELLS.cell(key, worlds=...)` decorator; `fn(rank, world, *args, **kwargs)` runs on every rank and
returns a picklable value -- and the first test that reads a cell at world size W runs every cell
that this pytest session's selected tests read at W, from all modules, in one spawn of W ranks.
The results are kept for the session; a test reads its cell with `CELLS.result(key, world)` (one
value per rank) and asserts in the pytest process, so a failure names the check and the numbers.

Which cells a session reads: a cell serves the tests of its module named in its `tests` (all of
them without it) whose parameters have the values in its `match` (a test without such a
parameter reads it too) and whose `world` parameter, if they have one, is the cell's world size.
So `-k` picks cells as well as tests: `pytest tests/test_parity.py -k "0-adamw-1-4"` spawns 4
ranks for that one cell.

Groups and order: cells of `group="shared"` (the default) share their world size's spawn; a cell
that names another group gets a spawn of its own (one per group and world size). Every rank of a
spawn runs its cells in the same order: the modules' registration order, cells marked
`early=True` before all others (their process's heap is still fresh: resident-memory checks),
cells marked `late=True` after all others (a rank may abort there). `needs=[(module, key,
world), ...]` names cells whose spawn must have run before this cell's (a checkpoint written at
one world size and read at another): the spawns run in the order the needs impose, so a chain
that comes back to a world size it left puts one of its visits there in a group of its own
(tests/test_checkpoint.py's 4 -> 2 -> 1 -> 4).
`once(key, fn, *args)` computes a value once per spawn (a DDP reference several cells compare
with): every rank reaches it at the same cell, so the collectives inside pair up.

A rank that dies or hangs loses only the cell in flight ([Note: crash-tolerant grids] in
support/spawns.py).

Environment (print with pytest -s): RANK_GRID_TRACE=1 prints each cell's name on every rank as it
starts; RANK_GRID_DEBUG=1 prints each spawn's size, wall time, slowest cells, and threads and
process groups per rank at its end, the seconds each module's cells took, and the CPU seconds
(summed over ranks: a cost the machine's load does not change) by module and of the costliest
cells; RANK_GRID_CELL_TIMEOUT_S sets the default watchdog of a cell (300 s);
RANK_GRID_SPAWN_CELLS the most cells a spawn runs ([Note: spawns of bounded length] in spawns.py).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import pytest

from . import spawns

CELL_TIMEOUT_S = float(os.environ.get("RANK_GRID_CELL_TIMEOUT_S", 300))
SESSION_DIR_ENV = "RANK_GRID_SESSION_DIR"

CellId = spawns.CellId


# ------------------------------------------------------------------------------------------
# registration


@dataclasses.dataclass
class CellSpec:
    module: str
    key: Any
    fn: Callable
    args: tuple
    kwargs: dict
    worlds: Tuple[int, ...]
    group: str
    tests: Optional[Tuple[str, ...]]
    match: Optional[dict]
    needs: Tuple[CellId, ...]
    order: int  # -1: before the other cells of its spawn, 1: after them
    timeout: float
    index: int


_REGISTRY: Dict[Tuple[str, Any], CellSpec] = {}
_ONCE: Dict[Any, Any] = {}


class Cells:
    """The cells of one test module (see [Note: one spawn per world size])."""

    def __init__(self, module: str):
        self.module = module

    def add(self, key, fn: Callable, *args, worlds: Iterable[int] = (2,), group: str = "shared",
            tests: Optional[Iterable[str]] = None, match: Optional[dict] = None, needs: Sequence[CellId] = (),
            early: bool = False, late: bool = False, timeout: Optional[float] = None, **kwargs) -> None:
        """Registers fn(rank, world, *args, **kwargs) under `key` at each of `worlds`; `tests`
        (function names) and `match` (parameter values) say which tests read it."""
        ident = (self.module, key)
        assert ident not in _REGISTRY, f"cell {key!r} registered twice in {self.module}"
        _REGISTRY[ident] = CellSpec(self.module, key, fn, args, kwargs, tuple(worlds), group,
                                    None if tests is None else tuple(tests), None if match is None else dict(match),
                                    tuple(needs), -1 if early else 1 if late else 0,
                                    CELL_TIMEOUT_S if timeout is None else timeout,
                                    len(_REGISTRY))

    def cell(self, key, worlds: Iterable[int] = (2,), **options):
        """Decorator form of add: the options other than add's own are the function's kwargs."""
        def register(fn):
            self.add(key, fn, worlds=worlds, **options)
            return fn
        return register

    def keys(self) -> List[Any]:
        return [spec.key for spec in _REGISTRY.values() if spec.module == self.module]

    def spec(self, key) -> CellSpec:
        return _REGISTRY[(self.module, key)]

    def result(self, key, world: int) -> list:
        """Every rank's value of the cell; fails the calling test (cleanly) when a rank raised,
        died or hung there."""
        spec = self.spec(key)
        assert world in spec.worlds, f"cell {key!r} does not run at world size {world}"
        return _values((self.module, key, world))


def spec_of(cid: CellId) -> CellSpec:
    """The spec of a registered cell (by (module, key, world)): what the spawns' ranks run."""
    return _REGISTRY[cid[:2]]


def once(key, fn: Callable, *args):
    """fn(*args), computed once per spawn under `key` (see [Note: one spawn per world size])."""
    if key not in _ONCE:
        _ONCE[key] = fn(*args)
    return _ONCE[key]


def device_mesh(device_type: str, shape, mesh_dim_names=None):
    """init_device_mesh(device_type, shape, mesh_dim_names=...), made once per spawn.

    [Note: one mesh per shape]
    Every device mesh makes its own process groups (one per sub-group of each dim), and they
    cannot be destroyed between cells ([Note: spawns of bounded length]): measured at world 4,
    85 cells of the TP, hybrid and DTensor files left 156 groups and ~490 threads per rank, their
    idle loops taking CPU from every later cell. Cells that want a mesh take it here, so a spawn
    holds one mesh per (device, shape, dim names) -- as a training script holds one mesh for all
    its models. Every rank runs the spawn's cells in one order, so the first call, which is
    collective, comes at the same cell on every rank. A cell that needs a mesh of its own (one
    that checks what a new mesh does) calls init_device_mesh itself."""
    from torch.distributed.device_mesh import init_device_mesh

    key = ("device_mesh", device_type, tuple(shape), None if mesh_dim_names is None else tuple(mesh_dim_names))
    return once(key, lambda: init_device_mesh(device_type, tuple(shape), mesh_dim_names=key[3]))


_OWN_DIR: List[str] = []


def session_dir() -> str:
    """One directory per pytest session, shared by every spawn (checkpoints across world sizes)."""
    path = os.environ.get(SESSION_DIR_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="mfsdp_rank_grid_")
        os.environ[SESSION_DIR_ENV] = path  # spawned ranks inherit it
        _OWN_DIR.append(path)
    return path


def end_session() -> None:
    """Called by conftest at the end of the session: removes the session directory."""
    for path in _OWN_DIR:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(SESSION_DIR_ENV, None)
    _OWN_DIR.clear()
    if os.environ.get("RANK_GRID_DEBUG"):
        if _LONE:
            print(f"\n[rank_grid] cells run in a spawn of their own (outside the session's selection): {_LONE}",
                  file=sys.stderr)
        print("\n[rank_grid] seconds in cells by module: " + ", ".join(
            f"{m} {s:.1f}" for s, m in sorted(((s, m) for m, s in _SECONDS.items()), reverse=True)), file=sys.stderr)
        by_module: Dict[str, float] = {}
        for cid, cpu in _CPU.items():
            by_module[cid[0]] = by_module.get(cid[0], 0.0) + cpu
        print("\n[rank_grid] CPU seconds in cells by module (all ranks): " + ", ".join(
            f"{m} {s:.1f}" for s, m in sorted(((s, m) for m, s in by_module.items()), reverse=True)), file=sys.stderr)
        print("\n[rank_grid] costliest cells in CPU seconds (all ranks): " + ", ".join(
            f"{c[0]}::{c[1]}@{c[2]} {s:.1f}" for s, c in sorted(((s, c) for c, s in _CPU.items()), reverse=True)[:40]),
            file=sys.stderr)


# ------------------------------------------------------------------------------------------
# which cells this session reads


_SESSION_ITEMS: List[Any] = []
_SELECTED: Optional[set] = None


def set_session_items(items) -> None:
    """Called by conftest once the session's tests are collected and selected."""
    global _SELECTED
    _SESSION_ITEMS[:] = list(items)
    _SELECTED = None


def _serves(spec: CellSpec, world: int, test: str, params: dict) -> bool:
    if spec.tests is not None and test not in spec.tests:
        return False
    if "world" in params and params["world"] != world:
        return False
    return all(params.get(k, v) == v for k, v in (spec.match or {}).items())


def _with_needs(cells: Iterable[CellId]) -> set:
    out, todo = set(), list(cells)
    while todo:
        cid = todo.pop()
        if cid in out:
            continue
        out.add(cid)
        todo.extend(_REGISTRY[cid[:2]].needs)
    return out


def _selected() -> set:
    global _SELECTED
    if _SELECTED is None:
        wanted = []
        for item in _SESSION_ITEMS:
            module = getattr(getattr(item, "module", None), "__name__", None)
            test = getattr(item, "originalname", None)
            params = getattr(getattr(item, "callspec", None), "params", {})
            for spec in _REGISTRY.values():
                if spec.module == module:
                    wanted += [(module, spec.key, w) for w in spec.worlds if _serves(spec, w, test, params)]
        _SELECTED = _with_needs(wanted)
    return _SELECTED


# ------------------------------------------------------------------------------------------
# running the grids


_RESULTS: Dict[CellId, list] = {}
_RAN: set = set()  # (group, world) slots whose shared spawn has run
_LONE: List[CellId] = []  # cells that needed a spawn of their own
_SECONDS: Dict[str, float] = {}  # module -> seconds its cells took (the slowest rank's)
_CPU: Dict[CellId, float] = {}  # cell -> CPU seconds, summed over its ranks (load-independent cost)


def _values(cid: CellId) -> list:
    _ensure(cid)
    per_rank = _RESULTS[cid]
    if any(status == "crash" for status, _, _ in per_rank):
        died = [v for _, v, _ in per_rank if " died in this cell" in v or " hung " in v]
        first = died[0] if died else next(v for _, v, _ in per_rank if "finished the cell" not in v)
        lines = first.splitlines()
        why = next((ln.strip() for ln in lines if "what()" in ln), lines[-1].strip() if lines else "")
        pytest.fail(f"{lines[0][:200]} {why[:400]}\n\nWhat every rank left:\n" +
                    "\n".join(v for _, v, _ in per_rank), pytrace=False)
    for rank, (status, value, _) in enumerate(per_rank):
        if status == "error":
            pytest.fail(f"cell {cid[1]!r} at world {cid[2]}: rank {rank} raised {value}", pytrace=False)
    return [value for _, value, _ in per_rank]


def _order(cells: Iterable[CellId]) -> List[CellId]:
    return sorted(cells, key=lambda c: (_REGISTRY[c[:2]].order, _REGISTRY[c[:2]].index, c[2]))


def _slot(cid: CellId) -> Tuple[str, int]:
    return _REGISTRY[cid[:2]].group, cid[2]


def _ensure(cid: CellId) -> None:
    """Runs the spawn of cid's (group, world) unless it has its result: every selected cell of
    that slot, after the spawns that its cells need. A cell outside the selection (a test run
    outside a normal session) gets a spawn of its own."""
    if cid in _RESULTS:
        return
    slot = _slot(cid)
    if slot in _RAN or cid not in _selected():
        for need in _REGISTRY[cid[:2]].needs:
            _ensure(need)
        _LONE.append(cid)
        _spawn(slot, [cid])
        return
    _RAN.add(slot)
    cells = [c for c in _selected() if _slot(c) == slot and c not in _RESULTS]
    for cell in cells:
        for need in _REGISTRY[cell[:2]].needs:
            if _slot(need) != slot:
                _ensure(need)
    _spawn(slot, _order(cells))


def _spawn(slot: Tuple[str, int], cells: List[CellId]) -> None:
    session_dir()
    t0 = time.time()
    results, cpu = spawns.run_grid(slot[1], cells, spec_of)
    _RESULTS.update(results)
    _CPU.update(cpu)
    for cid, per_rank in results.items():
        _SECONDS[cid[0]] = _SECONDS.get(cid[0], 0.0) + max(r[2] for r in per_rank)
    if os.environ.get("RANK_GRID_DEBUG"):
        slowest = sorted(((max(r[2] for r in per_rank), cid) for cid, per_rank in results.items()), reverse=True)
        print(f"\n[rank_grid] {slot[0]} grid at world {slot[1]}: {len(cells)} cells, {time.time() - t0:.1f} s; "
              "slowest: " + ", ".join(f"{c[0]}::{c[1]} {s:.1f} s" for s, c in slowest[:12]), file=sys.stderr)


def params(cells: Cells, keys: Iterable, gaps: Optional[Dict[Any, str]] = None) -> List:
    """(key, world) for each key at each of its worlds: the parameters of a test over cells. A
    key in `gaps` is a known difference from a peer (the reason says which): a strict xfail, so
    the day it passes the mark has to go."""
    gaps = gaps or {}
    out = []
    for key in keys:
        for w in cells.spec(key).worlds:
            if key in gaps:
                out.append(pytest.param(key, w, marks=pytest.mark.xfail(strict=True, reason=gaps[key])))
            else:
                out.append((key, w))
    return out
