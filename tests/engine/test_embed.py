"""Embeddings (LLM.embed, PoolingParams) against HF transformers' final hidden states of
the same tiny random model, float32: each prompt's vector must point where HF's pooled
hidden state points (cosine >= 0.999), whether embedded with others or alone, in
chunks, or from the prefix cache; and embedding requests must not change what
generation requests batched with them produce."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pyllm import LLM, PoolingParams
from pyllm.sampling.params import ParamError
from tests.engine.test_engine import GREEDY, _assert_all_blocks_free, _generate, _prompts

# Different lengths: one token, under a block, a block and one, several chunks of 32.
LENGTHS = [1, 5, 17, 40, 100]


def _texts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"<{rng.randint(2, 511)}>" for _ in range(n)) for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model.eval()


def _hf_pooled(hf_model, token_ids: list[int], pooling: str) -> torch.Tensor:
    """HF's final hidden states (after the final norm) of the prompt, pooled."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([token_ids])).last_hidden_state[0]
    return hidden[-1] if pooling == "last" else hidden.mean(dim=0)


def _cosine(vector: list[float], reference: torch.Tensor) -> float:
    v = torch.tensor(vector)
    return float(torch.nn.functional.cosine_similarity(v, reference, dim=0))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_match_hf_pooled_hidden_states(tiny_model_dir, hf_model, pooling):
    # A budget of 32 tokens a step: the long prompts are embedded in chunks.
    llm = LLM(
        tiny_model_dir, dtype="float32", pooling=pooling, max_num_batched_tokens=32,
        kv_cache_memory=0.05,
    )  # fmt: skip
    texts = _texts()
    together = llm.embed(texts, use_tqdm=False)
    alone = [llm.embed(text, use_tqdm=False)[0] for text in texts]
    for out in together + alone:
        reference = _hf_pooled(hf_model, out.prompt_token_ids, pooling)
        assert _cosine(out.outputs.embedding, reference) >= 0.999
        assert len(out.outputs.embedding) == hf_model.config.hidden_size
        assert abs(torch.tensor(out.outputs.embedding).norm() - 1) < 1e-5
    # Embedded again alone, the long prompts met their own blocks in the prefix cache:
    # `last` reuses them (its last token is still computed), `mean` computes every token.
    cached = [out.num_cached_tokens for out in alone]
    assert cached[-1] > 0 if pooling == "last" else cached == [0] * len(texts)
    _assert_all_blocks_free(llm)


def test_embed_takes_token_ids_and_pooling_params(tiny_model_dir, hf_model):
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=0.05)
    ids = [[5, 6, 7, 8], [9] * 20]
    raw = llm.embed(ids, PoolingParams(normalize=False), use_tqdm=False)
    for out, prompt in zip(raw, ids, strict=True):
        assert out.prompt_token_ids == prompt
        reference = _hf_pooled(hf_model, prompt, "last")
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding), reference, atol=1e-4, rtol=1e-4
        )
    # Matryoshka: the first 16 values, normalized again.
    cut = llm.embed(ids[0], PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    expected = torch.nn.functional.normalize(torch.tensor(raw[0].outputs.embedding[:16]), dim=0)
    torch.testing.assert_close(torch.tensor(cut), expected, atol=1e-6, rtol=1e-5)


def test_embed_refuses_bad_input_naming_it(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=0.05)
    hidden = llm.engine.model_config.hidden_size
    with pytest.raises(ParamError, match="dimensions") as error:
        llm.embed("<5>", PoolingParams(dimensions=hidden + 1), use_tqdm=False)
    assert error.value.param == "dimensions"
    with pytest.raises(ParamError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        llm.embed(["<5>", 3.5], use_tqdm=False)
    with pytest.raises(TypeError, match="pooling_params"):
        llm.embed("<5>", GREEDY, use_tqdm=False)
    with pytest.raises(ParamError, match="context length") as error:
        llm.embed([[5] * 2000], use_tqdm=False)
    assert error.value.param == "prompt"
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "pooling, kv_cache", [("last", "paged"), ("mean", "paged"), ("mean", "contiguous")]
)
def test_embeddings_and_generation_in_one_batch(tiny_model_dir, pooling, kv_cache):
    prompts = _prompts(6, seed=2)
    texts = _texts(seed=3)
    llm = LLM(
        tiny_model_dir, dtype="float32", pooling=pooling, kv_cache=kv_cache,
        max_num_batched_tokens=64, kv_cache_memory=0.05,
    )  # fmt: skip
    generated_alone = [_generate(llm, [p])[0] for p in prompts]
    embedded_alone = [llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in texts]
    engine = llm.engine
    for i, prompt in enumerate(prompts):  # interleaved: both kinds in every step
        engine.add_request(f"g{i}", None, GREEDY, prompt_token_ids=prompt)
        if i < len(texts):
            engine.add_request(f"e{i}", texts[i], PoolingParams())
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [finished[f"g{i}"].outputs[0].token_ids for i in range(6)] == generated_alone
    for i, expected in enumerate(embedded_alone):
        got = torch.tensor(finished[f"e{i}"].outputs.embedding)
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=1e-4)
    if kv_cache == "paged":
        _assert_all_blocks_free(llm)
    else:  # every slot given back, its memory released
        assert engine.kv_manager.committed_bytes() == 0 and not engine.scheduler.has_unfinished


def test_embeddings_survive_preemption(tiny_model_dir, hf_model):
    # 40 blocks of 16 tokens for 16 generations of up to 182 tokens and long texts to
    # embed in chunks: sequences are preempted and recomputed.
    memory = 40 * 16 * 2 * 2 * 2 * 64 * 4 / 2**30
    llm = LLM(
        tiny_model_dir, dtype="float32", pooling="mean", kv_cache_memory=memory,
        max_num_batched_tokens=64,
    )  # fmt: skip
    engine = llm.engine
    texts = _texts(seed=5)
    for i, prompt in enumerate(_prompts(16, seed=6)):
        engine.add_request(f"g{i}", None, GREEDY, prompt_token_ids=prompt)
    for i, text in enumerate(texts):  # the first to be preempted: priority 1
        engine.add_request(f"e{i}", text, PoolingParams(), priority=1)
    embedded, preempted = {}, set()
    while engine.has_unfinished_requests():
        embedded.update((o.request_id, o) for o in engine.step() if o.request_id[0] == "e")
        waiting = engine.scheduler.waiting
        preempted |= {s.request_id for s in waiting if s.pooling_params and s.num_preemptions}
    assert preempted  # some embedding was preempted mid-prompt and computed again
    for i in range(len(texts)):
        out = embedded[f"e{i}"]
        reference = _hf_pooled(hf_model, out.prompt_token_ids, "mean")
        assert _cosine(out.outputs.embedding, reference) >= 0.999
    _assert_all_blocks_free(llm)
