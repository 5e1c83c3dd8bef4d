"""The tool-call formats --tool-call-parser names (pyllm.entrypoints.tool_parsers): each
on representative replies, malformed ones left as content; and each end to end through
a real server whose tiny model is made to write its calls by a regex."""

from __future__ import annotations

import json
import re

import openai
import pytest

from pyllm.engine.outputs import CompletionOutput
from pyllm.entrypoints.chat_reply import ReplyReader, ReplyStream
from pyllm.entrypoints.openai_protocol import ChatCompletionRequest
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


def _streamed(name: str, text: str, tools=None) -> tuple[str, dict[int, list], int]:
    """(content, {index: [name, arguments]}, deltas) a ReplyStream sends when `text`
    arrives a character at a time."""
    tools = tools or API_TOOLS
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], tools=tools)
    stream = ReplyStream(ReplyReader(None, TOOL_PARSERS[name]), body)
    content, calls, deltas = "", {}, 0
    for end in range(1, len(text) + 1):
        step = stream.step(
            CompletionOutput(0, text[:end], [], "stop" if end == len(text) else None)
        )
        content += step.content or ""
        for call in step.calls:
            deltas += 1
            if call.name is not None:
                assert call.index not in calls, "a call named twice"
                calls[call.index] = [call.name, ""]
            calls[call.index][1] += call.arguments
    return content, calls, deltas


STREAMED = {**{name: cases[0][0] for name, cases in GOOD.items()}, "mistral": GOOD["mistral"][3][0]}
STREAMED["hermes"] = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris",'
    '  "days": 2}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


@pytest.mark.parametrize("name", list(STREAMED))
def test_streamed_calls_add_up_to_the_whole_replys(name):
    text = STREAMED[name]
    content, calls, deltas = _streamed(name, text)
    whole_content, whole = TOOL_PARSERS[name].parse(text, TOOLS)
    assert [calls[i] for i in range(len(calls))] == [[c.name, c.arguments] for c in whole]
    assert content == (whole_content or "")
    assert deltas > 2 * len(whole)  # arguments in several fragments


def test_streamed_arguments_are_the_models_own_text():
    # As written (no space after the colon), streamed and whole alike.
    text = '<tool_call>{"name": "get_weather", "arguments": {"city":"Oslo"}}</tool_call>'
    assert _streamed("hermes", text)[1] == {0: ["get_weather", '{"city":"Oslo"}']}
    assert parse("hermes", text)[1] == [("get_weather", {"city": "Oslo"})]
    assert TOOL_PARSERS["hermes"].parse(text, TOOLS)[1][0].arguments == '{"city":"Oslo"}'


def test_streamed_text_that_is_not_a_call_is_content():
    for name, text in [
        ("hermes", "<tool_call>not json</tool_call>"),
        ("hermes", 'I would use <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),
        ("qwen3_coder", "a <b>bold</b> <tool_call><function=rm_rf></function></tool_call>"),
        ("mistral", "[TOOL_CALLS]rm_rf[ARGS]{}"),
        ("llama3_json", "plain answer {}"),
    ]:
        assert _streamed(name, text) == (text, {}, 0), (name, text)


def test_streamed_calls_cut_short_or_broken_stay_as_sent():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    assert _streamed("hermes", text)[:2] == ("", {0: ["get_weather", '{"city": "Par']})
    # Arguments stop at the first character that cannot be JSON.
    text = "[TOOL_CALLS]get_weather[ARGS]{\"city\": 'Paris'}"
    assert _streamed("mistral", text)[:2] == ("", {0: ["get_weather", '{"city": ']})


# ---------------------------------------------------------------- the server

# Two calls each, the first with an argument long enough to stream in several fragments.
CITY = "Paris, the capital and most populous city of France"
FORCED = {
    "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{CITY}", '
    '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    "</tool_call>",
    "llama3_json": f'{{"name": "get_weather", "parameters": {{"city": "{CITY}", "days": 2}}}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "{CITY}", '
    '"days": 2}}, {"name": "get_time", "arguments": {}}]',
    "qwen3_coder": f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{CITY}\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
}
API_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _ask(client, model: str, regex: str, stream: bool):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=API_TOOLS,
        max_tokens=160,
        stream=stream,
        extra_body={"guided_regex": regex},
    )


@pytest.mark.parametrize("name", list(FORCED))
def test_server_reads_each_format(name, qwen3_dir, tmp_path):
    server = start_server(
        tmp_path,
        ["--model", str(qwen3_dir), "--max-model-len", "512", "--tool-call-parser", name],
        api_key=None,
    )
    try:
        with openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="none", max_retries=0
        ) as client:
            _check_format(client, server.model, FORCED[name])
    finally:
        stop_server(server.process)


def _check_format(client, model: str, forced: str) -> None:
    whole = _ask(client, model, re.escape(forced), stream=False).choices[0]
    assert (whole.finish_reason, whole.message.content) == ("tool_calls", None)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert calls == [("get_weather", {"city": CITY, "days": 2}), ("get_time", {})]

    chunks = list(_ask(client, model, re.escape(forced), stream=True))
    deltas = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    # Each call's first delta: index, id, type and name; then argument fragments only.
    firsts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.type, d.function.name) for d in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    assert len({d.id for d in firsts}) == 2
    for d in deltas:
        assert (d.id is None) == (d.function.name is None) == (d not in firsts)
    fragments = [d for d in deltas if d.index == 0 and d.function.arguments]
    assert len(fragments) > 3 and not firsts[0].function.arguments.endswith("}")
    streamed = {}
    for d in deltas:
        streamed[d.index] = streamed.get(d.index, "") + d.function.arguments
    assert [streamed[0], streamed[1]] == [c.function.arguments for c in whole.message.tool_calls]

    # The SDK's own accumulation of the stream: the same calls as the whole reply.
    with client.chat.completions.stream(
        model=model,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=API_TOOLS,
        max_tokens=160,
        extra_body={"guided_regex": re.escape(forced)},
    ) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.type, c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.type, c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    # Not a call after all: content, never an error.
    cut = _ask(client, model, re.escape(forced[:30]), stream=False).choices[0]
    assert (cut.finish_reason, cut.message.tool_calls, cut.message.content) == (
        "stop",
        None,
        forced[:30],
    )
