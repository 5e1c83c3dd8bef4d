"""How long a client may take to send a request, and how many connections are served.

uvicorn waits for a request's bytes as long as its client likes: a request line sent
halfway, headers dripped a byte at a time, or a body that stops short each hold a
connection (and a file descriptor) for good. Here:

    guarded_protocol(read_timeout)  uvicorn's h11 protocol, closing a connection whose
                                    next request's headers are not complete within
                                    read_timeout (from its start, or from the end of the
                                    previous response), with a 408; and answering past
                                    uvicorn's limit_concurrency with a JSON 503
    BodyTimeout                     ASGI middleware: a body must arrive within
                                    read_timeout of its headers, else 408 and close
"""

from __future__ import annotations

import asyncio
import json
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from pyllm.entrypoints import anthropic_protocol as anthropic
from pyllm.entrypoints.openai_protocol import RequestError, error_body
from pyllm.entrypoints.security import send_json
from pyllm.entrypoints.server_config import ServerConfig

logger = logging.getLogger("pyllm")

READ_TIMEOUT_S = ServerConfig.read_timeout
_CLOSE = (b"connection", b"close")


def _timeout_response(read_timeout: float) -> bytes:
    """A whole 408 response, written on the socket as is (h11 is mid-request)."""
    message = f"the request was not received within {read_timeout:g} s"
    body = json.dumps(error_body(message, "invalid_request_error", None, "request_timeout"))
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n{body}".encode()
    )


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with the header deadline and a JSON 503; guarded_protocol sets its
    read_timeout."""

    read_timeout: float = READ_TIMEOUT_S
    timeout_response: bytes = _timeout_response(READ_TIMEOUT_S)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        # uvicorn's own check answers in plain text; the app wrapper does it in JSON.
        self.limit, self.limit_concurrency = self.limit_concurrency, None
        if self.limit is not None:
            self.app = _limited(self.app, self)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._follow()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _follow(self) -> None:
        """The deadline runs while the connection waits for a request's headers."""
        if self.transport.is_closing() or not self._waiting_for_headers():
            self._stop_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.read_timeout, self._expire)

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            logger.debug("closing %s: no request within %g s", self.client, self.read_timeout)
            self.transport.write(self.timeout_response)
            self.transport.close()


def guarded_protocol(read_timeout: float = READ_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's H11Protocol with the header deadline and a JSON 503 (module docstring):
    pass it as uvicorn.Config(http=...)."""
    timeouts = {"read_timeout": read_timeout, "timeout_response": _timeout_response(read_timeout)}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), timeouts)


def _limited(app, protocol: H11Protocol):
    """`app`, answering 503 while the server holds its limit of connections or
    requests (uvicorn's rule for limit_concurrency; this request's task is counted)."""
    limit = protocol.limit

    async def limited(scope, receive, send):
        busy = len(protocol.connections) >= limit or len(protocol.tasks) > limit
        if scope["type"] != "http" or not busy:
            return await app(scope, receive, send)
        logger.warning("refusing a request: %d connections open (--limit-concurrency)", limit)
        message = f"the server is serving its limit of {limit} connections; retry later"
        body = error_body(message, "server_error", None, "server_busy")
        if anthropic.is_messages_path(scope["path"]):  # its own shape, as its routes'
            body = anthropic.error_body(503, body)
        await send_json(send, 503, body, [(b"retry-after", b"1"), _CLOSE])

    return limited


class BodyTimeout:
    """A request's body must arrive within `timeout` seconds of its headers; else the
    route's read fails with 408 (request_timeout) and the connection is closed."""

    def __init__(self, app, timeout: float = READ_TIMEOUT_S):
        self.app, self.timeout = app, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        reading, timed_out = True, False

        async def timed_receive():
            nonlocal reading, timed_out
            if not reading:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                timed_out = True
                raise RequestError(
                    f"the request body was not received within {self.timeout:g} s",
                    status_code=408,
                    code="request_timeout",
                ) from None
            reading = message["type"] == "http.request" and message.get("more_body", False)
            return message

        async def closing_send(message):
            if timed_out and message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), _CLOSE]}
            await send(message)

        await self.app(scope, timed_receive, closing_send)
