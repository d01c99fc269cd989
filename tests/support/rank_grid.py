"""The one harness of the multi-rank tests: cells, grids and spawns.

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

[Note: crash-tolerant grids]
A cell that raises is caught and reported by its own test. But some failures are not Python
exceptions: a collective whose sizes differ across ranks aborts the process inside gloo
(std::terminate), and a rank left waiting in a collective its peers never issue hangs. A dead or
hung rank would lose every cell of the spawn. So every rank writes each cell's result to a file as
soon as the cell ends; the parent reads them after the spawn, reports the cell in flight when a
rank died (with the exit code, the survivors' errors and the tail of the dead rank's stderr), and
spawns again for the cells after it. The ranks start each cell together (through the rendezvous
store, so gloo's timeouts only measure waits inside the cell); after a cell that raised on some
rank they check that the default group still pairs a small all-reduce correctly, and if it does
not, the spawn stops and the next one starts afresh. Every wait is bounded: the library's
collectives by the cells' `collective_timeout`, gloo's by the group timeout, a cell by its
watchdog (a rank still inside a cell after its timeout dumps its stacks and exits), the spawn by
run_on_ranks' timeout, all spawns of a grid by a wall-clock budget.

Environment (print with pytest -s): RANK_GRID_TRACE=1 prints each cell's name on every rank as it
starts; RANK_GRID_DEBUG=1 prints each spawn's size, wall time, slowest cells, and threads and
process groups per rank at its end, the seconds each module's cells took, and the CPU seconds
(summed over ranks: a cost the machine's load does not change) by module and of the costliest
cells; RANK_GRID_CELL_TIMEOUT_S sets the default watchdog of a cell (300 s);
RANK_GRID_SPAWN_CELLS the most cells a spawn runs ([Note: spawns of bounded length]).
"""
from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import gc
import importlib
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist

from megatron_fsdp_c.testing import run_on_ranks

GROUP_TIMEOUT_S = 60.0      # gloo's own collectives (DDP, the library's on gloo, the sanity check)
CELL_SKEW_S = 120.0         # the most one rank waits for the others at a cell's start or end
CELL_TIMEOUT_S = float(os.environ.get("RANK_GRID_CELL_TIMEOUT_S", 300))
SPAWN_TIMEOUT_S = 3600.0    # one spawn, a backstop (each cell has its watchdog)
GRID_BUDGET_S = 5400.0      # all spawns of one (group, world size)
# [Note: spawns of bounded length]
# A spawn runs at most SPAWN_CELLS cells, then the next spawn takes the rest. Each process group a
# cell makes (every device mesh makes its own; torch's caches keep them, so they cannot be
# destroyed between cells: ../shared/DESIGN.md) leaves an idle gloo loop thread waking every
# 10 ms, so a spawn's idle CPU grows with the groups its cells have made: measured at world 4
# when every cell made its own meshes, ~350 groups per rank by the end of 278 cells, their loops
# using more CPU than the cells. Cells now share their meshes ([Note: one mesh per shape]), and a
# 100-cell spawn ends with at most ~30 groups per rank at world 4 (~5 at world 2). Long spawns
# still cost more than the start-ups they save (~4 CPU-seconds per rank): with one spawn per world
# size (500 cells) the suite took 592 s of pytest and ~1170 CPU-seconds for all of make test, with
# 100 cells 483 s of pytest and ~800 CPU-seconds for pytest alone (the same tree, idle machine).
# `once()` values are per spawn, so a reference is trained again in each spawn that reads it.
SPAWN_CELLS = int(os.environ.get("RANK_GRID_SPAWN_CELLS", 100))
SESSION_DIR_ENV = "RANK_GRID_SESSION_DIR"

CellId = Tuple[str, Any, int]  # (module, key, world)


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


def _read_float(path: str) -> float:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return 0.0


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
    results = run_grid(slot[1], cells)
    _RESULTS.update(results)
    for cid, per_rank in results.items():
        _SECONDS[cid[0]] = _SECONDS.get(cid[0], 0.0) + max(r[2] for r in per_rank)
    if os.environ.get("RANK_GRID_DEBUG"):
        slowest = sorted(((max(r[2] for r in per_rank), cid) for cid, per_rank in results.items()), reverse=True)
        print(f"\n[rank_grid] {slot[0]} grid at world {slot[1]}: {len(cells)} cells, {time.time() - t0:.1f} s; "
              "slowest: " + ", ".join(f"{c[0]}::{c[1]} {s:.1f} s" for s, c in slowest[:12]), file=sys.stderr)


def _store():
    return dist.distributed_c10d._get_default_store()


def _group_still_pairs(rank: int, world: int) -> str:
    """'' if the default group pairs an all-reduce correctly, else why not."""
    t = torch.tensor([float(rank + 1)], dtype=torch.float64)
    try:
        work = dist.all_reduce(t, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    expected = world * (world + 1) / 2
    return "" if t.item() == expected else f"all-reduce gave {t.item()}, expected {expected}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a dead rank stays a zombie until the parent joins it


def _wait_for_peers(store, keys: List[str], out_dir: str, world: int) -> None:
    """Waits (through the store) until every rank has set `keys`; raises at once when a peer has
    died, and after CELL_SKEW_S when one is stuck."""
    deadline = time.time() + CELL_SKEW_S
    while True:
        try:
            store.wait(keys, datetime.timedelta(seconds=1))
            return
        except Exception:  # noqa: BLE001 - a timeout, or the store's host (rank 0) is gone
            dead = []
            for r in range(world):
                try:
                    with open(os.path.join(out_dir, f"pid.{r}")) as f:
                        pid = int(f.read())
                except (OSError, ValueError):
                    continue
                if not _alive(pid):
                    dead.append(r)
            if dead:
                raise RuntimeError(f"rank(s) {dead} died") from None
            if time.time() > deadline:
                raise


def _grid_worker(rank: int, world: int, cells: Sequence[CellId], out_dir: str):
    # The C++ runtime's last words (gloo's "terminate called after ...") go to fd 2: keep them.
    console = os.fdopen(os.dup(2), "w", buffering=1)
    err = open(os.path.join(out_dir, f"stderr.{rank}"), "w")
    os.dup2(err.fileno(), 2)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    torch.set_num_threads(1)
    # imports (and each module's prepare hook) now, not inside a cell where peers wait in a collective
    for module in dict.fromkeys(c[0] for c in cells):
        mod = importlib.import_module(module)
        getattr(mod, "prepare", lambda keys: None)({c[1] for c in cells if c[0] == module})
    # What the imports made lives as long as the process: out of the collector's sight, a collection
    # (after every cell, and whenever allocations trigger one) scans only what the cells made --
    # with torch and transformers imported, a full collection scans ~350k objects (~0.5 s).
    gc.collect()
    gc.freeze()
    pg = dist.distributed_c10d._get_default_group()
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=GROUP_TIMEOUT_S), pg)
    store = _store()
    with open(os.path.join(out_dir, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    trace = bool(os.environ.get("RANK_GRID_TRACE"))
    for j, cid in enumerate(cells):
        spec = _REGISTRY[cid[:2]]
        # start together (imports and earlier cells end at different times under load): the
        # gloo timeouts then only measure waits inside the cell
        store.set(f"start{j}/{rank}", "1")
        _wait_for_peers(store, [f"start{j}/{r}" for r in range(world)], out_dir, world)
        open(os.path.join(out_dir, f"started.{j}.{rank}"), "w").close()
        if trace:
            print(f"[rank {rank}] cell {cid[0]}::{cid[1]} at world {world}", file=console, flush=True)
        t0, cpu0 = time.time(), time.process_time()
        # a rank stuck where no timeout reaches (a deadlock) dumps every thread's stack and exits
        faulthandler.dump_traceback_later(spec.timeout, exit=True, file=sys.stderr)
        try:
            torch.manual_seed(0)
            value = ("ok", spec.fn(rank, world, *spec.args, **spec.kwargs))
        except Exception as e:  # noqa: BLE001 - reported by the cell's test
            value = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            faulthandler.cancel_dump_traceback_later()
        gc.collect()
        try:
            payload = pickle.dumps(value + (time.time() - t0,))
        except Exception as e:  # noqa: BLE001 - an unpicklable value fails its cell only
            payload = pickle.dumps(("error", f"the cell's value does not pickle: {type(e).__name__}: {e}",
                                    time.time() - t0))
        with open(os.path.join(out_dir, f"cell.{j}.{rank}.pkl"), "wb") as f:
            f.write(payload)
        with open(os.path.join(out_dir, f"cpu.{j}.{rank}"), "w") as f:
            f.write(repr(time.process_time() - cpu0))
        store.set(f"cell{j}/{rank}", value[0])
        _wait_for_peers(store, [f"cell{j}/{r}" for r in range(world)], out_dir, world)
        if any(store.get(f"cell{j}/{r}") != b"ok" for r in range(world)):
            why = _group_still_pairs(rank, world)
            if why:
                raise RuntimeError(f"process group out of step after cell {cid[1]!r}: {why}")
    # (threads, groups named by a counter, groups named by a hash of their ranks) at the end, for
    # RANK_GRID_DEBUG: every group keeps a gloo loop waking every 10 ms ([Note: spawns of bounded length])
    names = [pg.group_name for pg in dist.distributed_c10d._world.pg_map]
    return (len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1,
            sum(n.isdigit() for n in names), sum(not n.isdigit() for n in names))


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if "Warning" not in ln and ln.strip()]
    return "\n".join(lines)[-n:]


def run_grid(world: int, cells: Sequence[CellId]) -> Dict[CellId, list]:
    """{cell: [per rank (status, value, seconds)]}; status 'ok', 'error' (traceback text) or
    'crash' (a rank died or hung in this cell: what each rank left). See [Note: crash-tolerant
    grids]."""
    cells = list(cells)
    results: Dict[CellId, list] = {}
    deadline = time.time() + GRID_BUDGET_S
    start = 0
    while start < len(cells):
        if time.time() > deadline:
            for cell in cells[start:]:
                results[cell] = [("error", f"not run: the grid's {GRID_BUDGET_S:.0f} s budget was spent", 0.0)] * world
            break
        todo = cells[start:start + SPAWN_CELLS]  # see [Note: spawns of bounded length]
        with tempfile.TemporaryDirectory() as out_dir:
            outcomes = run_on_ranks(_grid_worker, world, todo, out_dir, timeout_s=SPAWN_TIMEOUT_S, raise_errors=False)
            if os.environ.get("RANK_GRID_DEBUG"):
                print(f"\n[rank_grid] (threads, counter-named groups, hash-named groups) per rank at the end "
                      f"of the spawn: {[v for _, v in outcomes]}",
                      file=sys.stderr)
            next_start = start + len(todo)
            for j, cell in enumerate(todo):
                files = [os.path.join(out_dir, f"cell.{j}.{r}.pkl") for r in range(world)]
                if all(os.path.exists(p) for p in files):
                    per_rank = []
                    for p in files:
                        with open(p, "rb") as f:
                            per_rank.append(pickle.load(f))
                    results[cell] = per_rank
                    _CPU[cell] = sum(_read_float(os.path.join(out_dir, f"cpu.{j}.{r}")) for r in range(world))
                    continue
                started = any(os.path.exists(os.path.join(out_dir, f"started.{j}.{r}")) for r in range(world))
                if not started and j > 0:
                    next_start = start + j  # the spawn stopped after a cell that broke the group
                    break
                if not started:  # the spawn failed before its first cell: so would the next one
                    why = "\n".join(f"rank {r}: {status} {str(value)[-1500:]}" for r, (status, value) in
                                    enumerate(outcomes))
                    for rest in cells[start:]:
                        results[rest] = [("error", f"the spawn failed before its first cell:\n{why}", 0.0)] * world
                    next_start = len(cells)
                    break
                results[cell] = _crash_report(out_dir, j, world, outcomes)
                next_start = start + j + 1
                break
        start = next_start
    return results


def _crash_report(out_dir: str, j: int, world: int, outcomes: list) -> list:
    per_rank = []
    for r in range(world):
        path = os.path.join(out_dir, f"cell.{j}.{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                status, value, secs = pickle.load(f)
            per_rank.append(("crash", f"rank {r} finished the cell ({status}): {str(value)[:1500]}", secs))
            continue
        status, value = outcomes[r]
        if status == "dead":
            tail = _tail(os.path.join(out_dir, f"stderr.{r}"), 3000)
            if value == -9:
                how = "hung and was killed after the spawn's timeout"
            elif "Timeout (" in tail:
                how = "hung in this cell past its watchdog and exited (its stacks below)"
                tail = tail[tail.rindex("Timeout ("):]
            else:
                how = (f"died in this cell (exit code {value}"
                       f"{' = signal ' + str(-value) if isinstance(value, int) and value < 0 else ''})")
            text = f"rank {r} {how}; its stderr ends:\n{tail}"
        else:
            text = f"rank {r} left the cell with: {str(value)[-2500:]}"
        per_rank.append(("crash", text, 0.0))
    return per_rank


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
