"""Host memory: how much is available, a clear refusal when a model will not fit in it,
the default KV cache size that follows what the weights leave, and zeroed memory (on
huge pages, or committed at once).

    available = available_memory_bytes()            # before loading anything
    kv_bytes = default_kv_cache_bytes(weights_bytes, requested, available=available)
    check_fits(weights_bytes, kv_bytes, "model.gguf", hints, available=available)

Figures are bytes; messages give them in GiB (the unit of `kv_cache_memory`).
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import torch

GIB = 2**30
# A model is refused unless weights + KV cache fit in this share of the available
# memory: the rest covers activations, the tokenizer, allocator slack and transient
# copies while loading.
FIT_MARGIN = 0.9
# The default KV cache: this share of the memory left after the weights (within the
# margin), at most DEFAULT_KV_CACHE_CAP_BYTES and at least MIN_KV_CACHE_BYTES.
KV_CACHE_SHARE = 0.25
DEFAULT_KV_CACHE_CAP_BYTES = 2 * GIB
# Enough for a small pool: a few thousand tokens of a small model, a few hundred of
# an 8B one.
MIN_KV_CACHE_BYTES = 64 * 2**20

# Limits at or above this mean "no limit" (cgroup v1 writes 2^63 rounded to a page).
_NO_LIMIT = 2**60
# (mount under the cgroup root, limit file, usage file, memory.stat key of the
# inactive page cache)
_CGROUP_V2_FILES = ("", "memory.max", "memory.current", "inactive_file")
_CGROUP_V1_FILES = (
    "memory",
    "memory.limit_in_bytes",
    "memory.usage_in_bytes",
    "total_inactive_file",
)


class InsufficientMemoryError(MemoryError):
    """The model (weights + KV cache) does not fit in the available memory.

    A MemoryError rather than a ValueError: nothing in the request or the arguments is
    malformed, the machine is too small, and the server's `except ValueError` paths
    (which answer 400 for a refused request) must not report it as the client's fault.
    """

    def __init__(self, message: str, needed_bytes: int, available_bytes: int):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


def available_memory_bytes(
    meminfo: str | os.PathLike = "/proc/meminfo",
    proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
    cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
) -> int | None:
    """Bytes this process can still allocate: MemAvailable from /proc/meminfo, bounded
    by the headroom of any memory cgroup it runs in (a container's limit, which
    MemAvailable does not show). None where neither is known (not Linux)."""
    figures = (_meminfo_available(meminfo), _cgroup_headroom(proc_cgroup, cgroup_root))
    known = [f for f in figures if f is not None]
    return min(known) if known else None


def _meminfo_available(path: str | os.PathLike) -> int | None:
    try:
        with open(path) as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the figure is in KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(proc_cgroup: str | os.PathLike, root: str | os.PathLike) -> int | None:
    """The smallest (limit - usage + inactive file cache) over the memory cgroups that
    hold this process, v2 or v1; None where none sets a limit."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or ".." in parts[2]:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            mount, *files = _CGROUP_V2_FILES
        elif "memory" in controllers.split(","):
            mount, *files = _CGROUP_V1_FILES
        else:
            continue
        # The process's own group and its ancestors all limit it; in a container the
        # listed path may not exist under the mount, whose root is then its group.
        base = Path(root) / mount
        group = base / path.lstrip("/")
        for directory in [group, *group.parents]:
            if not directory.is_relative_to(base):
                break
            headroom = _group_headroom(directory, *files)
            if headroom is not None:
                headrooms.append(headroom)
    return min(headrooms) if headrooms else None


def _group_headroom(
    directory: Path, limit_file: str, usage_file: str, cache_key: str
) -> int | None:
    try:
        limit_text = (directory / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        usage = int((directory / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    # Inactive page cache is reclaimed before the group's limit bites.
    inactive = 0
    try:
        for line in (directory / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                inactive = int(value)
                break
    except (OSError, ValueError):
        pass
    return max(0, int(limit_text) - usage + inactive)


def format_gib(num_bytes: int | float) -> str:
    gib = num_bytes / GIB
    return f"{gib:.2f} GiB" if gib < 10 else f"{gib:.1f} GiB"


def check_fits(
    model_bytes: int,
    kv_bytes: int,
    what: str,
    hints: Sequence[str] = (),
    *,
    weights_dtype: str | None = None,
    available: int | None = None,
    margin: float = FIT_MARGIN,
) -> None:
    """Raises InsufficientMemoryError unless model_bytes + kv_bytes <= margin * available.

    `what` names the model in the message ("model.gguf"), `weights_dtype` what its
    weights are held in ("bfloat16", "q4_k"), and `hints` the ways out, joined into
    "use A, B, or C". `available` defaults to available_memory_bytes() now; pass the
    figure taken before the weights were loaded. Where it is unknown, nothing is checked.
    """
    for name, value in (("model_bytes", model_bytes), ("kv_bytes", kv_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin!r}")
    if available is None:
        available = available_memory_bytes()
        if available is None:
            return
    if available < 0:
        raise ValueError(f"available must be non-negative, got {available!r}")
    needed = model_bytes + kv_bytes
    if needed <= margin * available:
        return
    weights = f"{format_gib(model_bytes)} for its weights"
    if weights_dtype:
        weights += f" in {weights_dtype}"
    if kv_bytes:
        weights += f" + {format_gib(kv_bytes)} KV cache"
    message = (
        f"{what} needs {weights}, but only {format_gib(available)} of memory is available "
        f"(and {100 - round(100 * margin)}% of that is kept free)"
    )
    hints = [h for h in hints if h]
    if hints:
        ways = hints[0] if len(hints) == 1 else ", ".join(hints[:-1]) + ", or " + hints[-1]
        message += f"; use {ways}"
    raise InsufficientMemoryError(message, needed, available)


def default_kv_cache_bytes(
    weights_bytes: int,
    requested: int | None = None,
    *,
    available: int | None = None,
    minimum: int = MIN_KV_CACHE_BYTES,
) -> int:
    """The KV cache size in bytes: `requested` where the user gave one; else
    KV_CACHE_SHARE of what the margin leaves after the weights,
    min(DEFAULT_KV_CACHE_CAP_BYTES, 0.25 * (0.9 * available - weights_bytes)), but at
    least `minimum` (pass the bytes of the smallest useful pool, e.g. a few blocks).
    `available` (bytes before the weights were loaded) defaults to
    available_memory_bytes(); where it is unknown, the cap. Within the margin, weights
    that fit leave room for this default, so check_fits refuses only the weights."""
    if requested is not None:
        if not isinstance(requested, int) or isinstance(requested, bool) or requested <= 0:
            raise ValueError(
                f"requested KV cache bytes must be a positive integer, got {requested!r}"
            )
        return requested
    if not isinstance(weights_bytes, int) or weights_bytes < 0:
        raise ValueError(f"weights_bytes must be a non-negative integer, got {weights_bytes!r}")
    if available is None:
        available = available_memory_bytes()
        if available is None:
            return max(DEFAULT_KV_CACHE_CAP_BYTES, minimum)
    left = FIT_MARGIN * available - weights_bytes
    share = int(KV_CACHE_SHARE * left)
    return max(min(DEFAULT_KV_CACHE_CAP_BYTES, share), minimum)


# The first 2 MiB of each KV tensor stay on 4 KiB pages: the first step of a short job
# would fault in one huge page per layer's key and value, and where memory must be
# compacted for them that step took 0.15-0.75 s instead of 0.02 s.
SMALL_PAGES_FIRST = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in anonymous memory marked MADV_HUGEPAGE, which Linux backs with
    2 MiB pages where transparent huge pages are enabled ("madvise" or "always"): the KV
    pool.

    Attention reads a sequence's blocks scattered over the whole cache, so with 4 KiB
    pages nearly every block is a TLB miss; measured with 2 threads
    (benchmarks/bench_ops.py, bf16, the same memory with THP_MEM_ALLOC_ENABLE=1 vs 0):
    decode attention over 1 GiB of KV (32 x 8192) 11.0-11.4 -> 13.0-13.4 GB/s. Without
    MADV_HUGEPAGE (not Linux) this is torch.zeros."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    tensor, memory = _anonymous(shape, dtype)
    nbytes = tensor.numel() * dtype.itemsize
    if nbytes > SMALL_PAGES_FIRST:
        memory.madvise(mmap.MADV_HUGEPAGE, SMALL_PAGES_FIRST, nbytes - SMALL_PAGES_FIRST)
    return tensor


def zeros_uncommitted(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in anonymous memory: its pages are committed as they are first
    written, so the process holds only the part it has written."""
    return _anonymous(shape, dtype)[0]


def _anonymous(
    shape: tuple[int, ...], dtype: torch.dtype, flags: int = 0
) -> tuple[torch.Tensor, mmap.mmap]:
    numel = math.prod(shape)
    flags |= mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    memory = mmap.mmap(-1, numel * dtype.itemsize, flags=flags)
    # The tensor holds a reference to `memory`, which is unmapped when both are gone.
    # Anonymous pages read as zero; without MAP_POPULATE they are committed as they are
    # first written.
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape), memory


def zeros_committed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are all committed at once (MAP_POPULATE: one call
    into the kernel instead of a fault per 4 KiB page), for memory written whole at
    once: the weights the loader copies. On 2 MiB pages those weights decoded a little
    faster (TinyLlama-1.1B b1, 2 threads: Q8_0 38-40 against 42-43 ms a step, Q4_K_M
    22.3-22.9 against 22.9-23.7), but faulting them in made the kernel compact memory
    where free memory was fragmented: loads of 1.2-1.9 s against 0.7-1.1 s."""
    if not hasattr(mmap, "MAP_POPULATE"):
        return torch.zeros(shape, dtype=dtype)
    return _anonymous(shape, dtype, mmap.MAP_POPULATE)[0]
