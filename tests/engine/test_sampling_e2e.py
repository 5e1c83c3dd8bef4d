"""Sampling through the whole engine: stop strings across token boundaries (and never
streamed), logprobs against HF transformers, seeded requests inside a batch."""

from __future__ import annotations

import pytest
import torch

from pyllm import LLM, SamplingParams
from tests.engine.test_engine import _prompts, _write_byte_tokenizer
from tests.model.conftest import make_hf_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-sampling")
    hf_model = make_hf_model("llama", path, max_position_embeddings=1024)
    _write_byte_tokenizer(path, vocab_size=512)
    return path, hf_model


@pytest.fixture(scope="module")
def tiny(tiny_model):
    path, hf_model = tiny_model
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.05)
    return llm, hf_model


def _stream(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[list[str], object]:
    """Steps the engine by hand; returns the text visible after each step and the
    final output."""
    engine = llm.engine
    engine.add_request("stream", None, params, prompt_token_ids=prompt)
    seen, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.append(output.outputs[0].text)
            final = output
    return seen, final


def test_stop_string_split_across_tokens_stops_and_never_streams(tiny):
    llm, _ = tiny
    prompt = _prompts(1, seed=11)[0]
    free = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    text = free.text  # tokens decode as "<id>" pieces glued together
    boundaries = [i for i in range(1, len(text)) if text[i] == "<"]
    cut = boundaries[len(boundaries) // 2]
    stop = text[cut - 2 : cut + 2]  # two characters either side of a token boundary
    assert stop not in text[: cut - 2 + len(stop) - 1]  # its first occurrence is here

    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    seen, final = _stream(llm, prompt, params)
    out = final.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: cut - 2]
    for visible in seen:  # nothing past the stop string was ever shown
        assert out.text.startswith(visible)
        assert stop not in visible

    with_stop = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    _, final = _stream(llm, prompt, with_stop)
    assert final.outputs[0].text == text[: cut + 2]


def test_best_of_returns_the_samples_with_the_highest_logprob_per_token(tiny):
    """best_of=4, n=2 draws the same 4 samples as n=4 (sibling i is seeded seed + i) and
    returns the 2 with the highest mean logprob, best first; nothing shows before then."""
    llm, _ = tiny
    prompt = _prompts(1, seed=11)[0]
    common = dict(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    params = SamplingParams(n=4, logprobs=0, **common)
    every = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    every = every[0].outputs
    means = [sum(lp for lp, _ in c.logprobs) / len(c.logprobs) for c in every]
    ranked = sorted(range(4), key=lambda i: means[i], reverse=True)
    assert len({tuple(c.token_ids) for c in every}) > 1  # the samples differ

    engine = llm.engine
    engine.add_request("best", None, SamplingParams(n=2, best_of=4, **common), prompt)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert all(not o.outputs for o in outputs[:-1]) and outputs[-1].finished
    best = outputs[-1].outputs
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [every[i].token_ids for i in ranked[:2]]
    assert all(c.logprobs is None for c in best)  # not asked for


def test_greedy_logprobs_match_hf(tiny):
    llm, hf_model = tiny
    prompt = _prompts(1, seed=12)[0]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + generated])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    for step, (token, (chosen, top)) in enumerate(
        zip(generated, out.outputs[0].logprobs, strict=True)
    ):
        row = reference[len(prompt) - 1 + step]
        assert abs(chosen - float(row[token])) < 1e-3
        expected_top = torch.topk(row, 5)
        assert set(top) == set(expected_top.indices.tolist())
        for token_id, logprob in top.items():
            assert abs(logprob - float(row[token_id])) < 1e-3


def test_seeded_request_same_alone_and_in_a_batch(tiny):
    llm, _ = tiny
    prompts = _prompts(9, seed=13)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[prompts[4]], sampling_params=seeded, use_tqdm=False)
    batch_params = [other] * 4 + [seeded] + [other] * 4
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=batch_params, use_tqdm=False)
    assert batched[4].outputs[0].token_ids == alone[0].outputs[0].token_ids
    unseeded = [
        llm.generate(prompt_token_ids=[prompts[0]], sampling_params=other, use_tqdm=False)[0]
        for _ in range(2)
    ]
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def _hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_prompt_logprobs(got, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        chosen, top = got[p]
        row = reference[p - 1]  # the logits at p - 1 predict token p
        assert abs(chosen - float(row[prompt[p]])) < 1e-3, f"position {p}"
        assert set(top) == set(row.topk(k).indices.tolist()), f"position {p}"
        for token_id, logprob in top.items():
            assert abs(logprob - float(row[token_id])) < 1e-3


def test_prompt_logprobs_match_hf_chunked_and_cached(tiny_model):
    """Prompt logprobs against HF: in one prefill, in chunks of 16 tokens (chunked
    prefill), and again for a prompt whose first blocks come from the prefix cache."""
    path, hf_model = tiny_model
    prompt = [(7 * i + 3) % 500 + 2 for i in range(150)]
    reference = _hf_prompt_logprobs(hf_model, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=4)
    results = []
    for budget in (512, 16):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=0.05, max_num_batched_tokens=budget)
        first, again = (
            llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
            for _ in range(2)
        )
        assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 128
        for out in (first, again):
            _check_prompt_logprobs(out.prompt_logprobs, prompt, reference, 4)
        results.append(first.prompt_logprobs)
    one_pass, chunked = results
    for p in range(1, len(prompt)):
        assert abs(one_pass[p][0] - chunked[p][0]) < 1e-4
    # Not asked: not computed.
    plain = llm.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(), use_tqdm=False
    )
    assert plain[0].prompt_logprobs is None


def test_prompt_logprobs_with_n_and_in_a_batch(tiny):
    """n > 1 (siblings share the prompt's blocks) and a batch of other requests: the
    prompt logprobs are the request's own, computed once."""
    llm, hf_model = tiny
    prompts = _prompts(4, seed=21)
    prompt = [(11 * i + 5) % 500 + 2 for i in range(40)]
    params = SamplingParams(temperature=1.0, n=3, max_tokens=3, prompt_logprobs=0, seed=2)
    batch = [SamplingParams(max_tokens=3)] * 2 + [params] + [SamplingParams(max_tokens=3)] * 2
    outputs = llm.generate(
        prompt_token_ids=prompts[:2] + [prompt] + prompts[2:], sampling_params=batch, use_tqdm=False
    )
    got = outputs[2].prompt_logprobs
    _check_prompt_logprobs(got, prompt, _hf_prompt_logprobs(hf_model, prompt), 0)
    assert len(outputs[2].outputs) == 3
    assert all(o.prompt_logprobs is None for i, o in enumerate(outputs) if i != 2)
