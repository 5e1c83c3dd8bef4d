"""A reasoning model's thinking read apart from its answer: `<think>...</think>`, as
vLLM's `--reasoning-parser` reads it (gpt-oss's harmony channels: harmony.py).

`deepseek_r1`: the chat template opens `<think>` itself, so the reply begins inside it
(a `<think>` the model writes anyway is dropped): everything up to `</think>` is
reasoning, the rest the answer; a reply with no `</think>` is all reasoning.
`qwen3`: reasoning only where the reply writes `<think>` (none with enable_thinking
false); from there up to `</think>` (or the end, if cut short). Text is split exactly,
nothing stripped, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK, END_THINK = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the template opened <think>: the reply begins as reasoning

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a reply so far."""
        if self.starts_inside:
            text = text.removeprefix(THINK)
            reasoning, found, answer = text.partition(END_THINK)
            return (reasoning, answer) if found else (text, "")
        before, found, rest = text.partition(THINK)
        if not found:
            return "", text
        reasoning, _, answer = rest.partition(END_THINK)
        return reasoning, before + answer


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser called `name` (one of REASONING_PARSERS), or None for no name."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {REASONING_PARSERS})")
    return ReasoningParser(name, starts_inside=name == "deepseek_r1")


def settled(text: str) -> str:
    """A streamed reply's text less a tag cut short at its end (it waits for the rest)."""
    for size in range(len(END_THINK) - 1, 0, -1):
        end = text[-size:]
        if len(text) >= size and (THINK.startswith(end) or END_THINK.startswith(end)):
            return text[:-size]
    return text
