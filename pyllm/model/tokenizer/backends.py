"""Backends: the one place each library's API is used.

`FastBackend` wraps a `tokenizers.Tokenizer` (a HF tokenizer.json, or one built from GGUF
metadata); `SentencePieceBackend` wraps a `tokenizer.model` with HF's conventions around it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import tokenizers
from tokenizers import processors

from pyllm.model.tokenizer.sentencepiece_proto import (
    CONTROL,
    UNKNOWN,
    USER_DEFINED,
    sentencepiece_piece_types,
)

SPM_SPACE = "\u2581"


@dataclass
class TokenizerParts:
    """What a source (HF directory, GGUF file) yields: the arguments of `Tokenizer`."""

    backend: FastBackend | SentencePieceBackend
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    extra_eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None


class FastBackend:
    """A `tokenizers.Tokenizer`: its normalizer, pre-tokenizer, model, post-processor, decoder."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(
            i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        return self.tokenizer

    def force_bos_eos(
        self, bos_id: int | None, eos_id: int | None, add_bos: bool | None, add_eos: bool | None
    ) -> None:
        """Make `encode(add_special_tokens=True)` add BOS/EOS exactly as the flags say.

        A flag of None keeps what the tokenizer's own post-processor does (Llama 3's tokenizer.json
        adds <|begin_of_text|> there and its config has no flag).
        """
        added = self.encode("", add_special_tokens=True)  # only what the post-processor adds
        has_bos = bos_id is not None and added[:1] == [bos_id]
        has_eos = eos_id is not None and added[int(has_bos) :][-1:] == [eos_id]
        want_bos = has_bos if add_bos is None else bool(add_bos) and bos_id is not None
        want_eos = has_eos if add_eos is None else bool(add_eos) and eos_id is not None
        if (want_bos, want_eos) == (has_bos, has_eos):
            return
        single, specials = "$A:0", []
        if want_bos:
            bos = self.id_to_token(bos_id)
            single, specials = f"{bos}:0 {single}", [(bos, bos_id)]
        if want_eos:
            eos = self.id_to_token(eos_id)
            single = f"{single} {eos}:0"
            specials = [*specials, (eos, eos_id)] if eos_id != bos_id else specials
        self.tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B:1", special_tokens=specials
        )


class SentencePieceBackend:
    """A SentencePiece model (a `tokenizer.model`, or one written from a GGUF file's
    vocabulary), with the HF conventions around it.

    Special tokens (the model's control pieces and the config's added tokens) are cut out of the
    text first, and each run of text between them is encoded on its own, so each gets the dummy
    "\u2581" prefix -- what llama.cpp and HF's SentencePiece tokenizers do.

    `hf_tokenizer()` gives the `tokenizers.Tokenizer` that encodes alike, where the source can
    build one (`hf_factory`; a GGUF vocabulary's), for tools that take a tokenizer.json.
    """

    def __init__(
        self,
        model_file: str | None,
        added_tokens: dict[int, tuple[str, bool]],
        add_bos: bool,
        add_eos: bool,
        *,
        model_proto: bytes | None = None,
        piece_types: tuple[list[int], bool] | None = None,
        hf_factory: Callable[[], tokenizers.Tokenizer] | None = None,
    ):
        """model_file, or model_proto (serialized) with piece_types: (each piece's type,
        add_dummy_prefix), which a model_file's protobuf is read for."""
        import sentencepiece

        if model_proto is None:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        else:
            self.sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_id = self.eos_id = None
        self._hf_factory, self._hf = hf_factory, None
        n = self.sp.get_piece_size()
        # id -> (text, special): the model's control and unknown pieces are special, its
        # user-defined pieces are matched whole but not special; added tokens as the config says.
        if piece_types is None:
            piece_types = sentencepiece_piece_types(self.sp.serialized_model_proto())
        piece_types, self.add_dummy_prefix = piece_types
        self.added = {
            i: (self.sp.id_to_piece(i), kind != USER_DEFINED)
            for i, kind in enumerate(piece_types)
            if kind in (CONTROL, UNKNOWN, USER_DEFINED)
        }
        self.added.update(added_tokens)
        self.added_ids = {text: i for i, (text, _) in self.added.items()}
        self.special_ids = frozenset(i for i, (_, special) in self.added.items() if special)
        self.vocab_size = max(n, max(self.added, default=-1) + 1)
        self.split_pattern = (
            re.compile("(" + longest_match_regex(self.added_ids) + ")") if self.added_ids else None
        )

    def hf_tokenizer(self) -> tokenizers.Tokenizer | None:
        """The `tokenizers.Tokenizer` that encodes alike, built on first use; None where the
        source has none (a `tokenizer.model`)."""
        if self._hf is None and self._hf_factory is not None:
            self._hf = self._hf_factory()
        return self._hf

    def default_id(self, name: str) -> int | None:
        """The model's own id for a special token the config does not name."""
        token_id = {
            "bos_token": self.sp.bos_id(),
            "eos_token": self.sp.eos_id(),
            "pad_token": self.sp.pad_id(),
            "unk_token": self.sp.unk_id(),
        }[name]
        return token_id if token_id >= 0 else None

    def set_bos_eos(self, bos_id: int | None, eos_id: int | None) -> None:
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = []
        pieces = self.split_pattern.split(text) if self.split_pattern else [text]
        # re.split with one group alternates text, token, text, ...: odd indices are tokens.
        for index, piece in enumerate(pieces):
            if index % 2:
                ids.append(self.added_ids[piece])
            elif piece:
                ids.extend(self.sp.encode(piece))
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_special_tokens and self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        # With add_dummy_prefix, SentencePiece drops the leading space of every run it decodes.
        # That is right only for text at the very start; a run after an added token keeps it.
        parts: list[str] = []
        run: list[int] = []
        for token_id in [*ids, None]:
            if token_id is not None and token_id not in self.added:
                run.append(token_id)
                continue
            if run:
                text = self.sp.decode(run)
                first_piece = self.sp.id_to_piece(run[0])
                if parts and self.add_dummy_prefix and first_piece.startswith(SPM_SPACE):
                    text = " " + text
                parts.append(text)
                run = []
            if token_id is not None and not (skip_special_tokens and token_id in self.special_ids):
                parts.append(self.added[token_id][0])
        return "".join(parts)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self.added:
            return self.added[token_id][0]
        return self.sp.id_to_piece(token_id) if token_id < self.sp.get_piece_size() else None

    def token_to_id(self, token: str) -> int | None:
        if token in self.added_ids:
            return self.added_ids[token]
        token_id = self.sp.piece_to_id(token)
        # piece_to_id answers unk for any unknown piece; only the unk piece itself maps to it.
        unknown = token_id == self.sp.unk_id() and token != self.sp.id_to_piece(token_id)
        return None if unknown else token_id


def longest_match_regex(words) -> str:
    """A regex of any of `words` that takes the longest at each position ("<|im_start|>" over
    a shorter token it starts with), as a trie: one branch per next character. A flat
    alternation of Gemma 3's 6,400 control and user-defined tokens split 60 KB of text in
    0.1 s; the trie in under 1 ms."""
    trie: dict = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def branch(node: dict) -> str:
        alternatives = [re.escape(c) + branch(child) for c, child in node.items() if c]
        if not alternatives:
            return ""
        if "" in node:  # a word ends here: longer ones first, then this one
            return "(?:" + "|".join(alternatives) + ")?"
        if len(alternatives) == 1:
            return alternatives[0]
        return "(?:" + "|".join(alternatives) + ")"

    return branch(trie)
