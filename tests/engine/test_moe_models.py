"""Mixture-of-experts models through the whole engine: greedy tokens equal to HF's
for Qwen3-MoE, Mixtral and gpt-oss, alone and batched with chunked prefill, in both KV-cache
modes; and `pyllm generate` on a tiny Qwen3-MoE GGUF file."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tokenizers import pre_tokenizers

from pyllm import LLM, SamplingParams
from pyllm.model.tokenizer import Tokenizer
from tests.engine.test_engine import _prompts, _write_byte_tokenizer
from tests.model.conftest import make_hf_model
from tests.model.test_gguf import write_hf_as_gguf

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

KINDS = {
    "qwen3moe": {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True},
    "mixtral": {"sliding_window": 12},
    "gpt_oss": {"swiglu_limit": 1.5},
}


def hf_greedy(hf_model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_tokens_match_hf_alone_batched_and_chunked(tmp_path, kind):
    hf = make_hf_model(kind, tmp_path, max_position_embeddings=1024, **KINDS[kind])
    _write_byte_tokenizer(tmp_path, vocab_size=512)
    prompts = _prompts(5, seed=3)
    expected = [hf_greedy(hf, p) for p in prompts]
    for kv_cache in ("paged", "contiguous"):
        # 16 tokens a step: the longer prompts prefill in chunks beside others' decodes.
        llm = LLM(str(tmp_path), dtype="float32", kv_cache=kv_cache, max_num_batched_tokens=16,
                  kv_cache_memory=0.05)  # fmt: skip
        batched = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in batched] == expected, kv_cache
        alone = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY, use_tqdm=False)
        assert alone[0].outputs[0].token_ids == expected[0], kv_cache


def byte_level_tokenizer(vocab_size: int) -> dict:
    """tokenizer.* metadata of a GPT-2-style byte-level BPE vocabulary: the 256 byte
    symbols, then merges of pairs of them up to vocab_size tokens."""
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [f"{a} {b}" for a in symbols[:16] for b in symbols[:16]][: vocab_size - 256]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": symbols + [m.replace(" ", "") for m in merges],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": [1] * vocab_size,
    }


def test_generate_cli_on_a_moe_gguf(tmp_path):
    """`pyllm generate --model tiny-moe.gguf`: the text it prints is the prompt and
    HF's greedy continuation of the same tokens."""
    hf = make_hf_model("qwen3moe", tmp_path / "hf", max_position_embeddings=1024)
    path = tmp_path / "tiny-moe.gguf"
    write_hf_as_gguf(hf, path, "qwen3moe", tokenizer=byte_level_tokenizer(512))
    prompt = "Once upon a time"
    run = subprocess.run(
        [sys.executable, "-m", "pyllm", "generate", "--model", str(path), "--dtype", "float32",
         "--max-tokens", str(NEW_TOKENS), "--kv-cache-memory", "0.05", prompt],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    tokenizer = Tokenizer.from_pretrained(str(path))
    ids = tokenizer.encode(prompt)
    continuation = tokenizer.decode(hf_greedy(hf, ids))
    # Byte tokens that end mid-character are held back by the streaming detokenizer.
    assert run.stdout == prompt + continuation.rstrip("\ufffd") + "\n"
    assert len(continuation.rstrip("\ufffd")) >= NEW_TOKENS // 2
