"""The engine behind an asyncio server: LLMEngine's step loop in one background thread.

    engine = AsyncEngine(LLMEngine(config)); engine.start()
    async for output in engine.generate(request_id, prompt_token_ids, params): ...

Only the engine thread touches LLMEngine's mutable state (add, step, abort). Requests
reach it through a thread-safe command queue; each step's outputs go back to the event
loop of the request's caller with `loop.call_soon_threadsafe`. The HTTP side therefore
never waits on the model, and the model never waits on a slow client: a RequestOutput
is cumulative (all text and tokens so far), so a stream keeps only the newest one
rather than a backlog.

Nothing a request does can stop the loop: a request the engine refuses fails alone,
and if a step raises, the requests in flight fail with the error and the loop goes on.
Only a lost tensor-parallel rank (WorkerLostError) ends it: every request fails, new
ones are refused (EngineDeadError), and `fatal_error` says why.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pyllm.distributed.parallel import WorkerLostError
from pyllm.engine.outputs import RequestOutput
from pyllm.engine.pooling import PoolingParams
from pyllm.sampling.params import SamplingParams

logger = logging.getLogger("pyllm")

_IDLE_POLL_S = 0.5  # how often an idle engine thread checks whether it should stop


# What a client is told when a rank is lost; the rank's own error (a gloo source path,
# an internal port) goes to the log only.
WORKER_LOST = "tensor-parallel engine stopped: a rank was lost (the server log says why)"


class EngineDeadError(RuntimeError):
    """The engine thread is not running: no request can be served. `code`: why, for a
    client (server_shutting_down, engine_stopped, engine_failed)."""

    def __init__(self, message: str, code: str = "engine_stopped") -> None:
        super().__init__(message)
        self.code = code


class _RequestStream:
    """The newest output of one request, handed from the engine thread to its event loop.

    `put` runs on the event loop (through call_soon_threadsafe), so no lock is needed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self._latest, BaseException):
            return  # an error is final
        self._latest = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        return item


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    stream: _RequestStream
    priority: int = 0
    group: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    reason: str


_STOP = object()


class AsyncEngine:
    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._closing: EngineDeadError | None = None  # why new requests are refused, once set
        self.fatal_error: str | None = None  # set when the engine can no longer run
        # Each counter has one writer (the event loop, the engine thread), so no lock.
        self._num_submitted = 0
        self._num_taken = 0

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._thread = threading.Thread(target=self._run, name="pyllm-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)
        close = getattr(self.engine, "close", None)  # stops tensor-parallel ranks
        if close is not None:
            close()

    def stats(self):
        """The engine's snapshot (LLMEngine.stats: an EngineStats); requests submitted
        but not taken yet are num_pending, apart."""
        return self.engine.stats()

    @property
    def num_pending(self) -> int:
        """Requests submitted that the engine thread has not taken yet."""
        return max(0, self._num_submitted - self._num_taken)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------ requests

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams):
        """Raises ValueError (naming the field) if the engine would refuse the request.

        Reads only what never changes after start-up (vocabulary, context length, cache
        size), so it is safe to call from the event loop while the engine thread steps.
        """
        self.engine.validate(prompt_token_ids, params)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        group: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's cumulative outputs, the last one with finished=True (an
        embedding request, PoolingParams: one EmbeddingRequestOutput).
        priority and group as in LLMEngine.add_request.

        If the caller stops iterating early (a client disconnected, a task was
        cancelled), the request is aborted and its KV blocks freed.
        """
        if self._closing is not None:
            raise EngineDeadError(str(self._closing), self._closing.code)
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        stream = _RequestStream(asyncio.get_running_loop())
        self._num_submitted += 1
        command = _Add(request_id, list(prompt_token_ids), params, stream, priority, group)
        self._commands.put(command)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped it
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def abort_all(self, reason: str) -> None:
        """Ends every request, running or queued, with EngineDeadError(reason), and
        refuses new ones the same way: the last step of a graceful shutdown."""
        self._closing = EngineDeadError(reason, "server_shutting_down")
        self._commands.put(_AbortAll(reason))

    # --------------------------------------------------------- engine thread

    def _run(self) -> None:
        logger.info("pyllm engine loop started")
        while True:
            idle = not self.engine.has_unfinished_requests()
            if not self._take_commands(block=idle):
                break
            if self.engine.has_unfinished_requests() and not self._step():
                break
        for request_id in list(self._streams):
            error = EngineDeadError("the server is shutting down", "server_shutting_down")
            self._fail(request_id, error)
        logger.info("pyllm engine loop stopped")

    def _take_commands(self, block: bool) -> bool:
        """Applies queued commands (waiting for one if `block`); False on stop."""
        while True:
            try:
                command = (
                    self._commands.get(timeout=_IDLE_POLL_S)
                    if block
                    else (self._commands.get_nowait())
                )
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                self._num_taken += 1
                self._add(command)
            elif isinstance(command, _AbortAll):
                for request_id in list(self._streams):
                    self._fail(request_id, EngineDeadError(command.reason, "server_shutting_down"))
            else:
                self._abort(command.request_id)

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(
                command.request_id,
                None,
                command.params,
                command.prompt_token_ids,
                command.priority,
                command.group,
            )
        except Exception as error:  # refused: this request fails, the loop goes on
            self._send(command.stream, error)
            return
        self._streams[command.request_id] = command.stream

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("aborting request %s failed", request_id)

    def _step(self) -> bool:
        """One engine step; False if the engine cannot run any more."""
        try:
            outputs = self.engine.step()
        except WorkerLostError as error:
            logger.error("%s", error)
            self.fatal_error = WORKER_LOST
            self._closing = EngineDeadError(WORKER_LOST, "engine_failed")
            for request_id in list(self.engine.requests):
                self._fail(request_id, EngineDeadError(WORKER_LOST, "engine_failed"))
            return False
        except Exception as error:
            # Which request caused it is unknown: fail all those in flight, keep going.
            logger.exception("engine step failed; failing %d requests", len(self._streams))
            for request_id in list(self.engine.requests):
                self._fail(request_id, RuntimeError(f"engine step failed: {error!r}"))
            return True
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if output.finished:
                self._streams.pop(output.request_id, None)
            if stream is not None and not self._send(stream, output):
                self._abort(output.request_id)
        return True

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        self._abort(request_id)
        if stream is not None:
            self._send(stream, error)

    @staticmethod
    def _send(stream: _RequestStream, item: RequestOutput | BaseException) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:  # the caller's event loop is closed
            return False
        return True
