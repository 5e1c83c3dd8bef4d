"""Tokenizers for pyllm: one interface over three sources of a vocabulary, plus chat templates.

    Tokenizer.from_pretrained("path/to/hf_dir")     # tokenizer.json, else tokenizer.model
    Tokenizer.from_pretrained("path/to/model.gguf") # the vocabulary embedded in a GGUF file

A HF directory's `tokenizer.json` runs through the `tokenizers` library as it is. A directory
with only `tokenizer.model` runs through `sentencepiece`. A GGUF file carries no tokenizer
program, only llama.cpp's metadata (tokens, merges or scores, token types, special ids), so we
build the `tokenizers.Tokenizer` it describes:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges. Text is first split by
  the regex `tokenizer.ggml.pre` names (the split the merges were learned on), then mapped to the
  GPT-2 byte alphabet.
- `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE. Spaces become "\u2581", a "\u2581"
  is prepended to each run of text (`add_space_prefix`), pieces merge best-score-first, and
  characters outside the vocabulary fall back to `<0xNN>` byte tokens.

In all three, control and user-defined tokens are matched whole in the text ("<|im_start|>" is one
id), as HF's tokenizers do.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import numpy
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

# Roles a message may have; anything else is a caller error, not something to pass to a template.
CHAT_ROLES = ("system", "user", "assistant", "tool")

# Used when a model ships no chat template: "role: content" lines, then the assistant's cue.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)

# llama.cpp's token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPM_SPACE = "\u2581"

# Pre-tokenizer regexes, keyed by tokenizer.ggml.pre. GPT-2's own split is built into
# ByteLevel(use_regex=True), so only the others are spelled out.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is Llama 3's split with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

_GPT2_PRE = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")
# StarCoder-family vocabularies (SmolLM's among them) were trained on text cut into single digits
# before the GPT-2 split, so "a  1" is "a", "  ", "1" and never "a", " ", " 1".
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone")
_REGEX_PRE = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Llama 3's tokenizer looks a whole pre-token up in the vocabulary before merging.
_IGNORE_MERGES_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3")


class Tokenizer:
    """Text <-> token ids for one model, with its special ids and chat template.

    Build one with `from_pretrained`, `from_hf_dir` or `from_gguf`. `encode` adds BOS/EOS as the
    model asks (`add_special_tokens=True`); `decode` keeps special tokens unless told to skip them,
    like HF. `eos_token_ids` holds every id that ends generation (Llama 3 stops on both
    <|end_of_text|> and <|eot_id|>).
    """

    def __init__(
        self,
        backend: _FastBackend | _SentencePieceBackend,
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
        path = os.fspath(path)
        config = _read_json(path, "tokenizer_config.json")
        special_map = _read_json(path, "special_tokens_map.json")
        token_names = {
            name: _token_content(config.get(name, special_map.get(name)))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")

        if os.path.exists(os.path.join(path, "tokenizer.json")):
            backend = _FastBackend(
                tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
            )
        elif os.path.exists(os.path.join(path, "tokenizer.model")):
            backend = _SentencePieceBackend(
                os.path.join(path, "tokenizer.model"),
                added_tokens=_added_tokens_from_config(config),
                add_bos=True if add_bos is None else bool(add_bos),  # Llama's SentencePiece default
                add_eos=bool(add_eos),
            )
        else:
            raise FileNotFoundError(
                f"directory {path!r} has neither tokenizer.json nor tokenizer.model"
            )

        ids = {name: backend.token_to_id(t) if t else None for name, t in token_names.items()}
        if isinstance(backend, _SentencePieceBackend):
            ids = {name: backend.default_id(name) if i is None else i for name, i in ids.items()}
            backend.set_bos_eos(ids["bos_token"], ids["eos_token"])
        else:
            backend.force_bos_eos(ids["bos_token"], ids["eos_token"], add_bos, add_eos)

        generation = _read_json(path, "generation_config.json").get("eos_token_id")
        extra_eos = generation if isinstance(generation, list) else [generation]
        return cls(
            backend,
            bos_token_id=ids["bos_token"],
            eos_token_id=ids["eos_token"],
            pad_token_id=ids["pad_token"],
            unk_token_id=ids["unk_token"],
            extra_eos_token_ids=[i for i in extra_eos if isinstance(i, int)],
            chat_template=_read_hf_chat_template(path, config),
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        """From the tokenizer.* metadata of a GGUF file (tokenizer.ggml.model "gpt2" or "llama")."""
        meta = read_gguf_tokenizer_metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"GGUF file {os.fspath(path)!r} has no tokenizer.ggml.tokens")
        token_types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
            )
        ids = {
            key: meta.get(f"tokenizer.ggml.{key}_token_id")
            for key in ("bos", "eos", "unknown", "padding", "eot", "eom")
        }
        # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)

        if kind == "gpt2":
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:
                raise ValueError(
                    f"GGUF file {os.fspath(path)!r} has a gpt2 tokenizer but no merges"
                )
            pre = meta.get("tokenizer.ggml.pre", "default")
            fast = _byte_level_bpe_from_gguf(tokens, token_types, merges, pre)
        elif kind == "llama":
            scores = meta.get("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise ValueError(f"GGUF file {os.fspath(path)!r} needs one score per token")
            add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
            fast = _sentencepiece_bpe_from_gguf(
                tokens, token_types, scores, ids["unknown"], add_space_prefix
            )
        else:
            raise ValueError(
                f"tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', 'llama')"
            )
        backend = _FastBackend(fast)
        backend.force_bos_eos(ids["bos"], ids["eos"], add_bos, add_eos)
        return cls(
            backend,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["padding"],
            unk_token_id=ids["unknown"],
            extra_eos_token_ids=[i for i in (ids["eot"], ids["eom"]) if i is not None],
            chat_template=meta.get("tokenizer.chat_template"),
        )

    # ----- the interface -----

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the rows the embedding must have at least)."""
        return self._backend.vocab_size

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


# ----- backends: the one place each library's API is used -----


class _FastBackend:
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


class _SentencePieceBackend:
    """A SentencePiece `tokenizer.model`, with the HF conventions around it.

    Special tokens (the model's control pieces and the config's added tokens) are cut out of the
    text first, and each run of text between them is encoded on its own, so each gets the dummy
    "\u2581" prefix -- what llama.cpp and HF's SentencePiece tokenizers do.
    """

    def __init__(
        self,
        model_file: str,
        added_tokens: dict[int, tuple[str, bool]],
        add_bos: bool,
        add_eos: bool,
    ):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.add_bos, self.add_eos = add_bos, add_eos
        self.bos_id = self.eos_id = None
        n = self.sp.get_piece_size()
        # id -> (text, special): the model's control and unknown pieces are special, its
        # user-defined pieces are matched whole but not special; added tokens as the config says.
        piece_types, self.add_dummy_prefix = _sentencepiece_piece_types(
            self.sp.serialized_model_proto()
        )
        self.added = {
            i: (self.sp.id_to_piece(i), kind != _USER_DEFINED)
            for i, kind in enumerate(piece_types)
            if kind in (_CONTROL, _UNKNOWN, _USER_DEFINED)
        }
        self.added.update(added_tokens)
        self.added_ids = {text: i for i, (text, _) in self.added.items()}
        self.special_ids = frozenset(i for i, (_, special) in self.added.items() if special)
        self.vocab_size = max(n, max(self.added, default=-1) + 1)
        # Longest first, so "<|im_start|>" wins over a shorter token it starts with.
        alternatives = sorted(self.added_ids, key=len, reverse=True)
        self.split_pattern = (
            re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else None
        )

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
                if parts and self.add_dummy_prefix and first_piece.startswith(_SPM_SPACE):
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


def _sentencepiece_piece_types(model_proto: bytes) -> tuple[list[int], bool]:
    """(type of each piece, add_dummy_prefix) from a serialized SentencePiece ModelProto.

    Piece types are numbered NORMAL=1 ... BYTE=6, as llama.cpp numbers them too. The Python API
    can test control/unknown/byte/unused but not user-defined, and the protobuf bindings are an
    extra dependency; the wire format is small: ModelProto field 1 holds each piece, whose field
    3 is its type (NORMAL when absent); field 3 is the NormalizerSpec, whose field 3 is
    add_dummy_prefix (true when absent).
    """
    types, add_dummy_prefix = [], True
    for field, value in _protobuf_fields(model_proto):
        if field == 1:
            kind = _NORMAL
            for piece_field, piece_value in _protobuf_fields(value):
                if piece_field == 3:
                    kind = piece_value
            types.append(kind)
        elif field == 3:
            for spec_field, spec_value in _protobuf_fields(value):
                if spec_field == 3:
                    add_dummy_prefix = bool(spec_value)
    return types, add_dummy_prefix


def _protobuf_fields(data: bytes):
    """(field number, value) of each field of one protobuf message: varints as int,
    length-delimited fields as bytes, fixed 32/64-bit fields as raw bytes."""
    pos = 0

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                return result
            shift += 7

    while pos < len(data):
        key = varint()
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            yield field, varint()
            continue
        size = {1: 8, 5: 4}.get(wire_type)
        if size is None and wire_type != 2:
            raise ValueError(f"unsupported protobuf wire type {wire_type} in a SentencePiece model")
        if size is None:
            size = varint()
        yield field, data[pos : pos + size]
        pos += size


# ----- GGUF -----


def read_gguf_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The `tokenizer.*` and `general.architecture` metadata of a GGUF file, as Python values
    (arrays as lists), as gguf.GGUFReader's `contents()` gives them (tests check that). The
    file is parsed once through `open_gguf`, shared with the model loader."""
    from pyllm.model.gguf_file import open_gguf

    meta = {}
    for key, value in open_gguf(path).metadata.items():
        if key.startswith("tokenizer.") or key == "general.architecture":
            # Copies: the parsed metadata is shared and must stay as read.
            meta[key] = value.tolist() if isinstance(value, numpy.ndarray) else copy.copy(value)
    return meta


def _byte_level_bpe_from_gguf(
    tokens: list[str], token_types: list[int], merges: list[str], pre: str
) -> tokenizers.Tokenizer:
    if pre not in _GPT2_PRE and pre not in _DIGITS_THEN_GPT2_PRE and pre not in _REGEX_PRE:
        known = sorted({*_GPT2_PRE, *_DIGITS_THEN_GPT2_PRE, *_REGEX_PRE})
        raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported (supported: {known})")
    vocab = _unique_vocab(tokens)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    model = models.BPE(vocab, pairs, ignore_merges=pre in _IGNORE_MERGES_PRE)
    tokenizer = tokenizers.Tokenizer(model)
    if pre in _REGEX_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGITS_THEN_GPT2_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(tokenizer, tokens, token_types, special_types=(_CONTROL,))
    return tokenizer


def _sentencepiece_bpe_from_gguf(
    tokens: list[str],
    token_types: list[int],
    scores: list[float],
    unk_id: int | None,
    add_space_prefix: bool,
) -> tokenizers.Tokenizer:
    vocab = _unique_vocab(tokens)
    unk_token = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(
        vocab,
        _merges_from_scores(tokens, token_types, scores),
        unk_token=unk_token,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = tokenizers.Tokenizer(model)
    # A normalizer, not Metaspace: it prepends "\u2581" even to text that already starts with a
    # space (" hi" -> "\u2581\u2581hi"), as SentencePiece and llama.cpp do. Added tokens are cut
    # out before normalizing, so every run of text between them gets its own prefix.
    steps = [normalizers.Prepend(_SPM_SPACE)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
    tokenizer.pre_tokenizer = None
    tokenizer.decoder = decoders.Decoder.custom(_SentencePieceDecoder(add_space_prefix))
    _add_gguf_special_tokens(tokenizer, tokens, token_types, special_types=(_CONTROL, _UNKNOWN))
    return tokenizer


class _SentencePieceDecoder:
    """Tokens -> text for a SentencePiece-style vocabulary: "\u2581" is a space, "<0xNN>" a raw
    byte, and the dummy prefix space of the first token is dropped.

    Used instead of tokenizers' ByteFallback decoder, which turns a whole run of byte tokens into
    U+FFFD when any of them is invalid: then "\u4f60" followed by a stray byte decodes to four
    U+FFFD, and decoding a longer sequence could rewrite text already streamed. Here the bytes
    are joined and decoded once with errors="replace", so only the invalid bytes are replaced
    and the text of a prefix that ends on a whole character never changes.
    """

    def __init__(self, strip_prefix_space: bool):
        self.strip_prefix_space = strip_prefix_space

    def decode_chain(self, tokens: list[str]) -> list[str]:
        raw = bytearray()
        for token in tokens:
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                raw.append(int(token[3:5], 16))
            else:
                raw += token.replace(_SPM_SPACE, " ").encode("utf-8")
        if self.strip_prefix_space and tokens and tokens[0].startswith(_SPM_SPACE):
            del raw[:1]
        return [raw.decode("utf-8", errors="replace")]


def _merges_from_scores(
    tokens: list[str], token_types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's rule "join the adjacent pair whose concatenation
    is the best-scoring piece": every split of a normal piece into two normal pieces is a merge,
    ranked by the score of the piece it makes."""
    normal = {t for t, kind in zip(tokens, token_types, strict=True) if kind == _NORMAL}
    ranked = []
    for token_id, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind != _NORMAL:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[token_id], token_id, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def _unique_vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id. A few files repeat a token's text; the repeat keeps its id under a spelling no
    text can produce, so ids stay dense and the first spelling stays the one that encodes."""
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab[token if token not in vocab else f"<pyllm-duplicate-{token_id}>"] = token_id
    return vocab


def _add_gguf_special_tokens(
    tokenizer: tokenizers.Tokenizer,
    tokens: list[str],
    token_types: list[int],
    special_types: tuple[int, ...],
) -> None:
    """Match control and user-defined tokens whole in the text. They keep their vocabulary ids:
    tokenizers reuses an id when an added token's text is already in the model's vocabulary."""
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True)
        if kind in special_types
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=True)
        if kind == _USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


# ----- HF directory helpers -----


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


# ----- chat templates -----


def validate_messages(messages: Sequence[dict[str, Any]]) -> None:
    """Raise ValueError unless `messages` is a list of {"role": <known role>, "content": str}."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{index}] has unknown role {role!r} (allowed: {CHAT_ROLES})")
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{index}].content must be a str, got {type(content).__name__}"
            )


def render_chat_template(
    template: str,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Render a HF-style Jinja chat template with the variables HF's apply_chat_template provides
    (messages, tools, add_generation_prompt, bos_token, eos_token, ... and any extras)."""
    import jinja2

    validate_messages(messages)
    compiled = _compile_chat_template(template)
    try:
        return compiled.render(
            messages=[dict(m) for m in messages],
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateError as error:  # undefined names, sandbox refusals
        raise ValueError(f"chat template failed: {type(error).__name__}: {error}") from error


@lru_cache(maxsize=16)
def _compile_chat_template(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; for
        inference it renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str):
        raise ValueError(f"chat template error: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the plain JSON.
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    # trim_blocks/lstrip_blocks: templates are written for them (HF renders with both on).
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationBlock]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template does not parse: {error}") from error
