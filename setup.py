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


def _is_cuda_root(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "bin", "nvcc")) and os.path.isfile(
        os.path.join(path, "include", "cuda_runtime.h")
    )


def _find_cuda_home() -> str | None:
    """The CUDA toolkit root, found before torch.utils.cpp_extension guesses it.

    torch guesses from `which nvcc`, which is wrong where nvcc is a wrapper script
    in /usr/local/bin (it would take /usr/local). A candidate counts only if it
    holds both bin/nvcc and include/cuda_runtime.h: an explicit CUDA_HOME or
    CUDA_PATH first, then /usr/local/cuda, the root above a real nvcc on PATH, and
    versioned /usr/local/cuda-* installs, newest first.
    """
    explicit = [os.environ.get(name) for name in ("CUDA_HOME", "CUDA_PATH")]
    for name, value in zip(("CUDA_HOME", "CUDA_PATH"), explicit, strict=True):
        if value and not _is_cuda_root(value):
            print(
                f"pyllm build: ignoring {name}={value}: no bin/nvcc and include/cuda_runtime.h",
                file=sys.stderr,
            )
    candidates = [*explicit, "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for candidate in candidates:
        if candidate and _is_cuda_root(candidate):
            return candidate
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
        # Without it torch asks the (absent) GPU for its architecture and raises.
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
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
    "-std=c++20",  # the sources use C++20 (std::bit_cast); torch before 2.13 asks C++17
]
link_flags = ["-fopenmp"]
sources = _sources("csrc/**/*.cpp")

if TARGET == "cuda":
    # The .cu files include c10/cuda headers only: ATen/cuda/CUDAContext.h would
    # need the cuBLAS/cuSPARSE headers, which a bare toolkit (/usr/local/cuda
    # here) lacks; they live in the nvidia-* wheels, not on the include path.
    cxx_flags.append("-DPYLLM_WITH_CUDA")
    nvcc_flags = [
        "-O3",
        "-std=c++20",  # as the C++ sources: inline code shared by both must agree
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
