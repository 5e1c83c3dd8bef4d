"""Anthropic's Messages API (/v1/messages) on a real `pyllm serve`, driven by the official
`anthropic` SDK: replies whole and streamed, forced tool calls, tool results, token
counts, and errors in Anthropic's shape with the SDK's exception classes. (Thinking
blocks and streamed tool_use input, on a reasoning server: test_reasoning.py.)"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest

from pyllm.entrypoints.anthropic_serving import AnthropicErrors
from pyllm.entrypoints.openai_protocol import error_body
from tests.server.conftest import read_metrics, wait_for

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOL_TURNS = [
    {"role": "user", "content": "What is the weather in Oslo?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "18 degrees and sunny"}],
            }
        ],
    },
]


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(
        base_url=server.base_url, api_key=server.api_key, max_retries=0, timeout=120
    ) as c:
        yield c
    assert server.process.poll() is None, f"the server died:\n{server.log_tail()}"


@pytest.fixture
def raw(server):
    """httpx with Anthropic's headers: the key as x-api-key."""
    headers = {"x-api-key": server.api_key, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as client:
        yield client


def _create(claude, server, **kwargs):
    return claude.messages.create(**{**_args(server), **kwargs})


def _args(server, max_tokens: int = 12) -> dict:
    """Greedy (temperature goes as an extra field: newer SDKs leave sampling fields out)."""
    return dict(
        model=server.model, max_tokens=max_tokens, messages=QUESTION, extra_body={"temperature": 0}
    )


def test_create(claude, server):
    message = _create(claude, server, system="You are a geography teacher.")
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == server.model
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert 0 < message.usage.output_tokens <= 12
    counted = claude.messages.count_tokens(
        model=server.model, system="You are a geography teacher.", messages=QUESTION
    )
    assert counted.input_tokens == message.usage.input_tokens > 0


def test_stop_sequence(claude, server):
    text = _create(claude, server).content[0].text
    word = text.split()[1]
    message = _create(claude, server, stop_sequences=[word])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == text[: text.index(word)]


def test_stream_matches_create(claude, server):
    whole = _create(claude, server)
    with claude.messages.stream(**_args(server)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_events_in_order(raw, server):
    body = {"model": server.model, "max_tokens": 5, "messages": QUESTION, "stream": True,
            "temperature": 0}  # fmt: skip
    with raw.stream("POST", "/v1/messages", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    kinds = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == kinds
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert data[-2]["delta"]["stop_reason"] == "max_tokens" and data[-2]["usage"]["output_tokens"]


def test_forced_tool_call(claude, server):
    message = _create(
        claude,
        server,
        max_tokens=60,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
    )
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])


def test_forced_tool_call_streamed(claude, server):
    args = {**_args(server, 60), "messages": [{"role": "user", "content": "Oslo?"}]}
    with claude.messages.stream(**args, tools=[WEATHER], tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    jsonschema.validate(final.content[-1].input, WEATHER["input_schema"])


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    ],
)
def test_forced_tool_without_an_object_schema_streams_the_same_input(claude, server, schema):
    """Its input is wrapped as {"value": ...}, streamed or not."""
    tool = {"name": "pick", "description": "Picks", "input_schema": schema}
    args = {**_args(server, 30), "messages": [{"role": "user", "content": "Pick one."}]}
    forced = dict(tools=[tool], tool_choice={"type": "tool", "name": "pick"})
    whole = claude.messages.create(**args, **forced)
    with claude.messages.stream(**args, **forced) as stream:
        streamed = stream.get_final_message()
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    (call,) = [block for block in whole.content if block.type == "tool_use"]
    assert set(call.input) == {"value"}
    jsonschema.validate(call.input["value"], schema)
    assert streamed.content[-1].type == "tool_use" and streamed.content[-1].input == call.input


def test_tool_result_turn(claude, server):
    message = _create(claude, server, tools=[WEATHER], messages=TOOL_TURNS)
    assert message.content and message.usage.output_tokens > 0
    with_result = claude.messages.count_tokens(
        model=server.model, tools=[WEATHER], messages=TOOL_TURNS
    )
    without = claude.messages.count_tokens(
        model=server.model, tools=[WEATHER], messages=TOOL_TURNS[:1]
    )
    assert with_result.input_tokens > without.input_tokens


def _error(error: anthropic.APIStatusError) -> dict:
    assert error.body["type"] == "error" and set(error.body["error"]) == {"type", "message"}
    return error.body["error"]


def test_bad_role_names_the_field(claude, server):
    with pytest.raises(anthropic.BadRequestError) as raised:
        _create(claude, server, messages=[{"role": "system", "content": "hi"}])
    error = _error(raised.value)
    assert error["type"] == "invalid_request_error" and "messages[0].role" in error["message"]


def test_missing_max_tokens(claude, raw, server):
    body = {"model": server.model, "messages": QUESTION}
    response = raw.post("/v1/messages", json=body)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "message": "max_tokens: Field required",
    }
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.post("/v1/messages", body=body, cast_to=httpx.Response)
    assert "max_tokens" in _error(raised.value)["message"]


def test_images_refused(claude, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    with pytest.raises(anthropic.BadRequestError) as raised:
        _create(claude, server, messages=[{"role": "user", "content": [image]}])
    assert "messages[0].content[0]" in _error(raised.value)["message"]


def test_malformed_blocks_are_named(raw, server):
    for block, named in [
        ({"type": "text"}, "messages[0].content: Value error, content[0].text: Field required"),
        ({"type": "server_tool_use"}, "content[0] has type 'server_tool_use'"),
        ({"type": "tool_use", "id": "t", "name": "f", "input": {}}, "messages[0].content[0]: a"),
    ]:
        body = {
            "model": server.model,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [block]}],
        }
        response = raw.post("/v1/messages", json=body)
        assert response.status_code == 400 and named in response.json()["error"]["message"]


def test_thinking_blocks_sent_back_are_left_out(claude, server):
    thinking = {"type": "thinking", "thinking": "Hm.", "signature": "sig"}
    answer = {"role": "assistant", "content": [thinking, {"type": "text", "text": "Paris."}]}
    plain = {"role": "assistant", "content": "Paris."}

    def count(turn) -> int:
        messages = [*QUESTION, turn, {"role": "user", "content": "Sure?"}]
        return claude.messages.count_tokens(model=server.model, messages=messages).input_tokens

    assert count(answer) == count(plain)


def test_wrong_api_key(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            bad.messages.create(model=server.model, max_tokens=5, messages=QUESTION)
    assert _error(raised.value)["type"] == "authentication_error"
    # The OpenAI routes keep OpenAI's shape; the x-api-key header is taken there too.
    response = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": "wrong"})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    good = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": server.api_key})
    assert good.status_code == 200


def test_unknown_model(claude):
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(model="claude-nope", max_tokens=5, messages=QUESTION)
    assert _error(raised.value)["type"] == "not_found_error"


def test_openapi_declares_the_routes(server):
    document = httpx.get(f"{server.base_url}/openapi.json").json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert "post" in document["paths"][path]
    assert "MessagesRequest" in document["components"]["schemas"]


def test_stream_dropped_frees_the_request(raw, server):
    before = read_metrics(server.base_url)["pyllm:generation_tokens_total"]
    story = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    body = {"model": server.model, "max_tokens": 400, "messages": story, "stream": True}
    with raw.stream("POST", "/v1/messages", json=body) as response:
        lines = response.iter_lines()  # kept referenced: the connection stays open
        deltas = 0
        while deltas < 3:
            deltas += next(lines) == "event: content_block_delta"

    def idle():
        m = read_metrics(server.base_url)
        return m["pyllm:num_requests_running"] == 0 and (
            m["pyllm:num_free_kv_blocks"] == m["pyllm:num_kv_blocks"]
        )

    assert wait_for(idle, timeout=30)
    assert read_metrics(server.base_url)["pyllm:generation_tokens_total"] - before < 400


def _run(app, path: str) -> tuple[dict, bytes]:
    """(the response's start, its body) of `app` at `path`: plain ASGI, no server."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))
    return sent[0], b"".join(m.get("body", b"") for m in sent[1:])


def test_middleware_errors_take_anthropic_shape():
    """Errors made outside the route (here the drain's, split in two body messages)."""
    body = json.dumps(error_body("shutting down", "server_error", None, "x")).encode()

    async def draining(scope, receive, send):
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": body[:10], "more_body": True})
        await send({"type": "http.response.body", "body": body[10:]})

    start, sent = _run(AnthropicErrors(draining), "/v1/messages")
    assert start["status"] == 503
    assert json.loads(sent) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "shutting down"},
    }
    assert dict(start["headers"])[b"content-length"] == str(len(sent)).encode()
    assert _run(AnthropicErrors(draining), "/v1/chat/completions")[1] == body
