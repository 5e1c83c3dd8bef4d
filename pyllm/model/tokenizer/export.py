"""Writes a model's tokenizer as HF files (tokenizer.json, tokenizer_config.json), so tools
that load tokenizers with HF transformers (load generators, evaluation harnesses) can
use the tokenizer of a GGUF file offline: `pyllm export-tokenizer`."""

from __future__ import annotations

import json
import os

from tokenizers import decoders

from pyllm.model.tokenizer import FALLBACK_CHAT_TEMPLATE, Tokenizer
from pyllm.model.tokenizer.backends import SPM_SPACE


def export_hf_tokenizer(
    tokenizer: Tokenizer, directory: str | os.PathLike, model_max_length: int | None = None
) -> list[str]:
    """Writes tokenizer.json and tokenizer_config.json into `directory` (made if missing);
    returns their paths. transformers.AutoTokenizer.from_pretrained(directory) then
    encodes, decodes and renders chats as this tokenizer does."""
    if tokenizer.hf_tokenizer() is None:
        raise ValueError(
            "this tokenizer is a SentencePiece tokenizer.model, already in HF's format: "
            "point the tool at the model's own directory"
        )
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": _token(tokenizer, tokenizer.pad_token_id),
        "unk_token": _token(tokenizer, tokenizer.unk_token_id),
        # What the server renders chats with, when the model has no template of its own.
        "chat_template": tokenizer.chat_template or FALLBACK_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    config = {k: v for k, v in config.items() if v is not None}
    json_path = os.path.join(directory, "tokenizer.json")
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(json_path, "w", encoding="utf-8") as f:
        f.write(hf_tokenizer_json(tokenizer))
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return [json_path, config_path]


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """The tokenizer as a HF tokenizer.json document (for files, and for libraries that
    take one, such as llguidance)."""
    fast = tokenizer.hf_tokenizer()
    if fast is None:
        raise ValueError("a SentencePiece tokenizer.model has no tokenizer.json form")
    try:
        return fast.to_str()
    except Exception:  # a Python decoder (GGUF SentencePiece vocabularies): not serializable
        original = fast.decoder
        fast.decoder = _hf_sentencepiece_decoder(tokenizer)
        try:
            return fast.to_str()
        finally:
            fast.decoder = original


def _hf_sentencepiece_decoder(tokenizer: Tokenizer) -> decoders.Decoder:
    """HF's decoder for a SentencePiece BPE vocabulary. It decodes as pyllm's does, except
    that a run of byte tokens with an invalid one becomes U+FFFD as a whole."""
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    # Whether the first token's leading space is dropped (the dummy prefix SentencePiece adds).
    pieces = (tokenizer.token_to_id(SPM_SPACE + "a"), tokenizer.token_to_id(SPM_SPACE))
    piece = next((i for i in pieces if i is not None), None)
    if piece is not None and not tokenizer.decode([piece]).startswith(" "):
        steps.append(decoders.Strip(" ", 1, 0))
    return decoders.Sequence(steps)


def _token(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.convert_ids_to_tokens([token_id])[0]
