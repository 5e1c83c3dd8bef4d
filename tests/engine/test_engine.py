"""The engine end to end: continuous batching, chunked prefill, preemption and prefix
caching must not change what a request generates, and must leave every block free."""

from __future__ import annotations

import random

import pytest

from pyllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _write_byte_tokenizer(path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"eos_token": "<1>", "bos_token": "<0>"}')


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice([1, 3, 15, 16, 17, 40, 100, 170]) for _ in range(count)]
    return [[rng.randint(2, 511) for _ in range(n)] for n in lengths]


def _generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.kv_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.engine.scheduler.has_unfinished


@pytest.fixture(scope="module")
def alone_outputs(tiny_model_dir):
    """Each prompt generated on its own, in a fresh float32 engine."""
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=0.05)
    return [_generate(llm, [p])[0] for p in _prompts(16)]


@pytest.mark.parametrize("budget", [16, 64, 512])
def test_batching_and_chunking_change_nothing(tiny_model_dir, alone_outputs, budget):
    llm = LLM(tiny_model_dir, dtype="float32", max_num_batched_tokens=budget, kv_cache_memory=0.05)
    assert _generate(llm, _prompts(16)) == alone_outputs
    _assert_all_blocks_free(llm)


def test_preemption_loses_nothing(tiny_model_dir, alone_outputs):
    # 16 prompts of up to 182 tokens each, in a cache of 40 blocks of 16 tokens:
    # the engine must preempt and recompute to finish them all.
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=40 * 16 * 2 * 2 * 2 * 64 * 4 / 2**30)
    assert llm.engine.kv_manager.num_blocks == 40
    assert _generate(llm, _prompts(16)) == alone_outputs
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_blocks_free(llm)


def test_prefix_cache_serves_shared_prefix(tiny_model_dir):
    rng = random.Random(1)
    prefix = [rng.randint(2, 511) for _ in range(256)]
    first = prefix + [rng.randint(2, 511) for _ in range(5)]
    second = prefix + [rng.randint(2, 511) for _ in range(7)]

    plain = LLM(tiny_model_dir, dtype="float32", enable_prefix_caching=False)
    expected = _generate(plain, [second])[0]

    llm = LLM(tiny_model_dir, dtype="float32")
    _generate(llm, [first])
    computed_before = llm.engine.stats().prompt_tokens_computed
    out = llm.generate(prompt_token_ids=[second], sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 256
    assert llm.engine.stats().prompt_tokens_computed - computed_before == 7
    assert out.outputs[0].token_ids == expected
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_stats_snapshot_follows_the_engine(tiny_model_dir, kv_cache):
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache=kv_cache, kv_cache_memory=0.05)
    engine = llm.engine
    start = engine.stats()
    assert (start.steps, start.num_running, start.generation_tokens) == (0, 0, 0)
    assert (start.kv_cache, start.model_path) == (kv_cache, engine.config.model_path)
    blocks = engine.kv_manager.num_blocks if kv_cache == "paged" else None
    assert start.num_kv_blocks == start.num_free_kv_blocks == blocks
    prompts = _prompts(3, seed=4)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), None, GREEDY, prompt_token_ids=prompt)
    assert engine.stats().num_waiting == 3
    engine.step()
    busy = engine.stats()
    assert busy.num_running >= 1 and busy.steps == 1 and busy.kv_cache_usage > 0
    assert busy.kv_cache_committed_bytes == engine.kv_cache_committed_bytes() > 0
    if blocks is not None:
        assert busy.num_free_kv_blocks < blocks
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.stats()
    assert done.generation_tokens == 3 * GREEDY.max_tokens
    assert done.prompt_tokens_computed + done.prefix_cache_hits == sum(map(len, prompts))
    assert done.num_running == done.num_waiting == 0


def test_too_long_request_is_rejected_without_stalling_others(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32")
    too_long = SamplingParams(max_tokens=1000, temperature=0.0)
    with pytest.raises(ValueError, match="context length"):
        llm.generate(prompt_token_ids=[[5] * 100], sampling_params=too_long, use_tqdm=False)
    _assert_all_blocks_free(llm)
    assert len(_generate(llm, [[5, 6, 7]])[0]) == GREEDY.max_tokens


def test_abort_frees_blocks(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32")
    engine = llm.engine
    for i, prompt in enumerate(_prompts(4, seed=3)):
        engine.add_request(str(i), None, GREEDY, prompt_token_ids=prompt)
    engine.step()
    engine.step()
    for i in range(4):
        engine.abort_request(str(i))
    _assert_all_blocks_free(llm)


def test_n_samples_share_the_prompt(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32")
    prompt = _prompts(1, seed=5)[0] + list(range(2, 66))
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    # The siblings reused the first sequence's full prompt blocks.
    full_blocks = (len(prompt) - 1) // 16
    assert llm.engine.kv_manager.prefix_cache_hits >= 2 * full_blocks * 16
    _assert_all_blocks_free(llm)


# ------------------------------------------------------------------ contiguous KV cache


def _assert_all_slots_free(llm: LLM) -> None:
    slots = llm.engine.kv_manager
    assert slots.arena.committed_bytes == 0
    assert sorted(slots.free_slots) == list(range(slots.num_slots))
    assert not llm.engine.scheduler.has_unfinished


@pytest.mark.parametrize("budget", [16, 512])
def test_contiguous_cache_generates_what_paged_does(tiny_model_dir, alone_outputs, budget):
    llm = LLM(
        tiny_model_dir,
        dtype="float32",
        kv_cache="contiguous",
        max_num_batched_tokens=budget,
        kv_cache_memory=0.05,
    )
    assert _generate(llm, _prompts(16)) == alone_outputs
    _assert_all_slots_free(llm)


def test_contiguous_cache_preempts_within_its_memory_budget(tiny_model_dir, alone_outputs):
    # The same 40 blocks' worth of memory as test_preemption_loses_nothing: 640 tokens
    # for 16 prompts of up to 182 tokens, so the engine must preempt to finish them.
    budget = 40 * 16 * 2 * 2 * 2 * 64 * 4
    llm = LLM(
        tiny_model_dir, dtype="float32", kv_cache="contiguous", kv_cache_memory=budget / 2**30
    )
    peak = 0
    engine = llm.engine
    for i, prompt in enumerate(_prompts(16)):
        engine.add_request(str(i), None, GREEDY, prompt_token_ids=prompt)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[int(out.request_id)] = out.outputs[0].token_ids
        peak = max(peak, engine.kv_cache_committed_bytes())
    assert [outputs[i] for i in range(16)] == alone_outputs
    assert engine.scheduler.num_preemptions > 0
    assert 0 < peak <= budget
    _assert_all_slots_free(llm)


def test_contiguous_cache_commits_memory_as_sequences_grow(tiny_model_dir):
    from pyllm.engine.slot_manager import COMMIT_AHEAD

    llm = LLM(tiny_model_dir, dtype="float32", kv_cache="contiguous")
    engine, arena = llm.engine, llm.engine.kv_manager.arena
    assert engine.kv_cache_committed_bytes() == 0
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add_request("a", None, params, prompt_token_ids=list(range(2, 102)))
    engine.step()  # the 100-token prompt
    first = engine.kv_cache_committed_bytes()
    assert arena.bytes_for_tokens(100) <= first <= arena.bytes_for_tokens(100 + COMMIT_AHEAD)
    engine.add_request("b", None, params, prompt_token_ids=list(range(2, 302)))
    engine.step()
    second = engine.kv_cache_committed_bytes()
    assert second >= first + arena.bytes_for_tokens(300)
    for _ in range(150):  # a grows past its lookahead
        engine.step()
    assert engine.kv_cache_committed_bytes() > second
    while engine.has_unfinished_requests():
        engine.step()
    _assert_all_slots_free(llm)


def test_contiguous_cache_n_samples_and_abort(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache="contiguous")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[_prompts(1, seed=5)[0]], sampling_params=params,
                       use_tqdm=False)[0]  # fmt: skip
    assert [len(o.token_ids) for o in out.outputs] == [8, 8, 8]
    engine = llm.engine
    for i, prompt in enumerate(_prompts(4, seed=3)):
        engine.add_request(str(i), None, GREEDY, prompt_token_ids=prompt)
    engine.step()
    assert engine.kv_cache_committed_bytes() > 0
    for i in range(4):
        engine.abort_request(str(i))
    _assert_all_slots_free(llm)


def test_contiguous_cache_refuses_prefix_caching(tiny_model_dir):
    with pytest.raises(ValueError, match="enable_prefix_caching needs kv_cache='paged'"):
        LLM(tiny_model_dir, dtype="float32", kv_cache="contiguous", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        LLM(tiny_model_dir, dtype="float32", kv_cache="virtual")
