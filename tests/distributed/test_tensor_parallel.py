"""Tensor parallelism (gloo, CPU, one thread per rank) generates what one process does:
greedy tokens identical to tensor_parallel_size=1 in float32, and seeded samples too,
with chunked prefill and prefix caching on, in both KV-cache modes."""

from __future__ import annotations

import random

import pytest
import torch

from pyllm import LLM, SamplingParams
from pyllm.model.default_model import default_model_path
from tests.distributed.conftest import child_pids, make_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randint(2, 511) for _ in range(rng.choice([1, 5, 17, 40]))]
               for _ in range(count)]  # fmt: skip
    shared = [rng.randint(2, 511) for _ in range(33)]  # two prompts share 2 blocks
    return prompts + [shared + [5, 6], shared + [7]]


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _outputs(model: str, tp: int, prompts, **options) -> tuple[list, list]:
    llm = LLM(model, dtype="float32", kv_cache_memory=0.02, tensor_parallel_size=tp,
              max_num_batched_tokens=16, **options)  # fmt: skip
    try:
        greedy, seeded = _run(llm, prompts, GREEDY), _run(llm, prompts, SEEDED)
        if options.get("kv_cache", "paged") == "paged":
            assert llm.engine.kv_manager.prefix_cache_hits > 0 or tp == 1
    finally:
        llm.engine.close()
    return greedy, seeded


@pytest.mark.parametrize(
    "kind, overrides",
    [("llama", {}), ("qwen2", {}), ("llama", {"num_key_value_heads": 1})],
    ids=["llama-gqa", "qwen2-bias", "llama-kv-replicated"],
)
def test_tp2_generates_what_tp1_does(tmp_path, kind, overrides):
    model = make_model_dir(tmp_path, kind, **overrides)
    prompts = _prompts(6)
    greedy, seeded = _outputs(model, 1, prompts)
    assert _outputs(model, 2, prompts) == (greedy, seeded)
    if not overrides:
        assert _outputs(model, 2, prompts, kv_cache="contiguous") == (greedy, seeded)
    assert not child_pids(), "worker processes outlived the engine"


@pytest.mark.parametrize(
    "kind, overrides",
    [("qwen3moe", {"num_hidden_layers": 3, "mlp_only_layers": [1], "norm_topk_prob": True}),
     ("mixtral", {"sliding_window": 12}),
     ("gpt_oss", {"swiglu_limit": 1.5})],
    ids=["qwen3moe", "mixtral", "gpt-oss"],
)  # fmt: skip
def test_moe_tp2_generates_what_tp1_does(tmp_path, kind, overrides):
    """Each rank every expert's half of the intermediate rows (the default), or half
    the experts whole (expert_parallel); the router replicated either way."""
    model = make_model_dir(tmp_path, kind, **overrides)
    prompts = _prompts(6)
    expected = _outputs(model, 1, prompts)
    assert _outputs(model, 2, prompts) == expected
    assert _outputs(model, 2, prompts, expert_parallel=True, kv_cache="contiguous") == expected
    assert not child_pids(), "worker processes outlived the engine"


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_speculative_tp2_generates_what_plain_tp1_does(tmp_path, kv_cache):
    """n-gram proposals verified across ranks, rejected KV rolled back on each."""
    model = make_model_dir(tmp_path, "llama")
    prompts = _prompts(6)
    expected = _outputs(model, 1, prompts, kv_cache=kv_cache)
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1, "disable_by_batch_size": 64}  # fmt: skip
    llm = LLM(model, dtype="float32", kv_cache_memory=0.02, tensor_parallel_size=2,
              max_num_batched_tokens=16, kv_cache=kv_cache, speculative_config=ngram)  # fmt: skip
    try:
        assert (_run(llm, prompts, GREEDY), _run(llm, prompts, SEEDED)) == expected
        assert llm.engine.stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.engine.close()
    assert not child_pids(), "worker processes outlived the engine"


def test_smollm2_tp3_generates_what_tp1_does():
    """9 heads and 3 KV heads: 3 ranks of 3 heads and one KV head each. float32 widened
    from the GGUF file; prompts share a prefix (prefix cache) and chunk at 16 tokens."""
    words = (
        "The history of the old city begins with a small harbour where fishermen sold "
        "their catch to traders who came down the river from the hills every spring"
    )
    prompts = [f"{words} {tail}" for tail in ("and", "before the war, when", "until")]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outputs = []
    for tp in (1, 3):
        llm = LLM(None, dtype="float32", quantization="none", kv_cache_memory=0.05,
                  tensor_parallel_size=tp, max_num_batched_tokens=16)  # fmt: skip
        try:
            first = llm.generate(prompts[:1], params, use_tqdm=False)
            result = first + llm.generate(prompts[1:], params, use_tqdm=False)
            outputs.append([o.outputs[0].token_ids for o in result])
            assert result[-1].num_cached_tokens >= 16  # the shared prefix came from the cache
        finally:
            llm.engine.close()
    assert outputs[0] == outputs[1]


def test_gemma3_270m_tp2_replicates_its_kv_head():
    """Gemma 3 270M: 4 heads and 1 KV head (each rank keeps it), sliding-window and
    global layers, a 262k vocabulary split in two; float32 widened from the PyPI file."""
    from tests.model.test_gemma3 import gemma3_gguf

    path = gemma3_gguf()
    outputs = []
    for tp in (1, 2):
        llm = LLM(path, dtype="float32", quantization="none", kv_cache_memory=0.05,
                  tensor_parallel_size=tp, max_num_batched_tokens=16)  # fmt: skip
        try:
            result = llm.generate(["The capital of France is", "Once upon a time"],
                                  SamplingParams(temperature=0.0, max_tokens=12),
                                  use_tqdm=False)  # fmt: skip
            outputs.append([o.outputs[0].token_ids for o in result])
        finally:
            llm.engine.close()
    assert outputs[0] == outputs[1]


def test_quantized_gguf_shards_keep_their_blocks():
    """Each rank of a Q4_1 file holds a third of every projection's blocks (row ranges
    of q/k/v and gate/up, column ranges of o_proj and down_proj), never widened."""
    llm = LLM(None, tensor_parallel_size=3, kv_cache_memory=0.05)
    try:
        model = llm.engine.model
        layer = model.model.model.layers[0]
        qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
        assert qkv.qparts and o.qparts and layer.mlp.down_proj.qparts
        assert sum(p.stop - p.start for p in qkv.qparts) == (9 + 3 + 3) * 64 // 3
        assert o.in_features == 576 // 3 and layer.mlp.down_proj.in_features == 1536 // 3
        out = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.engine.close()


def test_heads_that_do_not_divide_fail_before_any_process_starts():
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\)"):
        LLM(default_model_path(), tensor_parallel_size=2)
    assert not child_pids()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_int8_kv_tp2_generates_what_tp1_does(tmp_path, kv_cache):
    """Each rank quantizes its own kv heads (a scale per token and head), as one
    process does for all of them."""
    model = make_model_dir(tmp_path, "llama")
    prompts = _prompts(6)
    expected = _outputs(model, 1, prompts, kv_cache=kv_cache, kv_cache_dtype="int8")
    assert _outputs(model, 2, prompts, kv_cache=kv_cache, kv_cache_dtype="int8") == expected
    assert not child_pids(), "worker processes outlived the engine"
