"""POST /v1/chat/completions: messages through the chat template, replies (their tool
calls, and a harmony model's reasoning apart from its answer) whole or streamed."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pyllm.engine.outputs import CompletionOutput
from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints.harmony import HarmonyStream, speaks_harmony
from pyllm.entrypoints.harmony import parse as parse_harmony
from pyllm.entrypoints.openai_protocol import RequestError
from pyllm.entrypoints.serving import Job, OpenAIServing, Progress
from pyllm.entrypoints.tool_calls import (
    Call,
    call_id,
    may_be_hermes,
    parse_hermes,
    parse_named,
    parse_required,
)


class ChatServing(OpenAIServing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # gpt-oss: replies in channels, read out of text decoded with its markers kept.
        self.harmony = speaks_harmony(self.tokenizer)

    async def chat(self, request: Request) -> Response:
        return await self._respond(request, api.ChatCompletionRequest)

    def _response(
        self, body: api.ChatCompletionRequest, jobs: list[Job], created: int, progress: Progress
    ) -> api.ChatCompletionResponse:
        return api.ChatCompletionResponse(
            id=jobs[0].request_id,
            created=created,
            model=self.model_name,
            system_fingerprint=self.fingerprint,
            choices=[self._choice(body, c) for c in progress.finals[0].outputs],
            usage=self._usage(progress, jobs),
        )

    async def _prepare(self, body: api.ChatCompletionRequest) -> list[Job]:
        body.check()
        self.check_model(body.model)
        self._check_num_seqs(body, 1)
        params = body.to_sampling_params()
        if self.harmony:
            params.skip_special_tokens = False
        messages = body.template_messages()
        tools = body.template_tools()

        def tokenize() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tools=tools
            )
            return self.tokenizer.encode(text, add_special_tokens=False)

        try:
            ids = await asyncio.to_thread(tokenize)
        except Exception as error:  # the template refused these messages
            raise RequestError(f"messages could not be rendered: {error}", "messages") from None
        await self._validate(body, ids, params, "messages")
        return [Job(api.random_id("chatcmpl"), ids, params, priority=body.priority)]

    def _choice(self, body: api.ChatCompletionRequest, c: CompletionOutput) -> api.ChatChoice:
        """A finished choice: its message (content, tool calls, reasoning) and logprobs."""
        logprobs = None
        if body.logprobs:
            logprobs = self.tokens.chat_logprobs(c.token_ids, c.logprobs or [])
        reasoning = None
        if self.harmony:
            reasoning, content, calls = _harmony_parts(body, c)
        else:
            content, calls = _tool_calls(body, c)
        tool_calls = [_api_call(call) for call in calls] or None
        message = api.AssistantMessage(
            content=content, tool_calls=tool_calls, reasoning_content=reasoning
        )
        return api.ChatChoice(
            index=c.index,
            message=message,
            logprobs=logprobs,
            finish_reason="tool_calls" if calls else c.finish_reason,
        )

    def _events(
        self, body: api.ChatCompletionRequest, jobs: list[Job], created: int, progress: Progress
    ) -> AsyncIterator[str]:
        streaming: set[int] = set()  # choices sending content although tools were offered
        channels: dict[int, HarmonyStream] = {}  # harmony: what each choice has sent

        def choice(index: int, c: CompletionOutput, text: str, token_ids, logprobs, offset: int):
            if self.harmony:
                stream = channels.setdefault(c.index, HarmonyStream())
                return _harmony_chunk(body, c, stream.delta(c.text))
            if body.tool_mode != "none" and c.index not in streaming:
                if c.finish_reason is None and (body.tool_mode != "auto" or may_be_hermes(c.text)):
                    return None  # held back while it may be a tool call, sent whole at the end
                if c.finish_reason is not None and (calls := _tool_calls(body, c)[1]):
                    return _calls_chunk(c, calls)
                text = c.text  # plain content after all: all of it so far
                streaming.add(c.index)
            return api.ChatChunkChoice(
                index=c.index,
                delta=api.DeltaMessage(content=text),
                logprobs=self.tokens.chat_logprobs(token_ids, logprobs) if body.logprobs else None,
                finish_reason=c.finish_reason,
            )

        opening = (
            api.ChatChunkChoice(index=i, delta=api.DeltaMessage(role="assistant", content=""))
            for i in range(body.n)
        )
        chunk = functools.partial(
            api.ChatCompletionChunk,
            id=jobs[0].request_id,
            created=created,
            model=self.model_name,
            system_fingerprint=self.fingerprint,
        )
        return self._stream(body, jobs, progress, chunk, opening, choice)


def _calls_chunk(c: CompletionOutput, calls: list[Call]) -> api.ChatChunkChoice:
    delta = [_api_call(call, i) for i, call in enumerate(calls)]
    return api.ChatChunkChoice(
        index=c.index, delta=api.DeltaMessage(tool_calls=delta), finish_reason="tool_calls"
    )


def _tool_calls(body: api.ChatCompletionRequest, c: CompletionOutput) -> tuple[str | None, list]:
    """(content, tool calls) of a finished chat choice, as its tool_choice reads it."""
    mode = body.tool_mode
    calls = None
    if mode == "required" and c.finish_reason == "stop":
        calls = parse_required(c.text)
    elif mode == "named" and c.finish_reason == "stop":
        calls = parse_named(body.tool_choice.function.name, c.text)
    elif mode == "auto":
        return parse_hermes(c.text, {tool.function.name for tool in body.tools})
    return (None, calls) if calls else (c.text, [])


def _harmony_parts(body: api.ChatCompletionRequest, c: CompletionOutput):
    """(reasoning, content, tool calls) of a finished harmony reply. Under a required or
    named tool_choice the output was constrained to the calls' JSON, with no channels."""
    if body.tool_mode in ("required", "named"):
        content, calls = _tool_calls(body, c)
        return None, content, calls
    reply = parse_harmony(c.text)
    tools = {tool.function.name for tool in body.tools or ()}
    calls = [call for call in reply.calls if call.name in tools]
    content = reply.content or (None if calls else "")
    return reply.reasoning or None, content, calls


def _harmony_chunk(body, c: CompletionOutput, delta: tuple[str, str]):
    """A streamed harmony choice's step: its new reasoning and content; its tool calls
    whole at the end."""
    reasoning, content = delta
    calls = []
    if c.finish_reason is not None:
        calls = _harmony_parts(body, c)[2]
    if not reasoning and not content and c.finish_reason is None:
        return None
    message = api.DeltaMessage(
        content=content or None,
        reasoning_content=reasoning or None,
        tool_calls=[_api_call(call, i) for i, call in enumerate(calls)] or None,
    )
    reason = "tool_calls" if calls else c.finish_reason
    return api.ChatChunkChoice(index=c.index, delta=message, finish_reason=reason)


def _api_call(call: Call, index: int | None = None) -> api.ToolCall:
    function = api.FunctionCall(name=call.name, arguments=call.arguments)
    if index is None:
        return api.ToolCall(id=call_id(), function=function)
    return api.DeltaToolCall(index=index, id=call_id(), function=function)
