"""The engine over an int8 KV cache (kv_cache_dtype="int8"): batching, chunking,
preemption, prefix caching and both layouts change nothing it generates, and the same
kv_cache_memory holds about twice bfloat16's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from pyllm import LLM
from pyllm.engine.config import ConfigError, EngineConfig
from tests.engine.test_engine import (
    GREEDY,
    _assert_all_blocks_free,
    _generate,
    _prompts,
    _write_byte_tokenizer,
)
from tests.model.conftest import make_hf_model

INT8 = dict(dtype="float32", kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def int8_alone(tiny_model_dir):
    """Each prompt generated on its own, in a fresh engine with an int8 cache."""
    llm = LLM(tiny_model_dir, kv_cache_memory=0.05, **INT8)
    assert llm.engine.kv_cache.layers[0][0].dtype == torch.int8
    return [_generate(llm, [p])[0] for p in _prompts(16)]


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
@pytest.mark.parametrize("budget", [16, 512])
def test_int8_batching_and_layouts_change_nothing(tiny_model_dir, int8_alone, kv_cache, budget):
    llm = LLM(
        tiny_model_dir, kv_cache=kv_cache, max_num_batched_tokens=budget, kv_cache_memory=0.05,
        **INT8,
    )  # fmt: skip
    assert _generate(llm, _prompts(16)) == int8_alone


def test_int8_preemption_loses_nothing(tiny_model_dir, int8_alone):
    # 40 blocks of 16 tokens (2 layers, 2 kv heads of 64: 132 bytes per token and head
    # and layer), too few for 16 prompts of up to 182 tokens at once.
    llm = LLM(tiny_model_dir, kv_cache_memory=40 * 16 * 2 * 2 * 132 / 2**30, **INT8)
    assert llm.engine.kv_manager.num_blocks == 40
    assert _generate(llm, _prompts(16)) == int8_alone
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_blocks_free(llm)


def test_int8_prefix_cache_serves_shared_prefix(tiny_model_dir):
    rng = random.Random(1)
    prefix = [rng.randint(2, 511) for _ in range(256)]
    first, second = prefix + [5, 6, 7], prefix + [9, 10, 11, 12]
    expected = _generate(LLM(tiny_model_dir, enable_prefix_caching=False, **INT8), [second])[0]
    llm = LLM(tiny_model_dir, **INT8)
    _generate(llm, [first])
    out = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 256
    assert out.outputs[0].token_ids == expected
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_int8_cache_holds_twice_the_bf16_tokens(tmp_path, head_dim):
    """Same kv_cache_memory: tokens in blocks of the engine's own report. int8 rows plus
    a float16 scale per token and kv head: 2 * D / (D + 2) of bfloat16's tokens, 1.94x
    at head_dim 64 and 1.97x at 128."""
    make_hf_model("llama", tmp_path, head_dim=head_dim, max_position_embeddings=1024)
    _write_byte_tokenizer(tmp_path, vocab_size=512)
    tokens = {}
    for kv_dtype in ("auto", "int8"):
        llm = LLM(str(tmp_path), dtype="bfloat16", kv_cache_dtype=kv_dtype, kv_cache_memory=0.01)
        manager = llm.engine.kv_manager
        tokens[kv_dtype] = manager.num_blocks * manager.block_size
        assert f"({tokens[kv_dtype]} tokens" in manager.describe()
    ratio = tokens["int8"] / tokens["auto"]
    assert ratio == pytest.approx(2 * head_dim / (head_dim + 2), rel=0.01)
    assert ratio >= 1.9


def test_kv_cache_dtype_refused_by_name(tiny_model_dir):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of \\('auto', 'int8'\\)"):
        EngineConfig(model=tiny_model_dir, kv_cache_dtype="fp8")
