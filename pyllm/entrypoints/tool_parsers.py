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

A reply a parser cannot read as calls of the offered tools is all content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyllm.entrypoints.tool_calls import Call, call_id, json_call, parse_hermes, read_blocks

PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_QWEN3_CODER_BLOCK = re.compile(
    r"<tool_call>\s*<function=([^>\n]+)>(.*?)(?:</function>\s*(?:</tool_call>|$)|$)", re.DOTALL
)
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
    openings: tuple[str, ...]  # how a reply that is a call begins
    special_markers: bool = False  # its markers are special tokens: decode them kept
    new_id: Callable[[], str] = call_id

    def parse(self, text: str, tools: Tools) -> tuple[str | None, list[Call]]:
        """(content or None, calls) of a finished reply."""
        return self.read(text, tools)

    def may_be_call(self, text: str) -> bool:
        """Whether a streamed reply so far may turn out to be calls (so it is held back
        rather than sent as content)."""
        start = text.lstrip()
        return any(start.startswith(o) or o.startswith(start) for o in self.openings)


def _hermes(text: str, tools: Tools) -> tuple[str | None, list[Call]]:
    return parse_hermes(text, set(tools))


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


def _mistral_id() -> str:
    # Mistral's chat templates refuse a call id that is not 9 letters or digits.
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def _qwen3_coder(text: str, tools: Tools) -> tuple[str | None, list[Call]]:
    return read_blocks(text, _QWEN3_CODER_BLOCK, lambda match: _qwen3_coder_call(match, tools))


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
        ToolParser("hermes", _hermes, ("<tool_call>",)),
        ToolParser("llama3_json", _llama3_json, (PYTHON_TAG, "{")),
        ToolParser("mistral", _mistral, (MISTRAL_CALLS,), True, _mistral_id),
        ToolParser("qwen3_coder", _qwen3_coder, ("<tool_call>",)),
    )
}
TOOL_CALL_PARSERS = tuple(TOOL_PARSERS)


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r} (known: {TOOL_CALL_PARSERS})")
    return TOOL_PARSERS[name]
