"""Tool calls read while a reply streams, as OpenAI streams them: a call's name once it
is certain, then its arguments' text as the model writes it.

Each format (tool_parsers.py) reads the calls so far out of the reply's text
(`CallSoFar`: a name, the arguments' text so far, whether they are whole); a
`CallStream` sends what is new since the last step. A call's arguments are the model's
own JSON text, so the fragments add up to the arguments of the whole reply.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_SPACE = " \t\n\r"
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
_STRING_START = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{0,4}|\\$)*$')
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_START = re.compile(r"-?(?:0|[1-9]\d*)?(?:\.\d*)?(?:[eE][+-]?\d*)?$")
_LITERALS = ("true", "false", "null")
_LITERAL = re.compile("true|false|null")


@dataclass
class CallSoFar:
    name: str
    arguments: str  # the arguments' JSON text so far
    done: bool = False  # the arguments are whole


@dataclass
class CallDelta:
    """What is new of one call: its name on its first delta, then argument text."""

    index: int
    name: str | None
    arguments: str


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in _SPACE:
        at += 1
    return at


def value_end(text: str, at: int) -> int | None:
    """Where the JSON value at text[at] ends; None while it may go on (cut short at the
    end of the text, or not JSON)."""
    try:
        _, end = _DECODER.raw_decode(text, at)
    except ValueError:
        return None
    if end == len(text) and text[at] not in '{["':  # a number may have more digits
        return None
    return end


def may_be_json(text: str) -> bool:
    """Whether text is the beginning of a JSON value, as far as it goes (arguments are
    streamed only while they may still be JSON)."""
    closers: list[str] = []
    expect, i = "value", 0  # value, item (or "]"), key, first key (or "}"), colon, next
    while i < len(text):
        if text[i] in _SPACE:
            i += 1
            continue
        ch = text[i]
        if expect in ("item", "first key", "next") and closers and ch == closers[-1]:
            closers.pop()
            expect, i = "next", i + 1
        elif expect == "next" and closers and ch == ",":
            expect, i = ("key" if closers[-1] == "}" else "value"), i + 1
        elif expect == "colon" and ch == ":":
            expect, i = "value", i + 1
        elif expect in ("value", "item") and ch in "{[":
            closers.append("}" if ch == "{" else "]")
            expect, i = ("first key" if ch == "{" else "item"), i + 1
        elif expect in ("value", "item", "key", "first key") and ch == '"':
            match = _STRING.match(text, i)
            if match is None:
                return _STRING_START.match(text, i) is not None
            expect, i = ("colon" if "key" in expect else "next"), match.end()
        elif expect in ("value", "item"):
            rest = text[i:]
            if _NUMBER_START.match(rest) or any(w.startswith(rest) for w in _LITERALS):
                return True  # cut short in a number or a literal
            match = _NUMBER.match(text, i) or _LITERAL.match(text, i)
            if match is None:
                return False
            expect, i = "next", match.end()
        else:
            return False
    return True


def members(text: str, at: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members so far of the JSON object at text[at] ('{'): {key: (its value's start,
    end or None while open)}, and the object's end (None while open, or not JSON)."""
    spans: dict[str, tuple[int, int | None]] = {}
    i = skip_space(text, at + 1)
    while i < len(text):
        if text[i] == "}":
            return spans, i + 1
        if spans:
            if text[i] != ",":
                return spans, None
            i = skip_space(text, i + 1)
        key_end = value_end(text, i)
        if key_end is None or text[i] != '"':
            return spans, None
        key = json.loads(text[i:key_end])
        i = skip_space(text, key_end)
        if i == len(text) or text[i] != ":":
            return spans, None
        i = skip_space(text, i + 1)
        end = value_end(text, i) if i < len(text) else None
        if i < len(text):
            spans[key] = (i, end)
        if end is None:
            return spans, None
        i = skip_space(text, end)
    return spans, None


def json_call_so_far(
    text: str, at: int, names, keys: tuple[str, ...]
) -> tuple[CallSoFar | None, int | None]:
    """The call so far of the {"name": ..., <key>: {...}} object at text[at] (None until
    its name is whole and one of `names`; arguments under the first of `keys`), and the
    object's end (None while open)."""
    spans, end = members(text, at)
    name = _string(text, spans.get("name"))
    if name not in names:
        return None, end
    key = next((k for k in keys if k in spans), None)
    if key is None:  # no arguments yet, or none at all
        return CallSoFar(name, "" if end is None else "{}", end is not None), end
    start, stop = spans[key]
    arguments = text[start : stop or len(text)]
    if text[start] != "{":  # arguments as a JSON string: sent once decoded, whole
        return CallSoFar(name, "", False), end
    if stop is None and not may_be_json(arguments):
        return None, end
    return CallSoFar(name, arguments, stop is not None), end


def json_calls_so_far(text: str, at: int, names, keys: tuple[str, ...]) -> list[CallSoFar]:
    """The calls so far of a JSON list of call objects at text[at] ('[')."""
    calls, i = [], skip_space(text, at + 1)
    while i < len(text) and text[i] == "{":
        call, end = json_call_so_far(text, i, names, keys)
        if call is None or end is None:
            return calls + ([call] if call else [])
        calls.append(call)
        i = skip_space(text, end)
        if i < len(text) and text[i] == ",":
            i = skip_space(text, i + 1)
    return calls


def _string(text: str, span: tuple[int, int | None] | None) -> str | None:
    if span is None or span[1] is None or text[span[0]] != '"':
        return None
    return json.loads(text[span[0] : span[1]])


def model_arguments(calls: list, so_far: list[CallSoFar]) -> list:
    """The calls of a whole reply with each one's arguments as the model wrote them (as
    they were streamed), where they are the same calls and the same values."""
    if len(so_far) != len(calls):
        return calls
    for call, written in zip(calls, so_far, strict=True):
        if not written.done or written.name != call.name:
            return calls
        try:
            if json.loads(written.arguments) != json.loads(call.arguments):
                return calls
        except ValueError:
            return calls
    for call, written in zip(calls, so_far, strict=True):
        call.arguments = written.arguments
    return calls


@dataclass
class CallStream:
    """The calls one streamed reply has sent: each one's name and arguments so far."""

    sent: list[CallSoFar] = field(default_factory=list)

    def step(self, calls: list[CallSoFar]) -> list[CallDelta]:
        """The deltas from what was sent to `calls` (the calls so far, or the whole
        reply's). Arguments that do not extend what was sent are not sent."""
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self.sent):
                self.sent.append(CallSoFar(call.name, call.arguments))
                deltas.append(CallDelta(i, call.name, call.arguments))
                continue
            sent = self.sent[i].arguments
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                self.sent[i].arguments = call.arguments
                deltas.append(CallDelta(i, None, call.arguments[len(sent) :]))
        return deltas
