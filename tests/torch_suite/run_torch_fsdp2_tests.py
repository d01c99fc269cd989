"""Runs torch's own FSDP2 test files against torch's fully_shard or ours, one test per subprocess.

    python tests/torch_suite/run_torch_fsdp2_tests.py --impl torch --impl ours \
        [--tests-dir /work/torch_fsdp2_tests] [--files frozen,training] [-k REGEX] \
        [--timeout 300] [--devices 2] [--out results.json] [--log-dir DIR]

The test files (test/distributed/_composable/fsdp/test_fully_shard_*.py of the pytorch
repository, matching the installed torch) are not part of this repository: point --tests-dir at
a copy. The harness never edits them. Every Python process of a run starts with
tests/torch_suite/_site/sitecustomize.py, which emulates an N-device machine on the CPU and, for
--impl ours, swaps megatron_fsdp_c.per_module's fully_shard, FSDPModule and UnshardHandle in for
torch's ([Note: torch-suite set-up] there says exactly what is patched).

Per file, the harness lists the test ids (unittest's loader, after the file's own parametrisation)
in one subprocess, then runs each id in its own subprocess with a timeout, so a hang costs one
timeout and the table still comes out. --batch first runs a file's tests in one subprocess per
impl (each test gets the timeout from the previous result) and keeps its passes and skips; every
other test is then run alone as above. A test is pass, fail, skip, or timeout; fail carries the
first exception line of its output (the innermost one of a rank's traceback, not the "Process N
exited" wrapper). With both impls it prints, per file, the tests
run, torch passes and ours passes, then every test's status and the failure lines, and a list of
the tests torch passes and ours does not. Whole logs go to --log-dir.

Not collected by pytest: torch's files need their own runner (MultiProcessTestCase spawns ranks
per test), take hours on two cores, and read torch internals we do not promise to mimic (see
TRIAGE.md next to this file for the triage of a run).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SITE_DIR = Path(__file__).resolve().parent / "_site"
REPO_ROOT = Path(__file__).resolve().parents[2]

# Lists a test file's test ids (--list) or runs some (one result line each, as each ends). Runs
# under the same sitecustomize as the tests, so ids are those the file declares once parametrised
# (instantiate_*_tests run at import). The file is imported, not run as __main__, so its
# run_tests() does not take over; the ranks are forked from this process (see sitecustomize).
DRIVER = r"""
import importlib.util, json, sys, time, traceback, unittest
path, args = sys.argv[1], sys.argv[2:]
spec = importlib.util.spec_from_file_location("torch_suite_tests", path)
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
loader = unittest.TestLoader()
def walk(suite):
    for item in suite:
        if isinstance(item, unittest.TestSuite):
            yield from walk(item)
        else:
            yield item
if args == ["--list"]:
    ids = [type(c).__name__ + "." + c._testMethodName for c in walk(loader.loadTestsFromModule(module))
           if type(c).__module__ == spec.name]  # not base classes the file imported
    print("TORCH_SUITE_IDS " + json.dumps(ids), flush=True)
    sys.exit(0)
for test_id in args:
    result = unittest.TestResult()
    start = time.monotonic()
    loader.loadTestsFromName(test_id, module).run(result)
    seconds = round(time.monotonic() - start, 1)
    if result.errors or result.failures or result.unexpectedSuccesses:
        texts = [t for _, t in result.errors + result.failures] or ["unexpected success"]
        out = {"status": "fail", "text": "\n".join(texts)}
    elif result.skipped:
        out = {"status": "skip", "text": result.skipped[0][1]}
    else:
        out = {"status": "pass", "text": "expected failure" if result.expectedFailures else ""}
    print("TORCH_SUITE_RESULT " + json.dumps({"id": test_id, "seconds": seconds, **out}), flush=True)
"""

_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Failure|Interrupt|Exit|Timeout)\b:?")
# MultiProcessTestCase's and MultiThreadedTestCase's wrappers around a rank's own exception.
_WRAPPER = re.compile(r"(Process|Thread) \d+ (exited|timed out)|Caught exception:|subprocess.CalledProcessError")


def first_failure_line(output: str) -> str:
    """The innermost exception line of the first traceback in `output` that is not
    MultiProcessTestCase's wrapper around a rank's error."""
    lines = output.splitlines()
    candidates = []
    for i, line in enumerate(lines):
        if _EXC_LINE.match(line) and i > 0 and (lines[i - 1].startswith(" ") or lines[i - 1] == ""):
            candidates.append(line.strip())
    for line in candidates:
        if not _WRAPPER.search(line):
            return line[:300]
    return candidates[0][:300] if candidates else (lines[-1][:300] if lines else "")


def child_env(impl: str, devices: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SITE_DIR), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["MFSDP_TORCH_SUITE_IMPL"] = impl
    env["MFSDP_TORCH_SUITE_DEVICES"] = str(devices)
    # One thread per rank: several ranks share the two cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def collect(path: Path, devices: int, timeout: float) -> tuple[list[str], str]:
    try:
        proc = subprocess.run([sys.executable, "-c", DRIVER, str(path), "--list"], env=child_env("torch", devices),
                              capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return [], f"listing the tests took over {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith("TORCH_SUITE_IDS "):
            return json.loads(line[len("TORCH_SUITE_IDS "):]), ""
    return [], first_failure_line(proc.stderr + proc.stdout) or f"collection exited {proc.returncode}"


def run_ids(path: Path, ids: list[str], impl: str, devices: int, timeout: float,
            log_dir: Path | None) -> dict:
    """Runs `ids` in one subprocess; returns the results it printed before ending, or before a
    test ran `timeout` seconds without a result (the subprocess is then killed)."""
    start = time.monotonic()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as cwd:
        # A new session: a timeout ends the test's rank processes too, not only the test process.
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(path), *ids], env=child_env(impl, devices),
                                cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        progress = [time.monotonic()]  # when the last result (or the start) was seen

        def read():
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("TORCH_SUITE_RESULT "):
                    progress[0] = time.monotonic()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            # Each test gets `timeout` from the previous result: one hang in a batch costs one timeout.
            while reader.is_alive():
                reader.join(1.0)
                if time.monotonic() - progress[0] > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
            reader.join()
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)  # interrupted: leave no rank process behind
            raise
    output = "".join(lines)
    seconds = round(time.monotonic() - start, 1)
    if log_dir is not None:
        log = log_dir / impl / (f"{path.stem}.{ids[0]}.log" if len(ids) == 1 else f"{path.stem}.batch.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(output)
    results = {}
    for line in output.splitlines():
        if line.startswith("TORCH_SUITE_RESULT "):
            r = json.loads(line[len("TORCH_SUITE_RESULT "):])
            reason = first_failure_line(r["text"]) if r["status"] == "fail" else r["text"][:200]
            results[r["id"]] = {"status": r["status"], "reason": reason, "seconds": r["seconds"]}
    if len(ids) == 1 and ids[0] not in results:
        if time.monotonic() - start >= timeout:
            results[ids[0]] = {"status": "timeout", "reason": f"no result in {timeout:.0f} s", "seconds": seconds}
        else:
            results[ids[0]] = {"status": "fail", "reason": "exited without a result: " + first_failure_line(output),
                               "seconds": seconds}
    return results


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests-dir", default="/work/torch_fsdp2_tests", type=Path)
    ap.add_argument("--impl", action="append", choices=["torch", "ours"],
                    help="run with torch's fully_shard, ours, or both (repeat the flag); default both")
    ap.add_argument("--files", default="", help="comma-separated substrings of file names (default: every test_fully_shard_*.py)")
    ap.add_argument("-k", dest="pattern", default="", help="regex over 'file::Class.test' ids")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test (default 300)")
    ap.add_argument("--devices", type=int, default=2, help="emulated accelerators: world sizes follow from it (default 2)")
    ap.add_argument("--batch", action="store_true",
                    help="run a file's tests in one process per impl (each test gets --timeout from the previous result); a test "
                         "left without a result by a hang or crash is rerun alone")
    ap.add_argument("--out", type=Path, help="write every result as JSON here")
    ap.add_argument("--log-dir", type=Path, help="keep each test's output here, as IMPL/FILE.Class.test.log")
    args = ap.parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C, so the running test's process group is ended too.
    signal.signal(signal.SIGTERM, _interrupt)
    impls = args.impl or ["torch", "ours"]
    files = sorted(args.tests_dir.glob("test_fully_shard_*.py"))
    if args.files:
        wanted = [w for w in args.files.split(",") if w]
        files = [f for f in files if any(w in f.name for w in wanted)]
    if not files:
        print(f"no test_fully_shard_*.py files in {args.tests_dir} (matching {args.files!r})", file=sys.stderr)
        return 2
    try:  # torch's test utilities import it; without it every test would fail alike, at import
        import expecttest  # noqa: F401
    except ImportError:
        print("torch's test files need the expecttest package: pip install expecttest", file=sys.stderr)
        return 2
    pattern = re.compile(args.pattern) if args.pattern else None

    results: dict = {}  # file -> test id -> impl -> result
    for path in files:
        # Ids come from the torch run: the swap changes no test's name.
        ids, error = collect(path, args.devices, args.timeout)
        per_file = results.setdefault(path.name, {})
        if error:
            for impl in impls:
                per_file.setdefault("<collection>", {})[impl] = {"status": "fail", "reason": error, "seconds": 0}
            print(f"{path.name}: collection failed: {error}", flush=True)
            continue
        ids = [t for t in ids if not pattern or pattern.search(f"{path.name}::{t}")]
        for impl in impls:
            done = {}
            if args.batch and ids:
                # One process for the file. Threaded tests share that process (and module state
                # such as cached meshes), so only its passes stand: every other outcome, and a test
                # a hang or crash left without a result, is decided by running the test alone.
                done = run_ids(path, ids, impl, args.devices, args.timeout, args.log_dir)
                done = {t: r for t, r in done.items() if r["status"] in ("pass", "skip")}
            for test_id in ids:
                r = done.get(test_id) or run_ids(path, [test_id], impl, args.devices, args.timeout,
                                                 args.log_dir)[test_id]
                per_file.setdefault(test_id, {})[impl] = r
                print(f"{path.name}::{test_id} [{impl}] {r['status']} {r['seconds']}s {r['reason']}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    print()
    print_tables(results, impls)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


def print_tables(results: dict, impls: list[str]) -> None:
    print("| file | tests run | " + " | ".join(f"{i} pass" for i in impls) + " |")
    print("|---|---|" + "---|" * len(impls))
    totals = [0] * (1 + len(impls))
    for name, tests in results.items():
        # "Run": not skipped by every impl.
        run = [t for t, r in tests.items() if any(r[i]["status"] != "skip" for i in impls if i in r)]
        passes = [sum(1 for t in run if tests[t].get(i, {}).get("status") == "pass") for i in impls]
        totals = [a + b for a, b in zip(totals, [len(run)] + passes)]
        print(f"| {name} | {len(run)} | " + " | ".join(str(p) for p in passes) + " |")
    print("| total | " + " | ".join(str(t) for t in totals) + " |")
    print()
    for name, tests in results.items():
        for test_id, r in tests.items():
            cells = "  ".join(f"{i}={r[i]['status']}" for i in impls if i in r)
            print(f"{name}::{test_id}  {cells}")
            for i in impls:
                if i in r and r[i]["status"] in ("fail", "timeout"):
                    print(f"    [{i}] {r[i]['reason']}")
    if set(impls) == {"torch", "ours"}:
        print()
        print("torch passes, ours does not:")
        for name, tests in results.items():
            for test_id, r in tests.items():
                if r.get("torch", {}).get("status") == "pass" and r.get("ours", {}).get("status") != "pass":
                    print(f"  {name}::{test_id}  [{r['ours']['status']}] {r['ours']['reason']}")


if __name__ == "__main__":
    sys.exit(main())
