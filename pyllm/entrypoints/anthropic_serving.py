"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, served as
the chat route serves its equivalent chat request (anthropic_protocol.py), replies as
text and tool_use blocks, whole or as Anthropic's stream of events; and
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
from pyllm.entrypoints.openai_protocol import RequestError
from pyllm.entrypoints.request_io import read_request
from pyllm.entrypoints.serving import Job, Progress, _raise_failed
from pyllm.entrypoints.serving_chat import ChatServing
from pyllm.entrypoints.tool_calls import may_be_hermes

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

        def tokenize() -> list[int]:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tools=tools
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
        stop_reason, stop_sequence = _stop_reason(body, c, content)
        return anthropic.MessagesResponse(
            id=jobs[0].request_id,
            model=self.model_name,
            content=content,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=_usage(jobs, c),
        )

    def _content(self, body: anthropic.MessagesRequest, c: CompletionOutput) -> list:
        """A finished reply's blocks: its text, then its tool calls (as the chat route
        reads them out of the text, under its tool_choice)."""
        message = self._choice(body.chat(), c).message
        content: list = []
        if message.content:
            content.append(anthropic.TextContent(text=message.content))
        for call in message.tool_calls or ():
            arguments = json.loads(call.function.arguments)
            if not isinstance(arguments, dict):  # a schema that is not an object's
                arguments = {"value": arguments}
            content.append(
                anthropic.ToolUseContent(
                    id=f"toolu_{uuid.uuid4().hex[:24]}", name=call.function.name, input=arguments
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
        message_stop. Text streams as it comes; a reply that may be a tool call (tools
        offered) is held back and sent whole at its end, as on the chat route."""
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
        blocks = _Blocks(live=chat.tool_mode == "none" and not self.harmony)
        async for index, output in self._outputs(jobs):
            self._track(progress, index, output)
            _raise_failed(chat, output)
            c = output.outputs[0]
            if not blocks.live and chat.tool_mode == "auto" and not self.harmony:
                blocks.live = not may_be_hermes(c.text)
            for sent in blocks.text_so_far(c) if blocks.live else ():
                yield sent
            if c.finish_reason is not None:
                for sent in self._ending(body, jobs, c, blocks):
                    yield sent
        self._observe(progress)

    def _ending(self, body, jobs: list[Job], c: CompletionOutput, blocks: _Blocks) -> list[str]:
        """The events after a reply's last output: what was held back, then the end."""
        if blocks.live:
            content = [anthropic.TextContent(text=c.text)] if c.text else []
            events = blocks.close()
        else:
            content = self._content(body, c)
            events = [e for block in content for e in blocks.whole(block)]
        stop_reason, stop_sequence = _stop_reason(body, c, content)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = {"output_tokens": len(c.token_ids)}
        events.append(event("message_delta", {"delta": delta, "usage": usage}))
        events.append(event("message_stop", {}))
        return events


class _Blocks:
    """The content blocks a stream has sent: their count, and an open text block."""

    def __init__(self, live: bool):
        self.live = live  # text is sent as it comes
        self.count = 0
        self.text_open = False
        self.sent = 0  # characters of text sent

    def text_so_far(self, c: CompletionOutput) -> list[str]:
        text = c.text[self.sent :]
        if not text:
            return []
        self.sent = max(self.sent, len(c.text))
        events = []
        if not self.text_open:
            events.append(self._start({"type": "text", "text": ""}))
            self.text_open = True
        events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def close(self) -> list[str]:
        if not self.text_open:
            return []
        self.text_open = False
        self.count += 1
        return [event("content_block_stop", {"index": self.count - 1})]

    def whole(self, block) -> list[str]:
        """A block's events, all of it in one delta."""
        if isinstance(block, anthropic.TextContent):
            events = [self._start({"type": "text", "text": ""})]
            events.append(self._delta({"type": "text_delta", "text": block.text}))
        else:
            events = [self._start({**block.model_dump(), "input": {}})]
            partial = json.dumps(block.input, ensure_ascii=False)
            events.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
        self.text_open = True  # open, whichever kind: close() ends it
        return events + self.close()

    def _start(self, block: dict) -> str:
        return event("content_block_start", {"index": self.count, "content_block": block})

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.count, "delta": delta})


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


def _stop_reason(body, c: CompletionOutput, content: list) -> tuple[str, str | None]:
    if any(isinstance(block, anthropic.ToolUseContent) for block in content):
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
