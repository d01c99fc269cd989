"""Build of megatron_fsdp_c._C: a pure-C CPython extension (no pybind, no C++).

CPU-only by default. With CUDA (nvcc on PATH and MFSDP_CUDA != 0, or MFSDP_CUDA=1) the .cu
kernels are compiled by nvcc and NCCL is linked from the nvidia-nccl wheel or the toolkit
(see csrc/cuda/README in the CUDA issue). The C sources are listed in one place: SOURCES.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()

CORE = ["csrc/core/status.c", "csrc/core/layout.c", "csrc/core/kernels_cpu.c"]
COMM = ["csrc/comm/pipeline.c"]
GLUE = ["csrc/python/module.c", "csrc/python/torch_backend.c", "csrc/python/engine.c", "csrc/python/cuda_glue.c"]
CUDA_C = ["csrc/cuda/nccl_transport.c"]  # C, compiled by the C compiler
CUDA_CU = ["csrc/cuda/kernels.cu"]
CPU_ONLY = ["csrc/cuda/cuda_absent.c"]

C_FLAGS = ["-std=c11", "-O3", "-ffp-contract=off", "-fno-strict-aliasing", "-Wall", "-Wextra",
           "-Wno-unused-parameter", "-Wno-missing-field-initializers"]


def find_cuda():
    """(nvcc, cuda_home, nccl_include, nccl_lib) or None when this build is CPU-only."""
    want = os.environ.get("MFSDP_CUDA", "auto").lower()
    if want in ("0", "no", "off", "false"):
        return None
    nvcc = shutil.which("nvcc") or (os.environ.get("CUDA_HOME") and str(Path(os.environ["CUDA_HOME"]) / "bin/nvcc"))
    if not nvcc or not Path(nvcc).exists():
        if want in ("1", "yes", "on", "true"):
            sys.exit("MFSDP_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        return None
    cuda_home = Path(nvcc).resolve().parent.parent  # nvcc may be a wrapper script: look for the headers
    for candidate in (os.environ.get("CUDA_HOME"), cuda_home, "/usr/local/cuda"):
        if candidate and (Path(candidate) / "include/cuda_runtime.h").exists():
            cuda_home = Path(candidate)
            break
    nccl_inc = nccl_lib = None
    try:  # the nvidia-nccl-cu13 wheel (pulled in by CUDA builds of torch, or installed by hand)
        import nvidia.nccl as nccl_pkg  # noqa: F401
        base = Path(list(nccl_pkg.__path__)[0])
        if (base / "include/nccl.h").exists():
            nccl_inc, nccl_lib = base / "include", base / "lib"
    except ImportError:
        pass
    if nccl_inc is None and (cuda_home / "include/nccl.h").exists():
        nccl_inc, nccl_lib = cuda_home / "include", cuda_home / "lib64"
    if nccl_inc is None:
        if want in ("1", "yes", "on", "true"):
            sys.exit("MFSDP_CUDA=1 but nccl.h was not found: pip install nvidia-nccl-cu13")
        print("megatron_fsdp_c: nvcc found but no NCCL headers; building CPU-only", file=sys.stderr)
        return None
    return nvcc, cuda_home, nccl_inc, nccl_lib


CUDA = find_cuda()


class BuildExt(build_ext):
    """Compiles the .cu sources with nvcc first and links their objects into the extension."""

    def build_extension(self, ext):
        if CUDA:
            nvcc, cuda_home, nccl_inc, _ = CUDA
            out_dir = Path(self.build_temp) / "cuda"
            out_dir.mkdir(parents=True, exist_ok=True)
            arch = os.environ.get("MFSDP_CUDA_ARCH", "90")
            for src in CUDA_CU:
                obj = out_dir / (Path(src).stem + ".o")
                cmd = [nvcc, "-c", str(ROOT / src), "-o", str(obj), "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                       f"-gencode=arch=compute_{arch},code=sm_{arch}", "-I", str(nccl_inc),
                       "--expt-relaxed-constexpr", "-Xptxas", "-v" if os.environ.get("MFSDP_PTXAS_VERBOSE") else "-O3"]
                print(" ".join(cmd))
                subprocess.check_call(cmd)
                ext.extra_objects.append(str(obj))
        super().build_extension(ext)


def extension():
    sources = CORE + COMM + GLUE
    include_dirs, library_dirs, libraries, macros, rpath = [], [], [], [], []
    if CUDA:
        _, cuda_home, nccl_inc, nccl_lib = CUDA
        sources += CUDA_C
        include_dirs += [str(cuda_home / "include"), str(nccl_inc)]
        library_dirs += [str(cuda_home / "lib64"), str(nccl_lib)]
        libraries += ["cudart"]
        macros += [("MFSDP_WITH_CUDA", "1")]
        # libnccl.so.2 from the wheel has no unversioned symlink: link it by full name.
        nccl_so = sorted(Path(nccl_lib).glob("libnccl.so*"))
        extra_link = [str(nccl_so[-1])] if nccl_so else ["-lnccl"]
        rpath += [str(nccl_lib), "$ORIGIN/../nvidia/nccl/lib"]
    else:
        sources += CPU_ONLY
        extra_link = []
    return Extension(
        "megatron_fsdp_c._C",
        sources=sources,
        include_dirs=include_dirs,
        library_dirs=library_dirs,
        libraries=libraries,
        define_macros=macros,
        extra_compile_args=C_FLAGS,
        extra_link_args=extra_link + [f"-Wl,-rpath,{p}" for p in rpath],
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExt})
