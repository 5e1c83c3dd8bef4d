"""Batch-invariant mode on the bundled SmolLM2 with its weights kept quantized: a
prompt's greedy tokens are the same alone, batched with others, chunked at any budget
(even one that leaves single prompt tokens to a step), and served from the prefix
cache."""

from __future__ import annotations

import random

import pytest

import pyllm.ops as ops
from pyllm import LLM, SamplingParams
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
