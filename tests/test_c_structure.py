"""The C engine's shape, checked from its objects: every C file of csrc/core, csrc/comm, csrc/cuda
and csrc/python is compiled alone (gcc -c -O0, the .cu files through the emulator's translation,
csrc/tests/emu/host_kernels.py, with g++), and `nm` says which global symbols each defines and
which it needs. A file that needs a symbol another defines calls down to it; those calls must
form a stack, not a circle (no file reaches itself through the files it calls), never go up a
layer (core, comm, cuda, python), and follow the maps at the top of pipeline.c, kernels.cu and
nccl_transport.c, which list their files from the floor up. No C file of those four folders
grows past MAX_LINES.

`python tests/test_c_structure.py` prints the files from the floor up. Skipped without gcc or nm;
without g++ the .cu files are left out, without Python.h csrc/python is. About 6 s of compiler
time (3.5 of it the .cu files' templates), spread over the cores."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
LAYERS = ("core", "comm", "cuda", "python")  # floor to roof: a file calls its own layer or those below
# A ceiling, not a target (as tests/test_structure.py's): past it, a smell to look at. The Engine
# type (csrc/python/engine.c, ~720 lines) is one room under it: one method per pipeline entry point
# with its argument parsing and GIL handling ([Note: engine calls]), bound by one method table.
MAX_LINES = 1000
# Files allowed over MAX_LINES, each with the reason it is one room. Empty: keep it so.
LONG_FILES_ALLOWED = {}
# Maps that list their files from the floor up: each file calls only files listed before it.
MAPS = ("comm/pipeline.c", "cuda/kernels.cu", "cuda/nccl_transport.c")

GCC, GXX, NM = shutil.which("gcc"), shutil.which("g++"), shutil.which("nm")
PY_INCLUDE = Path(sysconfig.get_paths()["include"])
HAS_PYTHON_H = (PY_INCLUDE / "Python.h").exists()
C_FLAGS = ["-std=c11", "-O0", "-g0", "-w", "-D_POSIX_C_SOURCE=200809L"]
# The CUDA half against the emulated runtime and NCCL (csrc/tests/emu): their calls are the same.
CUDA_FLAGS = ["-DMFSDP_WITH_CUDA", f"-I{CSRC / 'tests/emu'}", f"-I{CSRC / 'cuda'}"]
DEFINED = set("TDBRCGS")  # strong definitions; weak ones (W, V: C++ inline functions) belong to no file

pytestmark = pytest.mark.skipif(GCC is None or NM is None, reason="the C structure check needs gcc and nm")


def sources():
    """The C files checked, as paths relative to the repository."""
    files = []
    for layer in LAYERS:
        if layer == "python" and not HAS_PYTHON_H:
            continue
        files += sorted((CSRC / layer).glob("*.c"))
        if layer == "cuda" and GXX:
            files += sorted((CSRC / layer).glob("*.cu"))
    return [f.relative_to(ROOT) for f in files]


def _host_kernels():
    spec = importlib.util.spec_from_file_location("host_kernels", CSRC / "tests/emu/host_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_one(src: Path, out_dir: Path) -> Path:
    """src (relative to the repository) compiled alone into out_dir; an error fails with its text."""
    obj = out_dir / (str(src).replace("/", "_") + ".o")
    path = ROOT / src
    if path.suffix == ".cu":
        cpp = obj.with_suffix(".cpp")
        cpp.write_text(f'#line 1 "{src}"\n' + _host_kernels().rewrite(path.read_text()))
        cmd = [GXX, "-std=c++17", "-O0", "-g0", "-w", *CUDA_FLAGS, "-c", str(cpp), "-o", str(obj)]
    else:
        cmd = [GCC, *C_FLAGS, "-c", str(path), "-o", str(obj)]
        if src.parts[1] in ("cuda", "python"):
            cmd += CUDA_FLAGS
        if src.parts[1] == "python":
            cmd += [f"-I{PY_INCLUDE}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"{src} does not compile alone:\n{' '.join(cmd)}\n{done.stderr}"
    return obj


def symbols(obj: Path):
    """(defined, needed): the object's global symbols, by `nm -P`."""
    out = subprocess.run([NM, "-P", str(obj)], capture_output=True, text=True, check=True).stdout
    defined, needed = set(), set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 2:
            if fields[1] == "U":
                needed.add(fields[0])
            elif fields[1] in DEFINED:
                defined.add(fields[0])
    return defined, needed


def call_graph(objects: dict) -> dict:
    """{file: sorted files it calls}, from {file: object}: A calls B when A needs a symbol B
    defines (both, when two files define it: cuda_absent.c stands in for kernels.cu)."""
    table = {f: symbols(o) for f, o in objects.items()}
    where = {}
    for f, (defined, _) in table.items():
        for s in defined:
            where.setdefault(s, set()).add(f)
    return {f: sorted({g for s in needed for g in where.get(s, ()) if g != f}) for f, (_, needed) in table.items()}


def cycle(graph):
    """One call circle as a list of files, or None."""
    state, stack = {}, []

    def visit(f):
        state[f] = "open"
        stack.append(f)
        for g in graph.get(f, ()):
            if state.get(g) == "open":
                return stack[stack.index(g):] + [g]
            if g not in state:
                found = visit(g)
                if found:
                    return found
        stack.pop()
        state[f] = "done"
        return None

    for f in sorted(graph):
        if f not in state:
            found = visit(f)
            if found:
                return found
    return None


def floor_up(graph):
    """The files, each after every file it calls (ties by layer, then name)."""
    order, placed = [], set()
    rank = {f: (LAYERS.index(Path(f).parts[1]), f) for f in graph}
    while len(order) < len(graph):
        ready = sorted((f for f in graph if f not in placed and set(graph[f]) <= placed), key=rank.get)
        if not ready:
            raise AssertionError(f"call circle: {' -> '.join(cycle(graph))}")
        order.append(ready[0])
        placed.add(ready[0])
    return order


def build_graph(files, out_dir: Path) -> dict:
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        objects = dict(zip(map(str, files), pool.map(lambda f: compile_one(f, out_dir), files)))
    return call_graph(objects)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    return build_graph(sources(), tmp_path_factory.mktemp("c_objects"))


def test_the_graph_sees_calls(graph):
    """The objects were read (a pass below means something): calls known to cross files are there."""
    assert "csrc/core/status.c" in graph["csrc/comm/pipeline.c"]
    assert "csrc/comm/guards.c" in graph["csrc/comm/reduce.c"]
    assert "csrc/core/kernels_cpu.c" in graph["csrc/core/cpu_table.c"]
    assert "csrc/cuda/nccl_watch.c" in graph["csrc/cuda/nccl_collectives.c"]
    if GXX:
        assert "csrc/cuda/kernels_cast.cu" in graph["csrc/cuda/kernels.cu"]


def test_no_call_circle(graph):
    found = cycle(graph)
    assert found is None, "C files call each other in a circle (move what both need to a floor file): " + \
                          " -> ".join(found)


def test_the_checker_sees_circles(tmp_path):
    """Two files planted to call each other are found, through the same compile and nm."""
    for name, calls, own in (("a.c", "b", "a"), ("b.c", "a", "b")):
        (tmp_path / name).write_text(f"int {calls}(int);\nint {own}(int x) {{ return x ? {calls}(x - 1) : 0; }}\n")
    objects = {}
    for name in ("a.c", "b.c"):
        obj = tmp_path / (name + ".o")
        subprocess.run([GCC, *C_FLAGS, "-c", str(tmp_path / name), "-o", str(obj)], check=True)
        objects[name] = obj
    planted = call_graph(objects)
    assert planted == {"a.c": ["b.c"], "b.c": ["a.c"]}
    assert cycle(planted) is not None
    assert cycle({"a.c": ["b.c"], "b.c": []}) is None


def test_no_call_up_a_layer(graph):
    up = [f"{f} -> {g}" for f, calls in graph.items() for g in calls
          if LAYERS.index(Path(g).parts[1]) > LAYERS.index(Path(f).parts[1])]
    assert not up, f"calls up a layer ({' < '.join(LAYERS)}):\n" + "\n".join(up)


def file_map(path: Path):
    """The files a map at the top of `path` lists, in its order (` *   name.c   what it does`)."""
    head = path.read_text().split("*/", 1)[0]
    return [m.group(1) for m in re.finditer(r"^ \*   (\w+\.(?:c|cu)) ", head, re.M)]


@pytest.mark.parametrize("map_file", MAPS)
def test_maps_read_floor_up(graph, map_file):
    if map_file.endswith(".cu") and not GXX:
        pytest.skip("the .cu files are compiled with g++, which is missing")
    folder = (CSRC / map_file).parent
    listed = file_map(CSRC / map_file)
    on_disk = {p.name for p in folder.iterdir() if p.suffix in (".c", ".cu")} & {Path(f).name for f in graph}
    prefix = Path(map_file).stem.split("_")[0]  # the map of nccl_transport.c covers nccl_*.c only
    if map_file.startswith("cuda/"):
        on_disk = {n for n in on_disk if n.startswith(prefix)}
    assert set(listed) == on_disk, f"{map_file}'s map lists {sorted(listed)}, the folder has {sorted(on_disk)}"
    rel = lambda name: str((folder / name).relative_to(ROOT))  # noqa: E731
    late = [f"{a} calls {b}, listed after it" for i, a in enumerate(listed)
            for b in listed[i + 1:] if rel(b) in graph.get(rel(a), ())]
    assert not late, f"{map_file}'s map is not floor to roof:\n" + "\n".join(late)


def test_no_long_files():
    for path in LONG_FILES_ALLOWED:
        assert (ROOT / path).exists(), f"{path} is allowed to be long but no longer exists: drop it"
    files = [p for layer in LAYERS for p in sorted((CSRC / layer).iterdir())
             if p.suffix in (".c", ".h", ".cu", ".cuh")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    long = {p: n for p, n in long.items() if p not in LONG_FILES_ALLOWED}
    assert not long, f"C files over {MAX_LINES} lines (split them by concern): {long}"


if __name__ == "__main__":
    if GCC is None or NM is None:
        sys.exit("needs gcc and nm")
    with tempfile.TemporaryDirectory() as tmp:
        g = build_graph(sources(), Path(tmp))
    for f in floor_up(g):
        print(f"{f:36} calls {', '.join(g[f]) or '-'}")
