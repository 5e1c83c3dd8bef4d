"""Block manager and scheduler on their own, driven by a fake model that "samples" a
fixed token: checks the bookkeeping invariants without running any kernel."""

from __future__ import annotations

import inspect
import random

import pytest

from pyllm.engine.block_manager import BlockManager
from pyllm.engine.kv_manager import KVCacheManager
from pyllm.engine.scheduler import Scheduler
from pyllm.engine.sequence import Sequence, SequenceStatus
from pyllm.engine.slot_manager import SlotManager
from pyllm.sampling.params import SamplingParams


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[int]:
    """Steps until every sequence is done; returns tokens scheduled per step."""
    per_step = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return per_step
        batch = scheduler.schedule()
        assert not batch.is_empty, "scheduler stalled with work left"
        assert batch.num_tokens <= scheduler.max_num_batched_tokens
        per_step.append(batch.num_tokens)
        assert len({id(seq) for seq, _ in batch.all()}) == len(batch.all()), "scheduled twice"
        for seq, n in batch.all():
            seq.num_computed_tokens += n
            assert seq.num_computed_tokens <= seq.num_tokens
            if seq.num_computed_tokens == seq.num_tokens:  # prompt complete: sample
                seq.append_token(7)
                if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                    scheduler.finish(seq, "length")
                    continue
            scheduler.kv_manager.register_computed_blocks(seq)
    raise AssertionError("did not finish")


def make_seq(n_prompt: int, max_tokens: int, base: int = 0) -> Sequence:
    return Sequence(
        request_id=str(base),
        prompt_token_ids=[base + i for i in range(n_prompt)],
        sampling_params=SamplingParams(max_tokens=max_tokens),
    )


@pytest.mark.parametrize("budget", [1, 16, 64, 512])
def test_all_blocks_free_after_mixed_requests(budget):
    rng = random.Random(budget)
    bm = BlockManager(num_blocks=64, block_size=8)
    scheduler = Scheduler(bm, max_num_batched_tokens=budget, max_num_seqs=8)
    seqs = [make_seq(rng.randint(1, 100), rng.randint(1, 20), base=i * 1000) for i in range(20)]
    for s in seqs:
        scheduler.add(s)
    run_to_completion(scheduler)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert all(s.num_output_tokens == s.sampling_params.max_tokens for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_preemption_when_blocks_run_out():
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    seqs = [make_seq(10, 20, base=i * 100) for i in range(4)]  # each needs 8 blocks at the end
    for s in seqs:
        scheduler.add(s)
    run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    assert all(s.num_output_tokens == 20 for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("caching", [False, True])
def test_blocks_without_a_prefix_are_taken_again_first(caching):
    """A finished sequence's blocks that hold no cached prefix are the next ones taken
    (their pages are already in memory); hashed ones wait at the back, least recently
    freed first, so cached prefixes outlive them."""
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=caching)
    first = make_seq(10, 1, base=0)  # 3 blocks: 2 full, one partly filled
    bm.match_prefix(first)
    bm.append_slots(first, 10)
    first.num_computed_tokens = 10
    bm.register_computed_blocks(first)
    table = list(first.block_table)
    bm.free(first)
    second = make_seq(6, 1, base=100)  # 2 blocks
    bm.match_prefix(second)
    bm.append_slots(second, 6)
    reused = table[2:] if caching else table[:2]
    assert second.block_table[: len(reused)] == reused
    assert set(second.block_table).isdisjoint(table[:2]) == caching  # prefixes kept
    if caching:
        assert all(bm.holds(*key) for key in _prefix_keys(table[:2], bm))


def _prefix_keys(block_ids, bm):
    return [(bm.blocks[b].hash, bm.blocks[b].token_ids) for b in block_ids]


def test_chunked_prefill_respects_budget_and_keeps_decoding():
    bm = BlockManager(num_blocks=200, block_size=16)
    scheduler = Scheduler(bm, max_num_batched_tokens=32)
    short = make_seq(4, 30, base=0)
    scheduler.add(short)
    scheduler.schedule()  # short's prompt
    short.num_computed_tokens = 4
    short.append_token(7)
    long = make_seq(300, 2, base=10_000)
    scheduler.add(long)
    batch = scheduler.schedule()
    assert [(s, n) for s, n in batch.decodes] == [(short, 1)]
    assert batch.prefills == [(long, 31)]


def test_prefix_cache_hit_counts_and_frees():
    bm = BlockManager(num_blocks=64, block_size=16)
    scheduler = Scheduler(bm, max_num_batched_tokens=512)
    shared = list(range(256))
    first = Sequence("a", shared + [1000, 1001], SamplingParams(max_tokens=2))
    scheduler.add(first)
    run_to_completion(scheduler)
    second = Sequence("b", shared + [2000, 2001, 2002], SamplingParams(max_tokens=2))
    scheduler.add(second)
    batch = scheduler.schedule()
    assert batch.prefills == [(second, 3)]  # only its own suffix
    assert second.num_cached_prompt_tokens == 256
    assert bm.prefix_cache_hits == 256
    run_to_completion(scheduler)
    assert bm.num_free_blocks == bm.num_blocks


def test_fully_cached_prompt_still_computes_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(bm)
    prompt = list(range(8))
    for name in ("a", "b"):
        seq = Sequence(name, prompt, SamplingParams(max_tokens=1))
        scheduler.add(seq)
        batch = scheduler.schedule()
        (scheduled, n), *_ = batch.all()
        assert n >= 1 and scheduled.num_computed_tokens + n == len(prompt)
        run_to_completion(scheduler)
    assert bm.num_free_blocks == bm.num_blocks


def test_kv_managers_implement_the_protocol():
    """Both managers have every method of KVCacheManager, with the same parameters, and
    the prefix-cache counters (the scheduler relies on nothing else)."""
    methods = [n for n, v in vars(KVCacheManager).items() if inspect.isfunction(v) and n[0] != "_"]
    assert "append_slots" in methods and "describe" in methods
    for cls in (BlockManager, SlotManager):
        for name in methods:
            want = inspect.signature(getattr(KVCacheManager, name)).parameters
            got = inspect.signature(getattr(cls, name)).parameters
            assert list(got) == list(want), (cls.__name__, name)
    bm = BlockManager(num_blocks=4, block_size=4)
    for name in KVCacheManager.__annotations__:
        assert isinstance(getattr(bm, name), int)
