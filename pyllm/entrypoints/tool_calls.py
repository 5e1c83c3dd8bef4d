"""Tool calls out of a model's text, for the chat API's `tools`.

With tool_choice "required" the output was constrained to a JSON list of
{"name", "arguments"} objects; with a named function, to that function's arguments.
With "auto" the model writes calls in its own format, which `--tool-call-parser` names
(tool_parsers.py); the default, Hermes / Qwen2-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, is read here,
anything else is plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

HERMES_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class Call:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_required(text: str) -> list[Call] | None:
    """The calls of a constrained "required" output; None if it is not whole (cut by
    max_tokens)."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return [Call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]


def parse_named(name: str, text: str) -> list[Call] | None:
    try:
        json.loads(text)
    except ValueError:
        return None
    return [Call(name, text)]


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[Call]]:
    """(content outside the calls or None, the calls) of a model's own output. A block
    that is not JSON naming one of the tools stays content."""
    return read_blocks(text, _HERMES_BLOCK, lambda match: _hermes_call(match.group(1), names))


def _hermes_call(block: str, names: set[str]) -> Call | None:
    try:
        return json_call(json.loads(block), names, ("arguments", "parameters"))
    except ValueError:
        return None


def json_call(call, names, keys: tuple[str, ...]) -> Call | None:
    """The Call of a decoded {"name": ..., <key>: {...}} naming one of `names` (its
    arguments under the first of `keys` present), or None."""
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = next((call[key] for key in keys if key in call), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(call["name"], json.dumps(arguments, ensure_ascii=False))


def read_blocks(text: str, pattern: re.Pattern, read) -> tuple[str | None, list[Call]]:
    """(the text outside the blocks or None, their calls): each match of `pattern` that
    read(match) makes a Call of is cut out; the others stay content."""
    calls, kept, last = [], [], 0
    for match in pattern.finditer(text):
        call = read(match)
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last : match.start()])
        last = match.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls
