"""Adaptive proposal length: the chosen length is the best of the cost model over every
length, a sequence's record counts what the step verified (the scheduler's trims
included), and an engine whose proposals keep failing proposes less while its greedy
output stays the plain engine's."""

from __future__ import annotations

import pytest

from pyllm import LLM, SamplingParams
from pyllm.engine.spec_decode.adaptive import ROW_COST, AcceptanceRecord, best_length


def _expected_per_cost(a: float, k: int) -> float:
    # Position i (0-based) of a k-token proposal is reached with probability a^i; the
    # token after the last accepted one is emitted too.
    return sum(a**i for i in range(k + 1)) / (1 + ROW_COST * k)


@pytest.mark.parametrize("most", [1, 4, 8])
def test_best_length_is_the_best_of_every_length(most):
    chosen = [best_length(a / 100, most) for a in range(0, 101)]
    for a, k in zip(range(0, 101), chosen, strict=True):
        values = [_expected_per_cost(a / 100, j) for j in range(most + 1)]
        assert values[k] == pytest.approx(max(values))
    assert chosen == sorted(chosen)  # longer with higher acceptance
    assert chosen[10] == 0 and chosen[-1] == most


def _record(proposed: list[int], position: int) -> AcceptanceRecord:
    record = AcceptanceRecord()
    record.proposed, record.position = proposed, position
    return record


def test_record_counts_the_accepted_prefix_and_one_rejection():
    record = _record([5, 6, 7, 8], 3)
    record.observe([1, 2, 3, 5, 6, 9])  # 5 and 6 accepted, 9 emitted instead of 7
    assert (record.accepted, record.tries, record.proposed) == (2, 3, None)
    record.observe([1, 2, 3, 5, 6, 9, 4])  # nothing proposed since: nothing counted
    assert (record.accepted, record.tries) == (2, 3)


def test_record_counts_only_what_the_scheduler_left():
    proposed = [5, 6, 7, 8]
    record = _record(proposed, 0)
    del proposed[2:]  # the step's budget kept two proposals, both accepted
    record.observe([5, 6, 4])
    assert (record.accepted, record.tries) == (2, 2)


def test_a_failing_sequence_stops_and_later_tries_again():
    record = AcceptanceRecord()
    for _ in range(20):
        record.proposed, record.position = [9, 9, 9, 9], 0
        record.observe([1])
    assert best_length(record.rate, 4) == 0
    idle_steps = 0
    while best_length(record.rate, 4) == 0:
        record.idle()
        idle_steps += 1
    assert 1 < idle_steps < 40


def test_failing_proposals_shrink_and_output_stays_the_plain_engines(tiny_model_dir):
    # Random prompts: proposals come from the tiny model's own looping output, and
    # many are rejected. Adaptive lengths propose fewer tokens, with more of them
    # accepted, and never change the tokens.
    prompts = [[(7 * i + 13 * j) % 509 + 2 for j in range(24)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)

    def run(spec):
        llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory=0.05, speculative_config=spec)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats()

    base = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1, "disable_by_batch_size": 64}  # fmt: skip
    plain, _ = run(None)
    fixed_tokens, fixed = run({**base, "adaptive_length": False})
    adaptive_tokens, adaptive = run(base)
    assert fixed_tokens == plain and adaptive_tokens == plain
    assert fixed.spec_decode_num_accepted_tokens < fixed.spec_decode_num_draft_tokens / 2
    assert adaptive.spec_decode_num_draft_tokens < fixed.spec_decode_num_draft_tokens
    assert adaptive.spec_decode_num_accepted_tokens > 0
    rate = lambda s: s.spec_decode_num_accepted_tokens / s.spec_decode_num_draft_tokens  # noqa: E731
    assert rate(adaptive) > rate(fixed)
