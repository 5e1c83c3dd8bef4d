"""The server's life: the engine thread started and stopped with the app, and on
SIGTERM/SIGINT a drain (new requests get 503 while those in flight finish) before
uvicorn stops; an engine that failed for good stops the server too."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from pyllm.engine.async_engine import AsyncEngine
from pyllm.entrypoints.openai_protocol import error_body
from pyllm.entrypoints.security import send_json

logger = logging.getLogger("pyllm")

SHUTTING_DOWN = "the server is shutting down"
RETRY_AFTER_S = 5  # what a 503 during shutdown tells the client to wait
ABORT_GRACE_S = 5  # for streams to send their last event once the engine ends them


@dataclass
class DrainState:
    """HTTP requests in flight, and whether the server has begun to shut down."""

    draining: bool = False
    in_flight: int = 0


class Drain:
    """Counts the requests in flight; once draining, answers new ones with 503 and
    Retry-After (a load balancer or client retries elsewhere, or after the restart).
    /metrics still answers, so the drain can be watched."""

    def __init__(self, app, state: DrainState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/metrics":
            return await self.app(scope, receive, send)
        if self.state.draining:
            headers = [(b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]
            if scope["path"] == "/health":
                return await send_json(send, 503, {"status": "shutting down"}, headers)
            body = error_body(SHUTTING_DOWN, "server_error", None, "server_shutting_down")
            return await send_json(send, 503, body, headers)
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


def engine_lifespan(engine: AsyncEngine):
    """The app's lifespan: starts the engine thread (unless running) and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_running:
            engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    return lifespan


class GracefulServer(uvicorn.Server):
    """uvicorn, draining on SIGTERM/SIGINT instead of closing open streams.

    On the first signal, new requests get 503 (the socket stays open to say so) while
    those in flight run on for up to `shutdown_timeout` seconds; then the engine ends
    what is left with an error, which each open stream sends as its last event before
    [DONE]; then uvicorn stops with no request running, and the process exits 0. A
    second signal skips the wait.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain: DrainState,
                 shutdown_timeout: float):  # fmt: skip
        super().__init__(config)
        self.engine = engine
        self.drain = drain
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry = False
        self._drainer: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        watcher = asyncio.create_task(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets is not None:  # uvicorn says where it listens only on sockets it bound
            self._log_started_message(sockets)

    async def _watch_engine(self) -> None:
        """An engine that failed for good ends the server (requests meanwhile get 503)."""
        while not self.engine.fatal_error:
            await asyncio.sleep(0.2)
        logger.error("stopping the server: %s", self.engine.fatal_error)
        self.should_exit = True

    def handle_exit(self, sig: int, frame) -> None:
        if self._loop is None or self.should_exit:
            return super().handle_exit(sig, frame)
        # A signal handler runs between two bytecodes of the loop's own thread.
        self._loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self._drainer is None:
            self.drain.draining = True
            self._drainer = asyncio.create_task(self._drain_then_exit())
        else:
            self._hurry = True

    async def _drain_then_exit(self) -> None:
        loop = asyncio.get_running_loop()
        logger.info(
            "shutting down: %d request(s) in flight may run for up to %g s; new ones "
            "get 503 (signal again to stop now)",
            self.drain.in_flight,
            self.shutdown_timeout,
        )
        deadline = loop.time() + self.shutdown_timeout
        while self.drain.in_flight and loop.time() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        if self.drain.in_flight:
            logger.info("shutdown: ending %d request(s) still running", self.drain.in_flight)
            self.engine.abort_all(SHUTTING_DOWN)
            deadline = loop.time() + ABORT_GRACE_S
            while self.drain.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True
