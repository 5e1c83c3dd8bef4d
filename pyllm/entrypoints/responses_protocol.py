"""OpenAI's Responses API (POST /v1/responses): the request and response bodies, and a
request turned into the chat request it means.

A Responses request is served as the equivalent `ChatCompletionRequest` (instructions
as the system message, earlier turns of `previous_response_id` next, message items as
messages, `function_call` items as an assistant's tool calls, `function_call_output`
items as tool messages, `text.format` as response_format), so the chat route's checks,
template, sampling and forced tool calls apply unchanged. Requests are parsed strictly;
unknown fields are ignored, except those whose meaning this server cannot honour
(background, conversation, prompt, top_logprobs, built-in tools): those are refused.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, PrivateAttr, TypeAdapter, ValidationError, field_validator

from pyllm.entrypoints.openai_protocol import ChatCompletionRequest, RequestError, invalid_body
from pyllm.entrypoints.openai_protocol.base import ResponseModel, StrictRequest
from pyllm.entrypoints.openai_protocol.errors import fields_renamed, param_of_location

# OpenAI's bounds on metadata, which is kept with a stored response.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512

# ------------------------------------------------------------------- requests


class TextPart(StrictRequest):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(StrictRequest):
    """An assistant's earlier refusal, as clients send it back: its text."""

    type: Literal["refusal"]
    refusal: str


class MessageItem(StrictRequest):
    """A turn: `{"role", "content"}`, with or without `"type": "message"`."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart | RefusalPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text if isinstance(p, TextPart) else p.refusal for p in self.content)


class FunctionCallItem(StrictRequest):
    """A call the assistant made earlier (an output item sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(StrictRequest):
    """A function's answer to a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


class ReasoningItem(StrictRequest):
    """An earlier reasoning output item, sent back: left out of the prompt."""

    type: Literal["reasoning"]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str | None, TypeAdapter] = {
    kind: TypeAdapter(model)
    for kind, model in {
        None: MessageItem,
        "message": MessageItem,
        "function_call": FunctionCallItem,
        "function_call_output": FunctionCallOutputItem,
        "reasoning": ReasoningItem,
    }.items()
}
_PART_TYPES = ("input_text", "output_text", "refusal")


def _item(item: Any, where: str):
    """One input item, parsed by its type; a ValueError naming it and its bad field."""
    if not isinstance(item, dict):
        raise ValueError(f"{where} must be an object, got {type(item).__name__}")
    kind = item.get("type")
    if not (kind is None or isinstance(kind, str)) or kind not in _ITEMS:
        raise ValueError(
            f"{where} has type {kind!r}; this server takes message, function_call, "
            "function_call_output and reasoning items"
        )
    content = item.get("content") if kind in (None, "message") else None
    for j, part in enumerate(content if isinstance(content, list) else ()):
        part_kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part_kind, str) and part_kind not in _PART_TYPES:
            raise ValueError(
                f"{where}.content[{j}] has type {part_kind!r}; this server takes "
                "input_text, output_text and refusal parts (no images, files or audio)"
            )
    try:
        return _ITEMS[kind].validate_python(item, strict=True)
    except ValidationError as error:
        first = error.errors()[0]
        field = param_of_location(first["loc"])
        raise ValueError(f"{where}{'.' + field if field else ''}: {first['msg']}") from None


class FunctionTool(StrictRequest):
    # Built-in tools (web_search, file_search, ...) need OpenAI's services: refused here.
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(StrictRequest):
    type: Literal["function"]
    name: str


class TextFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # "schema" would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictRequest):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictRequest):
    """Accepted; a --reasoning-parser decides whether thinking is read apart."""

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(StrictRequest):
    """POST /v1/responses; `chat()` is the chat request it means."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    # Accepted only where they change nothing (see _check).
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    _chat: ChatCompletionRequest | None = PrivateAttr(None)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        # Said here: pydantic would report the first member of the union (not a string).
        if isinstance(value, list):
            return [_item(item, f"input[{i}]") for i, item in enumerate(value)]
        return value

    def chat(self, history: list[dict[str, Any]] = ()) -> ChatCompletionRequest:
        """The chat request this one means, after the messages of earlier turns
        (`history`); checked, its RequestErrors naming this request's fields."""
        if self._chat is None:
            self._check()
            with responses_fields():
                try:
                    self._chat = ChatCompletionRequest.model_validate(self._chat_fields(history))
                except ValidationError as error:
                    raise invalid_body(error) from None
        return self._chat

    def _check(self) -> None:
        refused = {
            "background": self.background,
            "conversation": self.conversation,
            "prompt": self.prompt,
            "top_logprobs": self.top_logprobs,
        }
        for name, value in refused.items():
            if value:
                raise RequestError(f"{name} is not supported by this server", name)
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise RequestError("input must hold at least one item", "input")
        _check_metadata(self.metadata)
        if self.text is not None and self.text.format is not None:
            _check_format(self.text.format)

    def _chat_fields(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        system = (
            [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        )
        messages = [*system, *history, *self.input_messages()]
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            fields["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self._format().type != "text":
            fields["response_format"] = _response_format(self._format())
        optional = {
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "parallel_tool_calls": self.parallel_tool_calls,
            "stream": self.stream,
            "user": self.user,
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        return fields

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages: consecutive function_call items are
        one assistant turn's calls (after its text, if it has one)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
                last = messages[-1] if messages else {}
                if last.get("role") != "assistant":
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
                )
        return messages

    def echo(self) -> dict[str, Any]:
        """The settings a response repeats back."""
        choice = self.tool_choice or "auto"
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": None if self.reasoning is None else self.reasoning.model_dump(),
            "store": self.store,
            "temperature": self.temperature,
            "text": {"format": self._format().model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [tool.model_dump() for tool in self.tools or ()],
            "top_p": self.top_p,
            "user": self.user,
        }

    def _format(self) -> TextFormat:
        fmt = self.text.format if self.text is not None else None
        return fmt or TextFormat(type="text")

    def structured_field(self) -> str | None:
        """The field that asked for structured output: text.format or tool_choice."""
        return _field_here(self.chat().structured_field())


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if len(metadata or ()) > MAX_METADATA_KEYS:
        raise RequestError(f"metadata may hold at most {MAX_METADATA_KEYS} keys", "metadata")
    for key, value in (metadata or {}).items():
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise RequestError(
                f"metadata keys may have at most {MAX_METADATA_KEY_CHARS} characters and "
                f"values {MAX_METADATA_VALUE_CHARS}",
                "metadata",
            )


def _check_format(fmt: TextFormat) -> None:
    if fmt.type == "json_schema" and fmt.name is None:
        raise RequestError("text.format of type json_schema needs name", "text.format.name")
    if fmt.type == "json_schema" and fmt.json_schema is None:
        raise RequestError("text.format of type json_schema needs schema", "text.format.schema")


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict}
    return {
        "type": "json_schema",
        "json_schema": {k: v for k, v in schema.items() if v is not None},
    }


def _chat_tool_choice(choice: str | FunctionToolChoice) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = tool.model_dump(exclude_none=True, exclude={"type"})
    return {"type": "function", "function": function}


# The chat request's fields under their names here.
_FIELDS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}
_MESSAGES = re.compile(r"^messages\[\d+\][\w.\[\]]*")
_TOOL_FUNCTION = re.compile(r"^(tools\[\d+\])\.function")


def _field_here(param: str | None) -> str | None:
    if param is None:
        return None
    if param.startswith("response_format"):
        return "text.format" + param[len("response_format") :].replace(".json_schema", "", 1)
    # The chat's messages are numbered otherwise (instructions, earlier turns).
    param = _MESSAGES.sub("input", param)
    return _FIELDS.get(param) or _TOOL_FUNCTION.sub(r"\1", param)


def responses_fields():
    """RequestErrors raised inside, about the chat request, name this request's fields."""
    return fields_renamed(_field_here)


# ------------------------------------------------------------------- responses


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = []


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(ResponseModel):
    """A reasoning model's thinking (--reasoning-parser), ahead of its answer."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = []
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(ResponseModel):
    """The reply, and the request's settings echoed as OpenAI's SDK expects them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = {}
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
    background: bool = False


class DeletedResponse(ResponseModel):
    """DELETE /v1/responses/{id}'s reply."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
