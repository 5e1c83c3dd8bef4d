"""Kernel graphs: the kernel calls of one model step, recorded and replayed from C++.

A batch-1 decode step of a small model makes about 300 kernel calls. The Python that
makes them runs between kernels that each stream a weight through the caches, so it
finds its own code and objects evicted and costs about three times what it costs in a
tight loop (SmolLM2 on 2 cores: ~0.9 ms of a ~6 ms step). `record` runs a step for real
while a `_C.KernelGraph` keeps each direct kernel call (`_C.DIRECT_OPS`) with its
arguments; `KernelGraph.replay()` makes the same calls on the same tensors in one C++
loop, as a CUDA graph replays a GPU's launches. A replay computes the same values as
the recorded step would, given the same inputs: the caller writes each step's inputs
into the tensors the recording read.

A step is recorded only if the kernels are all it computes: any other torch function it
calls (anything but an allocation, a view or a look at metadata) would not be repeated
by a replay, so the recording is refused and the caller runs such a model op by op.
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

from pyllm import _C

_ALLOCATIONS = frozenset((torch.empty, torch.empty_like))
# What a step may ask of a tensor besides views: its metadata (attributes such as shape
# and dtype are a getter's __get__), never its values; and torch.device(...).
_METADATA = frozenset(
    ("__get__", "dim", "size", "stride", "numel", "is_contiguous", "element_size", "__len__")
)
# _C's functions are swapped for recording ones while a step records: one at a time.
_RECORDING = threading.Lock()


class _Watch(TorchFunctionMode):
    """Notes the first torch function the step calls that a replay would not repeat:
    anything but an allocation, a view (its tensors share an argument's storage) or a
    look at metadata. A torch function mode sees the Python's calls only, not the
    kernels' own (and, unlike a dispatch mode, costs no import of torch._dynamo)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refused is None and not _replayable(func, args, kwargs, out):
            self.refused = getattr(func, "__qualname__", None) or str(func)
        return out


def _replayable(func, args, kwargs, out) -> bool:
    if func in _ALLOCATIONS or func is torch.device:
        return True
    outs = out if isinstance(out, (list, tuple)) else [out]
    tensors = [o for o in outs if isinstance(o, torch.Tensor)]
    name = getattr(func, "__name__", "")
    if not tensors:
        return name in _METADATA
    in_place = name.endswith("_") and not name.endswith("__") or name.startswith("__i")
    if in_place or kwargs.get("inplace") or "out" in kwargs:
        return False  # it computes into a tensor it was given (x.mul_, x += y, out=)
    bases = {_storage(a) for a in args if isinstance(a, torch.Tensor)} - {None}
    return all(_storage(t) in bases for t in tensors)


def _storage(t: torch.Tensor) -> int | None:
    """Where t's storage lies; None for a tensor without one (oneDNN's packed weights)."""
    try:
        return t.untyped_storage().data_ptr()
    except NotImplementedError:
        return None


def record(fn, *args):
    """Runs fn(*args) and returns (its result, the KernelGraph of its kernel calls, None),
    or (its result, None, the op that refused the recording)."""
    graph, watch, thread = _C.KernelGraph(), _Watch(), threading.get_ident()
    kernels = {name: getattr(_C, name) for name in _C.DIRECT_OPS}

    def recording(name: str, kernel):
        add = getattr(graph, name)

        def call(*a):
            if threading.get_ident() != thread:
                return kernel(*a)
            add(*a)
            return kernel(*a)

        return call

    with _RECORDING:
        for name, kernel in kernels.items():
            setattr(_C, name, recording(name, kernel))
        try:
            with watch:
                result = fn(*args)
        finally:
            for name, kernel in kernels.items():
                setattr(_C, name, kernel)
    if watch.refused:
        return result, None, watch.refused
    return result, graph, None
