"""vLLM's POST /tokenize and POST /detokenize."""

from __future__ import annotations

from typing import Any

from pyllm.entrypoints.openai_protocol.base import ResponseModel, StrictRequest
from pyllm.entrypoints.openai_protocol.chat import ChatCompletionRequest
from pyllm.entrypoints.openai_protocol.errors import RequestError
from pyllm.entrypoints.openai_protocol.messages import ChatMessage


class TokenizeRequest(StrictRequest):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True  # messages only
    chat_template_kwargs: dict[str, Any] | None = None  # messages only
    # Default: BOS and the like for a prompt; none for messages (the template writes them).
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of prompt and messages", "prompt")
        if self.messages is not None:
            chat = ChatCompletionRequest(
                messages=self.messages, chat_template_kwargs=self.chat_template_kwargs
            )
            chat.check()

    def template_messages(self) -> list[dict[str, str]]:
        return ChatCompletionRequest(messages=self.messages).template_messages()


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str
