"""Helpers for the user-loop acceptance tests (issue 12): a crash-tolerant grid runner, tiny
plain-torch models, per-rank data, and float64 comparisons against DDP.

[Note: crash-tolerant grids]
The grid tests of all modules share one run_on_ranks spawn per world size (a spawn costs
seconds of imports per rank; a cell a fraction of one): the first test to need a world size runs
every (module, scenario, strategy) cell that this session selected at that size. A cell that
raises is caught and reported by its own test. But some failures are not Python exceptions: a collective whose sizes
differ across ranks aborts the process inside gloo (std::terminate), and a rank left waiting in
a collective its peers never issue hangs. A dead or hung rank would lose every cell of the spawn.
So every rank writes each cell's result to a file as soon as the cell ends; the parent reads
them after the spawn, reports the cell in flight when a rank died (with the exit code, the
survivors' errors and the tail of the dead rank's stderr), and spawns again for the cells after
it. After a cell that raised on some rank the ranks meet through the rendezvous store (not the
process group, which may be out of step) and check that the default group still pairs a small
all-reduce correctly; if it does not, the spawn stops and the next one starts afresh. Every
collective is bounded: the library's by `collective_timeout`, gloo's by the group timeout, the
spawn by run_on_ranks' timeout, the whole grid by a wall-clock budget.
"""
from __future__ import annotations

import datetime
import faulthandler
import functools
import gc
import importlib
import math
import os
import pickle
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megatron_fsdp_c.testing import run_on_ranks

STRATEGIES = [0, 1, 2, 3]
WORLDS = [2, 4]
RTOL = 1e-9          # float64: a wrong algorithm is off by ~1e-3, reduction-order rounding by ~1e-13
ATOL = 1e-12         # for elements that are (nearly) zero
COLLECTIVE_TIMEOUT = 15.0   # seconds; the library raises instead of waiting longer
GROUP_TIMEOUT_S = 15.0      # gloo's own collectives (DDP, the library's on gloo, the sanity check)
CELL_SKEW_S = 90.0          # the most one rank waits for the others at a cell's start or end
# a rank still inside one cell after this long dumps its stacks and exits
CELL_TIMEOUT_S = float(os.environ.get("USER_LOOPS_CELL_TIMEOUT_S", 150))
SPAWN_TIMEOUT_S = 480.0     # one spawn, a backstop (run_on_ranks kills it 30 s after)
GRID_BUDGET_S = 900.0       # all spawns of one grid


# ------------------------------------------------------------------------------------------
# the grid runner (see [Note: crash-tolerant grids])

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
    """Waits (through the store) until every rank has finished the cell; raises at once when a
    peer has died, and after CELL_SKEW_S when one is stuck."""
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


def _grid_worker(rank: int, world: int, cell_fn: Callable, cells: Sequence[tuple], out_dir: str):
    # The C++ runtime's last words (gloo's "terminate called after ...") go to fd 2: keep them.
    err = open(os.path.join(out_dir, f"stderr.{rank}"), "w")
    os.dup2(err.fileno(), 2)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    if cell_fn is run_cell:  # heavy imports now, not inside a cell where peers wait in a collective
        for module in sorted({c[0] for c in cells}):
            getattr(importlib.import_module(module), "prepare", lambda scenarios: None)(
                {c[1] for c in cells if c[0] == module})
    pg = dist.distributed_c10d._get_default_group()
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=GROUP_TIMEOUT_S), pg)
    store = _store()
    with open(os.path.join(out_dir, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    for j, cell in enumerate(cells):
        # start together (imports and earlier cells end at different times under load): the
        # gloo timeouts then only measure waits inside the cell
        store.set(f"start{j}/{rank}", "1")
        _wait_for_peers(store, [f"start{j}/{r}" for r in range(world)], out_dir, world)
        open(os.path.join(out_dir, f"started.{j}.{rank}"), "w").close()
        t0 = time.time()
        # a rank stuck where no timeout reaches (a deadlock) dumps every thread's stack and exits
        faulthandler.dump_traceback_later(CELL_TIMEOUT_S, exit=True, file=sys.stderr)
        try:
            value = ("ok", cell_fn(rank, world, *cell))
        except Exception as e:  # noqa: BLE001 - reported by the cell's test
            value = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            faulthandler.cancel_dump_traceback_later()
        gc.collect()
        with open(os.path.join(out_dir, f"cell.{j}.{rank}.pkl"), "wb") as f:
            pickle.dump(value + (time.time() - t0,), f)
        store.set(f"cell{j}/{rank}", value[0])
        _wait_for_peers(store, [f"cell{j}/{r}" for r in range(world)], out_dir, world)
        if any(store.get(f"cell{j}/{r}") != b"ok" for r in range(world)):
            why = _group_still_pairs(rank, world)
            if why:
                raise RuntimeError(f"process group out of step after cell {cell}: {why}")
    return "done"


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    lines = [ln for ln in text.splitlines() if "Warning" not in ln and ln.strip()]
    return "\n".join(lines)[-n:]


def run_grid(cell_fn: Callable, world: int, cells: Sequence[tuple]) -> Dict[tuple, list]:
    """{cell: [per rank (status, value, seconds)]}; status 'ok', 'error' (traceback text) or
    'crash' (a rank died or hung in this cell: what each rank left)."""
    cells = list(cells)
    results: Dict[tuple, list] = {}
    deadline = time.time() + GRID_BUDGET_S
    start = 0
    while start < len(cells):
        if time.time() > deadline:
            for cell in cells[start:]:
                results[cell] = [("error", f"not run: the grid's {GRID_BUDGET_S:.0f} s budget was spent", 0.0)] * world
            break
        todo = cells[start:]
        with tempfile.TemporaryDirectory() as out_dir:
            t0 = time.time()
            outcomes = run_on_ranks(_grid_worker, world, cell_fn, todo, out_dir, timeout_s=SPAWN_TIMEOUT_S,
                                    raise_errors=False)
            if os.environ.get("USER_LOOPS_DEBUG"):
                print(f"spawn at world {world} from cell {start}: {time.time() - t0:.1f} s", file=sys.stderr)
            next_start = len(cells)
            for j, cell in enumerate(todo):
                files = [os.path.join(out_dir, f"cell.{j}.{r}.pkl") for r in range(world)]
                if all(os.path.exists(p) for p in files):
                    per_rank = []
                    for p in files:
                        with open(p, "rb") as f:
                            per_rank.append(pickle.load(f))
                    results[cell] = per_rank
                    continue
                started = any(os.path.exists(os.path.join(out_dir, f"started.{j}.{r}")) for r in range(world))
                if not started and j > 0:
                    next_start = start + j  # the spawn stopped after a cell that broke the group
                    break
                if not started:  # the spawn failed before its first cell: so would the next one
                    why = "\n".join(f"rank {r}: {status} {str(value)[-1500:]}" for r, (status, value) in
                                    enumerate(outcomes))
                    for rest in todo:
                        results[rest] = [("error", f"the spawn failed before its first cell:\n{why}", 0.0)] * world
                    break
                per_rank = []
                for r in range(world):
                    if os.path.exists(files[r]):
                        with open(files[r], "rb") as f:
                            status, value, secs = pickle.load(f)
                        per_rank.append(("crash", f"rank {r} finished the cell ({status}): {str(value)[:1500]}", secs))
                        continue
                    status, value = outcomes[r]
                    if status == "dead":
                        tail = _tail(os.path.join(out_dir, f"stderr.{r}"), 3000)
                        if value == -9:
                            how = "hung and was killed after the spawn's timeout"
                        elif "Timeout (" in tail:
                            how = f"hung in this cell for {CELL_TIMEOUT_S:.0f} s and exited (its stacks below)"
                            tail = tail[tail.rindex("Timeout ("):]
                        else:
                            how = (f"died in this cell (exit code {value}"
                                   f"{' = signal ' + str(-value) if isinstance(value, int) and value < 0 else ''})")
                        text = f"rank {r} {how}; its stderr ends:\n{tail}"
                    else:
                        text = f"rank {r} left the cell with: {str(value)[-2500:]}"
                    per_rank.append(("crash", text, 0.0))
                results[cell] = per_rank
                next_start = start + j + 1
                break
        start = next_start
    return results


def run_cell(rank: int, world: int, module: str, scenario: str, strategy: int):
    """One grid cell on one rank: `module`.cell(rank, world, scenario, strategy)."""
    return importlib.import_module(module).cell(rank, world, scenario, strategy)


@functools.lru_cache(maxsize=None)
def cached_grid(world: int, cells: tuple) -> Dict[tuple, list]:
    return run_grid(run_cell, world, cells)


def selected_cells(session, world: int) -> tuple:
    """The cells at `world` of every grid test this pytest session runs (after -k and friends),
    from all modules at once: one spawn serves them all. A module's CELLS gives its order;
    the scenarios it lists in LAST (a rank may abort there) go after every other module's."""
    wanted = set()
    modules = {}
    for item in session.items:
        module = getattr(item, "module", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if module is None or not hasattr(module, "CELLS") or params.get("world") != world:
            continue
        if "scenario" in params and "strategy" in params:
            wanted.add((module.__name__, params["scenario"], params["strategy"]))
            modules[module.__name__] = module
    ordered = []
    for late in (False, True):
        for name in sorted(modules):
            last = getattr(modules[name], "LAST", ())
            ordered += [(name,) + c for c in modules[name].CELLS
                        if (name,) + c in wanted and (c[0] in last) == late]
    return tuple(ordered)


def cell_report(request, world: int, scenario: str, strategy: int) -> list:
    """The per-rank check results of the calling test's cell; fails the test (cleanly) when a
    rank raised, died or hung there."""
    cell = (request.module.__name__, scenario, strategy)
    cells = selected_cells(request.session, world)
    if cell not in cells:  # run outside a normal session: compute this cell alone
        cells = (cell,)
    per_rank = cached_grid(world, cells)[cell]
    if any(status == "crash" for status, _, _ in per_rank):
        died = [v for _, v, _ in per_rank if " died in this cell" in v or " hung " in v]
        first = died[0] if died else next(v for _, v, _ in per_rank if "finished the cell" not in v)
        lines = first.splitlines()
        why = next((ln.strip() for ln in lines if "what()" in ln), lines[-1].strip() if lines else "")
        pytest.fail(f"{lines[0][:200]} {why[:400]}\n\nWhat every rank left:\n" +
                    "\n".join(v for _, v, _ in per_rank), pytrace=False)
    for rank, (status, value, _) in enumerate(per_rank):
        if status == "error":
            pytest.fail(f"rank {rank} raised {value}", pytrace=False)
    return [value for _, value, _ in per_rank]


def assert_checks(per_rank: List[dict]) -> None:
    """Every rank's checks passed; the message lists each failed check once (first rank that saw it)."""
    failed, short = {}, {}
    for rank, checks in enumerate(per_rank):
        for name, (ok, message) in checks.items():
            if not ok and name not in failed:
                failed[name] = f"[rank {rank}] {name}: {message}"
                first = message.splitlines()[0] if message else ""
                short[name] = f"{name} ({first[:100]}{'...' if len(first) > 100 else ''})"
    if failed:
        pytest.fail(f"{len(failed)} check(s) failed: {'; '.join(short.values())}\n\n" + "\n".join(failed.values()),
                    pytrace=False)


# ------------------------------------------------------------------------------------------
# comparisons


def to_full(t):
    """A plain copy of a DTensor (collective) or a tensor: full_tensor() of a replicated DTensor is
    its local tensor itself, which the next backward overwrites."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def rel_excess(a: torch.Tensor, b: torch.Tensor, rtol=RTOL, atol=ATOL):
    """(worst |a-b| / (atol + rtol |b|), max |a-b|): > 1 means outside the tolerance."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if a.shape != b.shape:
        return math.inf, math.inf
    if a.numel() == 0:
        return 0.0, 0.0
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = (a - b).abs().masked_fill(both_inf | both_nan, 0.0)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    excess = diff / (atol + rtol * b.abs().masked_fill(~torch.isfinite(b), 0.0))
    excess = excess.masked_fill(diff == 0, 0.0)  # also when rtol = atol = 0 (exact equality)
    return excess.max().item(), diff.max().item()


def check_values(name: str, ours: Sequence[float], ref: Sequence[float], rtol=RTOL, atol=ATOL):
    """A check entry: (ok, message) comparing two sequences of numbers."""
    a = torch.tensor([float(v) for v in ours], dtype=torch.float64)
    b = torch.tensor([float(v) for v in ref], dtype=torch.float64)
    if a.shape != b.shape:
        return False, f"{len(ours)} values vs DDP's {len(ref)}"
    excess, diff = rel_excess(a, b, rtol, atol)
    if excess <= 1:
        return True, f"max |diff| {diff:.3g}"
    return False, (f"{name} differ from DDP's by up to {diff:.3g} (rtol {rtol:g}): "
                   f"ours {[f'{v:.12g}' for v in a.tolist()]} vs DDP {[f'{v:.12g}' for v in b.tolist()]}")


def check_params(ours: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor], rtol=RTOL, atol=ATOL):
    """A check entry comparing {name: tensor} dicts (names without the 'module.' prefix)."""
    ours = {strip(n): t for n, t in ours.items()}
    ref = {strip(n): t for n, t in ref.items()}
    if set(ours) != set(ref):
        return False, (f"parameter names differ: only ours {sorted(set(ours) - set(ref))[:5]}, "
                       f"only DDP's {sorted(set(ref) - set(ours))[:5]}")
    bad = []
    worst = 0.0
    for n in ref:
        excess, diff = rel_excess(ours[n], ref[n], rtol, atol)
        worst = max(worst, diff)
        if excess > 1:
            bad.append((diff, n))
    if not bad:
        return True, f"max |diff| {worst:.3g}"
    bad.sort(reverse=True)
    listed = ", ".join(f"{n} (max |diff| {d:.3g})" for d, n in bad[:4])
    return False, f"{len(bad)} of {len(ref)} parameters differ from DDP's: {listed}{' ...' if len(bad) > 4 else ''}"


def strip(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def ref_params(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ------------------------------------------------------------------------------------------
# data and tiny models a user might write


VOCAB, SEQ, D, HEADS, LAYERS, BATCH = 32, 8, 16, 2, 2, 2


def tokens(rank: int, step: int, vocab: int = VOCAB, seq: int = SEQ, batch: int = BATCH):
    """Per-rank, per-step token batch (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(1000 * step + rank + 17)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class Block(nn.Module):
    """A pre-norm transformer block with causal self-attention and a GELU MLP."""

    def __init__(self, d: int = D, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embeddings, a stack of blocks, a final norm and an untied head. forward(idx, targets,
    skip=None) skips block `skip` (LayerDrop); poison=True adds an inf-gradient term."""

    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx, targets, skip=None, poison=False):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = block(x)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if poison:  # d loss / d head.weight[0, 0] = inf (row 0 lives on the first rank's shard)
            loss = loss + self.head.weight[0, 0] * float("inf")
        return loss


def tiny_lm(seed: int = 0, layers: int = LAYERS) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(layers).to(torch.float64)


# ------------------------------------------------------------------------------------------
# schedulers


class MirroredSchedule:
    """Stands in for a scheduler that could not be built on the sharded optimizer: it runs the
    same scheduler on a one-parameter stand-in optimizer and copies the factor into the real
    optimizer's learning rates, so the rest of the loop can still be compared with DDP."""

    def __init__(self, factory: Callable, optimizer):
        import warnings
        self.optimizer = optimizer
        self.base = [g["lr"] for g in optimizer.param_groups]
        self.stand_in = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        self.scheduler = factory(self.stand_in)
        self._warnings = warnings
        self._apply()

    def _apply(self):
        factor = self.stand_in.param_groups[0]["lr"]
        for g, base in zip(self.optimizer.param_groups, self.base):
            g["lr"] = base * factor

    def step(self):
        with self._warnings.catch_warnings():
            self._warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()"
            self.scheduler.step()
        self._apply()

    def get_last_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]


def build_scheduler(factory: Callable, optimizer):
    """(scheduler, '') or, when building it on this optimizer raises, (MirroredSchedule, why)."""
    try:
        return factory(optimizer), ""
    except Exception as e:  # noqa: BLE001 - reported as a check by the caller
        return MirroredSchedule(factory, optimizer), f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------------------------
# the DDP side, once per spawn

_REFERENCES: Dict[tuple, object] = {}


def reference(key: tuple, run: Callable, *args):
    """run(*args), memoised in this process under `key`: a scenario's DDP run is the same for
    every strategy, so each spawn trains it once (every rank reaches the same cells in the same
    order, so the collectives inside still pair up)."""
    if key not in _REFERENCES:
        _REFERENCES[key] = run(*args)
    return _REFERENCES[key]
