"""setup.py under an old setuptools ([Note: the build reads either setuptools]): a wheel's build
stops at once naming the way out, and a command that builds no wheel (the GPU check's
`build_ext --inplace`) runs. Uses the interpreter this venv was made from, as a plain venv of it
would start (Python 3.11's: setuptools 65, no `wheel`); skipped where that one has neither."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE = getattr(sys, "_base_executable", sys.executable)


def _old_setuptools_without_wheel() -> bool:
    probe = ("import re, setuptools, importlib.util as u; "
             "v = tuple(int(x) for x in re.findall(r'\\d+', setuptools.__version__)[:2]); "
             "print(v < (70, 1) and u.find_spec('wheel') is None)")
    r = subprocess.run([BASE, "-c", probe], capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() == "True"


@pytest.mark.skipif(not _old_setuptools_without_wheel(), reason=f"{BASE} has no setuptools below 70.1 without wheel")
def test_old_setuptools_stops_wheel_builds_only():
    env = dict(os.environ, MFSDP_CUDA="0")  # (the CUDA probe needs torch, which the base interpreter lacks)
    for command in (["dist_info"], ["bdist_wheel"], ["editable_wheel"]):  # pip's steps, editable or not
        r = subprocess.run([BASE, "setup.py", *command], cwd=ROOT, capture_output=True, text=True, env=env)
        assert r.returncode != 0 and "cannot build a wheel (it needs the `wheel` package below 70.1)" in r.stderr, \
            (command, r.returncode, r.stderr[-2000:])
    r = subprocess.run([BASE, "setup.py", "-q", "--name"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "megatron-fsdp-c", (r.returncode, r.stdout, r.stderr[-2000:])
