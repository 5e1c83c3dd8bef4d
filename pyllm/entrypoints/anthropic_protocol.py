"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens): the
request and response bodies, and a request turned into the chat request it means.

A Messages request is served as the equivalent `ChatCompletionRequest` (system prompt
first, an assistant's `tool_use` blocks as its tool calls, a user's `tool_result` blocks
as tool messages, `tool_choice` any/tool as required/named), so the chat route's checks,
template, sampling and forced tool calls apply unchanged. `thinking` sets the chat
template's `enable_thinking` (as chat_template_kwargs does); with a reasoning parser the
reply's thinking comes back as a thinking block. Requests are parsed strictly, as the
OpenAI routes' are; unknown fields are ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, TypeAdapter, ValidationError, field_validator

from pyllm.entrypoints.openai_protocol import ChatCompletionRequest, RequestError
from pyllm.entrypoints.openai_protocol.base import ResponseModel, StrictRequest
from pyllm.entrypoints.openai_protocol.errors import fields_renamed, param_of_location

# ------------------------------------------------------------------- requests


class TextBlock(StrictRequest):
    type: Literal["text"]
    text: str


class MediaBlock(StrictRequest):
    """An image or a document: parsed only to be refused by name."""

    type: Literal["image", "document"]


class ThinkingBlock(StrictRequest):
    """An assistant's earlier thinking, as clients send it back: left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(StrictRequest):
    """A call an assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(StrictRequest):
    """A tool's answer to a call, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] = ""
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content if isinstance(block, TextBlock))


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | MediaBlock | ThinkingBlock,
    Field(discriminator="type"),
]
_BLOCK: TypeAdapter = TypeAdapter(Block)
BLOCK_TYPES = (
    "text",
    "tool_use",
    "tool_result",
    "image",
    "document",
    "thinking",
    "redacted_thinking",
)


class Message(StrictRequest):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, content: Any) -> Any:
        # Said here: pydantic would report the first member of the union (not a string).
        for j, block in enumerate(content if isinstance(content, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in BLOCK_TYPES:
                raise ValueError(
                    f"content[{j}] has type {kind!r}; this server takes text, tool_use and "
                    "tool_result blocks"
                )
            try:
                _BLOCK.validate_python(block, strict=True)
            except ValidationError as error:
                first = error.errors()[0]
                where = param_of_location(first["loc"][1:])  # after the block's type
                raise ValueError(
                    f"content[{j}]{'.' + where if where else ''}: {first['msg']}"
                ) from None
        return content

    def blocks(self) -> list:
        return (
            [TextBlock(type="text", text=self.content)]
            if isinstance(self.content, str)
            else (self.content)
        )


class ToolDefinition(StrictRequest):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools are not offered


class ToolChoice(StrictRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens


class ThinkingConfig(StrictRequest):
    """Whether the model thinks first. The budget is checked as Anthropic checks it, not
    enforced: thinking and answer share max_tokens."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # enabled: required
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking text left out

    def check(self) -> None:
        if self.type != "enabled":
            return
        if self.budget_tokens is None:
            raise RequestError(
                "thinking.budget_tokens is required when thinking is enabled",
                "thinking.budget_tokens",
            )
        if self.budget_tokens < MIN_THINKING_BUDGET:
            raise RequestError(
                f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET}, "
                f"got {self.budget_tokens}",
                "thinking.budget_tokens",
            )


class CountTokensRequest(StrictRequest):
    """POST /v1/messages/count_tokens; what POST /v1/messages adds is below."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    _chat: ChatCompletionRequest | None = PrivateAttr(None)

    def chat(self) -> ChatCompletionRequest:
        """The chat request this one means (checked; RequestErrors name this request's
        fields)."""
        if self._chat is None:
            self._check()
            with anthropic_fields():
                self._chat = ChatCompletionRequest.model_validate(self._chat_fields())
        return self._chat

    def _check(self) -> None:
        if not self.messages:
            raise RequestError("messages must hold at least one message", "messages")
        for i, message in enumerate(self.messages):
            _check_blocks(message, f"messages[{i}]")
        names = [tool.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise RequestError("tools must have distinct names", "tools")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise RequestError(f"tool_choice {choice.type!r} needs tools", "tool_choice")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise RequestError(
                f"tool_choice names tool {choice.name!r}, which is not in tools", "tool_choice.name"
            )
        if self.thinking is not None:
            self.thinking.check()

    def _chat_fields(self) -> dict[str, Any]:
        messages = [] if self.system is None else [{"role": "system", "content": _system(self)}]
        for message in self.messages:
            messages += _chat_messages(message)
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            fields["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            fields.update(_chat_tool_choice(self.tool_choice))
        if self.thinking is not None:
            enable = self.thinking.type != "disabled"
            fields["chat_template_kwargs"] = {"enable_thinking": enable}
        return fields

    def shows_thinking(self) -> bool:
        """Whether thinking blocks carry the thinking's text."""
        return self.thinking is None or self.thinking.display != "omitted"


STRUCTURED_FIELDS = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None  # accepted, not used
    # pyllm's extension, the chat route's structured output (vLLM's fields).
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _check(self) -> None:
        if self.max_tokens < 1:
            raise RequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens"
            )
        super()._check()
        budget = self.thinking and self.thinking.type == "enabled" and self.thinking.budget_tokens
        if budget and budget >= self.max_tokens:
            raise RequestError(
                f"thinking.budget_tokens must be less than max_tokens ({self.max_tokens}), "
                f"got {budget}",
                "thinking.budget_tokens",
            )

    def _chat_fields(self) -> dict[str, Any]:
        fields = super()._chat_fields()
        sampling = {
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            **{name: getattr(self, name) for name in STRUCTURED_FIELDS},
        }
        fields.update({k: v for k, v in sampling.items() if v is not None})
        return fields

    def structured_field(self) -> str | None:
        """The field that asked for structured output: a forced tool_choice."""
        return self.chat().structured_field()


def _check_blocks(message: Message, where: str) -> None:
    """Refuses images and blocks in the wrong turn, naming the block."""
    allowed = {
        "user": (TextBlock, ToolResultBlock),
        "assistant": (TextBlock, ToolUseBlock, ThinkingBlock),
    }
    for j, block in enumerate(message.blocks()):
        field = f"{where}.content[{j}]"
        if isinstance(block, MediaBlock):
            raise RequestError(
                f"{field}: {block.type} input is not supported by this server", field
            )
        if not isinstance(block, allowed[message.role]):
            raise RequestError(
                f"{field}: a {block.type} block may not be in a {message.role!r} message", field
            )
        if isinstance(block, ToolResultBlock) and not isinstance(block.content, str):
            for k, part in enumerate(block.content):
                if isinstance(part, MediaBlock):
                    raise RequestError(
                        f"{field}.content[{k}]: {part.type} input is not supported by this server",
                        f"{field}.content[{k}]",
                    )


def _system(request: CountTokensRequest) -> str:
    if isinstance(request.system, str):
        return request.system
    return "\n".join(block.text for block in request.system)


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: an assistant's text and calls; a user's tool
    results (each a tool message), then its text."""
    blocks = message.blocks()
    text = "\n".join(b.text for b in blocks if isinstance(b, TextBlock))
    if message.role == "assistant":
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    results = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)}
        for b in blocks
        if isinstance(b, ToolResultBlock)
    ]
    has_text = any(isinstance(b, TextBlock) for b in blocks) or not results
    return results + ([{"role": "user", "content": text}] if has_text else [])


def _result_text(block: ToolResultBlock) -> str:
    return f"Error: {block.text()}" if block.is_error else block.text()


def _chat_tool(tool: ToolDefinition) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice) -> dict[str, Any]:
    fields: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
    return fields


# The chat request's fields under their names here.
_FIELDS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}
_INDEXED = re.compile(r"^(messages|tools)\[\d+\][\w.\[\]]*")


def _field_here(param: str | None) -> str | None:
    if param is None:
        return None
    # The chat's messages and tools are numbered otherwise (the system prompt, tool results).
    return _FIELDS.get(param) or _INDEXED.sub(r"\1", param)


def anthropic_fields():
    """RequestErrors raised inside, about the chat request, name this request's fields."""
    return fields_renamed(_field_here)


# ------------------------------------------------------------------- errors

MESSAGES_PATH = "/v1/messages"
# Anthropic's error type for each status; others: invalid_request_error (4xx), api_error.
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def naming_field(message: str, param: str | None) -> str:
    """The message, led by the field at fault unless it names it already."""
    return message if not param or param in message else f"{param}: {message}"


def error_body(status: int, body: Any) -> dict | None:
    """An error body in OpenAI's shape (`{"error": {"message", "param", ...}}`) in
    Anthropic's (`{"type": "error", "error": {"type", "message"}}`); None if it is not
    one."""
    try:
        error = body["error"]
        message = naming_field(str(error["message"]), error.get("param"))
    except (KeyError, TypeError, AttributeError):
        return None
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


# ------------------------------------------------------------------- responses


class TextContent(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's proof of origin: none here


class ToolUseContent(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class Usage(ResponseModel):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(ResponseModel):
    input_tokens: int


class ErrorDetail(ResponseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    message: str


class ErrorResponse(ResponseModel):
    """Every error of the Messages routes."""

    type: Literal["error"] = "error"
    error: ErrorDetail
