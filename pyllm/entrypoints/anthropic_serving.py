"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served as
the chat route serves its equivalent chat request (anthropic_protocol.py), replies as
thinking, text and tool_use blocks, whole or as Anthropic's stream of events; and
AnthropicErrors, which gives every error of these routes (the middleware's included)
Anthropic's shape."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from pyllm.engine.async_engine import EngineDeadError
from pyllm.engine.outputs import CompletionOutput
from pyllm.entrypoints import anthropic_protocol as anthropic
from pyllm.entrypoints.anthropic_protocol import anthropic_fields
from pyllm.entrypoints.chat_reply import ReplyDelta, ReplyStream
from pyllm.entrypoints.openai_protocol import RequestError
from pyllm.entrypoints.request_io import read_request
from pyllm.entrypoints.serving import Job, Progress, _raise_failed
from pyllm.entrypoints.serving_chat import ChatServing

logger = logging.getLogger("pyllm")

_MAX_ERROR_BYTES = 1 << 16  # an error body longer than this is passed on as it is


class MessagesServing(ChatServing):
    """The Messages routes over the chat route's machinery: a request is prepared, run,
    aborted on disconnect and counted in the metrics as its chat request would be."""

    async def messages(self, request: Request):
        return await self._respond(request, anthropic.MessagesRequest)

    async def count_tokens(self, request: Request) -> anthropic.CountTokensResponse:
        body = await read_request(request, anthropic.CountTokensRequest, self.max_bytes)
        chat = body.chat()
        self.check_model(chat.model)
        ids = await self._prompt_ids(chat)
        return anthropic.CountTokensResponse(input_tokens=len(ids))

    async def _prompt_ids(self, chat) -> list[int]:
        messages, tools = chat.template_messages(), chat.template_tools()
        variables = chat.chat_template_kwargs or {}

        def tokenize() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tools=tools, **variables
            )
            return self.tokenizer.encode(text, add_special_tokens=False)

        try:
            return await asyncio.to_thread(tokenize)
        except Exception as error:  # the template refused these messages
            raise RequestError(f"messages could not be rendered: {error}", "messages") from None

    async def _prepare(self, body: anthropic.MessagesRequest) -> list[Job]:
        chat = body.chat()
        with anthropic_fields():
            jobs = await super()._prepare(chat)
        jobs[0].request_id = f"msg_{uuid.uuid4().hex}"
        return jobs

    def _response(
        self, body: anthropic.MessagesRequest, jobs: list[Job], created: int, progress: Progress
    ) -> anthropic.MessagesResponse:
        c = progress.finals[0].outputs[0]
        content = self._content(body, c)
        stop_reason, stop_sequence = _stop_reason(body, c, _has_calls(content))
        return anthropic.MessagesResponse(
            id=jobs[0].request_id,
            model=self.model_name,
            content=content,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=_usage(jobs, c),
        )

    def _content(self, body: anthropic.MessagesRequest, c: CompletionOutput) -> list:
        """A finished reply's blocks: its thinking, its text, then its tool calls (as the
        chat route reads them out of the text, under its tool_choice)."""
        message = self._choice(body.chat(), c).message
        content: list = []
        if message.reasoning_content:
            thinking = message.reasoning_content if body.shows_thinking() else ""
            content.append(anthropic.ThinkingContent(thinking=thinking))
        if message.content:
            content.append(anthropic.TextContent(text=message.content))
        for call in message.tool_calls or ():
            arguments = json.loads(call.function.arguments)
            if not isinstance(arguments, dict):  # a schema that is not an object's
                arguments = {"value": arguments}
            content.append(
                anthropic.ToolUseContent(
                    id=_tool_use_id(), name=call.function.name, input=arguments
                )
            )
        return content

    # ---------------------------------------------------------- streaming

    def _events(
        self, body: anthropic.MessagesRequest, jobs: list[Job], created: int, progress: Progress
    ) -> AsyncIterator[str]:
        return _errors_as_events(self._message_events(body, jobs, progress))

    async def _message_events(
        self, body: anthropic.MessagesRequest, jobs: list[Job], progress: Progress
    ) -> AsyncIterator[str]:
        """message_start, ping, each block's start, deltas and stop, message_delta,
        message_stop. Thinking and text stream as they come, a tool call once its name
        is certain, then its input as it is written (as on the chat route); a harmony
        reply is sent whole at its end."""
        chat = body.chat()
        self.metrics.prompt_tokens.inc(len(jobs[0].prompt_token_ids))
        start = {
            "id": jobs[0].request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(jobs[0].prompt_token_ids), "output_tokens": 0},
        }
        yield event("message_start", {"message": start})
        yield event("ping", {})
        blocks = _Blocks(body.shows_thinking())
        reply = None if self.harmony else ReplyStream(self.reader, chat)
        async for index, output in self._outputs(jobs):
            self._track(progress, index, output)
            _raise_failed(chat, output)
            c = output.outputs[0]
            if reply is not None:
                step = reply.step(c)
                for sent in blocks.step(step):
                    yield sent
                blocks.made_calls |= step.made_calls
            if c.finish_reason is not None:
                for sent in self._ending(body, c, blocks):
                    yield sent
        self._observe(progress)

    def _ending(self, body, c: CompletionOutput, blocks: _Blocks) -> list[str]:
        """The events after a reply's last output: a harmony reply's blocks, then the
        end."""
        if self.harmony:
            content = self._content(body, c)
            blocks.made_calls = _has_calls(content)
            events = [e for block in content for e in blocks.whole(block)]
        else:
            events = blocks.close()
        stop_reason, stop_sequence = _stop_reason(body, c, blocks.made_calls)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = {"output_tokens": len(c.token_ids)}
        events.append(event("message_delta", {"delta": delta, "usage": usage}))
        events.append(event("message_stop", {}))
        return events


class _Blocks:
    """The content blocks a stream has sent: their count, and the open one's kind (and
    call index, for a tool_use block)."""

    def __init__(self, show_thinking: bool):
        self.show_thinking = show_thinking
        self.count = 0
        self.open: str | None = None  # "thinking", "text" or "tool_use"
        self.call = -1  # the open tool_use block's call
        self.wrapped: bool | None = None  # the open tool_use block's input, once seen
        self.made_calls = False

    def step(self, delta: ReplyDelta) -> list[str]:
        """The events of one step of the reply: thinking, text, then tool calls."""
        events = []
        if delta.reasoning:
            events += self._open({"type": "thinking", "thinking": "", "signature": ""})
            if self.show_thinking:
                events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            events += self._open({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.calls:
            if call.name is not None:
                block = {"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": {}}
                events += self._open(block, new=True)
                self.call = call.index
            if call.arguments and call.index == self.call:
                events.append(self._input_delta(call.arguments))
        return events

    def _input_delta(self, arguments: str) -> str:
        """A tool_use block's input fragment; input that is not an object (a forced
        tool's schema may ask for any value) is wrapped as {"value": ...}, as whole."""
        if self.wrapped is None and arguments.strip():
            self.wrapped = not arguments.lstrip().startswith("{")
            if self.wrapped:
                arguments = '{"value": ' + arguments
        return self._delta({"type": "input_json_delta", "partial_json": arguments})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # the SDK's thinking block ends with its signature
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        if self.open == "tool_use" and self.wrapped:
            events.append(self._delta({"type": "input_json_delta", "partial_json": "}"}))
        self.wrapped = None
        self.open = None
        self.count += 1
        return [*events, event("content_block_stop", {"index": self.count - 1})]

    def whole(self, block) -> list[str]:
        """A block's events, all of it in one delta."""
        if isinstance(block, anthropic.ThinkingContent):
            events = self._open({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": block.thinking}))
        elif isinstance(block, anthropic.TextContent):
            events = self._open({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": block.text}))
        else:
            events = self._open({**block.model_dump(), "input": {}})
            partial = json.dumps(block.input, ensure_ascii=False)
            events.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
        return events + self.close()

    def _open(self, block: dict, new: bool = False) -> list[str]:
        """Starts a block of this kind unless one is open (`new`: a block anyway)."""
        if self.open == block["type"] and not new:
            return []
        events = self.close()
        self.open = block["type"]
        return [
            *events,
            event("content_block_start", {"index": self.count, "content_block": block}),
        ]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.count, "delta": delta})


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _has_calls(content: list) -> bool:
    return any(isinstance(block, anthropic.ToolUseContent) for block in content)


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event as Anthropic sends them: its type named twice."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _errors_as_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events; an error raised while they are made becomes the stream's last event
    (the status line is already sent), in Anthropic's shape."""
    try:
        async for sent in events:
            yield sent
    except Exception as error:
        status, message = _error_of(error)
        yield event("error", {"error": {"type": anthropic.error_type(status), "message": message}})
    finally:
        await events.aclose()  # aborts the engine request if it is still running


def _error_of(error: Exception) -> tuple[int, str]:
    if isinstance(error, RequestError):
        return error.status_code, anthropic.naming_field(error.message, error.param)
    if isinstance(error, ValueError):
        return 400, str(error)
    if isinstance(error, EngineDeadError):  # shut down (or the engine stopped): expected
        return 503, str(error)
    logger.exception("stream failed", exc_info=error)  # the details: in the log only
    return 500, f"internal error: {type(error).__name__}"


def _stop_reason(body, c: CompletionOutput, made_calls: bool) -> tuple[str, str | None]:
    if made_calls:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str) and c.stop_reason in (body.stop_sequences or ()):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _usage(jobs: list[Job], c: CompletionOutput) -> anthropic.Usage:
    return anthropic.Usage(
        input_tokens=len(jobs[0].prompt_token_ids), output_tokens=len(c.token_ids)
    )


# ------------------------------------------------------------------- errors


def anthropic_error(status: int, body: bytes) -> bytes:
    """An error body in OpenAI's shape in Anthropic's (others unchanged)."""
    try:
        reshaped = anthropic.error_body(status, json.loads(body))
    except ValueError:
        return body
    return body if reshaped is None else json.dumps(reshaped).encode()


class AnthropicErrors:
    """ASGI middleware, outermost: an error response of the Messages routes, whichever
    layer made it (security checks, drain, body limits, the routes), in Anthropic's
    shape. The other routes' answers pass untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not anthropic.is_messages_path(scope["path"]):
            return await self.app(scope, receive, send)
        held: dict[str, Any] = {}  # an error's start, and its body so far

        async def reshaping_send(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held.update(start=message, body=b"")
                return
            if "start" not in held or message["type"] != "http.response.body":
                return await send(message)
            held["body"] += message.get("body", b"")
            if message.get("more_body", False) and len(held["body"]) <= _MAX_ERROR_BYTES:
                return
            await _send_error(send, held.pop("start"), held.pop("body"), message)

        await self.app(scope, receive, reshaping_send)


async def _send_error(send, start: dict, body: bytes, last: dict) -> None:
    more = last.get("more_body", False)
    if not more:
        body = anthropic_error(start["status"], body)
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
    if not more:
        headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": more})
