"""A chat reply's parts out of its text: reasoning (--reasoning-parser), content and tool
calls (tool_choice, --tool-call-parser), for the whole reply or step by step as it
streams. Tool calls are read only from the answer, after the reasoning. (gpt-oss's
harmony replies: harmony.py.)"""

from __future__ import annotations

from dataclasses import dataclass

from pyllm.engine.outputs import CompletionOutput
from pyllm.entrypoints.openai_protocol import ChatCompletionRequest
from pyllm.entrypoints.reasoning import ReasoningParser, settled
from pyllm.entrypoints.tool_calls import Call, parse_named, parse_required
from pyllm.entrypoints.tool_parsers import TOOL_PARSERS, ToolParser


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
        elif mode == "named" and c.finish_reason == "stop":
            calls = parse_named(body.tool_choice.function.name, answer)
        elif mode == "auto":
            return self.tools.parse(answer, body.tool_schemas())
        return (None, calls) if calls else (answer, [])


@dataclass
class ReplyStream:
    """One streamed choice: what it has sent of its reasoning and answer. Its answer is
    held back while it may be a tool call, and sent whole once it is plain content."""

    reader: ReplyReader
    body: ChatCompletionRequest
    reasoning_sent: int = 0
    answer_sent: int = 0
    plain: bool = False  # sending content although tools were offered

    def step(self, c: CompletionOutput) -> tuple[str, str | None, list[Call]]:
        """(new reasoning, new content or None while held back, the calls once the
        reply is over and was calls)."""
        final = c.finish_reason is not None
        text = self.reader.text(self.body, c)
        if self.reader.reasoning is not None and not final:
            text = settled(text)
        reasoning, answer = self.reader.split(self.body, text)
        new_reasoning = reasoning[self.reasoning_sent :]
        self.reasoning_sent = len(reasoning)
        mode = self.body.tool_mode
        if mode != "none" and not self.plain:
            if not final and (mode != "auto" or self.reader.tools.may_be_call(answer)):
                return new_reasoning, None, []
            if final and (calls := self.reader.calls(self.body, c, answer)[1]):
                return new_reasoning, None, calls
            self.plain = True
        new_answer = answer[self.answer_sent :]
        self.answer_sent = len(answer)
        return new_reasoning, new_answer, []
