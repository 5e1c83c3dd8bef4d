"""IncrementalDetokenizer: streamed deltas concatenate to the decode of all generated ids, and no
delta shows U+FFFD for a character whose remaining bytes are still to come."""

import random

import pytest

from pyllm.model.tokenizer import Tokenizer
from pyllm.sampling import IncrementalDetokenizer
from tests.tokenizer import (
    MIXED_TEXTS,
    hf_smollm,
    pyllm_smollm,
    random_texts,
    train_sentencepiece,
    write_sentencepiece_gguf,
    write_sentencepiece_hf_dir,
)

MULTILINGUAL = [
    "我喜欢学习人工智能。你好，世界！",
    "日本語のテキスト、한국어 문장, Ελληνικά, Русский, עברית, العربية",
    "emoji 😀👍🏽 and family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and 🎉💡🤖",
    "naïve café résumé — “quotes” … ½ ² ∑",
    "  leading spaces, code:\n\tdef f():\n        return '你好'\n",
]


def stream(tokenizer, prompt_ids, generated_ids, skip_special_tokens=True):
    """Feed tokens one by one; return (deltas from add, delta from flush)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(token_id) for token_id in generated_ids]
    final = detok.flush()
    assert detok.output_text == "".join(deltas) + final
    assert detok.generated_ids == list(generated_ids)
    return deltas, final


def check_valid_text(tokenizer, generated_ids, prompt_ids=()):
    """For ids of valid text: deltas add up to decode(), the flush has nothing left, and no
    delta carries U+FFFD (the text has none, so any would be a split character)."""
    expected = tokenizer.decode(generated_ids, skip_special_tokens=True)
    assert "\ufffd" not in expected
    deltas, final = stream(tokenizer, list(prompt_ids), generated_ids)
    assert "".join(deltas) == expected
    assert final == ""
    assert not any("\ufffd" in delta for delta in deltas)
    return deltas


# ----- byte-level BPE (SmolLM2) -----


@pytest.mark.parametrize("text", MULTILINGUAL + MIXED_TEXTS)
def test_bpe_text_streams_exactly(text):
    tok = pyllm_smollm()
    ids = tok.encode(text, add_special_tokens=False)
    deltas = check_valid_text(tok, ids, prompt_ids=tok.encode("Question: "))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


def test_bpe_split_characters_are_held_back():
    """ "你" is two byte-level tokens here: the first alone must produce no text."""
    tok = pyllm_smollm()
    ids = tok.encode("你")
    assert len(ids) >= 2 and tok.decode(ids[:1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["你"]


def test_bpe_random_ids_concatenate_to_decode():
    """Arbitrary ids, invalid byte sequences included: the stream still equals decode()."""
    tok = pyllm_smollm()
    rng = random.Random(0)
    # Ids of byte-level tokens that are lone UTF-8 pieces make split characters likely.
    pieces = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert len(pieces) > 100
    for trial in range(150):
        pool = pieces if trial % 2 else range(tok.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            deltas, final = stream(tok, [], ids, skip_special_tokens=skip)
            assert "".join(deltas) + final == tok.decode(ids, skip_special_tokens=skip), ids


def test_bpe_special_tokens():
    tok = pyllm_smollm()
    ids = tok.encode("Hi<|im_end|>\n<|im_start|>assistant\n你好<|im_end|>")
    for skip in (True, False):
        deltas, final = stream(tok, [], ids, skip_special_tokens=skip)
        assert "".join(deltas) + final == tok.decode(ids, skip_special_tokens=skip)
    assert "<|im_end|>" not in "".join(stream(tok, [], ids)[0])


def test_hf_tokenizer_works_as_the_decoder():
    """The detokenizer needs only decode(ids, skip_special_tokens=...): HF's tokenizer gives the
    same stream as ours."""
    ours, hf = pyllm_smollm(), hf_smollm()
    for text in MULTILINGUAL:
        ids = ours.encode(text)
        assert stream(hf, [], ids) == stream(ours, [], ids)


# ----- SentencePiece with byte fallback -----


@pytest.fixture(scope="module", params=["tokenizer.model", "gguf"])
def sentencepiece_tokenizer(request, tmp_path_factory):
    """The tiny SentencePiece model, through sentencepiece or through the GGUF llama path; its
    vocabulary has no CJK or emoji, so those come out as <0xNN> byte tokens."""
    directory = tmp_path_factory.mktemp("sp_detok")
    model_file = str(directory / "tiny.model")
    train_sentencepiece(model_file)
    if request.param == "gguf":
        write_sentencepiece_gguf(model_file, str(directory / "tiny.gguf"), add_space_prefix=True)
        return Tokenizer.from_pretrained(directory / "tiny.gguf")
    write_sentencepiece_hf_dir(model_file, str(directory / "hf"))
    return Tokenizer.from_pretrained(directory / "hf")


def test_sentencepiece_byte_fallback_streams_exactly(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    for text in MULTILINGUAL + [t for t in MIXED_TEXTS if "<|" not in t]:
        ids = tok.encode(text, add_special_tokens=False)
        deltas = check_valid_text(tok, ids, prompt_ids=tok.encode("Question:"))
        assert "".join(deltas) == text  # decode drops only the dummy prefix it added
    pieces = tok.convert_ids_to_tokens(tok.encode("你好😀", add_special_tokens=False))
    assert sum(p.startswith("<0x") for p in pieces) == 10  # 3 + 3 + 4 bytes, one token each


def test_sentencepiece_first_token_space(sentencepiece_tokenizer):
    """The first generated token's "\u2581" is the dummy prefix, as in decode() of the generated
    ids; later ones are spaces."""
    tok = sentencepiece_tokenizer
    ids = tok.encode("Hello world hello", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[0].startswith("\u2581")
    deltas = check_valid_text(tok, ids, prompt_ids=tok.encode("Say:"))
    assert deltas[0] and not deltas[0].startswith(" ")
    assert "".join(deltas) == "Hello world hello"


def test_sentencepiece_random_text_and_ids(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    for text in random_texts(200, seed=5):
        check_valid_text(tok, tok.encode(text, add_special_tokens=False))
    rng = random.Random(1)
    byte_ids = [i for i, p in enumerate(tok.convert_ids_to_tokens(range(tok.vocab_size)))
                if p.startswith("<0x")]  # fmt: skip
    for trial in range(150):
        pool = byte_ids if trial % 2 else range(tok.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 25))]
        for skip in (True, False):
            deltas, final = stream(tok, [], ids, skip_special_tokens=skip)
            assert "".join(deltas) + final == tok.decode(ids, skip_special_tokens=skip), ids


def test_truncated_character_is_flushed_at_the_end(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    ids = tok.encode("ok 你", add_special_tokens=False)[:-1]  # drop the last byte of "你"
    deltas, final = stream(tok, [], ids)
    assert "\ufffd" not in "".join(deltas)
    assert final.endswith("\ufffd")
    assert "".join(deltas) + final == tok.decode(ids, skip_special_tokens=True)


# ----- DecodeStream path -----


class DecodeOnly:
    """A decoder with only decode(): the detokenizer's Python path."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_stream_gives_the_python_path_deltas():
    """A pyllm Tokenizer steps through tokenizers' DecodeStream; delta for delta, it says what the
    decode()-only path says, invalid byte sequences and special tokens included."""
    tok = pyllm_smollm()
    assert IncrementalDetokenizer(tok, [])._stream is not None
    rng = random.Random(2)
    texts = [tok.encode(text) for text in MULTILINGUAL + MIXED_TEXTS]
    randoms = [[rng.randrange(tok.vocab_size) for _ in range(40)] for _ in range(50)]
    for ids in texts + randoms:
        for skip in (True, False):
            assert stream(tok, [1, 2], ids, skip) == stream(DecodeOnly(tok), [1, 2], ids, skip)


def test_decode_stream_falls_back_when_emitted_text_changes():
    """DecodeStream refuses a decoder whose text for more tokens does not extend the text for
    fewer (here: reversed); the Python path then takes over and emits what it always did."""
    import tokenizers
    from tokenizers import decoders, models

    from pyllm.model.tokenizer.backends import FastBackend

    class Reverse:
        def decode_chain(self, tokens):
            return ["".join(tokens)[::-1]]

    fast = tokenizers.Tokenizer(models.WordLevel({c: i for i, c in enumerate("abcdef")}, "a"))
    fast.decoder = decoders.Decoder.custom(Reverse())
    tok = Tokenizer(FastBackend(fast), bos_token_id=None, eos_token_id=None)
    ids = [0, 1, 2, 3, 4, 5, 0, 1]
    assert stream(tok, [], ids) == stream(DecodeOnly(tok), [], ids)
    detok = IncrementalDetokenizer(tok, [])
    for token_id in ids:
        detok.add(token_id)
    assert detok._stream is None


def test_out_of_range_id_raises_as_decode_does():
    detok = IncrementalDetokenizer(pyllm_smollm(), [])
    detok.add(42)
    with pytest.raises(ValueError, match="out of range"):
        detok.add(pyllm_smollm().vocab_size)
