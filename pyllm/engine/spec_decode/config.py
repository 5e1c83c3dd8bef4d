"""speculative_config: vLLM's dict (`{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}`, or a draft model's `{"model": PATH,
"num_speculative_tokens": k}`), checked once into a SpeculativeConfig. A bad key or
value raises SpeculativeConfigError naming it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# vLLM's other methods: named here so the error says they are not supported yet.
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")
KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
    "adaptive_length",
)
# vLLM's defaults when neither lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# Speculation is skipped for a step with more running sequences than this: on 2 CPU
# cores, from batch 4 on, free text and code edits ran slower with proposals than
# without (docs/speculative-decoding.md has the measurement).
DEFAULT_DISABLE_BY_BATCH_SIZE = 2


class SpeculativeConfigError(ValueError):
    """A bad speculative_config; `option` names the engine option (for the CLI's flag)."""

    option = "speculative_config"

    def __init__(self, key: str | None, problem: str) -> None:
        where = "speculative_config" if key is None else f"speculative_config[{key!r}]"
        super().__init__(f"{where} {problem}")
        self.key = key


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: most tokens proposed per sequence and step
    prompt_lookup_max: int  # longest n-gram looked up
    prompt_lookup_min: int  # shortest n-gram looked up
    disable_by_batch_size: int  # no proposals in a step with more running sequences
    model: str | None = None  # the draft model's path (method "draft_model")
    # Propose each sequence only as many tokens as its acceptance so far makes worth
    # verifying (spec_decode/adaptive.py); False: always up to num_speculative_tokens.
    adaptive_length: bool = True


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """None, a SpeculativeConfig, a dict or its JSON text -> SpeculativeConfig or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        value = json_object(value)
    if not isinstance(value, dict):
        raise SpeculativeConfigError(None, f"must be a dict, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS), key=str)
    if unknown:
        raise SpeculativeConfigError(unknown[0], f"is not a known key; known: {list(KEYS)}")
    method = _method(value)
    k = _positive(value, "num_speculative_tokens", None)
    batch = _positive(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    adaptive = value.get("adaptive_length", True)
    if not isinstance(adaptive, bool):
        raise SpeculativeConfigError("adaptive_length", f"must be true or false, got {adaptive!r}")
    if method == "draft_model":
        return SpeculativeConfig(method, k, 0, 0, batch, _draft_path(value), adaptive)
    most, least = _lookup_bounds(value)
    return SpeculativeConfig(method, k, most, least, batch, None, adaptive)


def _lookup_bounds(value: dict) -> tuple[int, int]:
    """(prompt_lookup_max, prompt_lookup_min): one given, the other is the same (as
    vLLM); neither, vLLM's default."""
    most = _positive(value, "prompt_lookup_max", None)
    least = _positive(value, "prompt_lookup_min", None)
    most, least = most or least, least or most
    if most is None:
        return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
    if least > most:
        raise SpeculativeConfigError(
            "prompt_lookup_min", f"({least}) must not exceed prompt_lookup_max ({most})"
        )
    return most, least


def _method(value: dict) -> str:
    """ "ngram" from `method` (or vLLM's older `"model": "ngram"`); "draft_model" from
    `method` or a `model` path without one; another method is refused."""
    model = value.get("model")
    method = value.get("method")
    if method is None:
        method = "ngram" if model == "ngram" else "draft_model" if model is not None else None
    if method in NOT_YET:
        raise SpeculativeConfigError(
            "method",
            f"asks for {method!r} speculation, which is not supported yet; "
            f"supported: {list(METHODS)}",
        )
    if method not in METHODS:
        raise SpeculativeConfigError("method", f"must be one of {list(METHODS)}, got {method!r}")
    if method == "ngram" and model not in (None, "ngram"):
        raise SpeculativeConfigError(
            "model", f"names a draft model ({model!r}) but method is 'ngram'"
        )
    return method


def _draft_path(value: dict) -> str:
    """The draft model's path, which must exist; the n-gram keys are refused."""
    for key in ("prompt_lookup_max", "prompt_lookup_min"):
        if key in value:
            raise SpeculativeConfigError(key, "is an n-gram key: a draft model looks nothing up")
    path = value.get("model")
    if path is None:
        raise SpeculativeConfigError("model", "is required: the draft model's path")
    if not isinstance(path, str | os.PathLike) or not os.path.exists(path):
        raise SpeculativeConfigError(
            "model", f"must be a GGUF file or an HF model folder that exists, got {path!r}"
        )
    return os.fspath(path)


def _positive(value: dict, key: str, default: int | None) -> int | None:
    got = value.get(key, default)
    if key == "num_speculative_tokens" and got is None:
        raise SpeculativeConfigError(key, "is required (the most tokens proposed per step)")
    if got is not None and (isinstance(got, bool) or not isinstance(got, int) or got < 1):
        raise SpeculativeConfigError(key, f"must be a positive integer, got {got!r}")
    return got


def json_object(text: str) -> dict:
    """The CLI's `--speculative-config '<json>'`: a JSON object, else the error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise SpeculativeConfigError(None, f"is not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise SpeculativeConfigError(None, f"must be a JSON object, got {text!r}")
    return value
