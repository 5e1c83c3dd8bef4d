"""Builds pyllm's kernel library, pyllm._C, as a torch C++ (and CUDA) extension.

PYLLM_TARGET=auto|cpu|cuda   auto (default): CUDA kernels too when torch is a CUDA
                             build and nvcc is found; cpu/cuda force either.
TORCH_CUDA_ARCH_LIST          GPU architectures to compile for (default "8.0;9.0").
PYLLM_CPU_ARCH                value for -march (default "native": the build machine's
                             vector unit; use e.g. "x86-64-v3" for a portable binary).
MAX_JOBS                      parallel compile jobs (ninja).
"""

import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _fail(message: str) -> None:
    sys.exit(f"pyllm build: {message}")


try:
    import torch
except ImportError:
    _fail(
        "torch is not installed. Install it first (on a CPU machine: "
        "`pip install torch==2.13.0`), then `pip install --no-build-isolation .`"
    )


def _find_cuda_home() -> str | None:
    """The CUDA toolkit root, found before torch.utils.cpp_extension guesses it.

    torch guesses from `which nvcc`, which is wrong where nvcc is a wrapper script
    in /usr/local/bin; prefer an explicit CUDA_HOME, then /usr/local/cuda.
    """
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return None


def _choose_target() -> str:
    target = os.environ.get("PYLLM_TARGET", "auto").lower()
    if target not in ("auto", "cpu", "cuda"):
        _fail(f"PYLLM_TARGET must be auto, cpu or cuda, not {target!r}")
    cuda_home = _find_cuda_home()
    torch_has_cuda = torch.version.cuda is not None
    if target == "cuda":
        if not torch_has_cuda:
            _fail(f"PYLLM_TARGET=cuda but torch {torch.__version__} is a CPU-only build")
        if cuda_home is None:
            _fail("PYLLM_TARGET=cuda but no CUDA toolkit (nvcc) was found; set CUDA_HOME")
    if target == "auto":
        # Decided from the toolchain, never from torch.cuda.is_available():
        # build machines often have no GPU.
        target = "cuda" if torch_has_cuda and cuda_home else "cpu"
    if target == "cuda":
        os.environ["CUDA_HOME"] = cuda_home
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    return target


TARGET = _choose_target()

# Imported only now: it reads CUDA_HOME at import time.
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _sources(pattern: str) -> list[str]:
    return sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    )


cxx_flags = [
    "-O3",
    "-g0",  # Python's default -g makes the library 25x larger and the build slower.
    "-fopenmp",  # without it at::parallel_for silently runs on one thread
    f"-march={os.environ.get('PYLLM_CPU_ARCH', 'native')}",
    "-Wno-unused-function",
]
link_flags = ["-fopenmp"]
sources = _sources("csrc/**/*.cpp")

if TARGET == "cuda":
    cxx_flags.append("-DPYLLM_WITH_CUDA")
    nvcc_flags = [
        "-O3",
        "-DPYLLM_WITH_CUDA",
        "--use_fast_math",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ]
    extension = CUDAExtension(
        "pyllm._C",
        sources + _sources("csrc/**/*.cu"),
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
    )
else:
    extension = CppExtension(
        "pyllm._C",
        sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )

print(f"pyllm build: target={TARGET}, torch {torch.__version__}", file=sys.stderr)

setup(
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)},
)
