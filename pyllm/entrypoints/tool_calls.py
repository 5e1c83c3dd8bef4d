"""Tool calls out of a model's text, for the chat API's `tools`.

With tool_choice "required" the output was constrained to a JSON list of
{"name", "arguments"} objects; with a named function, to that function's arguments.
With "auto" the model writes calls in its own format: Hermes / Qwen2-style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks are read, anything
else is plain content.
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
    calls, kept, last = [], [], 0
    for match in _HERMES_BLOCK.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", call.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            continue
        if name not in names or not isinstance(arguments, dict):
            continue
        calls.append(Call(name, json.dumps(arguments, ensure_ascii=False)))
        kept.append(text[last : match.start()])
        last = match.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def may_be_hermes(text: str) -> bool:
    """Whether a streamed output so far may turn out to be a tool call (so it is held
    back rather than sent as content)."""
    start = text.lstrip()
    return start.startswith(HERMES_OPEN) or HERMES_OPEN.startswith(start)
