"""The tool-call formats --tool-call-parser names (pyllm.entrypoints.tool_parsers): each
on representative replies, malformed ones left as content; and each end to end through
a real server whose tiny model is made to write its calls by a regex."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pyllm.entrypoints.tool_parsers import TOOL_PARSERS, tool_parser
from tests.server.conftest import start_server, stop_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}
TOOLS = {"get_weather": WEATHER, "get_time": {}}


def parse(name: str, text: str):
    content, calls = TOOL_PARSERS[name].parse(text, TOOLS)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


PARIS = ("get_weather", {"city": "Paris", "days": 2})
GOOD = {
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
            '{"name": "get_time", "parameters": {}}',
            None,
            [PARIS, ("get_time", {})],
        ),
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
            None,
            [PARIS],
        ),
        ('Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "Sure.", [("get_time", {})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', None, [PARIS]),
        (
            '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}',
            None,
            [("get_time", {}), PARIS],
        ),
    ],
    "qwen3_coder": [
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
            None,
            [PARIS],
        ),
        (
            "Checking.\n<tool_call><function=get_time></function></tool_call>",
            "Checking.",
            [("get_time", {})],
        ),
        # A number-like string stays a string where the schema says string.
        (
            "<tool_call><function=get_weather><parameter=city>2</parameter></function></tool_call>",
            None,
            [("get_weather", {"city": "2"})],
        ),
    ],
    "hermes": [
        ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None, [("get_time", {})]),
    ],
}
MALFORMED = {
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Par',  # cut short
        '{"name": "rm_rf", "parameters": {}}',  # not an offered tool
        '{"name": "get_time", "parameters": []}',
        'Here: {"name": "get_time", "parameters": {}}',  # not the whole reply
        '{"city": "Paris"}',
        "plain answer",
    ],
    "mistral": [
        "[TOOL_CALLS][{'name': 'get_time'}]",
        '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]',
        "[TOOL_CALLS]get_time[ARGS]{not json",
        "[TOOL_CALLS]",
        "plain answer",
    ],
    "qwen3_coder": [
        "<tool_call><function=rm_rf><parameter=x>1</parameter></function></tool_call>",
        "<tool_call>not xml</tool_call>",
        "plain answer",
    ],
}


@pytest.mark.parametrize("name, text, content, calls", [
    (name, *case) for name, cases in GOOD.items() for case in cases
])  # fmt: skip
def test_calls_are_read(name, text, content, calls):
    assert parse(name, text) == (content, calls)


@pytest.mark.parametrize("name, text", [
    (name, text) for name, texts in MALFORMED.items() for text in texts
])  # fmt: skip
def test_malformed_calls_stay_content(name, text):
    assert parse(name, text) == (text, [])


def test_streamed_replies_are_held_back_while_they_may_be_calls():
    assert TOOL_PARSERS["llama3_json"].may_be_call(' {"na')
    assert TOOL_PARSERS["llama3_json"].may_be_call("<|python")
    assert TOOL_PARSERS["mistral"].may_be_call("[TOOL_")
    assert TOOL_PARSERS["qwen3_coder"].may_be_call("<tool_call>\n<func")
    assert not any(parser.may_be_call("Hello") for parser in TOOL_PARSERS.values())


def test_mistral_call_ids_are_nine_letters_or_digits():
    assert re.fullmatch("[A-Za-z0-9]{9}", TOOL_PARSERS["mistral"].new_id())
    with pytest.raises(ValueError, match="unknown tool call parser"):
        tool_parser("xml")


# ---------------------------------------------------------------- the server

FORCED = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
}
API_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _calls(server, stream: bool, regex: str) -> tuple[str, list[dict], str | None]:
    """(finish_reason, tool calls, content) of a reply forced to be `regex`."""
    body = {
        "model": server.model, "messages": [{"role": "user", "content": "Weather?"}],
        "tools": API_TOOLS, "max_tokens": 96, "guided_regex": regex, "stream": stream,
    }  # fmt: skip
    url = f"{server.base_url}/v1/chat/completions"
    if not stream:
        choice = httpx.post(url, json=body, timeout=120).json()["choices"][0]
        message = choice["message"]
        return choice["finish_reason"], message.get("tool_calls") or [], message["content"]
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    choices = [json.loads(line)["choices"][0] for line in lines]
    calls = [call for c in choices for call in c["delta"].get("tool_calls") or []]
    content = "".join(c["delta"].get("content") or "" for c in choices)
    return choices[-1]["finish_reason"], calls, content or None


@pytest.mark.parametrize("name", list(FORCED))
def test_server_reads_each_format(name, qwen3_dir, tmp_path):
    server = start_server(
        tmp_path,
        ["--model", str(qwen3_dir), "--max-model-len", "512", "--tool-call-parser", name],
        api_key=None,
    )
    try:
        for stream in (False, True):
            finish, calls, content = _calls(server, stream, re.escape(FORCED[name]))
            assert (finish, content) == ("tool_calls", None), (stream, calls, content)
            (call,) = calls
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
        # Not a call after all: content, never an error.
        finish, calls, content = _calls(server, False, re.escape(FORCED[name][:30]))
        assert (finish, calls, content) == ("stop", [], FORCED[name][:30])
    finally:
        stop_server(server.process)
