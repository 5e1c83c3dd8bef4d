"""gpt-oss's harmony format, read out of a chat reply: its reasoning, its answer and its
tool calls.

A reply is a run of messages, each ``<|channel|>NAME<|message|>TEXT`` closed by
``<|end|>`` (after which ``<|start|>assistant`` opens the next), ``<|return|>`` (the
end of the answer) or ``<|call|>`` (the end of a tool call). Channel ``analysis`` holds
the model's reasoning, ``final`` its answer; a message addressed ``to=functions.NAME``
(in its role or channel header, often with ``<|constrain|>json``) is a call of tool
NAME whose TEXT is the arguments. The markers are special tokens, so the reply must be
decoded with them kept (the server asks for that when a model speaks harmony).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pyllm.entrypoints.tool_calls import Call

CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
# The tokens that end a reply (not <|end|>, which ends one message of several).
STOP_TOKENS = ("<|return|>", "<|call|>")

_MESSAGE = re.compile(
    r"(?:<\|start\|>(?P<role>[^<]*))?<\|channel\|>(?P<channel>[^<]*)"
    r"(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<text>.*?)"
    r"(?=<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|$)",
    re.DOTALL,
)
_RECIPIENT = re.compile(r"\bto=functions\.(\S+)")
_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
            "<|constrain|>")  # fmt: skip
_MARKER = re.compile("|".join(re.escape(m) for m in _MARKERS))


@dataclass
class HarmonyReply:
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)


def speaks_harmony(tokenizer) -> bool:
    """Whether the model's vocabulary has harmony's channel markers as tokens."""
    if tokenizer is None:
        return False
    return all(tokenizer.token_to_id(t) is not None for t in (CHANNEL, MESSAGE))


def parse(text: str) -> HarmonyReply:
    """The reply's parts so far (text may end inside a message: its text counts; a
    header whose <|message|> has not come yet, nothing). A reply with no channel at all
    (a model that ignored the format) is all content."""
    reply = HarmonyReply()
    found = False
    for m in _MESSAGE.finditer(text):
        found = True
        header = f"{m['role'] or ''} {m['channel']}"
        recipient = _RECIPIENT.search(header)
        channel = m["channel"].split()[0] if m["channel"].split() else ""
        if recipient:
            reply.calls.append(Call(recipient.group(1), m["text"].strip()))
        elif channel == "analysis":
            reply.reasoning += m["text"]
        else:  # final, or commentary to the user
            reply.content += m["text"]
    if not found and CHANNEL not in text:
        reply.content = _MARKER.sub("", text)
    return reply


@dataclass
class HarmonyStream:
    """What a streamed reply has sent so far of its reasoning and content, to send only
    what is new after each step."""

    reasoning_sent: int = 0
    content_sent: int = 0

    def delta(self, text: str) -> tuple[str, str]:
        """(new reasoning, new content) in the reply's text so far. A marker cut short at
        its end (text that is not whole tokens) waits for the rest."""
        start = text.rfind("<")
        if start >= 0 and any(m.startswith(text[start:]) and m != text[start:] for m in _MARKERS):
            text = text[:start]
        reply = parse(text)
        reasoning = reply.reasoning[self.reasoning_sent :]
        content = reply.content[self.content_sent :]
        self.reasoning_sent, self.content_sent = len(reply.reasoning), len(reply.content)
        return reasoning, content
