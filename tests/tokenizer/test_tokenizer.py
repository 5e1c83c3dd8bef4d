"""Tokenizer tests: pyllm's ids against independent references.

- SmolLM2's GGUF (byte-level BPE, "smollm" split) against HF transformers' tokenizer built from the
  same file, and against that tokenizer with the digit split the model was trained with.
- A tiny SentencePiece model: pyllm's sentencepiece-backed tokenizer and the "llama" GGUF built
  from the same vocabulary, both against sentencepiece itself.
"""

import json
import os

import pytest

from pyllm.model.tokenizer import Tokenizer, read_gguf_tokenizer_metadata
from pyllm.model.tokenizer.sentencepiece_proto import sentencepiece_piece_types
from tests.tokenizer import (
    DIGIT_AFTER_SPACES_TEXTS,
    MIXED_TEXTS,
    SP_CONTROL,
    SP_USER_DEFINED,
    hf_smollm,
    pyllm_smollm,
    random_texts,
    smollm_gguf,
    train_sentencepiece,
    write_sentencepiece_gguf,
    write_sentencepiece_hf_dir,
)

# ----- SmolLM2 GGUF (byte-level BPE) -----


def test_gguf_metadata_equals_gguf_reader():
    """Our key-value reader against the gguf package's reader, key by key."""
    gguf = pytest.importorskip("gguf")
    ours = read_gguf_tokenizer_metadata(smollm_gguf())
    reader = gguf.GGUFReader(smollm_gguf())
    theirs = {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith("tokenizer.") or key == "general.architecture"
    }
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert ours[key] == theirs[key], key
    assert len(ours["tokenizer.ggml.tokens"]) == 49152
    assert len(ours["tokenizer.ggml.merges"]) == 48900


def test_smollm_special_ids_match_hf():
    ours, hf = pyllm_smollm(), hf_smollm()
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.unk_token_id == hf.unk_token_id
    assert ours.eos_token_ids == {hf.eos_token_id}
    assert ours.add_bos_token is False  # tokenizer.ggml.add_bos_token = false
    hf_added = hf.backend_tokenizer.get_added_tokens_decoder()
    assert ours.special_token_ids == {i for i, token in hf_added.items() if token.special}
    assert ours.special_token_ids == set(range(17))  # the 17 CONTROL tokens of this vocabulary


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_smollm_ids_match_hf_on_mixed_text(add_special_tokens):
    ours, hf = pyllm_smollm(), hf_smollm()
    texts = [t for t in MIXED_TEXTS if not _hf_gguf_split_differs(t)]
    assert len(texts) >= len(MIXED_TEXTS) - 1
    for text in texts:
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf.encode(text, add_special_tokens=add_special_tokens), text
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), text
        assert ours.decode(ids) == text  # byte-level BPE round-trips exactly


def test_smollm_special_tokens_are_single_ids():
    tok = pyllm_smollm()
    for token_id, token in enumerate(tok.convert_ids_to_tokens(range(17))):
        assert token.startswith("<") and token.endswith(">"), token
        assert tok.encode(f"x{token}y") == [tok.token_to_id("x"), token_id, tok.token_to_id("y")]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def _hf_gguf_split_differs(text: str) -> bool:
    """Whether HF's GGUF loader (GPT-2 split alone) may cut `text` differently from SmolLM2's
    trained tokenizer (single numerals first): a numeral (Unicode N*) after two or more spaces,
    or a non-ASCII numeral (such as "½", which merges with a space) after one."""
    import unicodedata

    for i, char in enumerate(text):
        if i == 0 or not unicodedata.category(char).startswith("N") or not text[i - 1].isspace():
            continue
        if not char.isascii() or (i >= 2 and text[i - 2].isspace()):
            return True
    return False


def _hf_with_digit_split():
    """HF's tokenizer for the same GGUF, given the pre-tokenizer SmolLM2's own tokenizer.json has
    (single digits, then the GPT-2 split) -- llama.cpp's "smollm" split."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import pre_tokenizers

    raw = RawTokenizer.from_str(hf_smollm().backend_tokenizer.to_str())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return raw


def test_smollm_splits_digits_like_the_trained_tokenizer():
    """HF's GGUF loader does not split digits for "smollm", so a whitespace run before a digit
    comes out differently there; compare those texts with the digit-splitting reference."""
    tok, reference = pyllm_smollm(), _hf_with_digit_split()
    for text in DIGIT_AFTER_SPACES_TEXTS + MIXED_TEXTS:
        assert tok.encode(text) == reference.encode(text).ids, text
    two_spaces = tok.token_to_id("\u0120\u0120")  # "ĠĠ", two spaces in the byte alphabet
    assert tok.encode("a  1") == [tok.token_to_id("a"), two_spaces, tok.token_to_id("1")]


def test_smollm_ids_match_references_on_random_text():
    tok, hf, reference = pyllm_smollm(), hf_smollm(), _hf_with_digit_split()
    compared_with_hf = 0
    for text in random_texts(1500, seed=1):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        if not _hf_gguf_split_differs(text):
            assert ids == hf.encode(text, add_special_tokens=False), text
            compared_with_hf += 1
        assert tok.decode(ids) == text
    assert compared_with_hf > 500


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
def test_gguf_pre_tokenizer_regexes_match_hf(tmp_path, pre):
    """SmolLM2's vocabulary written to a GGUF that names another split, against HF's tokenizer
    for SmolLM2 given the split HF transformers' GGUF loader uses for that name (Llama 3's,
    Qwen2's, GPT-2's). Loading each GGUF through HF would cost ~10 s; the split is what differs."""
    gguf = pytest.importorskip("gguf")
    from tokenizers import Regex, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    meta = read_gguf_tokenizer_metadata(smollm_gguf())
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = Tokenizer.from_gguf(path)

    state = json.loads(hf_smollm().backend_tokenizer.to_str())
    # Llama 3's tokenizer looks whole pre-tokens up before merging, as llama.cpp does for it.
    state["model"]["ignore_merges"] = pre == "llama-bpe"
    reference = RawTokenizer.from_str(json.dumps(state))
    if pre == "default":
        assert pre not in GGUF_PRE_TOKENIZER_SPLITS  # HF keeps GPT-2's ByteLevel split
    else:
        reference.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    for text in MIXED_TEXTS + DIGIT_AFTER_SPACES_TEXTS + random_texts(500, seed=2):
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == expected, (pre, text)


def test_unknown_pre_tokenizer_is_rejected(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("no-such-split")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no-such-split"):
        Tokenizer.from_gguf(path)


def test_hf_dir_with_tokenizer_json(tmp_path):
    """The folder HF saves for this tokenizer, plus a generation_config.json with two stop ids."""
    hf = hf_smollm()
    hf.save_pretrained(str(tmp_path))
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [2, 0]}, f)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_ids == {2, 0}
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.chat_template == hf.chat_template
    for text in MIXED_TEXTS + DIGIT_AFTER_SPACES_TEXTS:
        assert tok.encode(text) == hf.encode(text), text
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_from_pretrained_dispatch_and_errors(tmp_path):
    assert Tokenizer.from_pretrained(smollm_gguf()).vocab_size == 49152
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="out of range"):
        pyllm_smollm().decode([49152])


# ----- SentencePiece -----


@pytest.fixture(scope="module", params=[True, False], ids=["dummy_prefix", "no_dummy_prefix"])
def sentencepiece_model(request, tmp_path_factory):
    """(sentencepiece processor, pyllm on tokenizer.model, pyllm on the GGUF of the same vocab)."""
    sentencepiece = pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("sp")
    model_file = str(directory / "tiny.model")
    train_sentencepiece(model_file, add_dummy_prefix=request.param)
    write_sentencepiece_hf_dir(model_file, str(directory / "hf"))
    write_sentencepiece_gguf(model_file, str(directory / "tiny.gguf"), request.param)
    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    from_model = Tokenizer.from_pretrained(directory / "hf")
    from_gguf = Tokenizer.from_pretrained(directory / "tiny.gguf")
    return sp, from_model, from_gguf, request.param


def test_sentencepiece_piece_types_match_sentencepiece(sentencepiece_model):
    sp, _, _, dummy_prefix = sentencepiece_model
    types, add_dummy_prefix = sentencepiece_piece_types(sp.serialized_model_proto())
    assert add_dummy_prefix == dummy_prefix
    assert len(types) == sp.get_piece_size()
    for i, kind in enumerate(types):
        assert (kind == 2, kind == 3, kind == 6) == (
            sp.is_unknown(i),
            sp.is_control(i),
            sp.is_byte(i),
        )
    assert types[sp.piece_to_id(SP_USER_DEFINED)] == 4


def test_sentencepiece_special_ids(sentencepiece_model):
    sp, from_model, from_gguf, _ = sentencepiece_model
    for tok in (from_model, from_gguf):
        assert tok.vocab_size == sp.get_piece_size()
        assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (
            sp.bos_id(),
            sp.eos_id(),
            sp.unk_id(),
        )
        assert tok.eos_token_ids == {sp.eos_id()}
        assert tok.add_bos_token is True


def test_sentencepiece_ids_match_sentencepiece(sentencepiece_model):
    """Text without special tokens: both pyllm paths give sentencepiece's ids and text, the
    GGUF one through our score-ranked merges, byte fallback and prefix normalizer."""
    sp, from_model, from_gguf, _ = sentencepiece_model
    texts = [t for t in MIXED_TEXTS if "<|" not in t] + random_texts(1500, seed=3)
    for text in texts:
        expected = sp.encode(text)
        assert from_model.encode(text, add_special_tokens=False) == expected, text
        assert from_gguf.encode(text, add_special_tokens=False) == expected, text
        assert from_gguf.encode(text) == [sp.bos_id(), *expected], text
        for tok in (from_model, from_gguf):
            assert tok.decode(expected) == sp.decode(expected), text
            assert tok.convert_ids_to_tokens(expected) == [sp.id_to_piece(i) for i in expected]
    byte_fallback = sp.encode("你好😀")
    assert all(sp.is_byte(i) for i in byte_fallback if sp.id_to_piece(i) != "\u2581")


def test_sentencepiece_special_tokens_agree(sentencepiece_model):
    """Control, unknown and user-defined pieces are cut out of the text first and each run of
    text is encoded alone (llama.cpp's and HF's rule); both pyllm paths must agree on it."""
    sp, from_model, from_gguf, dummy_prefix = sentencepiece_model
    control, user = sp.piece_to_id(SP_CONTROL), sp.piece_to_id(SP_USER_DEFINED)
    texts = [
        f"{SP_USER_DEFINED}user\nHello world{SP_CONTROL} after",
        f"<s>Hi</s> there{SP_CONTROL}{SP_CONTROL}",
        f"text<unk>more {SP_USER_DEFINED}",
    ]
    for text in texts:
        ids = from_gguf.encode(text)
        assert from_model.encode(text) == ids, text
        segments = text.replace(SP_CONTROL, "\0").replace(SP_USER_DEFINED, "\0")
        assert ids.count(control) + ids.count(user) == segments.count("\0")
        for skip in (False, True):
            assert from_model.decode(ids, skip_special_tokens=skip) == from_gguf.decode(
                ids, skip_special_tokens=skip
            ), text
    ids = from_gguf.encode(f"{SP_USER_DEFINED}Hello world{SP_CONTROL}", add_special_tokens=False)
    assert ids[0] == user and ids[-1] == control
    assert ids[1:-1] == sp.encode("Hello world")
    # Only a space at the very start of the text is the dummy prefix; after a token it is text.
    space = " " if dummy_prefix else ""
    for tok in (from_model, from_gguf):
        assert tok.decode(ids, skip_special_tokens=True) == f"{SP_USER_DEFINED}{space}Hello world"


def test_sentencepiece_gguf_hf_tokenizer_encodes_alike(sentencepiece_model):
    """A GGUF vocabulary runs on SentencePiece; the tokenizers BPE it builds for tokenizer.json
    tools (merges ranked by score, byte fallback, the prefix normalizer) gives the same ids."""
    sp, _, from_gguf, _ = sentencepiece_model
    assert from_gguf.fast_tokenizer is None  # SentencePiece runs it
    hf = from_gguf.hf_tokenizer()
    for text in [t for t in MIXED_TEXTS if "<|" not in t] + random_texts(500, seed=5):
        assert hf.encode(text, add_special_tokens=False).ids == sp.encode(text), text


def test_a_vocabulary_sentencepiece_refuses_runs_on_tokenizers(tmp_path):
    """SentencePiece refuses a vocabulary that spells two pieces alike (a few GGUF files do):
    it then runs on the tokenizers BPE, with the same ids on text without special tokens."""
    sentencepiece = pytest.importorskip("sentencepiece")
    model_file = str(tmp_path / "tiny.model")
    train_sentencepiece(model_file, add_dummy_prefix=True)
    write_sentencepiece_gguf(model_file, str(tmp_path / "v.gguf"), True, repeat_a_piece=True)
    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    tokenizer = Tokenizer.from_pretrained(tmp_path / "v.gguf")
    assert tokenizer.fast_tokenizer is not None
    for text in [t for t in MIXED_TEXTS if "<" not in t] + random_texts(200, seed=7):
        assert tokenizer.encode(text, add_special_tokens=False) == sp.encode(text), text


def test_model_proto_of_short_and_long_pieces():
    """The proto written at once for short pieces equals the one written piece by piece, and
    a vocabulary with a piece too long for that (200 bytes) loads in SentencePiece too."""
    import numpy as np

    sentencepiece = pytest.importorskip("sentencepiece")
    from pyllm.model.tokenizer import sentencepiece_proto as proto

    pieces = ["<unk>", "<s>", "\u2581", "a", "b", "\u2581a", "ab", "\u4f60\u597d"]
    kinds = [2, 3, 1, 1, 1, 1, 1, 4]
    scores = np.array([0.0, 0.0, -1.0, -2.0, -3.0, -1.5, -1.2, 0.0], dtype="<f4")
    texts = [p.encode() for p in pieces]
    one_by_one = b"".join(
        proto._piece(t, float(v), k) for t, v, k in zip(texts, scores, kinds, strict=True)
    )
    assert proto._pieces_short(texts, scores, np.array(kinds)) == one_by_one
    long_pieces = [*pieces, "x" * 200]
    written = proto.bpe_model_proto(long_pieces, [*scores, -9.0], [*kinds, 1], True)
    sp = sentencepiece.SentencePieceProcessor(model_proto=written)
    assert [sp.id_to_piece(i) for i in range(len(long_pieces))] == long_pieces
    assert sp.encode("ab") == [2, 6]  # "ab" outscores "\u2581a": merged first
    assert sp.is_unknown(0) and sp.is_control(1) and not sp.is_byte(3)


def test_longest_match_regex_splits_as_a_longest_first_alternation():
    import random
    import re

    from pyllm.model.tokenizer.backends import longest_match_regex

    rng = random.Random(0)
    for _ in range(50):
        words = {"".join(rng.choices("ab<|>", k=rng.randint(1, 5))) for _ in range(20)}
        flat = re.compile(
            "(" + "|".join(map(re.escape, sorted(words, key=len, reverse=True))) + ")"
        )
        trie = re.compile("(" + longest_match_regex(words) + ")")
        for _ in range(20):
            text = "".join(rng.choices("ab<|> c", k=rng.randint(0, 30)))
            assert trie.split(text) == flat.split(text), (words, text)


def test_sentencepiece_hf_dir_needs_a_tokenizer(tmp_path):
    with open(os.path.join(tmp_path, "tokenizer_config.json"), "w") as f:
        f.write("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.model"):
        Tokenizer.from_hf_dir(tmp_path)
