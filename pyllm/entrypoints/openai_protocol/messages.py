"""A chat's messages and the tools a request offers, as the request sends them."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

from pyllm.entrypoints.openai_protocol.base import StrictRequest
from pyllm.sampling.json_depth import loads_bounded


class TextContentPart(StrictRequest):
    type: Literal["text"]
    text: str


class CalledFunction(StrictRequest):
    name: str
    # OpenAI's is a JSON string; an object is taken too (HF templates want one).
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(StrictRequest):
    """A call an assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictRequest):
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's convention: call arguments as
        a dict, not OpenAI's JSON string)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    """The call as templates read it: OpenAI's nesting, and name and arguments at the
    top too (some templates read call.name, others call.function.name)."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON (or too deep): the string itself
            arguments = loads_bounded(arguments)
    function = {"name": call.function.name, "arguments": arguments}
    template_call = {"type": call.type, "function": function, **function}
    if call.id is not None:
        template_call["id"] = call.id
    return template_call


class FunctionDefinition(StrictRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: NamedFunction
