"""The official `openai` client against a real pyllm server: chat and text completions,
streamed and not, in each API's own response format.

Token counts are checked against the model's tokenizer as HF transformers builds it
(independent of pyllm's), and streamed outputs against the same request not streamed.
"""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from tests.server.conftest import read_metrics, start_server, stop_server

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPT = "The three primary colors are"


def _chat_prompt_len(hf_tokenizer, messages) -> int:
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(hf_tokenizer.encode(text, add_special_tokens=False))


def _token_bytes_text(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")


def _stream(client, kind: str, **kwargs):
    api = client.chat.completions if kind == "chat" else client.completions
    return list(api.create(stream=True, **kwargs))


def _chunk_text(chunk, index: int = 0) -> str:
    for choice in chunk.choices:
        if choice.index == index:
            return (choice.delta.content or "") if hasattr(choice, "delta") else choice.text
    return ""


def _finish_reasons(chunks, index: int = 0) -> list[str]:
    return [
        c.finish_reason
        for chunk in chunks
        for c in chunk.choices
        if c.index == index and c.finish_reason is not None
    ]


def test_models(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    assert models.data[0].object == "model"
    assert client.models.retrieve(server.model).id == server.model


def test_chat_completion_and_usage(client, server, hf_tokenizer):
    r = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=24, temperature=0, logprobs=True
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == server.model and abs(r.created - time.time()) < 600
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    num_tokens = len(choice.logprobs.content)
    assert r.usage.prompt_tokens == _chat_prompt_len(hf_tokenizer, CHAT)
    assert r.usage.completion_tokens == num_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + num_tokens
    if choice.finish_reason == "length":
        assert num_tokens == 24
    else:  # ended by the end-of-turn token, whose text is skipped
        assert num_tokens < 24
        assert hf_tokenizer.convert_tokens_to_ids(choice.logprobs.content[-1].token) in (
            hf_tokenizer.eos_token_id,
            hf_tokenizer.convert_tokens_to_ids("<|im_end|>"),
        )
    text = _token_bytes_text(choice.logprobs.content)
    assert text.startswith(choice.message.content)


def test_chat_stream_matches_non_stream(client, server):
    kwargs = dict(model=server.model, messages=CHAT, max_tokens=24, temperature=0)
    reference = client.chat.completions.create(**kwargs)
    chunks = _stream(client, "chat", stream_options={"include_usage": True}, **kwargs)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(_chunk_text(c) for c in chunks)
    assert text == reference.choices[0].message.content
    assert _finish_reasons(chunks) == [reference.choices[0].finish_reason]
    # include_usage: a last chunk with usage and no choices; no usage before it.
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == reference.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format(http, server):
    body = {"model": server.model, "messages": CHAT, "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert json.loads(line.removeprefix("data: "))["object"] == "chat.completion.chunk"


def test_completion_and_stream(client, server, hf_tokenizer):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0)
    r = client.completions.create(**kwargs)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == server.model
    (choice,) = r.choices
    assert choice.index == 0 and choice.text and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(hf_tokenizer.encode(PROMPT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 16

    chunks = _stream(client, "completion", stream_options={"include_usage": True}, **kwargs)
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(_chunk_text(c) for c in chunks) == choice.text
    assert _finish_reasons(chunks) == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()


def test_chat_logprobs(client, server):
    r = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert sum(math.exp(t.logprob) for t in top) <= 1 + 1e-4
        # Greedy: the chosen token is the most likely one.
        assert entry.token == top[0].token
        assert entry.logprob == pytest.approx(top[0].logprob, abs=1e-5)
        assert entry.logprob <= 0
        for t in [entry, *top]:
            assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
    # Streamed, the same entries arrive spread over the chunks.
    chunks = _stream(
        client,
        "chat",
        model=server.model,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_completion_logprobs(client, server):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    r = client.completions.create(**kwargs)
    choice = r.choices[0]
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    assert "".join(lp.tokens).startswith(choice.text)
    assert lp.text_offset[0] == 0
    for i in range(1, n):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(logprob, abs=1e-5)  # greedy
        assert top[token] == pytest.approx(logprob, abs=1e-5)

    chunks = _stream(client, "completion", **kwargs)
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert tokens == lp.tokens


def test_completion_echo_logprobs_and_prompt_logprobs(client, http, server):
    """echo with logprobs: the prompt's tokens first (the first without a logprob), then
    the generated ones. Checked against the engine's other path: a token's logprob when
    generated (decode) equals its logprob as part of a longer prompt (prefill)."""
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0)
    plain = client.completions.create(logprobs=2, **kwargs)
    generated = plain.choices[0].logprobs
    r = client.completions.create(echo=True, logprobs=2, **kwargs)
    choice = r.choices[0]
    lp = choice.logprobs
    num_prompt = r.usage.prompt_tokens
    assert choice.text == PROMPT + plain.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == num_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[num_prompt:] == generated.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(generated.token_logprobs, abs=1e-5)
    assert lp.text_offset[num_prompt] == len(PROMPT)
    for i in range(1, num_prompt):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
        assert len(lp.top_logprobs[i]) == 2 and lp.token_logprobs[i] < 0
        assert max(lp.top_logprobs[i].values()) >= lp.token_logprobs[i]
        if lp.tokens[i] in lp.top_logprobs[i]:
            assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])

    # The generated text as part of the prompt: its prompt logprobs are the decode ones.
    body = dict(
        model=server.model,
        prompt=PROMPT + plain.choices[0].text,
        max_tokens=1,
        temperature=0,
        prompt_logprobs=3,
    )
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    prompt_lps = response.json()["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == response.json()["usage"]["prompt_tokens"]
    tail = prompt_lps[num_prompt : num_prompt + len(generated.tokens)]
    for entry, token, logprob in zip(tail, generated.tokens, generated.token_logprobs, strict=True):
        assert len(entry) in (3, 4)  # the top 3, plus the prompt token when outside them
        chosen = [e for e in entry.values() if e["decoded_token"] == token]
        assert chosen and chosen[0]["logprob"] == pytest.approx(logprob, abs=1e-3)
        assert chosen[0]["rank"] == 1  # greedy: the generated token was the most likely
        assert sorted(e["rank"] for e in entry.values() if e["rank"]) == [1, 2, 3]


@pytest.mark.parametrize("stream", [False, True])
def test_n2(client, server, stream):
    kwargs = dict(
        model=server.model,
        messages=CHAT,
        max_tokens=12,
        temperature=1.0,
        seed=3,
        n=2,
        logprobs=True,
    )
    if not stream:
        r = client.chat.completions.create(**kwargs)
        assert sorted(c.index for c in r.choices) == [0, 1]
        counts = [len(c.logprobs.content) for c in r.choices]
        assert all(c.message.content for c in r.choices)
        assert r.usage.completion_tokens == sum(counts)
        return
    chunks = _stream(client, "chat", stream_options={"include_usage": True}, **kwargs)
    counts = {0: 0, 1: 0}
    for chunk in chunks:
        for c in chunk.choices:
            counts[c.index] += len(c.logprobs.content) if c.logprobs else 0
    for index in (0, 1):
        assert "".join(_chunk_text(c, index) for c in chunks)
        assert len(_finish_reasons(chunks, index)) == 1
    assert chunks[-1].usage.completion_tokens == counts[0] + counts[1]


def test_completion_n2_and_batch_prompts(client, server):
    r = client.completions.create(
        model=server.model, prompt=[PROMPT, "Hello"], max_tokens=4, n=2, temperature=0
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    # Greedy: both choices of one prompt agree; each prompt's output is its own.
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]
    alone = client.completions.create(
        model=server.model, prompt="Hello", max_tokens=4, temperature=0
    )
    assert by_index[2] == alone.choices[0].text


def test_completion_best_of(client, server):
    """best_of samples 3 and returns the one with the highest logprob per token."""
    r = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, best_of=3, n=1, temperature=1.0, seed=5
    )
    assert [c.index for c in r.choices] == [0]
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].text


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stop(client, server, kind):
    if kind == "chat":
        kwargs = dict(model=server.model, messages=CHAT, temperature=0, max_tokens=24)
        create, text_of = client.chat.completions.create, lambda r: r.choices[0].message.content
    else:
        kwargs = dict(model=server.model, prompt=PROMPT, temperature=0, max_tokens=24)
        create, text_of = client.completions.create, lambda r: r.choices[0].text
    full = text_of(create(extra_body={"ignore_eos": True}, **kwargs))
    assert len(full) >= 12, full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    at = full.find(stop)

    r = create(stop=stop, extra_body={"ignore_eos": True}, **kwargs)
    assert text_of(r) == full[:at] and r.choices[0].finish_reason == "stop"
    # A stop string is never streamed, even in part.
    chunks = _stream(
        client, kind, stop=[stop, "\u2603never"], extra_body={"ignore_eos": True}, **kwargs
    )
    assert "".join(_chunk_text(c) for c in chunks) == full[:at]
    assert _finish_reasons(chunks) == ["stop"]
    kept = create(
        stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True}, **kwargs
    )
    assert text_of(kept) == full[: at + len(stop)]


def test_seed_reproducibility(client, server):
    def sample(seed: int) -> str:
        r = client.completions.create(
            model=server.model, prompt="Once upon a time", max_tokens=16, temperature=1.0,
            seed=seed, extra_body={"ignore_eos": True},
        )  # fmt: skip
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))

    kwargs = dict(model=server.model, messages=CHAT, max_tokens=10, temperature=1.0, seed=99, n=2)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_max_completion_tokens_and_extension_fields(client, server):
    r = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_completion_tokens=5,
        temperature=0.7,
        seed=1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body=dict(
            ignore_eos=True,
            min_tokens=5,
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            repeat_last_n=64,
            skip_special_tokens=True,
            include_stop_str_in_output=False,
            stop_token_ids=[],
        ),
    )
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_stop_token_ids(client, server, hf_tokenizer):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0)
    reference = client.completions.create(extra_body={"ignore_eos": True}, **kwargs)
    tokens = reference.choices[0].logprobs.tokens
    # A token of the output whose text maps back to exactly one id.
    k, token_id = next(
        (i, ids[0])
        for i, t in enumerate(tokens)
        if i >= 2 and len(ids := hf_tokenizer.encode(t, add_special_tokens=False)) == 1
    )
    k = tokens.index(tokens[k])  # generation stops at its first occurrence
    r = client.completions.create(extra_body={"stop_token_ids": [token_id]}, **kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == k + 1
    assert r.choices[0].logprobs.tokens == tokens[: k + 1]


def test_metrics_count_a_request(client, server):
    names = [
        "pyllm:num_requests_running",
        "pyllm:num_requests_waiting",
        "pyllm:kv_cache_usage_perc",
        "pyllm:kv_cache_committed_bytes",
        "pyllm:num_free_kv_blocks",
        "pyllm:num_kv_blocks",
        "pyllm:prompt_tokens_total",
        "pyllm:generation_tokens_total",
        "pyllm:num_preemptions_total",
        "pyllm:prefix_cache_queries_total",
        "pyllm:prefix_cache_hits_total",
        "pyllm:prefix_cache_disk_hits_total",
        "pyllm:prefix_cache_disk_writes_total",
        "pyllm:prefix_cache_disk_damaged_total",
        "pyllm:spec_decode_num_drafts_total",
        "pyllm:spec_decode_num_draft_tokens_total",
        "pyllm:spec_decode_num_accepted_tokens_total",
        "pyllm:spec_decode_num_emitted_tokens_total",
        "pyllm:time_to_first_token_seconds_count",
        "pyllm:time_per_output_token_seconds_count",
        "pyllm:e2e_request_latency_seconds_count",
    ]
    before = read_metrics(server.base_url)
    assert set(names) <= set(before), set(names) - set(before)
    # Long enough to fill whole KV blocks, so the second request can reuse them.
    prompt = " ".join(f"word{i}" for i in range(60))
    usages = [
        client.completions.create(
            model=server.model, prompt=prompt, max_tokens=5, temperature=0
        ).usage
        for _ in range(2)
    ]
    after = read_metrics(server.base_url)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("pyllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("pyllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("pyllm:time_to_first_token_seconds_count") == 2
    assert delta("pyllm:e2e_request_latency_seconds_count") == 2
    assert delta("pyllm:prefix_cache_hits_total") >= 32  # the second prompt's full blocks
    assert after["pyllm:num_free_kv_blocks"] == after["pyllm:num_kv_blocks"]
    assert after["pyllm:kv_cache_usage_perc"] == 0
    # Paged: the whole cache is committed at start and stays so.
    assert after["pyllm:kv_cache_committed_bytes"] == before["pyllm:kv_cache_committed_bytes"] > 0


def test_the_readme_chat_request_gets_one_reply(tmp_path):
    """The README's request at temperature 0, again and again, to a server with the
    defaults (the bundled model's weights kept quantized, the CPU's dtype): the prefix
    cache serves the later prompts, and every reply is the same."""
    server = start_server(tmp_path, ["--dtype", "auto", "--quantization", "auto"])
    try:
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 64,
            "temperature": 0,
        }
        headers = {"Authorization": f"Bearer {server.api_key}"}
        replies = []
        for _ in range(3):
            hits = read_metrics(server.base_url).get("pyllm:prefix_cache_hits_total", 0.0)
            r = httpx.post(
                f"{server.base_url}/v1/chat/completions", json=body, headers=headers, timeout=120
            )
            replies.append(r.json()["choices"][0]["message"]["content"])
        assert read_metrics(server.base_url)["pyllm:prefix_cache_hits_total"] > hits
        assert len(set(replies)) == 1, replies
    finally:
        stop_server(server.process)
