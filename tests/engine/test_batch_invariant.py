"""The bundled SmolLM2 with its weights kept quantized: a prompt's greedy tokens are the
same alone, chunked at any budget (even one that leaves single prompt tokens to a
step), and served from the prefix cache; by default where the build has a float path
for many rows, and batched with others below that path's rows too; in batch-invariant
mode everywhere and at any batch."""

from __future__ import annotations

import random

import pytest
import torch

import pyllm.ops as ops
from pyllm import LLM, SamplingParams
from pyllm.attention.backend import _step_fields
from pyllm.engine.scheduler import ScheduledBatch

WORDS = "the a cat dog runs over under house river tree blue green quickly slowly and then"
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(count: int = 8) -> list[str]:
    rng = random.Random(0)
    words = WORDS.split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 120))) for _ in range(count)]


def _tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(autouse=True)
def _restore():
    yield
    ops.set_batch_invariant(False)


def _llm(**options) -> LLM:
    return LLM(None, batch_invariant=True, kv_cache_memory=0.1, **options)


def test_greedy_tokens_do_not_depend_on_the_batch():
    prompts = _prompts()
    llm = _llm(enable_prefix_caching=False)
    assert ops.batch_invariant()
    alone = [_tokens(llm, [p])[0] for p in prompts]
    assert _tokens(llm, prompts) == alone
    # 16 tokens a step for 8 prompts: chunks of every size, single prompt tokens too.
    assert _tokens(_llm(enable_prefix_caching=False, max_num_batched_tokens=16), prompts) == alone
    cached = _llm(enable_prefix_caching=True)
    _tokens(cached, prompts)
    again = cached.generate(prompts, PARAMS, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == alone


def test_by_default_a_prompt_computes_alike_however_it_is_split():
    """A step's prompt rows take the many-row path at any count (quant_linear's
    many_rows), and fewer than 32 decode rows the int8 products, as one row does."""
    llm = LLM(None, kv_cache_memory=0.1, enable_prefix_caching=False)
    if not ops.packed_linear_vectorized(llm.engine.model.dtype):
        pytest.skip("no float path for many rows in this build: batch-invariant mode gives it")
    prompts = _prompts()
    assert not ops.batch_invariant()
    alone = [_tokens(llm, [p])[0] for p in prompts]
    assert _tokens(llm, prompts) == alone
    chunked = LLM(None, kv_cache_memory=0.1, enable_prefix_caching=False, max_num_batched_tokens=16)
    assert _tokens(chunked, prompts) == alone
    cached = LLM(None, kv_cache_memory=0.1, enable_prefix_caching=True)
    _tokens(cached, prompts)
    again = cached.generate(prompts, PARAMS, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == alone


def test_the_readme_chat_request_gets_one_reply():
    """The README's chat request at temperature 0, sent again and again to one engine:
    the prefix cache serves the later ones' prompts but not their replies."""
    llm = LLM(None, kv_cache_memory=0.1)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    replies = [llm.chat(messages, params, use_tqdm=False)[0] for _ in range(3)]
    assert replies[1].num_cached_tokens > 0
    assert len({r.outputs[0].text for r in replies}) == 1


def test_one_prompt_token_in_a_step_runs_as_a_prefill():
    """The two attention kernels round differently: a prompt token must meet the
    prefill kernel however its prompt was chunked; only an output token decodes."""
    llm = LLM(None, kv_cache_memory=0.05)
    engine = llm.engine
    engine.add_request("r", "one two three four five six", PARAMS)
    seq = engine.requests["r"].seqs[0]
    batch = ScheduledBatch()
    seq.num_computed_tokens = 2
    batch.add(seq, 1)
    assert batch.prefills == [(seq, 1)] and not batch.decodes
    seq.num_computed_tokens = seq.num_prompt_tokens
    batch.add(seq, 1)
    assert batch.decodes == [(seq, 1)]


def test_prompt_chunks_are_a_steps_first_rows():
    """Prompt chunks go before the other prefills (here a decode verifying proposals),
    and the step's metadata counts their tokens."""
    llm = LLM(None, kv_cache_memory=0.05)
    engine = llm.engine
    engine.add_request("a", "one two three four five six", PARAMS)
    engine.add_request("b", "seven eight nine ten eleven twelve", PARAMS)
    a, b = engine.requests["a"].seqs[0], engine.requests["b"].seqs[0]
    a.num_computed_tokens = a.num_prompt_tokens  # as if a were decoding with proposals
    batch = ScheduledBatch()
    batch.add(a, 3)
    batch.add(b, 4)
    assert batch.prefills == [(b, 4), (a, 3)] and batch.num_prompt_chunks == 1
    fields = _step_fields(batch.prefills, batch.decodes, [0] * 7, torch.device("cpu"))
    assert fields["num_prompt_tokens"] == 4 and fields["num_prefill_tokens"] == 7
