"""Tokenizers for pyllm: one interface over three sources of a vocabulary, plus chat templates.

    Tokenizer.from_pretrained("path/to/hf_dir")     # tokenizer.json, else tokenizer.model
    Tokenizer.from_pretrained("path/to/model.gguf") # the vocabulary embedded in a GGUF file

A HF directory's `tokenizer.json` runs through the `tokenizers` library as it is (hf.py). A
directory with only `tokenizer.model` runs through `sentencepiece` (backends.py). A GGUF file's
metadata describes a `tokenizers.Tokenizer` that gguf.py builds. Chat templates: chat.py.

In all three, control and user-defined tokens are matched whole in the text ("<|im_start|>" is one
id), as HF's tokenizers do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers

from pyllm.model.tokenizer.backends import FastBackend, SentencePieceBackend, TokenizerParts
from pyllm.model.tokenizer.chat import (
    CHAT_ROLES,
    FALLBACK_CHAT_TEMPLATE,
    render_chat_template,
    validate_messages,
)
from pyllm.model.tokenizer.gguf import load_gguf, read_gguf_tokenizer_metadata
from pyllm.model.tokenizer.hf import load_hf_dir

__all__ = [
    "CHAT_ROLES",
    "FALLBACK_CHAT_TEMPLATE",
    "Tokenizer",
    "read_gguf_tokenizer_metadata",
    "render_chat_template",
    "validate_messages",
]


class Tokenizer:
    """Text <-> token ids for one model, with its special ids and chat template.

    Build one with `from_pretrained`, `from_hf_dir` or `from_gguf`. `encode` adds BOS/EOS as the
    model asks (`add_special_tokens=True`); `decode` keeps special tokens unless told to skip them,
    like HF. `eos_token_ids` holds every id that ends generation (Llama 3 stops on both
    <|end_of_text|> and <|eot_id|>).
    """

    def __init__(
        self,
        backend: FastBackend | SentencePieceBackend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ):
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.eos_token_ids = frozenset(
            i for i in (eos_token_id, *extra_eos_token_ids) if i is not None
        )
        self.chat_template = chat_template

    # ----- constructors -----

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """From a `.gguf` file, or a directory holding HF tokenizer files or a single `.gguf`."""
        path = os.fspath(path)
        if os.path.isfile(path):
            if not path.endswith(".gguf"):
                raise ValueError(f"path must be a directory or a .gguf file, got {path!r}")
            return cls.from_gguf(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no tokenizer at path {path!r}")
        names = os.listdir(path)
        if "tokenizer.json" in names or "tokenizer.model" in names:
            return cls.from_hf_dir(path)
        ggufs = sorted(n for n in names if n.endswith(".gguf"))
        if len(ggufs) == 1:
            return cls.from_gguf(os.path.join(path, ggufs[0]))
        raise FileNotFoundError(
            f"directory {path!r} has no tokenizer.json or tokenizer.model and "
            f"{len(ggufs)} .gguf files (need exactly one)"
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """From a HF model directory: tokenizer.json (or tokenizer.model), tokenizer_config.json,
        special_tokens_map.json, generation_config.json and the chat template files."""
        return cls._from_parts(load_hf_dir(os.fspath(path)))

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """From the tokenizer.* metadata of a GGUF file (tokenizer.ggml.model "gpt2" or "llama")."""
        return cls._from_parts(load_gguf(path))

    @classmethod
    def _from_parts(cls, parts: TokenizerParts) -> Tokenizer:
        return cls(
            parts.backend,
            bos_token_id=parts.bos_token_id,
            eos_token_id=parts.eos_token_id,
            pad_token_id=parts.pad_token_id,
            unk_token_id=parts.unk_token_id,
            extra_eos_token_ids=parts.extra_eos_token_ids,
            chat_template=parts.chat_template,
        )

    # ----- the interface -----

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the rows the embedding must have at least)."""
        return self._backend.vocab_size

    @property
    def fast_tokenizer(self) -> tokenizers.Tokenizer | None:
        """The `tokenizers.Tokenizer` behind this one (for its DecodeStream); None for a
        SentencePiece `tokenizer.model`."""
        backend = self._backend
        return backend.tokenizer if isinstance(backend, FastBackend) else None

    def hf_tokenizer(self) -> tokenizers.Tokenizer | None:
        """A `tokenizers.Tokenizer` that encodes as this one (for a tokenizer.json): the one
        behind it, or for a GGUF SentencePiece vocabulary one built on first use (seconds for
        Gemma 3's); None for a SentencePiece `tokenizer.model`."""
        return self._backend.hf_tokenizer()

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids `decode(..., skip_special_tokens=True)` leaves out."""
        return self._backend.special_ids

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(text)` starts with BOS (tokenizer_config's add_bos_token, GGUF's
        tokenizer.ggml.add_bos_token, or what a tokenizer.json post-processor does)."""
        bos = self.bos_token_id
        return bos is not None and self._backend.encode("", True)[:1] == [bos]

    @property
    def bos_token(self) -> str | None:
        return self._token_or_none(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token_or_none(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS/EOS where the model adds them."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Bytes that do not form whole UTF-8 characters become U+FFFD."""
        ids = self._check_ids(ids)
        return self._backend.decode(ids, skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's spelling of each id (byte-level "Ġ", SentencePiece "\u2581")."""
        return [self._backend.id_to_token(i) for i in self._check_ids(ids)]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with `chat_template`, else the model's, else FALLBACK_CHAT_TEMPLATE.

        Returns the prompt text, or with `tokenize=True` its ids: the template writes any BOS
        itself, so no special tokens are added on top (as HF does). Extra keyword arguments are
        template variables, as in HF's apply_chat_template.
        """
        text = render_chat_template(
            chat_template or self.chat_template or FALLBACK_CHAT_TEMPLATE,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self._token_or_none(self.pad_token_id) or "",
            unk_token=self._token_or_none(self.unk_token_id) or "",
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _token_or_none(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} out of range for vocab_size {self.vocab_size}")
        return ids
