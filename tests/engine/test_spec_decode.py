"""Speculative decoding (n-gram proposals) end to end: greedy output token for token
that of the plain engine (batching, chunked prefill, prefix caching, both KV layouts,
preemption, penalties, stops and max_tokens inside an accepted run, logprobs), sampling
at temperature 1 drawing from the plain engine's distribution, and bad configs refused
by key. Every test that compares also checks that proposals were accepted, so none
can pass with speculation idle."""

from __future__ import annotations

import collections
import math
import random

import pytest

from pyllm import LLM, SamplingParams
from pyllm.cli import _engine_config, build_parser, main
from pyllm.sampling import sampler as sampler_module
from pyllm.sampling.sampler import Sampler
from tests.engine.test_engine import _assert_all_blocks_free

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": 4096,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _llm(path: str, spec: dict | None = NGRAM, **options) -> LLM:
    options.setdefault("kv_cache_memory", 0.05)
    return LLM(path, dtype="float32", speculative_config=spec, **options)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (a short unit repeated: proposals come from the prompt) and
    random ones (the tiny model's output soon loops: proposals come from the output)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 3 == 2:
            prompts.append([rng.randint(2, 511) for _ in range(rng.choice([1, 17, 40]))])
        else:
            unit = [rng.randint(2, 511) for _ in range(rng.randint(2, 9))]
            prompts.append((unit * 40)[: rng.randint(10, 120)])
    return prompts


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _accepted(llm: LLM) -> int:
    return llm.engine.stats().spec_decode_num_accepted_tokens


@pytest.fixture(scope="module")
def plain_outputs(tiny_model_dir):
    return _tokens(_llm(tiny_model_dir, None), _prompts(12))


@pytest.mark.parametrize(
    "options",
    [
        {},  # paged, prefix caching on
        {"max_num_batched_tokens": 16},  # chunked prefill; drafts trimmed to the budget
        {"enable_prefix_caching": False},
        {"kv_cache": "contiguous"},
        {"kv_cache": "contiguous", "max_num_batched_tokens": 16},
        {"adaptive_length": False},  # every proposal as long as a match allows
    ],
)
def test_greedy_output_is_the_plain_engines(tiny_model_dir, plain_outputs, options):
    adaptive = options.pop("adaptive_length", True)
    llm = _llm(tiny_model_dir, {**NGRAM, "adaptive_length": adaptive}, **options)
    assert _tokens(llm, _prompts(12)) == plain_outputs
    stats = llm.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
    # Each drafted step emits its accepted tokens and one more (no stop cut these).
    assert stats.spec_decode_num_emitted_tokens == (
        stats.spec_decode_num_accepted_tokens + stats.spec_decode_num_drafts
    )
    assert stats.generation_tokens == 12 * GREEDY.max_tokens
    if options.get("kv_cache") != "contiguous":
        _assert_all_blocks_free(llm)


def test_prefix_cache_shares_blocks_after_rejected_drafts(tiny_model_dir):
    # The second request reuses the first one's full blocks, prompt and output: they
    # must hold exactly the plain engine's KV, never a rejected proposal's.
    prompt = _prompts(1, seed=5)[0]
    first = _tokens(_llm(tiny_model_dir, None), [prompt], GREEDY)[0]
    follow = prompt + first + [7, 8, 9]
    expected = _tokens(_llm(tiny_model_dir, None), [follow])[0]
    llm = _llm(tiny_model_dir)
    assert _tokens(llm, [prompt]) == [first]
    drafted = llm.engine.stats().spec_decode_num_draft_tokens
    assert drafted > _accepted(llm) > 0  # some proposals were rejected
    out = llm.generate(prompt_token_ids=[follow], sampling_params=GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= 16 * ((len(prompt) + len(first) - 1) // 16) > 0
    assert out.outputs[0].token_ids == expected
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_penalties_and_min_tokens_apply_at_every_verified_position(tiny_model_dir, kv_cache):
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=24, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, frequency_penalty=0.7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20, logit_bias={1: 8.0}),
    ] * 3
    prompts = _prompts(12, seed=3)
    plain = _tokens(_llm(tiny_model_dir, None, kv_cache=kv_cache), prompts, params)
    llm = _llm(tiny_model_dir, kv_cache=kv_cache)
    assert _tokens(llm, prompts, params) == plain
    assert _accepted(llm) > 0


def test_every_sample_of_n_speculates_alone(tiny_model_dir, plain_outputs):
    # n = 3 greedy samples of each prompt: siblings share the prompt's blocks and each
    # verifies its own proposals; all three are the plain engine's output.
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, n=3)
    llm = _llm(tiny_model_dir)
    outputs = llm.generate(prompt_token_ids=_prompts(12), sampling_params=params, use_tqdm=False)
    for out, expected in zip(outputs, plain_outputs, strict=True):
        assert [o.token_ids for o in out.outputs] == [expected] * 3
    assert llm.engine.stats().spec_decode_num_drafts > 3 * 12
    _assert_all_blocks_free(llm)


def test_preemption_loses_nothing(tiny_model_dir, plain_outputs):
    # 12 prompts of up to 152 tokens in 24 blocks of 16 tokens: the engine preempts.
    llm = _llm(tiny_model_dir, kv_cache_memory=24 * 16 * 2 * 2 * 2 * 64 * 4 / 2**30)
    assert llm.engine.kv_manager.num_blocks == 24
    assert _tokens(llm, _prompts(12)) == plain_outputs
    assert llm.engine.scheduler.num_preemptions > 0
    assert _accepted(llm) > 0
    _assert_all_blocks_free(llm)


def _runs(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """Steps one request by hand; the output length after each step."""
    engine = llm.engine
    engine.add_request("runs", None, params, prompt_token_ids=prompt)
    lengths = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            lengths.append(len(output.outputs[0].token_ids))
    return lengths


def test_stops_and_max_tokens_inside_an_accepted_run(tiny_model_dir):
    prompt = _prompts(1, seed=7)[0]
    llm, inside, got, tokens = stops_inside_accepted_runs(
        _llm(tiny_model_dir, None), lambda: _llm(tiny_model_dir), prompt, stop_tokens=True
    )
    for p, out in zip(inside, got, strict=False):  # each stopped right at its run's token
        assert out.outputs[0].token_ids == tokens[: p + 1]
        assert out.outputs[0].finish_reason == "stop"
    _assert_all_blocks_free(llm)


def stops_inside_accepted_runs(plain: LLM, speculative, prompt, stop_tokens: bool):
    """Stop strings ending at each output position a step emitted with more tokens after
    it, (with stop_tokens) each output token as a stop token, and every max_tokens up
    to 32: the speculative engine's outputs equal the plain engine's, and it accepted
    proposals. Returns (that engine, those positions, its outputs, the full output)."""
    full = plain.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
    tokens = full[0].outputs[0].token_ids
    lengths = _runs(speculative(), prompt, GREEDY)
    # Output positions a step emitted with more tokens after them in the same step.
    pairs = zip([0, *lengths[:-1]], lengths, strict=True)
    inside = sorted({p for a, b in pairs for p in range(a, b - 1)})
    assert inside, "no accepted run to stop inside"
    # The text of tokens 0..p first occurs ending at token p: a stop string there.
    ends = [len(plain.tokenizer.decode(tokens[: p + 1])) for p in inside]
    text = full[0].outputs[0].text
    params = [
        *(SamplingParams(temperature=0.0, max_tokens=32, stop=[text[:end]]) for end in ends),
        *(SamplingParams(temperature=0.0, max_tokens=32, stop_token_ids=[t])
          for t in (tokens if stop_tokens else [])),
        *(SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in range(1, 33)),
    ]  # fmt: skip
    prompts = [prompt] * len(params)
    expected = plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    llm = speculative()
    got = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for want, out in zip(expected, got, strict=True):
        want, out = want.outputs[0], out.outputs[0]
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason,
        )  # fmt: skip
    assert _accepted(llm) > 0
    return llm, inside, got, tokens


def test_logprobs_are_the_plain_engines(tiny_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = _prompts(6, seed=2)
    plain = _llm(tiny_model_dir, None).generate(prompt_token_ids=prompts, sampling_params=params)
    llm = _llm(tiny_model_dir)
    spec = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert _accepted(llm) > 0
    for want, got in zip(plain, spec, strict=True):
        want, got = want.outputs[0], got.outputs[0]
        assert got.token_ids == want.token_ids
        for (lp, top), (want_lp, want_top) in zip(got.logprobs, want.logprobs, strict=True):
            assert lp == pytest.approx(want_lp, abs=1e-4)
            assert top.keys() == want_top.keys()
            assert list(top.values()) == pytest.approx(list(want_top.values()), abs=1e-4)


# ------------------------------------------------------------------ sampling


def _chi_square_bound(df: int, z: float = 3.09) -> float:
    """The chi-square distribution's upper 0.1% point (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _top_k_probs(plain: LLM, contexts: list[list[int]], k: int) -> list[dict[int, float]]:
    """The plain engine's top-k distribution at temperature 1 after each context."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k)
    outputs = plain.generate(prompt_token_ids=contexts, sampling_params=params, use_tqdm=False)
    found = []
    for out in outputs:
        top = out.outputs[0].logprobs[0][1]
        total = sum(math.exp(v) for v in top.values())
        found.append({t: math.exp(v) / total for t, v in top.items()})
    return found


def _joint(plain: LLM, prompt: list[int], k: int, depth: int) -> dict[tuple, float]:
    """P(first `depth` output tokens) under top-k sampling at temperature 1."""
    joint = {(): 1.0}
    for _ in range(depth):
        prefixes = list(joint)
        dists = _top_k_probs(plain, [prompt + list(p) for p in prefixes], k)
        joint = {
            p + (t,): joint[p] * q
            for p, d in zip(prefixes, dists, strict=True)
            for t, q in d.items()
        }
    return joint


@pytest.fixture(scope="module")
def looping_prompt(tiny_model_dir):
    """A prompt the tiny model's greedy output has settled into a loop in, so n-gram
    proposals after a sampled token are often among its top tokens."""
    rng = random.Random(2)
    start = [rng.randint(2, 511) for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    return start + _tokens(_llm(tiny_model_dir, None), [start], params)[0]


@pytest.mark.parametrize("broken", [False, True])
def test_sampling_keeps_the_plain_distribution(tiny_model_dir, looping_prompt, broken, monkeypatch):
    # 2000 draws of 3 tokens at temperature 1, top_k 4 (64 outcomes), against the
    # plain engine's probabilities; `broken` accepts every proposal, and must fail.
    if broken:
        monkeypatch.setattr(sampler_module, "accepted_sampled", lambda probs, _: len(probs))
    expected = _joint(_llm(tiny_model_dir, None), looping_prompt, k=4, depth=3)
    spec = {**NGRAM, "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    assert_draws_follow(_llm(tiny_model_dir, spec), looping_prompt, expected, broken)


def assert_draws_follow(llm: LLM, prompt, expected: dict, broken: bool, draws: int = 2000):
    """draws samples of 3 tokens from llm (proposals accepted) fit `expected`, the plain
    engine's joint probabilities, by a chi-square test; unless `broken`, which must fail."""
    engine = llm.engine  # a fixed seed for the draws: the test's outcome is stable
    engine.sampler = Sampler(engine.model_config.vocab_size, engine.eos_token_ids, seed=0)
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    counts = collections.Counter(map(tuple, _tokens(llm, [prompt] * draws, params)))
    assert _accepted(llm) > 50
    assert set(counts) <= set(expected)
    # Outcomes expected fewer than 5 times are pooled, as the test requires.
    small = [o for o, p in expected.items() if p * draws < 5]
    cells = [([o], p) for o, p in expected.items() if p * draws >= 5]
    if small:
        cells.append((small, sum(expected[o] for o in small)))
    chi2 = sum((sum(counts[o] for o in os) - p * draws) ** 2 / (p * draws) for os, p in cells)
    assert (chi2 > _chi_square_bound(len(cells) - 1)) == broken, chi2


# ------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "config, key",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "lookahead", "num_speculative_tokens": 2}, "method"),
        ({"model": "some/draft-model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min",
        ),  # noqa: E501
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 2,
                "prompt_lookup_min": 3,
            },
            "prompt_lookup_min",
        ),  # noqa: E501
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
            "disable_by_batch_size",
        ),  # noqa: E501
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "lookup"),
        ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_length": 1}, "adaptive_length"),
        (["ngram"], None),
    ],
)
def test_bad_configs_are_refused_by_key(tiny_model_dir, config, key):
    where = (
        "speculative_config must be a dict" if key is None else rf"speculative_config\['{key}'\]"
    )
    with pytest.raises(ValueError, match=where):
        _llm(tiny_model_dir, config)


def test_command_line_takes_json(capsys):
    argv = ["generate", "hi", "--speculative-config"]
    json = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    config = _engine_config(build_parser().parse_args([*argv, json])).speculative
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (3, 4)
    assert config.prompt_lookup_min == 4  # one bound given: the other is the same
    assert main([*argv, '{"method": "ngram"']) == 2
    assert "--speculative-config" in capsys.readouterr().err
    assert main([*argv, '{"method": "ngram", "num_speculative_tokens": 0}']) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err
