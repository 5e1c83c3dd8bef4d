"""Malformed and hostile requests: each gets the right 4xx in OpenAI's error shape, names
the field at fault, and leaves the server serving (and the engine with nothing leaked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import pytest

from tests.server.conftest import API_KEY, read_metrics, wait_for

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


@dataclass
class Case:
    name: str
    status: int
    param: str | None = None  # the field the error must name (None: not checked)
    path: str = CHAT
    body: dict | None = None  # merged over a valid request body
    raw: bytes | None = None  # sent as is instead of a JSON body
    headers: dict = field(default_factory=dict)
    method: str = "POST"
    code: str | None = None


def chat(**fields) -> dict:
    return {"messages": MESSAGES, "max_tokens": 4, **fields}


def call(function) -> dict:
    """An assistant message holding one earlier tool call of `function`."""
    tool_call = {"id": "1", "type": "function", "function": function}
    return {"role": "assistant", "tool_calls": [tool_call]}


def completion(**fields) -> dict:
    return {"prompt": "Hi", "max_tokens": 4, **fields}


TEN_MB = 10 * 2**20
# fmt: off
CASES = [
    # Not JSON, or not the right JSON.
    Case("malformed JSON", 400, raw=b'{"messages": [{"role": "user", "content": "Hi"}'),
    Case("JSON array body", 400, raw=b"[1, 2, 3]"),
    Case("invalid UTF-8", 400, raw=b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    Case("lone surrogate", 400, raw=b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    Case("missing messages", 400, "messages", body={"max_tokens": 4}),
    Case("empty messages", 400, "messages", body=chat(messages=[])),
    Case("messages not a list", 400, "messages", body=chat(messages="Hi")),
    Case("unknown role", 400, "messages[0].role", body=chat(messages=[{"role": "wizard", "content": "x"}])),  # noqa: E501
    Case("content a number", 400, "messages[0].content", body=chat(messages=[{"role": "user", "content": 5}])),  # noqa: E501
    Case("user content null", 400, "messages[0].content", body=chat(messages=[{"role": "user"}])),
    # An assistant's earlier tool calls, and content parts.
    Case("tool call function a string", 400, "messages[0].tool_calls[0].function", body=chat(messages=[call("f"), *MESSAGES])),  # noqa: E501
    Case("tool call function a number", 400, "messages[0].tool_calls[0].function", body=chat(messages=[call(5), *MESSAGES])),  # noqa: E501
    Case("tool call function without a name", 400, "messages[0].tool_calls[0].function.name", body=chat(messages=[call({"arguments": "{}"}), *MESSAGES])),  # noqa: E501
    Case("tool call arguments a number", 400, "messages[0].tool_calls[0].function.arguments", body=chat(messages=[call({"name": "f", "arguments": 5}), *MESSAGES])),  # noqa: E501
    Case("tool_calls not a list", 400, "messages[0].tool_calls", body=chat(messages=[{"role": "assistant", "tool_calls": {"id": "1"}}, *MESSAGES])),  # noqa: E501
    Case("tool call a string", 400, "messages[0].tool_calls[0]", body=chat(messages=[{"role": "assistant", "tool_calls": ["f"]}, *MESSAGES])),  # noqa: E501
    Case("tool call function, /tokenize", 400, "messages[0].tool_calls[0].function", path="/tokenize", body={"messages": [call("f"), *MESSAGES]}),  # noqa: E501
    Case("image content part", 400, "messages[0].content", body=chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])),  # noqa: E501
    Case("text part without text", 400, "messages[0].content", body=chat(messages=[{"role": "user", "content": [{"type": "text"}]}])),  # noqa: E501
    Case("tool parameters not an object", 400, "tools[0].function.parameters", body=chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}])),  # noqa: E501
    Case("body nested 5,000 deep", 400, raw=b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    # Wrong types and values.
    Case("max_tokens a string", 400, "max_tokens", body=chat(max_tokens="ten")),
    Case("max_tokens a float", 400, "max_tokens", body=chat(max_tokens=1.5)),
    Case("max_tokens negative", 400, "max_tokens", body=chat(max_tokens=-5)),
    Case("max_tokens zero", 400, "max_tokens", body=chat(max_tokens=0)),
    Case("max_tokens huge", 400, "max_tokens", body=chat(max_tokens=10**12), code="context_length_exceeded"),  # noqa: E501
    Case("max_completion_tokens huge", 400, "max_completion_tokens", body=chat(max_completion_tokens=10**30)),  # noqa: E501
    Case("temperature negative", 400, "temperature", body=chat(temperature=-1)),
    Case("temperature a string", 400, "temperature", body=chat(temperature="hot")),
    Case("top_p zero", 400, "top_p", body=chat(top_p=0)),
    Case("top_p above one", 400, "top_p", body=chat(top_p=1.5)),
    Case("priority a string", 400, "priority", body=chat(priority="high")),
    Case("priority a float", 400, "priority", path=COMPLETIONS, body=completion(priority=0.5)),
    Case("n zero", 400, "n", body=chat(n=0)),
    Case("n a million", 400, "n", body=chat(n=10**6)),
    Case("top_logprobs too many", 400, "top_logprobs", body=chat(logprobs=True, top_logprobs=50)),
    Case("top_logprobs without logprobs", 400, "top_logprobs", body=chat(top_logprobs=2)),
    Case("logprobs a bool (completions)", 400, "logprobs", COMPLETIONS, completion(logprobs=True)),
    Case("logprobs too many (completions)", 400, "logprobs", COMPLETIONS, completion(logprobs=21)),
    Case("presence_penalty out of range", 400, "presence_penalty", body=chat(presence_penalty=5)),
    Case("repetition_penalty zero", 400, "repetition_penalty", body=chat(repetition_penalty=0)),
    Case("repeat_last_n negative", 400, "repeat_last_n", body=chat(repeat_last_n=-1)),
    Case("min_tokens above max_tokens", 400, "min_tokens", body=chat(min_tokens=10, max_tokens=4)),
    Case("too many stop strings", 400, "stop", body=chat(stop=[f"s{i}" for i in range(100)])),
    Case("huge stop string", 400, "stop", body=chat(stop="x" * 100_000)),
    Case("empty stop string", 400, "stop", body=chat(stop=[""])),
    Case("logit_bias key not an id", 400, "logit_bias", body=chat(logit_bias={"abc": 1})),
    Case("logit_bias value too big", 400, "logit_bias", body=chat(logit_bias={"5": 1000})),
    Case("logit_bias token beyond the vocabulary", 400, "logit_bias", body=chat(logit_bias={"999999999": 1})),  # noqa: E501
    Case("stop_token_ids beyond the vocabulary", 400, "stop_token_ids", body=chat(stop_token_ids=[10**9])),  # noqa: E501
    Case("stop_token_ids negative", 400, "stop_token_ids", body=chat(stop_token_ids=[-3])),
    Case("seed beyond 64 bits", 400, "seed", body=chat(seed=2**70)),
    Case("stream a string", 400, "stream", body=chat(stream="yes")),
    Case("stream_options without stream", 400, "stream_options", body=chat(stream_options={"include_usage": True})),  # noqa: E501
    Case("tool without a name", 400, "tools[0].function.name", body=chat(tools=[{"type": "function", "function": {}}])),  # noqa: E501
    Case("tool_choice without tools", 400, "tool_choice", body=chat(tool_choice="required")),
    Case("tool_choice unknown function", 400, "tool_choice", body=chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"type": "function", "function": {"name": "g"}})),  # noqa: E501
    Case("response_format unknown type", 400, "response_format.type", body=chat(response_format={"type": "xml"})),  # noqa: E501
    Case("json_schema without schema object", 400, "response_format.json_schema", body=chat(response_format={"type": "json_schema"})),  # noqa: E501
    Case("two structured fields", 400, "guided_regex", body=chat(guided_json={"type": "object"}, guided_regex="a+")),  # noqa: E501
    # Prompts.
    Case("empty prompt", 400, "prompt", COMPLETIONS, completion(prompt="")),
    Case("empty prompt list", 400, "prompt", COMPLETIONS, completion(prompt=[])),
    Case("token id beyond the vocabulary", 400, "prompt", COMPLETIONS, completion(prompt=[1, 10**9])),  # noqa: E501
    Case("negative token id", 400, "prompt", COMPLETIONS, completion(prompt=[-1])),
    Case("prompt longer than the context", 400, "messages", body=chat(messages=[{"role": "user", "content": "hello " * 5000}]), code="context_length_exceeded"),  # noqa: E501
    Case("completion prompt longer than the context", 400, "prompt", COMPLETIONS, completion(prompt="hello " * 5000), code="context_length_exceeded"),  # noqa: E501
    Case("suffix", 400, "suffix", COMPLETIONS, completion(suffix="end")),
    Case("prompt_logprobs too many", 400, "prompt_logprobs", COMPLETIONS, completion(prompt_logprobs=21)),  # noqa: E501
    Case("prompt_logprobs negative", 400, "prompt_logprobs", COMPLETIONS, completion(prompt_logprobs=-1)),  # noqa: E501
    Case("echo with logprobs, streamed", 400, "echo", COMPLETIONS, completion(echo=True, logprobs=1, stream=True)),  # noqa: E501
    Case("best_of below n", 400, "best_of", COMPLETIONS, completion(n=3, best_of=2)),
    Case("best_of zero", 400, "best_of", COMPLETIONS, completion(best_of=0)),
    Case("best_of above n, streamed", 400, "best_of", COMPLETIONS, completion(best_of=3, stream=True)),  # noqa: E501
    # Sequences per request: prompts x n (or best_of), at most 256 by default.
    Case("too many prompts", 400, "prompt", COMPLETIONS, completion(prompt=["Hi"] * 257)),
    Case("prompts x n too many", 400, "n", COMPLETIONS, completion(prompt=["a", "b", "c"], n=100)),
    Case("prompts x best_of too many", 400, "best_of", COMPLETIONS, completion(prompt=[[1]] * 3, best_of=100)),  # noqa: E501
    # Who and what.
    Case("unknown model", 404, "model", body=chat(model="gpt-9"), code="model_not_found"),
    Case("unknown model (completions)", 404, "model", COMPLETIONS, completion(model="gpt-9"), code="model_not_found"),  # noqa: E501
    Case("missing API key", 401, headers={"Authorization": ""}, code="invalid_api_key"),
    Case("wrong API key", 401, headers={"Authorization": "Bearer wrong"}, code="invalid_api_key"),
    Case("API key as a prefix", 401, headers={"Authorization": f"Bearer {API_KEY[:-1]}"}),
    Case("API key, wrong scheme", 401, headers={"Authorization": f"Basic {API_KEY}"}),
    Case("models without a key", 401, path="/v1/models", method="GET", headers={"Authorization": ""}),  # noqa: E501
    Case("10 MB body", 413, raw=b'{"messages": "' + b"x" * TEN_MB + b'"}', code="request_too_large"),  # noqa: E501
    Case("unknown path", 404, path="/v1/nothing", body={}),
    Case("wrong method", 405, method="GET"),
]
# fmt: on


def _send(http: httpx.Client, server, case: Case) -> httpx.Response:
    headers = {"Content-Type": "application/json", **case.headers}
    if headers.get("Authorization") == "":
        del headers["Authorization"]
        http.headers.pop("Authorization", None)
    if case.raw is not None:
        content = case.raw
    elif case.body is not None:
        body = dict(case.body)
        body.setdefault("model", server.model)
        content = json.dumps(body).encode()
    else:
        content = json.dumps(chat(model=server.model)).encode()
    if case.method == "GET":
        return http.request("GET", case.path, headers=headers)
    return http.request(case.method, case.path, content=content, headers=headers)


def _check_error_shape(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


def test_enough_cases():
    assert len(CASES) >= 20
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request(http, server, case):
    response = _send(http, server, case)
    assert response.status_code == case.status, response.text[:500]
    error = _check_error_shape(response)
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error


def test_chunked_body_over_the_limit(http):
    """No Content-Length to refuse early: the body is counted as it is read."""

    def chunks():
        yield b'{"messages": "'
        for _ in range(10):
            yield b"x" * 2**20
        yield b'"}'

    response = http.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert _check_error_shape(response)["code"] == "request_too_large"


def test_server_keeps_serving_after_bad_requests(http, server):
    for case in CASES:
        _send(http, server, case)
    http.headers["Authorization"] = f"Bearer {API_KEY}"
    assert http.get("/health").json() == {"status": "ok"}
    r = http.post(COMPLETIONS, json=completion(model=server.model, max_tokens=3))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    # Nothing a refused request did is left in the engine.
    metrics = wait_for(
        lambda: (
            (m := read_metrics(server.base_url))["pyllm:num_requests_running"] == 0
            and m["pyllm:num_requests_waiting"] == 0
            and m
        ),
        timeout=10,
    )
    assert metrics and metrics["pyllm:num_free_kv_blocks"] == metrics["pyllm:num_kv_blocks"]
