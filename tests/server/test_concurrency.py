"""32 concurrent streaming clients: each gets exactly the greedy output it gets alone."""

from __future__ import annotations

import asyncio
import time

import openai

from tests.server.conftest import read_metrics, wait_for

SUBJECTS = [
    "the sea", "a mountain", "coffee", "the moon", "a library", "winter", "bicycles", "rain",
    "a volcano", "honey bees", "the desert", "trains", "a lighthouse", "autumn leaves", "chess",
    "the violin", "a glacier", "bread", "owls", "the city at night", "a river", "thunder",
    "gardens", "the printing press", "penguins", "a castle", "comets", "tea", "a forest",
    "clocks", "the alphabet", "snow",
]  # fmt: skip
NUM_CLIENTS = 32


def _request(i: int) -> tuple[str, dict]:
    """Half chat, half text completions; lengths differ so streams end at different steps."""
    max_tokens = 8 + i % 5
    if i % 2 == 0:
        messages = [{"role": "user", "content": f"Write one sentence about {SUBJECTS[i]}."}]
        return "chat", dict(messages=messages, max_tokens=max_tokens, temperature=0)
    return "completion", dict(
        prompt=f"Here is a short fact about {SUBJECTS[i]}:", max_tokens=max_tokens, temperature=0
    )


def _alone(client: openai.OpenAI, model: str, i: int) -> str:
    kind, kwargs = _request(i)
    if kind == "chat":
        return client.chat.completions.create(model=model, **kwargs).choices[0].message.content
    return client.completions.create(model=model, **kwargs).choices[0].text


async def _stream(client: openai.AsyncOpenAI, model: str, i: int) -> dict:
    kind, kwargs = _request(i)
    api = client.chat.completions if kind == "chat" else client.completions
    stream = await api.create(model=model, stream=True, **kwargs)
    text, first_token_at, finish_reasons = "", None, []
    async for chunk in stream:
        for choice in chunk.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            if piece and first_token_at is None:
                first_token_at = time.monotonic()
            text += piece or ""
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    return dict(text=text, first=first_token_at, end=time.monotonic(), finish=finish_reasons)


def test_32_concurrent_streams_match_their_outputs_alone(client, server):
    alone = [_alone(client, server.model, i) for i in range(NUM_CLIENTS)]
    assert len(set(alone)) > NUM_CLIENTS // 2  # the prompts really differ

    async def run_all():
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=300
        ) as aclient:
            return await asyncio.gather(
                *(_stream(aclient, server.model, i) for i in range(NUM_CLIENTS))
            )

    results = asyncio.run(run_all())
    for i, (result, expected) in enumerate(zip(results, alone, strict=True)):
        assert result["text"] == expected, f"client {i}: {result['text']!r} != {expected!r}"
        assert len(result["finish"]) == 1, f"client {i}: finish reasons {result['finish']}"
    # They really ran together: every stream had its first token before any stream ended.
    assert max(r["first"] for r in results) < min(r["end"] for r in results)
    metrics = wait_for(
        lambda: (m := read_metrics(server.base_url))["pyllm:num_requests_running"] == 0 and m,
        timeout=10,
    )
    assert metrics and metrics["pyllm:num_free_kv_blocks"] == metrics["pyllm:num_kv_blocks"]
