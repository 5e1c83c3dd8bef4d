"""The attention backends by name (the engine's kv_cache option), imported on first use
so that reading the names (EngineConfig, the CLI) loads no kernels. A new layout is one
backend module and one line here."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyllm.attention.backend import AttentionBackend

# name -> (module, the backend object in it). The order numbers them in the
# tensor-parallel step protocol.
BACKENDS = {
    "paged": ("pyllm.attention.paged", "PAGED"),
    "contiguous": ("pyllm.attention.contiguous", "CONTIGUOUS"),
}


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"kv_cache must be one of {tuple(BACKENDS)}, got {name!r}")
    module, attr = BACKENDS[name]
    return getattr(importlib.import_module(module), attr)


def backend_number(backend: AttentionBackend) -> int:
    """The backend's number in the step protocol."""
    return list(BACKENDS).index(backend.name)


def backend_of_number(number: int) -> AttentionBackend:
    return get_backend(list(BACKENDS)[number])
