"""The formats a model writes its own tool calls in (tool_choice "auto"), by vLLM's
`--tool-call-parser` names:

- `hermes` (the default; Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks (tool_calls.py);
- `llama3_json` (Llama 3.x): the whole reply is `{"name": ..., "parameters": {...}}`,
  perhaps after `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]NAME[ARGS]{...}`; text before the first `[TOOL_CALLS]` is content;
- `qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter>...</function>
  </tool_call>`, each value read by the type the tool's schema gives P.

A reply a parser cannot read as calls of the offered tools is all content. Streamed,
each format's calls so far are read as they are written (tool_stream.py); text before a
format's opening streams as content where the format allows it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyllm.entrypoints.tool_calls import (
    HERMES_OPEN,
    Call,
    call_id,
    json_call,
    parse_hermes,
    read_blocks,
)
from pyllm.entrypoints.tool_stream import (
    CallSoFar,
    json_call_so_far,
    json_calls_so_far,
    may_be_json,
    model_arguments,
    skip_space,
    value_end,
)

PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_QWEN3_CODER_BLOCK = re.compile(
    r"<tool_call>\s*<function=([^>\n]+)>(.*?)(?:</function>\s*(?:</tool_call>|$)|$)", re.DOTALL
)
_QWEN3_CODER_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_QWEN3_CODER_PARAMETER = re.compile(
    r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|$)", re.DOTALL
)
_ALPHANUMERIC = string.ascii_letters + string.digits

# {tool name: its parameters' JSON schema}
Tools = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class ToolParser:
    name: str
    read: Callable[[str, Tools], tuple[str | None, list[Call]]]
    # The calls so far of a reply from its first opening on, as they stream.
    read_so_far: Callable[[str, Tools], list[CallSoFar]]
    openings: tuple[str, ...]  # how a reply that is a call begins
    content_first: bool = True  # content may come before the calls
    special_markers: bool = False  # its markers are special tokens: decode them kept
    new_id: Callable[[], str] = call_id

    def parse(self, text: str, tools: Tools) -> tuple[str | None, list[Call]]:
        """(content or None, calls) of a finished reply; each call's arguments as the
        model wrote them (as they were streamed) where they read as the same values."""
        content, calls = self.read(text, tools)
        if calls:
            calls = model_arguments(calls, self.so_far(text, tools))
        return content, calls

    def so_far(self, text: str, tools: Tools) -> list[CallSoFar]:
        """The calls so far of a streamed reply."""
        at = self.calls_begin(text)[1]
        return [] if at is None else self.read_so_far(text[at:], tools)

    def calls_begin(self, text: str) -> tuple[int, int | None]:
        """(how much of a streamed reply so far is content for sure, where its calls
        begin or None). Space before a possible call is held back with it."""
        if not self.content_first:  # the whole reply is calls, or none of it
            start = skip_space(text, 0)
            if any(text.startswith(o, start) for o in self.openings):
                return 0, start
            return (0 if self.may_be_call(text) else len(text)), None
        found = [at for at in (text.find(o) for o in self.openings) if at >= 0]
        if found:
            return len(text[: min(found)].rstrip()), min(found)
        cut = max(
            (n for o in self.openings for n in range(1, len(o)) if text.endswith(o[:n])), default=0
        )
        return len(text[: len(text) - cut].rstrip()), None

    def may_be_call(self, text: str) -> bool:
        """Whether a streamed reply so far may turn out to be calls (so it is held back
        rather than sent as content)."""
        start = text.lstrip()
        return any(start.startswith(o) or o.startswith(start) for o in self.openings)


def _hermes(text: str, tools: Tools) -> tuple[str | None, list[Call]]:
    return parse_hermes(text, set(tools))


def _hermes_so_far(text: str, tools: Tools) -> list[CallSoFar]:
    calls = []
    blocks = text.split(HERMES_OPEN)[1:]
    for i, block in enumerate(blocks):
        at = skip_space(block, 0)
        call = None
        if block.startswith("{", at):
            call = json_call_so_far(block, at, tools, ("arguments", "parameters"))[0]
        if call is not None:
            calls.append(call)
        elif i == len(blocks) - 1:
            break  # not a call, or not yet one
    return calls


def _llama3_json_so_far(text: str, tools: Tools) -> list[CallSoFar]:
    body = text.lstrip().removeprefix(PYTHON_TAG)
    calls, at = [], 0
    while True:
        at = len(body) - len(body[at:].lstrip().lstrip(";").lstrip())
        if not body.startswith("{", at):
            return calls
        call, at = json_call_so_far(body, at, tools, ("parameters", "arguments"))
        if call is None:
            return calls
        calls.append(call)
        if at is None:
            return calls


def _llama3_json(text: str, tools: Tools) -> tuple[str | None, list[Call]]:
    body = text.strip().removeprefix(PYTHON_TAG)
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = len(body) - len(body[at:].lstrip().lstrip(";").lstrip())
        if at == len(body):
            break
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = json_call(value, tools, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
    return (None, calls) if calls else (text, [])


def _mistral(text: str, tools: Tools) -> tuple[str | None, list[Call]]:
    content, *segments = text.split(MISTRAL_CALLS)
    calls = []
    for segment in segments:
        found = _mistral_segment(segment.strip(), tools)
        if not found:
            return text, []
        calls += found
    if not calls:
        return text, []
    return content.strip() or None, calls


def _mistral_segment(segment: str, tools: Tools) -> list[Call] | None:
    """The calls of what follows one [TOOL_CALLS]: a JSON list (or object), or
    NAME[ARGS]{...}."""
    name, found, arguments = segment.partition(MISTRAL_ARGS)
    try:
        if found:
            values = [{"name": name.strip(), "arguments": json.loads(arguments)}]
        else:
            values = json.loads(segment)
    except ValueError:
        return None
    values = values if isinstance(values, list) else [values]
    calls = [json_call(value, tools, ("arguments", "parameters")) for value in values]
    return None if None in calls else calls


def _mistral_so_far(text: str, tools: Tools) -> list[CallSoFar]:
    calls = []
    for segment in text.split(MISTRAL_CALLS)[1:]:
        at = skip_space(segment, 0)
        if segment.startswith("[", at):
            calls += json_calls_so_far(segment, at, tools, ("arguments", "parameters"))
            continue
        name, found, arguments = segment.partition(MISTRAL_ARGS)
        start = skip_space(arguments, 0)
        if not found or name.strip() not in tools or not arguments.startswith("{", start):
            break
        end = value_end(arguments, start)
        if end is None and not may_be_json(arguments[start:]):
            break
        calls.append(CallSoFar(name.strip(), arguments[start : end or None], end is not None))
    return calls


def _mistral_id() -> str:
    # Mistral's chat templates refuse a call id that is not 9 letters or digits.
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def _qwen3_coder(text: str, tools: Tools) -> tuple[str | None, list[Call]]:
    return read_blocks(text, _QWEN3_CODER_BLOCK, lambda match: _qwen3_coder_call(match, tools))


def _qwen3_coder_so_far(text: str, tools: Tools) -> list[CallSoFar]:
    calls = []
    for block in text.split(HERMES_OPEN)[1:]:
        match = _QWEN3_CODER_FUNCTION.match(block)
        if match is None or match.group(1).strip() not in tools:
            break
        name = match.group(1).strip()
        body, closed, _ = block[match.end() :].partition("</function>")
        properties = (tools[name] or {}).get("properties") or {}
        pairs = []
        for parameter in _QWEN3_CODER_PARAMETER.finditer(body):
            if not closed and parameter.end() == len(body) and not body.endswith("</parameter>"):
                break  # its value may go on
            key = parameter.group(1).strip()
            value = _typed(parameter.group(2), properties.get(key) or {})
            pairs.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
        # As json.dumps writes the whole object: ", " between members.
        calls.append(
            CallSoFar(name, "{" + ", ".join(pairs) + ("}" if closed else ""), bool(closed))
        )
    return calls


def _qwen3_coder_call(match: re.Match, tools: Tools) -> Call | None:
    name = match.group(1).strip()
    if name not in tools:
        return None
    properties = (tools[name] or {}).get("properties") or {}
    arguments = {}
    for parameter in _QWEN3_CODER_PARAMETER.finditer(match.group(2)):
        key = parameter.group(1).strip()
        arguments[key] = _typed(parameter.group(2), properties.get(key) or {})
    return Call(name, json.dumps(arguments, ensure_ascii=False))


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as its schema's type: a string stays one; anything else is
    read as JSON where it is JSON (42, true, [1, 2]), else kept as text."""
    if schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


TOOL_PARSERS = {
    parser.name: parser
    for parser in (
        ToolParser("hermes", _hermes, _hermes_so_far, (HERMES_OPEN,)),
        ToolParser(
            "llama3_json", _llama3_json, _llama3_json_so_far, (PYTHON_TAG, "{"), content_first=False
        ),
        ToolParser(
            "mistral",
            _mistral,
            _mistral_so_far,
            (MISTRAL_CALLS,),
            special_markers=True,
            new_id=_mistral_id,
        ),
        ToolParser("qwen3_coder", _qwen3_coder, _qwen3_coder_so_far, (HERMES_OPEN,)),
    )
}
TOOL_CALL_PARSERS = tuple(TOOL_PARSERS)


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (known: {TOOL_CALL_PARSERS})")
    return TOOL_PARSERS[name]
