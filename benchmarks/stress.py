"""The stress harness: suspect multi-rank cells repeated many times inside the same processes, so a
repetition costs a cell (about a second), not a process start. Not part of make test.

    python benchmarks/stress.py                        # the suspect cells, worlds 2 and 4, 600 s
    python benchmarks/stress.py --world 2 --reps 200 --budget-s 300 --threads 1,4 --jitter-ms 3
    python benchmarks/stress.py --cells "megatron[2, offload]" --cells test_api::<key> ...
    python benchmarks/stress.py --world 4 --chunk-of "test_hybrid::('per-module', (2, 2), 1, 3, 'set_requires_all_reduce')"

One spawn of --world ranks (forked from the forkserver of megatron_fsdp_c.testing) runs
repetition after repetition: each one a fresh model and optimizer (the cell makes them), seeded
(torch.manual_seed and the jitter's generator) by the repetition's seed, with the repetition's
torch thread count, so a failure's (cell, seed, threads) can be run again alone (--cells,
--seed, --threads, --reps 1). Rank 0 picks each repetition and broadcasts it, so every rank
runs the same cells in the same order, and it starts none that would end past --budget-s (the
slowest repetition so far times 1.5 is the estimate); a rank still running at the budget's end is
killed. A repetition that fails (a check that does not hold, or an exception) ends its spawn (a
collective may be out of step) and the next spawn goes on with the next seed; so does a rank
that dies (SIGSEGV, glibc's "malloc(): ..." abort), reported with the cell, seed and threads in
flight, its exit code and its last words (support/spawns.py's last_words: a sanitizer's report
whole, glibc's message, faulthandler's stack of the thread that faulted, the stderr's last lines).
The summary ends with the first failure in one line, where the end of a log shows it.

Knobs: --reps (the most repetitions per world), --budget-s (the wall-clock bound of the whole
run), --malloc-perturb N (glibc's MALLOC_PERTURB_: freed and new blocks are filled with bytes
N / ~N, so a stale read sees garbage and a stale write is more likely to break a chunk header),
--threads (torch's thread count per repetition, cycled; FusedAdam's step takes torch's count),
--jitter-ms (random sleeps at the hand-offs between the autograd thread and the optimizer's
threads: [Note: jitter at the hand-offs] in megatron_fsdp_c/_jitter.py), --malloc-check (glibc's
checking malloc in the ranks, libc_malloc_debug.so with glibc.malloc.check=3: every block gets a
check byte past its end, tested when it is freed, so a small overflow aborts at the free of the
block it ran past, with faulthandler's stacks, not at a later allocation elsewhere).

It prints `failures/runs` per world and in all, and the first failure's cell and seed, and
appends the summary line to --log (benchmarks/results/stress.log), which is committed: counts
add up across sessions.

Cells: the suspect cells of [the memory-safety issue] -- ZeRO-2 and ZeRO-3 stepping inside the
backward (FusedAdamW(step_in_backward=True)), with and without CPU offload, both APIs, and the
cells of tests/test_backward_step.py around the first fault (ZeRO-1 and Megatron ZeRO-1 stepping
after the backward, HSDP at world 4): each is tests/test_backward_step.py's against_ddp, float64
against DDP and bit for bit against stepping after the backward. Any cell of the pytest grids can
be added as module::key (its registered function; a recording cell's checks are checked).
"""
from __future__ import annotations

import argparse
import ast
import ctypes
import datetime
import faulthandler
import gc
import importlib
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

# name -> (tests/test_backward_step.py's against_ddp keyword arguments, worlds)
SUSPECT = {
    "megatron[2]": (dict(api="megatron", strategy=2, offload=False), (2, 4)),
    "megatron[2, offload]": (dict(api="megatron", strategy=2, offload=True), (2, 4)),
    "megatron[3]": (dict(api="megatron", strategy=3, offload=False), (2, 4)),
    "megatron[3, offload]": (dict(api="megatron", strategy=3, offload=True), (2, 4)),
    "megatron[1, after]": (dict(api="megatron", strategy=1, offload=True, in_backward=False), (2,)),
    "per_module[zero2]": (dict(api="per_module", strategy="optim_grads", offload=False), (2, 4)),
    "per_module[zero2, offload]": (dict(api="per_module", strategy="optim_grads", offload=True), (2, 4)),
    "per_module[zero3]": (dict(api="per_module", strategy="optim_grads_params", offload=False), (2, 4)),
    "per_module[zero3, offload]": (dict(api="per_module", strategy="optim_grads_params", offload=True), (2, 4)),
    "per_module[zero1, after]": (dict(api="per_module", strategy="optim", offload=True, in_backward=False), (2,)),
    "per_module[hsdp, after]": (dict(api="per_module", strategy="optim_grads_params", offload=True,
                                     in_backward=False, hsdp=True), (4,)),
}
GROUP_TIMEOUT_S = 120.0
M_PERTURB = -6  # glibc's mallopt parameter (malloc.h)


def _cell_fn(name):
    """(fn(rank, world) -> list of failure texts) for a cell name."""
    from support.checks import Checks, failures_of

    if name in SUSPECT:
        import test_backward_step

        kwargs = SUSPECT[name][0]

        def run(rank, world):
            ck = Checks()
            test_backward_step.against_ddp(rank, world, ck, **kwargs)
            return failures_of(ck.items)
        return run
    spec = _registered(name)

    def run_registered(rank, world):
        value = spec.fn(rank, world, *spec.args, **spec.kwargs)
        recorded = isinstance(value, list) and all(isinstance(v, tuple) and len(v) == 6 for v in value)
        return failures_of(value) if recorded else []
    return run_registered


def _worlds_of(name):
    if name in SUSPECT:
        return SUSPECT[name][1]
    return _registered(name).worlds


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def _chunk_of(name: str, world: int) -> list:
    """The cells of make test's spawn that runs cell `name` (module::key) at `world` ranks, in that
    spawn's order, each as module::key: the suite collected as make test collects it, the cell's
    slot cut into chunks as its spawns are (spawns.chunks_of). A crash's neighbours, replayed."""
    import contextlib
    import io

    import pytest
    from support import rank_grid, spawns

    target = (name.partition("::")[0], _registered(name).key, world)
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), str(ROOT / "tests")])
    slot = rank_grid._slot(target)
    cells = rank_grid._order([c for c in rank_grid._selected() if rank_grid._slot(c) == slot])
    for chunk in spawns.chunks_of(cells):
        if target in chunk:
            # a cell reading what a spawn of another world wrote (a checkpoint to reshard) cannot run here
            alone = [c for c in chunk if any(rank_grid._slot(need) != slot for need in rank_grid.spec_of(c).needs)]
            if alone:
                print(f"--chunk-of: left out {len(alone)} cell(s) that read another spawn's files: "
                      f"{', '.join(str(c[:2]) for c in alone)}", flush=True)
            return [f"{m}::{k}" if isinstance(k, str) else f"{m}::{k!r}" for m, k, _ in chunk if (m, k, _) not in alone]
    raise SystemExit(f"--chunk-of: {name} runs in no spawn of world {world} in make test")


def _registered(name):
    """The spec of a pytest grid's cell named module::key; a key that is not a registered string is
    read as a Python literal (test_hybrid's keys are tuples: "test_hybrid::('per-module', (2, 2), 1, 3,
    'set_requires_all_reduce')")."""
    module, _, key = name.partition("::")
    importlib.import_module(module)
    from support import rank_grid

    keys = rank_grid.Cells(module).keys()
    if key not in keys:
        key = ast.literal_eval(key)
    if key not in keys:
        raise SystemExit(f"no cell {key!r} in {module}; its keys: {keys}")
    return rank_grid.spec_of((module, key, 0))


def _rank_main(rank, world, cells, plan, out_dir):
    """One spawn's ranks: repetitions until rank 0 says stop; returns rank 0's records."""
    import torch
    import torch.distributed as dist

    from megatron_fsdp_c import _jitter

    err = open(os.path.join(out_dir, f"stderr.{rank}"), "a")
    os.dup2(err.fileno(), 2)  # glibc's and gloo's last words go to fd 2
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    from megatron_fsdp_c import _C
    _C.native_fault_trace()  # a fault in a C/C++ thread names its frames (csrc/python/fault_trace.c)
    if plan["perturb"]:
        ctypes.CDLL(None).mallopt(M_PERTURB, plan["perturb"])
    pg = dist.distributed_c10d._get_default_group()
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=GROUP_TIMEOUT_S), pg)
    fns = [_cell_fn(c) for c in cells]
    slowest, runs, i = 0.0, [], 0
    while True:
        choice = torch.zeros(4, dtype=torch.int64)
        if rank == 0:
            left = plan["deadline"] - time.time()
            stop = plan["start"] + i >= plan["reps"] or left < 1.5 * slowest + 1.0
            k = plan["start"] + i
            threads = plan["threads"][(k // len(cells)) % len(plan["threads"])]
            choice = torch.tensor([int(stop), k % len(cells), plan["seed"] + k, threads], dtype=torch.int64)
        dist.broadcast(choice, 0)
        stop, c, seed, threads = (int(v) for v in choice)
        if stop:
            return runs
        with open(os.path.join(out_dir, f"current.{rank}"), "w") as f:
            f.write(f"{cells[c]}\t{seed}\t{threads}")
        torch.set_num_threads(threads)
        _jitter.seed(seed * 8 + rank)
        torch.manual_seed(seed)
        t0 = time.time()
        try:
            failures = fns[c](rank, world)
        except Exception as e:  # noqa: BLE001 - a failure of this repetition
            failures = [f"{type(e).__name__}: {e}\n{traceback.format_exc()}"]
        gc.collect()
        seconds = time.time() - t0
        slowest = max(slowest, seconds)
        flag = torch.tensor([1 if failures else 0], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        record = (cells[c], seed, threads, seconds, "\n".join(failures)[:4000])
        runs.append(record)
        with open(os.path.join(out_dir, f"runs.{rank}"), "a") as f:
            f.write(repr(record) + "\n")
        i += 1
        if int(flag):  # some rank failed: end the spawn (its collectives may be out of step)
            return runs


def _run_world(world, cells, args, deadline):
    """(runs, failures, first failure text or '') of --world ranks until --reps or the deadline."""
    from megatron_fsdp_c.testing import run_on_ranks
    from support import spawns

    runs, failures, first = 0, 0, ""
    while runs < args.reps and time.time() + 5 < deadline:
        with tempfile.TemporaryDirectory(prefix="mfsdp_stress_") as out_dir:
            plan = dict(start=runs, reps=args.reps, seed=args.seed, threads=args.threads, perturb=args.malloc_perturb,
                        deadline=deadline)
            outcomes = run_on_ranks(_rank_main, world, cells, plan, out_dir, raise_errors=False,
                                    timeout_s=max(5.0, deadline - time.time()))
            records = []
            try:
                with open(os.path.join(out_dir, "runs.0")) as f:
                    records = [eval(line) for line in f]  # noqa: S307 - our own reprs of tuples
            except OSError:
                pass
            runs += len(records)
            bad = [r for r in records if r[4]]
            failures += len(bad)
            if bad and not first:
                name, seed, threads, seconds, what = bad[0]
                first = f"world {world}: cell {name!r} seed {seed} threads {threads}: {what}"
            dead = [(r, o) for r, o in enumerate(outcomes) if o[0] != "ok"]
            if dead:
                inflight = []
                for r in range(world):
                    try:
                        inflight.append(open(os.path.join(out_dir, f"current.{r}")).read().split("\t"))
                    except OSError:
                        inflight.append(None)
                where = next((x for x in inflight if x), ["(before the first repetition)", "-", "-"])
                died = [r for r, o in dead if o[0] == "dead"]
                runs += 1
                failures += 1
                if not first:
                    first = (f"world {world}: cell {where[0]!r} seed {where[1]} threads {where[2]}: rank(s) {died} died "
                             f"(exit codes {[o[1] for _, o in dead if o[0] == 'dead']}); errors: "
                             + "; ".join(str(o[1])[:1500] for _, o in dead if o[0] == "error")
                             + "".join(f"\n-- stderr of rank {r}:\n{spawns.last_words(os.path.join(out_dir, f'stderr.{r}'), 4000)}"
                                       for r in died))
                print(f"  world {world}: a spawn ended by a dead or failed rank at {where}", flush=True)
            elif not records:
                break  # no time left for one repetition
            print(f"  world {world}: {failures}/{runs} so far, {deadline - time.time():.0f} s left", flush=True)
    return runs, failures, first


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--cells", action="append", help="a cell name (default: every suspect cell of the world)")
    ap.add_argument("--chunk-of", help="a cell (module::key): every cell of make test's spawn holding it, in its order")
    ap.add_argument("--reps", type=int, default=1000, help="the most repetitions per world")
    ap.add_argument("--budget-s", type=float, default=600.0, help="the wall-clock bound of the whole run")
    ap.add_argument("--malloc-perturb", type=int, default=0, help="glibc's MALLOC_PERTURB_ byte (0: off)")
    ap.add_argument("--malloc-check", action="store_true", help="glibc's checking malloc in the ranks")
    ap.add_argument("--threads", default="1", help="torch thread counts, cycled: 1,2,4")
    ap.add_argument("--jitter-ms", type=float, default=0.0, help="the most sleep at each hand-off (0: none)")
    ap.add_argument("--seed", type=int, default=0, help="the first repetition's seed")
    ap.add_argument("--log", default=str(HERE / "results" / "stress.log"), help="where the summary line is appended")
    args = ap.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    if not all(1 <= t <= 64 for t in args.threads):
        ap.error("--threads: counts from 1 to 64")
    if not 0 <= args.malloc_perturb <= 255:
        ap.error("--malloc-perturb: a byte, 0-255")
    # before the ranks' forkserver starts: it reads both at its start (and each rank sets M_PERTURB too)
    if args.jitter_ms:
        os.environ["MFSDP_TEST_JITTER_MS"] = str(args.jitter_ms)
    if args.malloc_perturb:
        os.environ["MALLOC_PERTURB_"] = str(args.malloc_perturb)
    if args.malloc_check:
        if os.environ.get("MFSDP_SANITIZE"):
            ap.error("--malloc-check: not under a sanitizer (ASan replaces malloc)")
        lib = subprocess.run(["gcc", "-print-file-name=libc_malloc_debug.so.0"], capture_output=True,
                             text=True).stdout.strip()
        if not os.path.isabs(lib):
            lib = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"
        if not os.path.exists(lib):
            ap.error(f"--malloc-check: glibc's libc_malloc_debug.so.0 not found ({lib}; glibc 2.34+)")
        os.environ["LD_PRELOAD"] = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), lib]))
        os.environ["GLIBC_TUNABLES"] = "glibc.malloc.check=3"
    t0 = time.time()
    deadline = t0 + args.budget_s
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip() or "?"
    if args.chunk_of:  # (the collection's session ends with it: before the harness's own session below)
        chosen = {world: _chunk_of(args.chunk_of, world) for world in args.world}
        for world, cells in chosen.items():
            print(f"world {world}: the chunk of make test's spawn with {args.chunk_of}: {len(cells)} cells", flush=True)
    else:
        chosen = {world: [c for c in (args.cells or list(SUSPECT)) if world in _worlds_of(c)] for world in args.world}
    from support import rank_grid, spawns

    rank_grid.session_dir()  # before the ranks start: the directory the grid cells share (checkpoints)
    total_runs = total_failures = 0
    first, parts = "", []
    for n, world in enumerate(args.world):
        cells = chosen[world]
        if not cells:
            print(f"world {world}: no selected cell runs at this world size", flush=True)
            continue
        # the worlds share what is left of the budget
        share = deadline if n == len(args.world) - 1 else time.time() + (deadline - time.time()) / (len(args.world) - n)
        print(f"world {world}: {len(cells)} cells, until {time.strftime('%H:%M:%S', time.localtime(share))}", flush=True)
        runs, failures, why = _run_world(world, cells, args, share)
        total_runs += runs
        total_failures += failures
        first = first or why
        parts.append(f"world {world} {failures}/{runs}")
    rank_grid.end_session()
    seconds = time.time() - t0
    what = (f"make test's spawn chunk with {args.chunk_of}" if args.chunk_of
            else ','.join(args.cells) if args.cells else 'suspect')
    line = (f"{time.strftime('%Y-%m-%d %H:%M')} {commit} failures/runs = {total_failures}/{total_runs} "
            f"({', '.join(parts)}) in {seconds:.0f} s; cells {what}, "
            f"threads {','.join(map(str, args.threads))}, malloc_perturb {args.malloc_perturb}, "
            f"jitter_ms {args.jitter_ms:g}, seed {args.seed}, reps {args.reps}, budget {args.budget_s:.0f} s, "
            f"torch {_torch_version()}"
            + (f", sanitizer {os.environ['MFSDP_SANITIZE']}" if os.environ.get("MFSDP_SANITIZE") else "")
            + (", malloc_check" if args.malloc_check else ""))
    print(line)
    if first:
        print("first failure: " + first)
        # and its gist last, where a log's tail shows it (CI prints the end of make asan's)
        gist = [ln.strip() for ln in first.splitlines()
                if ln.startswith(("SUMMARY: ", "Fatal Python error: ")) or spawns.SANITIZER_REPORT.search(ln)]
        print("first failure, in short: " + " | ".join([first.splitlines()[0][:300]] + gist[:3]))
    if args.log:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        with open(args.log, "a") as f:
            f.write(line + (f"\n    first failure: {first.splitlines()[0][:300]}" if first else "") + "\n")
    sys.exit(1 if total_failures else 0)


if __name__ == "__main__":
    main()
