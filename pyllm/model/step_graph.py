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

A step is recorded only if the kernels are all it computes: any other aten op outside
them (anything but an allocation or a view) would not be repeated by a replay, so the
recording is refused and the caller runs such a model op by op.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pyllm import _C

_ALLOCATIONS = frozenset(
    (
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.empty_like.default,
    )
)
# _C's functions are swapped for recording ones while a step records: one at a time.
_RECORDING = threading.Lock()


class _Watch(TorchDispatchMode):
    """Notes the first aten op outside the kernels that a replay would not repeat."""

    def __init__(self) -> None:
        super().__init__()
        self.in_kernel = False
        self.refused: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (self.in_kernel or func in _ALLOCATIONS or (func.is_view and _aliases(out, args))):
            self.refused = self.refused or str(func)
        return out


def _aliases(out, args) -> bool:
    """Whether a view op's outputs share its input's storage (reshape may copy instead)."""
    base = args[0].untyped_storage().data_ptr()
    outs = out if isinstance(out, (list, tuple)) else [out]
    return all(o.untyped_storage().data_ptr() == base for o in outs)


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
            watch.in_kernel = True
            try:
                return kernel(*a)
            finally:
                watch.in_kernel = False

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
