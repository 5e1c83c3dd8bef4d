"""GGUF vocabularies: the `tokenizers.Tokenizer` that llama.cpp's tokenizer metadata describes.

A GGUF file carries no tokenizer program, only tokens, merges or scores, token types and special
ids, so we build the tokenizer they describe:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges. Text is first split by
  the regex `tokenizer.ggml.pre` names (the split the merges were learned on), then mapped to the
  GPT-2 byte alphabet.
- `tokenizer.ggml.model == "llama"`: SentencePiece-style BPE. Spaces become "\u2581", a "\u2581"
  is prepended to each run of text (`add_space_prefix`), pieces merge best-score-first, and
  characters outside the vocabulary fall back to `<0xNN>` byte tokens. SentencePiece runs it,
  from a model written from the pieces, scores and types; the `tokenizers` BPE with merges
  derived from the scores is built where SentencePiece refuses the vocabulary, and on demand
  for tools that take a tokenizer.json.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import numpy
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from pyllm.model.gguf_file import open_gguf
from pyllm.model.tokenizer.backends import (
    SPM_SPACE,
    FastBackend,
    SentencePieceBackend,
    TokenizerParts,
)
from pyllm.model.tokenizer.chat import (
    BUILTIN_CHAT_TEMPLATES,
    END_OF_TURN_TOKENS,
    HARMONY_END_TOKENS,
    HARMONY_MESSAGE_END,
)
from pyllm.model.tokenizer.sentencepiece_proto import (
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    bpe_model_proto,
)

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


def load_gguf(path: str | os.PathLike) -> TokenizerParts:
    """From the tokenizer.* metadata of a GGUF file (tokenizer.ggml.model "gpt2" or "llama")."""
    meta = read_gguf_tokenizer_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"GGUF file {os.fspath(path)!r} has no tokenizer.ggml.tokens")
    token_types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
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

    extra_eos = _end_ids(tokens, ids)

    def hf_backend() -> FastBackend:
        backend = FastBackend(_build(path, meta, kind, tokens, token_types, ids["unknown"]))
        backend.force_bos_eos(ids["bos"], ids["eos"], add_bos, add_eos)
        return backend

    backend = None
    if kind == "llama":
        backend = _sentencepiece_backend(meta, tokens, token_types, add_bos, add_eos, hf_backend)
    if backend is None:
        backend = hf_backend()
    else:
        backend.set_bos_eos(ids["bos"], ids["eos"])
    return TokenizerParts(
        backend,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["padding"],
        unk_token_id=ids["unknown"],
        extra_eos_token_ids=[i for i in extra_eos if i is not None],
        chat_template=meta.get("tokenizer.chat_template")
        or BUILTIN_CHAT_TEMPLATES.get(meta.get("general.architecture")),
    )


def _end_ids(tokens: list[str], ids: dict[str, int | None]) -> list[int | None]:
    """The ids besides EOS that end a reply (end of turn, harmony's ends); sets ids["eot"]
    where the file names none, and ids["eos"] to harmony's end of reply."""
    named = {t: tokens.index(t) for t in (*END_OF_TURN_TOKENS, *HARMONY_END_TOKENS) if t in tokens}
    if ids["eot"] is None:
        ids["eot"] = next((named[t] for t in END_OF_TURN_TOKENS if t in named), None)
    extra_eos = [ids["eot"], ids["eom"]]
    if all(t in named for t in HARMONY_END_TOKENS):
        extra_eos = [i for i in extra_eos if i is None or tokens[i] != HARMONY_MESSAGE_END]
        extra_eos += [named[t] for t in HARMONY_END_TOKENS]
        if ids["eos"] is not None and tokens[ids["eos"]] == HARMONY_MESSAGE_END:
            ids["eos"] = named[HARMONY_END_TOKENS[0]]
    return extra_eos


def _build(
    path: str | os.PathLike,
    meta: dict[str, Any],
    kind: str | None,
    tokens: list[str],
    token_types: list[int],
    unk_id: int | None,
) -> tokenizers.Tokenizer:
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None:
            raise ValueError(f"GGUF file {os.fspath(path)!r} has a gpt2 tokenizer but no merges")
        pre = meta.get("tokenizer.ggml.pre", "default")
        return _byte_level_bpe_from_gguf(tokens, token_types, merges, pre)
    if kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError(f"GGUF file {os.fspath(path)!r} needs one score per token")
        add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        return _sentencepiece_bpe_from_gguf(tokens, token_types, scores, unk_id, add_space_prefix)
    raise ValueError(f"tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', 'llama')")


def read_gguf_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The `tokenizer.*` and `general.architecture` metadata of a GGUF file, as Python values
    (arrays as lists), as gguf.GGUFReader's `contents()` gives them (tests check that). The
    file is parsed once through `open_gguf`, shared with the model loader."""
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
    _add_gguf_special_tokens(tokenizer, tokens, token_types, special_types=(CONTROL,))
    return tokenizer


def _sentencepiece_backend(
    meta: dict[str, Any],
    tokens: list[str],
    token_types: list[int],
    add_bos: bool,
    add_eos: bool,
    hf_backend: Callable[[], FastBackend],
) -> SentencePieceBackend | None:
    """A "llama" vocabulary run by SentencePiece itself, from a model written from the
    file's pieces, scores and types: what llama.cpp's tokenizer does, and 0.2 s to build
    for Gemma 3's 262,144 pieces where the `tokenizers` BPE (`_sentencepiece_bpe_from_gguf`,
    whose 513,511 merges are derived from the scores) takes 1.5 s. That one is still built
    for tools that need a tokenizer.json (`hf_tokenizer`), and is the tokenizer where
    SentencePiece refuses the model (a piece twice, an empty piece, some byte pieces but
    not all 256, neither an unknown piece nor byte pieces). None then, and where scores
    are missing."""
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        return None  # _build names the problem
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    proto = bpe_model_proto(tokens, scores, token_types, add_space_prefix)
    try:
        return SentencePieceBackend(
            None,
            added_tokens={},
            add_bos=bool(add_bos),
            add_eos=bool(add_eos),
            model_proto=proto,
            piece_types=(token_types, add_space_prefix),
            hf_factory=lambda: hf_backend().tokenizer,
        )
    except RuntimeError:  # SentencePiece's refusal of an invalid model
        return None


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
    steps = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    tokenizer.pre_tokenizer = None
    tokenizer.decoder = decoders.Decoder.custom(_SentencePieceDecoder(add_space_prefix))
    _add_gguf_special_tokens(tokenizer, tokens, token_types, special_types=(CONTROL, UNKNOWN))
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
                raw += token.replace(SPM_SPACE, " ").encode("utf-8")
        if self.strip_prefix_space and tokens and tokens[0].startswith(SPM_SPACE):
            del raw[:1]
        return [raw.decode("utf-8", errors="replace")]


def _merges_from_scores(
    tokens: list[str], token_types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's rule "join the adjacent pair whose concatenation
    is the best-scoring piece": every split of a normal piece into two normal pieces is a merge,
    ranked by the score of the piece it makes."""
    normal = {t for t, kind in zip(tokens, token_types, strict=True) if kind == NORMAL}
    ranked = []
    for token_id, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind != NORMAL:
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
        if kind == USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
