"""HF model directories: tokenizer.json (or tokenizer.model) and the JSON files around it."""

from __future__ import annotations

import json
import os
from typing import Any

import tokenizers

from pyllm.model.tokenizer.backends import FastBackend, SentencePieceBackend, TokenizerParts

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def load_hf_dir(path: str) -> TokenizerParts:
    """From tokenizer.json (or tokenizer.model), tokenizer_config.json, special_tokens_map.json,
    generation_config.json and the chat template files."""
    config = _read_json(path, "tokenizer_config.json")
    special_map = _read_json(path, "special_tokens_map.json")
    token_names = {
        name: _token_content(config.get(name, special_map.get(name))) for name in _SPECIAL_NAMES
    }
    add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
    backend = _load_backend(path, config, add_bos, add_eos)

    ids = {name: backend.token_to_id(t) if t else None for name, t in token_names.items()}
    if isinstance(backend, SentencePieceBackend):
        ids = {name: backend.default_id(name) if i is None else i for name, i in ids.items()}
        backend.set_bos_eos(ids["bos_token"], ids["eos_token"])
    else:
        backend.force_bos_eos(ids["bos_token"], ids["eos_token"], add_bos, add_eos)

    generation = _read_json(path, "generation_config.json").get("eos_token_id")
    extra_eos = generation if isinstance(generation, list) else [generation]
    return TokenizerParts(
        backend,
        bos_token_id=ids["bos_token"],
        eos_token_id=ids["eos_token"],
        pad_token_id=ids["pad_token"],
        unk_token_id=ids["unk_token"],
        extra_eos_token_ids=[i for i in extra_eos if isinstance(i, int)],
        chat_template=_read_hf_chat_template(path, config),
    )


def _load_backend(
    path: str, config: dict[str, Any], add_bos: bool | None, add_eos: bool | None
) -> FastBackend | SentencePieceBackend:
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return FastBackend(tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
    if os.path.exists(os.path.join(path, "tokenizer.model")):
        return SentencePieceBackend(
            os.path.join(path, "tokenizer.model"),
            added_tokens=_added_tokens_from_config(config),
            add_bos=True if add_bos is None else bool(add_bos),  # Llama's SentencePiece default
            add_eos=bool(add_eos),
        )
    raise FileNotFoundError(f"directory {path!r} has neither tokenizer.json nor tokenizer.model")


def _read_json(directory: str, name: str) -> dict[str, Any]:
    file = os.path.join(directory, name)
    if not os.path.exists(file):
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config.json spells a token as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _added_tokens_from_config(config: dict[str, Any]) -> dict[int, tuple[str, bool]]:
    return {
        int(token_id): (entry["content"], bool(entry.get("special", False)))
        for token_id, entry in config.get("added_tokens_decoder", {}).items()
    }


def _read_hf_chat_template(directory: str, config: dict[str, Any]) -> str | None:
    """Newer checkpoints keep the template in chat_template.jinja (or .json), older ones in
    tokenizer_config.json, sometimes as a list of named templates ("default", "tool_use")."""
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = _read_json(directory, "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    return template
