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
from pyllm.attention.paged import PAGED
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


PASSAGE = (
    "The old lighthouse stood on the northern cliff for two hundred years. Every night "
    "its keeper climbed the narrow stairs, trimmed the wick and watched the ships pass "
    "safely between the rocks. When the storms came in winter, the light never failed."
)
# A passage to copy (proposals come from the prompt) and free text (from the output).
SPEC_PROMPTS = [
    f"Repeat this text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this text, changing 'lighthouse' to 'tower':\n\n{PASSAGE}",
    "Write a short story about a cat who learns to play the piano.",
]
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "disable_by_batch_size": 8,
}
SPEC_PARAMS = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def _chat_tokens(llm: LLM) -> list[list[int]]:
    prompts = [[{"role": "user", "content": p}] for p in SPEC_PROMPTS]
    return [o.outputs[0].token_ids for o in llm.chat(prompts, SPEC_PARAMS, use_tqdm=False)]


@pytest.mark.parametrize(
    "options",
    [{"dtype": "float32"}, {"dtype": "float32", "kv_cache": "contiguous"}, {}],
    ids=["float32", "float32-contiguous", "auto"],
)
def test_speculation_keeps_the_plain_tokens_with_kept_weights(options):
    """Verified proposals attend as decode tokens do: the int8 activations of kept
    weights turned the two kernels' last-bit differences into other tokens (11 of 16
    prompts parted from plain decoding within 96 tokens, one after 3)."""
    base = {"kv_cache_memory": 0.1, "enable_prefix_caching": False, **options}
    plain = _chat_tokens(LLM(None, **base))
    llm = LLM(None, speculative_config=SPEC, **base)
    assert _chat_tokens(llm) == plain
    assert llm.engine.stats().spec_decode_num_accepted_tokens > 0


def test_preemption_keeps_the_plain_tokens_with_kept_weights():
    """A preempted sequence's output tokens are computed again as decode rows."""
    roomy = _chat_tokens(LLM(None, dtype="float32", kv_cache_memory=0.1))
    block = LLM(None, dtype="float32", kv_cache_memory=0.1).engine.kv_manager.block_bytes
    tight = LLM(None, dtype="float32", kv_cache_memory=14 * block / 2**30)
    assert _chat_tokens(tight) == roomy
    assert tight.engine.scheduler.num_preemptions > 0


def test_verify_rows_attend_each_up_to_itself():
    """The metadata of a step with a prompt chunk and a sequence verifying proposals:
    the verify rows' lengths, tables and the prompt sequences before them."""
    llm = LLM(None, kv_cache_memory=0.05)
    engine = llm.engine
    engine.add_request("a", "one two three four five six", PARAMS)
    engine.add_request("b", "seven eight nine ten eleven twelve", PARAMS)
    a, b = engine.requests["a"].seqs[0], engine.requests["b"].seqs[0]
    for seq in (a, b):
        engine.kv_manager.match_prefix(seq)
        engine.kv_manager.append_slots(seq, seq.num_prompt_tokens + 3)
    a.num_computed_tokens = a.num_prompt_tokens  # decoding, with 3 rows to verify
    batch = ScheduledBatch()
    batch.add(a, 3)
    batch.add(b, 4)
    meta = PAGED.build(batch.prefills, batch.decodes, 16, torch.device("cpu"))
    n = a.num_prompt_tokens
    assert meta.num_prompt_seqs == 1 and meta.verify_seq_lens.tolist() == [n + 1, n + 2, n + 3]
    assert meta.verify_block_tables.tolist() == [a.block_table] * 3
    assert meta.max_decode_seq_len == n + 3
    only_prompts = PAGED.build(batch.prefills[:1], [], 16, torch.device("cpu"))
    assert only_prompts.verify_seq_lens is None and only_prompts.verify_block_tables is None
