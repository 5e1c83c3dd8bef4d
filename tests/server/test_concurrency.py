"""32 concurrent streaming clients: each gets exactly the greedy output it gets alone."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from pyllm.engine.async_engine import AsyncEngine
from pyllm.engine.outputs import CompletionOutput, RequestOutput
from pyllm.sampling.params import SamplingParams
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


# ---------------------------------------------------------------------------------------
# The step loop itself, in process, over a stand-in engine whose failures are on demand.

POISON = 13  # a prompt starting with this token makes the stand-in's step raise
REFUSED = 0  # a prompt starting with this token is refused by add_request


class _StandInEngine:
    """LLMEngine's interface as AsyncEngine uses it; one token per request per step."""

    tokenizer = None
    max_model_len = 64

    def __init__(self):
        self.requests: dict[str, list] = {}

    def add_request(self, request_id, prompt, params, prompt_token_ids, priority=0, group=None):
        if prompt_token_ids[0] == REFUSED:
            raise ValueError("prompt refused")
        self.requests[request_id] = [list(prompt_token_ids), 0, params.max_tokens]

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.002)
        if any(r[0][0] == POISON for r in self.requests.values()):
            raise RuntimeError("step failed")
        outputs = []
        for request_id, r in list(self.requests.items()):
            r[1] += 1
            done = r[1] >= r[2]
            completion = CompletionOutput(0, "x" * r[1], [7] * r[1], "length" if done else None)
            outputs.append(RequestOutput(request_id, None, r[0], [completion], done))
            if done:
                del self.requests[request_id]
        return outputs


def test_engine_loop_survives_refusals_failures_and_abandoned_requests():
    stand_in = _StandInEngine()
    engine = AsyncEngine(stand_in)
    engine.start()

    async def run(request_id, first_token, max_tokens=5, stop_after=None):
        last = None
        async for output in engine.generate(
            request_id, [first_token, 1, 2], SamplingParams(max_tokens=max_tokens)
        ):
            last = output
            if stop_after is not None and len(output.outputs[0].token_ids) >= stop_after:
                break
        return last

    async def scenario():
        assert (await run("a", 5)).outputs[0].text == "xxxxx"
        with pytest.raises(ValueError, match="refused"):
            await run("refused", REFUSED)
        # A step that raises fails the requests in flight, and only those.
        results = await asyncio.gather(
            run("long", 5, max_tokens=10_000), run("poison", POISON), return_exceptions=True
        )
        assert all(isinstance(r, RuntimeError) for r in results), results
        # The client of a long request leaves after 3 tokens: the request is aborted.
        partial = await run("abandoned", 5, max_tokens=10_000, stop_after=3)
        assert partial.outputs[0].token_ids and not partial.finished
        # And the loop still serves, many at once.
        outputs = await asyncio.gather(*(run(f"after-{i}", 5, max_tokens=i + 1) for i in range(32)))
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(range(1, 33))

    try:
        asyncio.run(scenario())
        assert wait_for(lambda: not stand_in.requests, timeout=5), stand_in.requests
        assert engine.is_running
    finally:
        engine.shutdown()
    assert not engine.is_running
