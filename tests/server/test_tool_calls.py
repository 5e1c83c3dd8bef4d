"""Reading tool calls out of model text (pyllm.entrypoints.tool_calls), no server."""

from __future__ import annotations

import json

from pyllm.entrypoints.tool_calls import parse_hermes, parse_named, parse_required

NAMES = {"get_weather", "get_time"}


def test_hermes_blocks_become_calls_and_the_rest_content():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    )
    content, calls = parse_hermes(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]


def test_unclosed_final_block_is_read():
    content, calls = parse_hermes('<tool_call>{"name": "get_time", "arguments": {}}', NAMES)
    assert content is None and calls[0].name == "get_time"


def test_blocks_that_are_not_calls_stay_content():
    for text in [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not a given tool
        '<tool_call>{"name": "get_time", "arguments": "x"}</tool_call>',
        "no calls at all",
    ]:
        assert parse_hermes(text, NAMES) == (text, [])


def test_constrained_outputs():
    calls = parse_required('[{"name": "get_time", "arguments": {"zone": "UTC"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    assert parse_required('[{"name": "get_ti') is None  # cut by max_tokens
    assert parse_named("get_time", '{"zone": "UTC"}')[0].arguments == '{"zone": "UTC"}'
    assert parse_named("get_time", '{"zone": ') is None
