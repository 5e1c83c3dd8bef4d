"""A chat reply's parts out of its text: reasoning (--reasoning-parser), content and tool
calls (tool_choice, --tool-call-parser), for the whole reply or step by step as it
streams. Tool calls are read only from the answer, after the reasoning; streamed, a
call's name is sent once it is certain, then its arguments as they are written
(tool_stream.py). (gpt-oss's harmony replies: harmony.py.)"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyllm.engine.outputs import CompletionOutput
from pyllm.entrypoints.openai_protocol import ChatCompletionRequest
from pyllm.entrypoints.reasoning import ReasoningParser, settled
from pyllm.entrypoints.tool_calls import parse_named, parse_required
from pyllm.entrypoints.tool_parsers import TOOL_PARSERS, ToolParser
from pyllm.entrypoints.tool_stream import (
    CallDelta,
    CallSoFar,
    CallStream,
    json_calls_so_far,
    model_arguments,
    skip_space,
    value_end,
)


@dataclass(frozen=True)
class ReplyReader:
    reasoning: ReasoningParser | None = None
    tools: ToolParser = TOOL_PARSERS["hermes"]
    # End-of-turn texts, which a decode that keeps special tokens leaves at the end.
    ends: tuple[str, ...] = ()

    def keeps_specials(self, body: ChatCompletionRequest) -> bool:
        """Whether the reply is decoded with special tokens kept: the tool parser's
        markers are special tokens, and the model may call tools its own way."""
        return body.tool_mode == "auto" and self.tools.special_markers

    def text(self, body: ChatCompletionRequest, c: CompletionOutput) -> str:
        """The reply's text, less the end-of-turn marker of a decode that kept it."""
        if c.finish_reason is not None and self.keeps_specials(body):
            for end in self.ends:
                if end and c.text.endswith(end):
                    return c.text[: -len(end)]
        return c.text

    def split(self, body: ChatCompletionRequest, text: str) -> tuple[str, str]:
        """(reasoning, answer). None under a required or named tool_choice, whose
        output was constrained to the calls' JSON."""
        if self.reasoning is None or body.tool_mode in ("required", "named"):
            return "", text
        return self.reasoning.split(text)

    def parts(self, body: ChatCompletionRequest, c: CompletionOutput):
        """(reasoning or None, content, tool calls) of a finished reply."""
        reasoning, answer = self.split(body, self.text(body, c))
        content, calls = self.calls(body, c, answer)
        if self.reasoning is not None:
            content = content or None  # as vLLM: no answer yet is null
        return reasoning or None, content, calls

    def calls(self, body: ChatCompletionRequest, c: CompletionOutput, answer: str):
        """(content, tool calls) of a finished answer, as its tool_choice reads it."""
        mode, calls = body.tool_mode, None
        if mode == "required" and c.finish_reason == "stop":
            calls = parse_required(answer)
            calls = calls and model_arguments(calls, self.so_far(body, answer))
        elif mode == "named" and c.finish_reason == "stop":
            calls = parse_named(body.tool_choice.function.name, answer)
        elif mode == "auto":
            return self.tools.parse(answer, body.tool_schemas())
        return (None, calls) if calls else (answer, [])

    def so_far(self, body: ChatCompletionRequest, answer: str) -> list[CallSoFar]:
        """The calls so far of a streamed answer, as its tool_choice reads it."""
        mode = body.tool_mode
        if mode == "named":  # the output is the arguments
            name = body.tool_choice.function.name
            return [CallSoFar(name, answer, value_end(answer, 0) is not None)]
        if mode == "required":  # the output is a JSON list of calls
            at = skip_space(answer, 0)
            if not answer.startswith("[", at):
                return []
            return json_calls_so_far(answer, at, body.tool_schemas(), ("arguments",))
        return self.tools.so_far(answer, body.tool_schemas())


@dataclass
class ReplyDelta:
    """What one step of a streamed reply adds."""

    reasoning: str = ""
    content: str | None = None  # None: nothing to send (held back, or calls)
    calls: list[CallDelta] = field(default_factory=list)
    made_calls: bool = False  # the finished reply is calls: finish_reason tool_calls


@dataclass
class ReplyStream:
    """One streamed choice: what it has sent of its reasoning, content and calls. Where
    tools are offered, text that may begin a call is held back until it is content or a
    call's name is certain; a call's arguments are sent as they are written."""

    reader: ReplyReader
    body: ChatCompletionRequest
    reasoning_sent: int = 0
    content_sent: int = 0  # characters of the answer sent as content
    calls: CallStream = field(default_factory=CallStream)

    def step(self, c: CompletionOutput) -> ReplyDelta:
        final = c.finish_reason is not None
        text = self.reader.text(self.body, c)
        if self.reader.reasoning is not None and not final:
            text = settled(text)
        reasoning, answer = self.reader.split(self.body, text)
        delta = ReplyDelta(reasoning[self.reasoning_sent :])
        self.reasoning_sent = len(reasoning)
        mode = self.body.tool_mode
        if mode == "none":
            delta.content = self._content(answer, len(answer)) or ""
        elif final:
            self._finish(c, answer, delta)
        elif mode == "auto":
            content_end, calls_at = self.reader.tools.calls_begin(answer)
            if calls_at is None and not self.calls.sent:
                delta.content = self._content(answer, content_end)
            delta.calls = self.calls.step(self.reader.so_far(self.body, answer))
        else:  # required or named: the output is calls
            delta.calls = self.calls.step(self.reader.so_far(self.body, answer))
        return delta

    def _content(self, answer: str, end: int) -> str | None:
        if end <= self.content_sent:
            return None
        new, self.content_sent = answer[self.content_sent : end], end
        return new

    def _finish(self, c: CompletionOutput, answer: str, delta: ReplyDelta) -> None:
        """The last step: the whole answer's calls (what is left of them), or the rest
        of its text as content."""
        content, calls = self.reader.calls(self.body, c, answer)
        if calls:
            delta.calls = self.calls.step(
                [CallSoFar(call.name, call.arguments, True) for call in calls]
            )
            delta.made_calls = True
            if content and not self.content_sent:
                delta.content = content
        elif self.calls.sent:  # calls cut short or broken: sent as far as they go
            delta.calls = self.calls.step(self.reader.so_far(self.body, answer))
        else:
            delta.content = self._content(answer, len(answer)) or ""
