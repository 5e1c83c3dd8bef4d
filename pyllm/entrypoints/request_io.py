"""Reading a request body into its model, and sending a stream of server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pyllm.engine.async_engine import EngineDeadError
from pyllm.entrypoints.openai_protocol import RequestError, error_body, invalid_body

logger = logging.getLogger("pyllm")

DONE = "data: [DONE]\n\n"


async def read_request(request: Request, model: type[BaseModel], max_bytes: int):
    """The body parsed as `model`; a RequestError if it is too large, not UTF-8 or
    not a valid `model`, or if the client leaves before sending it all."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise RequestError(
                    f"the request body is larger than {max_bytes} bytes",
                    status_code=413,
                    code="request_too_large",
                )
            chunks.append(chunk)
    except ClientDisconnect:  # an everyday event, not the server's error
        logger.debug("%s left before sending its whole request", request.client)
        raise RequestError("the client disconnected", status_code=499) from None
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(f"the request body is not valid UTF-8 (byte {error.start})") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as error:
        raise invalid_body(error) from None


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """The events as a text/event-stream response; an error raised while they are made
    becomes the stream's last event (the status line is already sent), then [DONE]."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as error:
            yield sse(_error_event(error))
            yield DONE
        finally:
            await events.aclose()  # aborts the engine requests if they are still running

    return StreamingResponse(
        guarded(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _error_event(error: Exception) -> dict:
    if isinstance(error, RequestError):
        return error_body(error.message, error.type, error.param, error.code)
    if isinstance(error, ValueError):
        return error_body(str(error), "invalid_request_error", None, None)
    if isinstance(error, EngineDeadError):  # shut down (or the engine stopped): expected
        return error_body(str(error), "server_error", None, error.code)
    logger.exception("stream failed", exc_info=error)  # the details: in the log only
    return error_body(f"internal error: {type(error).__name__}", "server_error", None, None)


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request):
    """Cancels the enclosed work if the client disconnects before it ends.

    After the body is read, the next ASGI message is http.disconnect: either the client
    left, or the response was sent. Waiting for it costs nothing.
    """
    work = asyncio.current_task()
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                work.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if disconnected:
            if hasattr(work, "uncancel"):  # Python 3.11+: our own cancel, now an error
                work.uncancel()
            raise RequestError("the client disconnected", status_code=499) from None
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
