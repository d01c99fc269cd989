"""The spawns of the multi-rank grids (support/rank_grid.py): what each rank of a spawn runs
(its cells in one order, each result to a file as the cell ends) and how the parent reads what
the ranks left, a dead or hung one included.

[Note: crash-tolerant grids]
A cell that raises is caught and reported by its own test. But some failures are not Python
exceptions: a collective whose sizes differ across ranks aborts the process inside gloo
(std::terminate), and a rank left waiting in a collective its peers never issue hangs. A dead or
hung rank would lose every cell of the spawn. So every rank writes each cell's result to a file as
soon as the cell ends; the parent reads them after the spawn, reports the cell in flight when a
rank died (with the exit code, the survivors' errors and the dead rank's last words), and
spawns again for the cells after it. The ranks start each cell together (through the rendezvous
store, so gloo's timeouts only measure waits inside the cell); after a cell that raised on some
rank they check that the default group still pairs a small all-reduce correctly, and if it does
not, the spawn stops and the next one starts afresh. Every wait is bounded: the library's
collectives by the cells' `collective_timeout`, gloo's by the group timeout, a cell by its
watchdog (a rank still inside a cell after its timeout dumps its stacks and exits), the spawn by
run_on_ranks' timeout, all spawns of a grid by a wall-clock budget.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import faulthandler
import gc
import importlib
import os
import pickle
import re
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron_fsdp_c.testing import run_on_ranks

GROUP_TIMEOUT_S = 60.0      # gloo's own collectives (DDP, the library's on gloo, the sanity check)
CELL_SKEW_S = 120.0         # the most one rank waits for the others at a cell's start or end
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
# [Note: spawns side by side]
# The cells wait more than they compute: their collectives are small, so a rank spends most of a
# cell waiting for a peer's process to be scheduled (measured: the suite's cells used ~60% of the
# two cores' time). SPAWN_PARALLEL chunks of a grid run as spawns side by side, so one spawn's
# waits are the other's compute. Chunks share nothing (once() values are per spawn, needs order
# grids, not chunks), and each spawn starts its cells together and bounds every wait as before.
# Measured (pytest tests, idle machine): 902-944 s one spawn at a time, 730 s two side by side,
# 800 s three (more waiting for the cores than the overlap saves); on 2026-12-07's machine 345 s
# one at a time, 294-300 s two. Two is the default since 2026-12-07: the SIGSEGV in a gloo
# all-gather once seen so (2026-11, test_user_loops' moe_unused_experts at world 2, a cell with a
# 15 s collective timeout) has the shape of a timed-out gloo collective writing into memory freed
# meanwhile, which the engine now never frees ([Note: buffers under a collective] in
# csrc/comm/buffers.c), and two runs starting side by side no longer race for a rendezvous port
# ([Note: the rendezvous port] in megatron_fsdp_c/testing.py); five full suites side by side ran
# clean after that (docs/testing.md). RANK_GRID_SPAWN_PARALLEL=1: one spawn at a time.
SPAWN_PARALLEL = int(os.environ.get("RANK_GRID_SPAWN_PARALLEL", 2))

CellId = Tuple[str, Any, int]  # (module, key, world)


def _read_float(path: str) -> float:
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return 0.0


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


def _grid_worker(rank: int, world: int, cells: Sequence[CellId], out_dir: str, spec_of: Callable):
    # The C++ runtime's last words (gloo's "terminate called after ...") go to fd 2: keep them.
    console = os.fdopen(os.dup(2), "w", buffering=1)
    err = open(os.path.join(out_dir, f"stderr.{rank}"), "w")
    os.dup2(err.fileno(), 2)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    # a fatal signal (glibc's heap checks abort, a SIGSEGV) prints every thread's Python stack after
    # the C runtime's last words: the crash report then names the line each thread was on
    faulthandler.enable(file=sys.stderr, all_threads=True)
    from megatron_fsdp_c import _C
    _C.native_fault_trace()  # in front of faulthandler: a fault in a C/C++ thread names its frames
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
        spec = spec_of(cid)
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


SANITIZER_REPORT = re.compile(r"^==\d+==ERROR: |: runtime error: ")
NATIVE_STACK, NATIVE_STACK_END = "megatron_fsdp_c: native stack of thread", "megatron_fsdp_c: end of the native stack"


def _block(lines: List[str], start: int, most: int) -> List[str]:
    """faulthandler's stack of one thread from its header line: up to `most` lines (innermost first)."""
    out = []
    for ln in lines[start:start + most]:
        if not ln.strip() or ln.startswith("Extension modules"):
            break
        out.append(ln)
    return out


def last_words(path: str, n: int = 6000) -> str:
    """What names a dead rank's fault, from its stderr file, in this order: the native stack of the
    faulting thread ([Note: native fault trace] in csrc/python/fault_trace.c), a sanitizer's report
    (ASan's from its ERROR line to its SUMMARY line, UBSan's runtime error and its stack), the
    lines just before Python's "Fatal Python error" (glibc's "malloc(): ..." or gloo's last
    words) with that line and faulthandler's stack of the faulting thread, then the end of the
    file. A plain tail does not do: faulthandler dumps every thread, a rank has a dozen, and CI's
    make asan once showed only the forkserver's frames and the list of extension modules."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if "Warning" not in ln]
    except OSError:
        return ""
    parts = []

    def span(is_start, end_prefix, most):
        """The first block from a line is_start accepts to one starting with end_prefix (its end)."""
        start = next((i for i, ln in enumerate(lines) if is_start(ln)), None)
        if start is None:
            return 0
        end = next((i for i in range(start, len(lines)) if lines[i].startswith(end_prefix)), start + most - 1)
        parts.append("\n".join(lines[start:end + 1][:most]))
        return end + 1
    # [Note: native fault trace] in csrc/python/fault_trace.c
    native = next((i for i, ln in enumerate(lines) if ln.startswith(NATIVE_STACK)), None)
    after_native = span(lambda ln: ln.startswith(NATIVE_STACK), NATIVE_STACK_END, 72)
    span(SANITIZER_REPORT.search, "SUMMARY: ", 120)
    fatal = max((i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error: ")), default=None)
    if fatal is not None:
        # glibc's or gloo's last words: just before the native stack where it precedes the fatal line
        upto = native if native is not None and after_native <= fatal else fatal
        before = [ln for ln in lines[max(0, upto - 8):upto] if ln.strip()]
        current = next((i for i in range(fatal, len(lines)) if lines[i].startswith("Current thread ")), None)
        if current is not None:
            stack = _block(lines, current, 60)
        else:  # the faulting thread runs no Python (a C/C++ thread: gloo's, autograd's, the engine's)
            stack = ["(no Python thread faulted: a C/C++ thread did, its native stack above; Python's threads "
                     "were at:)"]
            for i in range(fatal, len(lines)):
                if lines[i].startswith("Thread 0x"):
                    stack += _block(lines, i, 14)
        parts.append("\n".join(before + [lines[fatal]] + stack))
    text = [ln for ln in lines if ln.strip()]
    if not parts:
        return "\n".join(text)[-n:]
    parts.append("-- its last lines:\n" + "\n".join(text[-8:]))
    return "\n".join(p[:n // 2] for p in parts)


def chunks_of(cells: Sequence[CellId]) -> List[List[CellId]]:
    """A grid's cells cut into its spawns' chunks: equal ones, as many as SPAWN_PARALLEL keeps busy
    together (none left to run alone at the end). benchmarks/stress.py --chunk-of replays one."""
    cells = list(cells)
    parallel = max(1, SPAWN_PARALLEL)
    n_chunks = -(-len(cells) // SPAWN_CELLS)
    n_chunks = -(-n_chunks // parallel) * parallel if len(cells) >= 2 * parallel else n_chunks
    size = -(-len(cells) // max(1, n_chunks))
    return [cells[i:i + size] for i in range(0, len(cells), max(1, size))]


def run_grid(world: int, cells: Sequence[CellId],
             spec_of: Callable) -> Tuple[Dict[CellId, list], Dict[CellId, float]]:
    """({cell: [per rank (status, value, seconds)]}, {cell: CPU seconds summed over its ranks});
    status 'ok', 'error' (traceback text) or 'crash' (a rank died or hung in this cell: what each
    rank left). spec_of(cell) gives the cell's CellSpec in the ranks. See [Note: crash-tolerant
    grids]; the cells go in chunks of SPAWN_CELLS, SPAWN_PARALLEL chunks at a time ([Note: spawns
    side by side])."""
    deadline = time.time() + GRID_BUDGET_S
    parallel = max(1, SPAWN_PARALLEL)
    chunks = chunks_of(cells)
    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        done = list(pool.map(lambda chunk: _run_chunk(world, chunk, spec_of, deadline), chunks))
    results: Dict[CellId, list] = {}
    cpu: Dict[CellId, float] = {}
    for chunk_results, chunk_cpu in done:
        results.update(chunk_results)
        cpu.update(chunk_cpu)
    return results, cpu


def _run_chunk(world: int, cells: List[CellId], spec_of: Callable,
               deadline: float) -> Tuple[Dict[CellId, list], Dict[CellId, float]]:
    """One chunk's cells in spawns of `world` ranks: after a crash, a new spawn takes the cells
    after the one in flight ([Note: crash-tolerant grids])."""
    results: Dict[CellId, list] = {}
    cpu: Dict[CellId, float] = {}
    start = 0
    while start < len(cells):
        if time.time() > deadline:
            for cell in cells[start:]:
                results[cell] = [("error", f"not run: the grid's {GRID_BUDGET_S:.0f} s budget was spent", 0.0)] * world
            break
        todo = cells[start:]
        with tempfile.TemporaryDirectory() as out_dir:
            outcomes = run_on_ranks(_grid_worker, world, todo, out_dir, spec_of, timeout_s=SPAWN_TIMEOUT_S,
                                    raise_errors=False)
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
                    cpu[cell] = sum(_read_float(os.path.join(out_dir, f"cpu.{j}.{r}")) for r in range(world))
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
    return results, cpu


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
            # the C runtime's last words, then faulthandler's stacks of every thread
            tail = last_words(os.path.join(out_dir, f"stderr.{r}"), 6000)
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
