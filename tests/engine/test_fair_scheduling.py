"""Scheduling under load, counted in engine steps: a short request starts promptly
while long prompts prefill or another client's fan-out holds the sequence slots, and
`priority` orders the waiting queue."""

from __future__ import annotations

import random

import pytest

from pyllm import LLM, SamplingParams
from pyllm.engine.block_manager import BlockManager
from pyllm.engine.scheduler import Scheduler
from pyllm.engine.sequence import Sequence
from pyllm.sampling.params import ParamError
from tests.engine.test_engine import _write_byte_tokenizer
from tests.engine.test_scheduler import run_to_completion
from tests.model.conftest import make_hf_model

SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-4k")
    make_hf_model("llama", path, max_position_embeddings=4096)
    _write_byte_tokenizer(path, vocab_size=512)
    return LLM(str(path), dtype="float32", kv_cache_memory=0.25)


def _tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(2, 511) for _ in range(count)]


def _steps_to_first_token(engine, request_id: str, limit: int = 50) -> int:
    """Steps the engine until request_id has a token; returns how many steps it took."""
    for steps in range(1, limit + 1):
        for output in engine.step():
            if output.request_id == request_id and output.outputs[0].token_ids:
                return steps
    raise AssertionError(f"{request_id} got no token in {limit} steps")


def _drain(engine) -> dict[str, list[int]]:
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0].token_ids
    return finals


def _assert_idle(engine) -> None:
    assert not engine.scheduler.has_unfinished
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


@pytest.mark.parametrize("num_long", [1, 4])
def test_short_request_starts_within_two_steps_of_long_prefills(llm, num_long):
    engine = llm.engine
    long_params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i in range(num_long):
        engine.add_request(f"long-{i}", None, long_params, _tokens(2048, seed=10 * num_long + i))
    engine.step()  # the long prompts' prefill is under way
    longs = [seq for seq in engine.scheduler.running if seq.request_id.startswith("long")]
    computed = [seq.num_computed_tokens for seq in longs]
    assert 0 < max(computed) < 2048

    short_prompt = _tokens(16, seed=100)
    engine.add_request("short", None, SHORT, short_prompt)
    assert _steps_to_first_token(engine, "short") <= 2
    # The long prompts kept going meanwhile.
    assert sum(seq.num_computed_tokens for seq in longs) > sum(computed)
    finals = _drain(engine)
    _assert_idle(engine)
    assert (
        finals["short"]
        == llm.generate(prompt_token_ids=[short_prompt], sampling_params=SHORT, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )


def test_second_client_starts_while_a_fan_out_holds_every_slot(llm):
    engine = llm.engine
    fan_out = SamplingParams(temperature=0.8, seed=1, n=8, max_tokens=48, ignore_eos=True)
    for i in range(64):  # one API request: 64 prompts x n=8
        engine.add_request(f"big-{i}", None, fan_out, _tokens(16, seed=i), group="big")
    for _ in range(20):  # until the fan-out holds every sequence slot
        engine.step()
        if len(engine.scheduler.running) == engine.scheduler.max_num_seqs:
            break
    assert len(engine.scheduler.running) == engine.scheduler.max_num_seqs
    assert engine.scheduler.waiting
    engine.add_request("other", None, SHORT, _tokens(16, seed=200))
    assert _steps_to_first_token(engine, "other") <= 3
    finals = _drain(engine)
    _assert_idle(engine)
    assert len(finals["other"]) == 4
    assert all(len(finals[f"big-{i}"]) == 48 for i in range(64))


def test_priority_and_arrival_order_admission():
    bm = BlockManager(num_blocks=64, block_size=8)
    scheduler = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=1)
    params = SamplingParams(max_tokens=2)
    seqs = [
        Sequence(name, [i + 1] * 5, params, priority=p)
        for i, (name, p) in enumerate([("a", 0), ("b", 5), ("c", -1), ("d", 0)])
    ]
    for seq in seqs:
        scheduler.add(seq)
    started = []
    while scheduler.has_unfinished:
        started += _step_fake(scheduler, 1)
    assert started == ["c", "a", "d", "b"]


def test_groups_share_the_sequence_cap():
    bm = BlockManager(num_blocks=256, block_size=8)
    scheduler = Scheduler(bm, max_num_batched_tokens=256, max_num_seqs=4)
    params = SamplingParams(max_tokens=100)
    for i in range(8):
        scheduler.add(Sequence(f"a{i}", [i + 1] * 4, params, group="A"))
    _step_fake(scheduler, 2)
    assert scheduler.running_per_group == {"A": 4}
    for i in range(2):
        scheduler.add(Sequence(f"b{i}", [i + 50] * 4, params, group="B"))
    _step_fake(scheduler, 3)
    assert scheduler.running_per_group == {"A": 2, "B": 2}


def _step_fake(scheduler: Scheduler, steps: int) -> list[str]:
    """Steps with a fake model that samples token 7; returns the sequences started."""
    started = []
    for _ in range(steps):
        for seq, n in scheduler.schedule().all():
            if seq.num_computed_tokens == 0:
                started.append(seq.request_id)
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token(7)
                if seq.num_output_tokens >= seq.sampling_params.max_tokens:
                    scheduler.finish(seq, "length")
                    continue
            scheduler.kv_manager.register_computed_blocks(seq)
    return started


@pytest.mark.parametrize("priority", ["1", 1.5, True, None])
def test_priority_must_be_an_integer(llm, priority):
    with pytest.raises(ParamError, match="priority") as error:
        llm.engine.add_request("bad", None, SHORT, [5, 6], priority=priority)
    assert error.value.param == "priority"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("seed", range(6))
def test_groups_priorities_and_preemption_lose_nothing(seed):
    """Random groups, priorities and prompt lengths in too little memory: every
    sequence finishes, none is scheduled twice in a step, every block comes back."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.choice([24, 48]), block_size=8)
    scheduler = Scheduler(
        bm, max_num_batched_tokens=rng.choice([16, 64]), max_num_seqs=rng.choice([3, 8])
    )
    seqs = []
    for i in range(30):
        params = SamplingParams(max_tokens=rng.randint(1, 16))
        prompt = [i * 100 + j for j in range(rng.randint(1, 90))]
        group = rng.choice("abc")
        seqs.append(Sequence(f"{group}{i}", prompt, params, rng.randint(-1, 1), group))
    for seq in seqs:
        scheduler.add(seq)
    run_to_completion(scheduler)
    assert all(s.num_output_tokens == s.sampling_params.max_tokens for s in seqs)
    assert bm.num_free_blocks == bm.num_blocks
    assert not scheduler.running_per_group
