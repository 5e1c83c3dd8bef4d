"""POST /v1/chat/completions: the request, the response and its stream chunks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_serializer

from pyllm.entrypoints.openai_protocol.base import ResponseModel
from pyllm.entrypoints.openai_protocol.errors import RequestError
from pyllm.entrypoints.openai_protocol.messages import (
    ChatMessage,
    FunctionDefinition,
    NamedToolChoice,
    Tool,
)
from pyllm.entrypoints.openai_protocol.responses import UsageInfo
from pyllm.entrypoints.openai_protocol.sampling import SamplingRequest


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's: extra variables for the chat template ({"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None

    def max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def _logprobs_field_name(self) -> str:
        return "top_logprobs"

    def check(self) -> None:
        if not self.messages:
            raise RequestError("messages must hold at least one message", "messages")
        for i, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise RequestError(f"messages[{i}].content is required", f"messages[{i}].content")
        check_template_kwargs(self.chat_template_kwargs)
        if self.tool_choice not in (None, "none") and not self.tools:
            raise RequestError("tool_choice needs tools", "tool_choice")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise RequestError("tools must have distinct function names", "tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise RequestError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, which is "
                    "not in tools",
                    "tool_choice",
                )

    @property
    def tool_mode(self) -> str:
        """'none' (no tools, or tool_choice none), 'auto' (the model may call one, in
        its own format), 'required' (a list of calls) or 'named' (that function's
        arguments)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (none with tool_choice none)."""
        if self.tool_mode == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_schemas(self) -> dict[str, dict[str, Any]]:
        """{tool name: its parameters' JSON schema}."""
        return {tool.function.name: tool.function.parameters or {} for tool in self.tools or ()}

    def _structured_sources(self) -> dict[str, dict[str, Any]]:
        sources = super()._structured_sources()
        mode = self.tool_mode
        if mode == "named":
            function = self._function(self.tool_choice.function.name)
            sources["tool_choice"] = {"json": function.parameters or {"type": "object"}}
        elif mode == "required":
            calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.function.name},
                        "arguments": tool.function.parameters or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for tool in self.tools
            ]}}  # fmt: skip
            if self.parallel_tool_calls is False:
                calls["maxItems"] = 1
            sources["tool_choice"] = {"json": calls}
        return sources

    def _function(self, name: str) -> FunctionDefinition:
        return next(t.function for t in self.tools if t.function.name == name)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]


# The variables the server gives a chat template itself.
TEMPLATE_VARIABLES = (
    "messages", "tools", "documents", "add_generation_prompt", "tokenize", "chat_template",
    "bos_token", "eos_token", "pad_token", "unk_token",
)  # fmt: skip


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """chat_template_kwargs may add variables, not replace the server's own."""
    for name in kwargs or ():
        if name in TEMPLATE_VARIABLES:
            raise RequestError(
                f"chat_template_kwargs may not set {name!r}: the server sets it",
                f"chat_template_kwargs.{name}",
            )


# ------------------------------------------------------------------- responses


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # a JSON object


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(ResponseModel):
    name: str | None = None  # on a call's first delta only
    arguments: str = ""  # the next fragment of the arguments' JSON text


class DeltaToolCall(ResponseModel):
    """One streamed step of a call, as OpenAI sends them: its first delta has the id,
    type and name; the next ones only argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        body = handler(self)
        if body["function"]["name"] is None:
            del body["function"]["name"]
        return {k: v for k, v in body.items() if v is not None}


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    # A reasoning model's thinking apart from its answer (vLLM's field; gpt-oss's analysis).
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler):
        body = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if body.get(key) is None:
                body.pop(key, None)
        return body


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        # OpenAI sends only what a delta carries: {"role": ...} first, then {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str
