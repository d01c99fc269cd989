"""Build of megatron_fsdp_c._C: a pure-C CPython extension (no pybind, no C++).

Which build (docs/setup.md, "Installing, and building on a CUDA machine"):
  MFSDP_CUDA=auto (default): CUDA when the installed torch is a CUDA build (then a failing CUDA
      build is an error, with the reason), CPU-only when torch is CPU-only.
  MFSDP_CUDA=1: CUDA, or an error; MFSDP_CUDA=0: CPU-only.
Where from: nvcc from PATH, CUDA_HOME, CUDA_PATH or /usr/local/cuda (Debian's /usr/bin/nvcc with
/usr/include and /usr/lib/x86_64-linux-gnu too); NCCL from the library torch itself loads, else
NCCL_HOME, the nvidia-nccl wheel, the toolkit or the system. MFSDP_CUDA_ARCH: the GPU
architecture (default 90, H100).

What must hold (checked here): torch must be importable (pip install --no-build-isolation),
nvcc's CUDA major is torch's, and nccl.h is the NCCL torch runs. The CUDA runtime is linked
statically and its symbols kept private, and libnccl.so.2 is linked by its soname with an rpath
to torch's copy: in one process there is then one libnccl, torch's, and no second libcudart.so.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()

CORE = ["csrc/core/status.c", "csrc/core/layout.c", "csrc/core/kernels_cpu.c", "csrc/core/quant_cpu.c",
        "csrc/core/cpu_table.c", "csrc/core/adam_cpu.c"]  # floor to roof: the table lists the kernels of the two before it;
# adam_cpu.c, the fused optimizer step, stands apart (the engine never calls it)
# the collective pipeline, one file per concern, floor to roof (map at the top of
# csrc/comm/pipeline.c; the Makefile's COMM_SRC lists the same files)
COMM = [f"csrc/comm/{name}.c" for name in ("guards", "geometry", "buffers", "wire", "replicas", "reduce", "weights",
                                           "backward", "trainable", "pipeline")]
GLUE = ["csrc/python/glue.c", "csrc/python/plan.c", "csrc/python/kernels.c", "csrc/python/optim.c", "csrc/python/host_heap.c",
        "csrc/python/fault_trace.c",
        "csrc/python/torch_memory.c", "csrc/python/torch_transport.c", "csrc/python/nccl_transport_type.c",
        "csrc/python/bucket_spec.c", "csrc/python/engine.c", "csrc/python/module.c"]  # floor to roof (glue.h)
# the CUDA half, floor to roof (maps at the top of csrc/cuda/kernels.cu and nccl_transport.c; the
# Makefile's CUDA_C and CUDA_CU list the same files)
CUDA_C = ["csrc/cuda/nccl_watch.c", "csrc/cuda/nccl_collectives.c", "csrc/cuda/nccl_transport.c"]  # C, by the C compiler
CUDA_CU = ["csrc/cuda/kernels_cast.cu", "csrc/cuda/kernels_quant.cu", "csrc/cuda/kernels.cu"]
CPU_ONLY = ["csrc/cuda/cuda_absent.c"]

# -fopenmp: the fused Adam step's threads are torch's OpenMP team ([Note: the step's threads] in
# csrc/core/adam_cpu.c); linked with it too, so that _C NEEDs libgomp.so.1, the soname torch ships
C_FLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing", "-fopenmp", "-Wall",
           "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]

# [Note: the sanitized build]
# MFSDP_SANITIZE=address builds _C with AddressSanitizer and UndefinedBehaviorSanitizer (-O1 -g, frame
# pointers kept, any UB report fatal): `make asan` builds it into build/asan and runs the stress
# harness and a subset of the suite with it (the Makefile says what each runtime option is for).
# Python and torch are not instrumented, so ASan sees our C code's reads and writes, and every
# malloc/free of the process (double and invalid frees in torch or gloo included).
SANITIZE = os.environ.get("MFSDP_SANITIZE", "")
if SANITIZE not in ("", "address"):
    sys.exit(f"megatron_fsdp_c: MFSDP_SANITIZE={SANITIZE!r}: the sanitized build takes 'address' (ASan + UBSan), or "
             "unset it for the ordinary build")
SANITIZE_FLAGS = (["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]
                  if SANITIZE else [])
if SANITIZE:
    C_FLAGS = [f for f in C_FLAGS if f != "-O3"] + ["-O1"] + SANITIZE_FLAGS

LIB_DIRS = ("lib64", "lib", "targets/x86_64-linux/lib")
SYSTEM_LIB = Path("/usr/lib/x86_64-linux-gnu")


class CudaBuildError(Exception):
    pass


def say(text):
    print(f"megatron_fsdp_c: {text}", file=sys.stderr)


# What the build needs to know of the torch it will run with, printed as JSON by a Python that can
# import it (this one, or under pip's build isolation the environment's own: see torch_facts).
TORCH_FACTS = r"""
import json, torch
cuda = torch.version.cuda
nccl_version = nccl_path = None
if cuda:
    try:
        v = torch.cuda.nccl.version()
        nccl_version = list(v) if isinstance(v, tuple) else [v // 10000, v % 10000 // 100, v % 100]
    except Exception:  # a torch without NCCL
        pass
    libs = set()
    with open("/proc/self/maps") as f:  # the libnccl that importing torch mapped: torch's own
        for line in f:
            fields = line.split(None, 5)  # address perms offset device inode [path]
            if len(fields) == 6 and "/libnccl" in fields[5]:
                libs.add(fields[5].strip())
    nccl_path = sorted(libs)[0] if len(libs) == 1 else None
print(json.dumps([torch.__version__, cuda, nccl_version, nccl_path]))
"""


def torch_facts():
    """(torch version, cuda version or None, torch's NCCL [major, minor, patch] or None, path of
    the libnccl torch loaded or None), or None when no torch is found.

    [Note: the build finds the user's torch]
    The CUDA build must match the torch the package will run with, and that is the torch of the
    interpreter pip builds for. Without build isolation it imports here. Under pip's isolation
    (plain `pip install .`) it is hidden: pip points PYTHONPATH at its build environment, whose
    sitecustomize drops the interpreter's site-packages. The same interpreter without those two
    variables sees them again, so the facts are read there, in a child process; pip replaces
    PYTHONPATH wholesale, so nothing of the user's is lost by dropping it."""
    env = dict(os.environ)
    tries = [env]
    if "PYTHONPATH" in env or "PYTHONNOUSERSITE" in env:
        tries.append({k: v for k, v in env.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")})
    for e in tries:
        out = subprocess.run([sys.executable, "-c", TORCH_FACTS], capture_output=True, text=True, env=e, cwd="/")
        if out.returncode == 0 and out.stdout.strip():
            version, cuda, nccl_version, nccl_path = json.loads(out.stdout.strip().splitlines()[-1])
            return version, cuda, tuple(nccl_version) if nccl_version else None, nccl_path
    return None


def find_nvcc():
    candidates = [shutil.which("nvcc")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(str(Path(os.environ[var]) / "bin/nvcc"))
    candidates += ["/usr/local/cuda/bin/nvcc", "/usr/bin/nvcc"]
    for c in candidates:
        if c and Path(c).exists():
            return c, candidates
    return None, [c for c in candidates if c]


def nvcc_version(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise CudaBuildError(f"could not read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def cuda_roots(nvcc):
    roots = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]))
    roots += [Path(nvcc).resolve().parent.parent, Path("/usr/local/cuda"), Path("/usr")]
    return roots


def first(paths, what):
    for p in paths:
        if p.exists():
            return p
    raise CudaBuildError(f"{what} not found; looked in: {', '.join(map(str, paths))}")


def nccl_header_version(header):
    text = header.read_text(errors="replace")
    parts = [re.search(rf"#define\s+NCCL_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return tuple(int(m.group(1)) for m in parts) if all(parts) else None


def nccl_wheel_dirs():
    """nvidia/nccl of the nvidia-nccl wheel, wherever torch's site-packages are."""
    dirs = []
    try:
        import nvidia.nccl as pkg
        dirs += [Path(p) for p in pkg.__path__]
    except ImportError:
        pass
    for entry in sys.path:
        d = Path(entry) / "nvidia/nccl"
        if d.is_dir() and d not in dirs:
            dirs.append(d)
    return dirs


def find_nccl(roots, torch_nccl, torch_lib):
    """(include dir, library file) of the NCCL to build against."""
    home = [Path(os.environ["NCCL_HOME"])] if os.environ.get("NCCL_HOME") else []
    if torch_lib:  # the library torch loads, and the headers that ship with it
        lib = Path(torch_lib)
        includes = [lib.parent.parent / "include"] + [h / "include" for h in home]
    else:
        libs = [h / d / "libnccl.so.2" for h in home for d in LIB_DIRS]
        libs += [w / "lib/libnccl.so.2" for w in nccl_wheel_dirs()]
        libs += [r / d / "libnccl.so.2" for r in roots for d in LIB_DIRS] + [SYSTEM_LIB / "libnccl.so.2"]
        lib = first(libs, "libnccl.so.2 (set NCCL_HOME, or pip install nvidia-nccl-cu13)")
        includes = [h / "include" for h in home] + [lib.parent.parent / "include"]
    includes += [w / "include" for w in nccl_wheel_dirs()] + [r / "include" for r in roots]
    header = first([d / "nccl.h" for d in includes], "nccl.h (set NCCL_HOME to an NCCL with include/ and lib/)")
    version = nccl_header_version(header)
    if torch_nccl and version and version[:2] != tuple(torch_nccl[:2]):
        raise CudaBuildError(
            f"{header} is NCCL {'.'.join(map(str, version))} but torch runs NCCL {'.'.join(map(str, torch_nccl))}: "
            f"build against torch's (pip install nvidia-nccl-cu13=={'.'.join(map(str, torch_nccl))} ships its "
            "headers, or set NCCL_HOME)")
    return header.parent, lib, version


def find_cuda():
    """The CUDA build's settings, or None for a CPU-only build; exits with the reason when a
    CUDA build is wanted and cannot be made."""
    want = os.environ.get("MFSDP_CUDA", "auto").lower()
    if want in ("0", "no", "off", "false"):
        return None
    forced = want in ("1", "yes", "on", "true")
    facts = torch_facts()
    nvcc, looked = find_nvcc()
    if facts is None and not forced:
        if nvcc is None:
            say("torch is not installed for this Python and there is no nvcc: building CPU-only")
            return None
        sys.exit(f"megatron_fsdp_c: nvcc is here but torch is not installed for {sys.executable}, so the CUDA build "
                 "cannot be matched to torch's CUDA and NCCL. Install torch first (pip install torch), or set "
                 "MFSDP_CUDA=0 for a CPU-only build")
    _, torch_cuda, torch_nccl, torch_lib = facts if facts else (None, None, None, None)
    if not forced and not torch_cuda:
        say("torch is a CPU build: building CPU-only (MFSDP_CUDA=1 forces a CUDA build)")
        return None
    try:
        if nvcc is None:
            raise CudaBuildError(f"nvcc not found (looked at {', '.join(looked)}; set CUDA_HOME)")
        major, minor = nvcc_version(nvcc)
        if torch_cuda and int(torch_cuda.split(".")[0]) != major:
            raise CudaBuildError(f"nvcc is CUDA {major}.{minor} but torch was built with CUDA {torch_cuda}: use the "
                                 f"CUDA {torch_cuda.split('.')[0]} toolkit (CUDA_HOME) or a torch built for "
                                 f"CUDA {major}")
        roots = cuda_roots(nvcc)
        include = first([r / "include/cuda_runtime.h" for r in roots], "cuda_runtime.h").parent
        cudart = first([r / d / "libcudart_static.a" for r in roots for d in LIB_DIRS] +
                       [SYSTEM_LIB / "libcudart_static.a"], "libcudart_static.a")
        nccl_inc, nccl_lib, nccl_version = find_nccl(roots, torch_nccl, torch_lib)
        if torch_cuda and torch_lib is None:
            raise CudaBuildError("torch is a CUDA build but no libnccl was mapped when importing it (NCCL linked "
                                 "into torch?): a second libnccl here would break both")
    except CudaBuildError as e:
        why = "was asked for (MFSDP_CUDA=1)" if forced else "is needed: torch is a CUDA build"
        sys.exit(f"megatron_fsdp_c: the CUDA build {why}, but it cannot be made: {e}. (MFSDP_CUDA=0 builds "
                 "CPU-only: no CUDA kernels or native NCCL transport)")
    say(f"CUDA build: nvcc {major}.{minor} ({nvcc}), torch CUDA {torch_cuda or '- (CPU torch)'}; static cudart "
        f"{cudart}; NCCL {'.'.join(map(str, nccl_version or ())) or '?'} headers {nccl_inc}, library {nccl_lib}"
        f"{' (the one torch loads)' if torch_lib else ''}")
    return dict(nvcc=nvcc, include=include, cudart=cudart, nccl_inc=nccl_inc, nccl_lib=nccl_lib)


def setuptools_metadata():
    """[Note: the build reads either setuptools]
    `pip install .` builds with the setuptools pyproject.toml asks for (>= 77, which reads the
    license as an SPDX expression); `--no-build-isolation` builds with the environment's own,
    which in a plain venv of Python 3.11 is 65 (PEP 639's SPDX `project.license` string is a
    configuration error there, and the table form old ones read is refused from 2027). So the
    license is dynamic and given here in the form the running setuptools reads. Below 70.1,
    setuptools builds wheels only with the `wheel` package: without it a wheel's build (pip's,
    editable or not) stops here, with the two ways out, instead of at pip's "invalid command
    'bdist_wheel'". Other commands need no wheel: `setup.py build_ext --inplace` (the GPU check's
    build) runs on any setuptools."""
    version = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    if version < (70, 1) and {"dist_info", "bdist_wheel", "editable_wheel"} & set(sys.argv[1:]):
        try:
            import wheel  # noqa: F401 - provides bdist_wheel to setuptools < 70.1
        except ImportError:
            sys.exit(f"megatron_fsdp_c: this environment's setuptools {setuptools.__version__} cannot build a wheel "
                     "(it needs the `wheel` package below 70.1). Build without --no-build-isolation (pip then "
                     "builds with a new setuptools, still against this environment's torch), or "
                     "`pip install -U setuptools` first")
    return {"license_expression": "Apache-2.0"} if version >= (77, 0) else {"license": "Apache-2.0"}


METADATA = setuptools_metadata()  # first: it may stop the build
CUDA = find_cuda()


class BuildExt(build_ext):
    """[Note: the build runs in parallel]
    nvcc compiles the .cu sources in the background while the C sources compile, several at a
    time (one per core), and the link waits for both: the extension's ~30 C files and its three
    .cu files take about as long as the slowest of them, not their sum (a GPU check's build stage
    has a budget; make test's set-up runs beside the C tests). The C compiler's own calls are
    unchanged, one file each; only their order in time is."""

    def build_extension(self, ext):
        nvcc = []
        if CUDA:
            out_dir = Path(self.build_temp) / "cuda"
            out_dir.mkdir(parents=True, exist_ok=True)
            arch = os.environ.get("MFSDP_CUDA_ARCH", "90")
            for src in CUDA_CU:
                obj = out_dir / (Path(src).stem + ".o")
                cmd = [CUDA["nvcc"], "-c", str(ROOT / src), "-o", str(obj), "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                       f"-gencode=arch=compute_{arch},code=sm_{arch}", "--expt-relaxed-constexpr",
                       "-Xptxas", "-v" if os.environ.get("MFSDP_PTXAS_VERBOSE") else "-O3"]
                print(" ".join(cmd))
                nvcc.append((src, subprocess.Popen(cmd)))
                ext.extra_objects.append(str(obj))
        compile_one, link = self.compiler.compile, self.compiler.link_shared_object

        def compile_all(sources, output_dir=None, **kwargs):
            for obj in self.compiler.object_filenames(sources, output_dir=output_dir):
                Path(obj).parent.mkdir(parents=True, exist_ok=True)  # before the threads: no mkdir races
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                done = list(pool.map(lambda src: compile_one([src], output_dir=output_dir, **kwargs), sources))
            return [obj for objs in done for obj in objs]

        def link_after_nvcc(*args, **kwargs):
            for src, proc in nvcc:
                if proc.wait() != 0:
                    sys.exit(f"megatron_fsdp_c: nvcc failed on {src} (exit {proc.returncode}); see its output above")
            return link(*args, **kwargs)

        self.compiler.compile, self.compiler.link_shared_object = compile_all, link_after_nvcc
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile, self.compiler.link_shared_object = compile_one, link
            for _, proc in nvcc:  # a C error: the background nvcc is not left running
                if proc.poll() is None:
                    proc.kill()


def extension():
    sources = CORE + COMM + GLUE
    include_dirs, macros, link = [], [], ["-fopenmp"] + SANITIZE_FLAGS
    if CUDA:
        sources += CUDA_C
        include_dirs += [str(CUDA["include"]), str(CUDA["nccl_inc"])]
        macros += [("MFSDP_WITH_CUDA", "1")]
        nccl_dir = CUDA["nccl_lib"].parent
        # NEEDED libnccl.so.2 (its soname): torch's copy when torch is imported first (as the
        # package does), else found through the rpath: an installed wheel's site-packages, then
        # the directory it was built against.
        link += [str(CUDA["nccl_lib"]), f"-Wl,-rpath,$ORIGIN/../nvidia/nccl/lib:{nccl_dir}"]
        # the CUDA runtime, static and private: no libcudart.so to find, none to clash with torch's
        link += [str(CUDA["cudart"]), "-Wl,--exclude-libs,ALL", "-lstdc++", "-ldl", "-lrt", "-lpthread"]
    else:
        sources += CPU_ONLY
    return Extension(
        "megatron_fsdp_c._C",
        sources=sources,
        include_dirs=include_dirs,
        define_macros=macros,
        extra_compile_args=C_FLAGS,
        extra_link_args=link,
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExt}, **METADATA)
