"""Llama-family models, their configuration and their weight loaders.

Names are imported lazily, so that ``import pyllm.model.tokenizer`` (or the config
alone) does not load the compiled kernels.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelConfig": "pyllm.model.config",
    "auto_dtype": "pyllm.model.dtype",
    "resolve_dtype": "pyllm.model.dtype",
    "default_model_path": "pyllm.model.default_model",
    "LlamaForCausalLM": "pyllm.model.llama",
    "load_config": "pyllm.model.loader",
    "load_model": "pyllm.model.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pyllm.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
