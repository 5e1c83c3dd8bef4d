"""POST /v1/chat/completions: messages through the chat template, replies (their tool
calls, and a reasoning model's thinking apart from its answer) whole or streamed."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pyllm.engine.outputs import CompletionOutput
from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints.chat_reply import ReplyReader, ReplyStream
from pyllm.entrypoints.harmony import HarmonyStream, speaks_harmony
from pyllm.entrypoints.harmony import parse as parse_harmony
from pyllm.entrypoints.openai_protocol import RequestError
from pyllm.entrypoints.reasoning import ReasoningParser
from pyllm.entrypoints.serving import Job, OpenAIServing, Progress
from pyllm.entrypoints.tool_calls import Call
from pyllm.entrypoints.tool_parsers import TOOL_PARSERS, ToolParser
from pyllm.entrypoints.tool_stream import CallDelta


class ChatServing(OpenAIServing):
    def __init__(
        self,
        *args,
        reasoning: ReasoningParser | None = None,
        tool_parser: ToolParser = TOOL_PARSERS["hermes"],
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        # gpt-oss: replies in channels, read out of text decoded with its markers kept.
        self.harmony = speaks_harmony(self.tokenizer)
        self.reader = ReplyReader(reasoning, tool_parser, self._end_texts())

    def _end_texts(self) -> tuple[str, ...]:
        ids = sorted(getattr(self.tokenizer, "eos_token_ids", None) or ())
        return tuple(self.tokenizer.convert_ids_to_tokens(ids)) if ids else ()

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
        if self.harmony or self.reader.keeps_specials(body):
            params.skip_special_tokens = False
        messages = body.template_messages()
        tools = body.template_tools()
        variables = body.chat_template_kwargs or {}

        def tokenize() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                tools=tools,
                **variables,
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
        if self.harmony:
            reasoning, content, calls = self._harmony_parts(body, c)
        else:
            reasoning, content, calls = self.reader.parts(body, c)
        tool_calls = [self._api_call(call) for call in calls] or None
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
        replies: dict[int, ReplyStream] = {}  # what each choice has sent
        channels: dict[int, HarmonyStream] = {}  # harmony: what each choice has sent

        def choice(index: int, c: CompletionOutput, text: str, token_ids, logprobs, offset: int):
            if self.harmony:
                stream = channels.setdefault(c.index, HarmonyStream())
                return self._harmony_chunk(body, c, stream.delta(c.text))
            reply = replies.setdefault(c.index, ReplyStream(self.reader, body))
            step = reply.step(c)
            content = step.content
            if self.reader.reasoning is not None or body.tool_mode != "none":
                content = content or None  # a step of reasoning or calls alone: no content
                if not (step.reasoning or content or step.calls or c.finished or body.logprobs):
                    return None
            return api.ChatChunkChoice(
                index=c.index,
                delta=api.DeltaMessage(
                    content=content,
                    reasoning_content=step.reasoning or None,
                    tool_calls=[self._delta_call(call) for call in step.calls] or None,
                ),
                logprobs=self.tokens.chat_logprobs(token_ids, logprobs) if body.logprobs else None,
                finish_reason="tool_calls" if step.made_calls else c.finish_reason,
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

    def _delta_call(self, call: CallDelta) -> api.DeltaToolCall:
        """A call's first delta carries its id and name, the others argument text."""
        function = api.DeltaFunctionCall(name=call.name, arguments=call.arguments)
        if call.name is None:
            return api.DeltaToolCall(index=call.index, function=function)
        return api.DeltaToolCall(
            index=call.index, id=self.reader.tools.new_id(), type="function", function=function
        )

    def _harmony_parts(self, body: api.ChatCompletionRequest, c: CompletionOutput):
        """(reasoning, content, tool calls) of a finished harmony reply. Under a required
        or named tool_choice the output was constrained to the calls' JSON, with no
        channels."""
        if body.tool_mode in ("required", "named"):
            content, calls = self.reader.calls(body, c, c.text)
            return None, content, calls
        reply = parse_harmony(c.text)
        tools = {tool.function.name for tool in body.tools or ()}
        calls = [call for call in reply.calls if call.name in tools]
        content = reply.content or (None if calls else "")
        return reply.reasoning or None, content, calls

    def _harmony_chunk(self, body, c: CompletionOutput, delta: tuple[str, str]):
        """A streamed harmony choice's step: its new reasoning and content; its tool
        calls whole at the end."""
        reasoning, content = delta
        calls = []
        if c.finish_reason is not None:
            calls = self._harmony_parts(body, c)[2]
        if not reasoning and not content and c.finish_reason is None:
            return None
        message = api.DeltaMessage(
            content=content or None,
            reasoning_content=reasoning or None,
            tool_calls=[
                self._delta_call(CallDelta(i, call.name, call.arguments))
                for i, call in enumerate(calls)
            ]
            or None,
        )
        reason = "tool_calls" if calls else c.finish_reason
        return api.ChatChunkChoice(index=c.index, delta=message, finish_reason=reason)

    def _api_call(self, call: Call) -> api.ToolCall:
        function = api.FunctionCall(name=call.name, arguments=call.arguments)
        return api.ToolCall(id=self.reader.tools.new_id(), function=function)
