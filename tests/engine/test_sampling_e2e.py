"""Sampling through the whole engine: stop strings across token boundaries (and never
streamed), logprobs against HF transformers, seeded requests inside a batch."""

from __future__ import annotations

import pytest
import torch

from pyllm import LLM, SamplingParams
from tests.engine.test_engine import _prompts, _write_byte_tokenizer
from tests.model.conftest import make_hf_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-sampling")
    hf_model = make_hf_model("llama", path, max_position_embeddings=1024)
    _write_byte_tokenizer(path, vocab_size=512)
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
