"""What chat and text completions share: a request's checks against this server and its
engine, running its prompts, and its usage, metrics and stream of events."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from pyllm import __version__
from pyllm.engine.async_engine import AsyncEngine
from pyllm.engine.outputs import CompletionOutput, RequestOutput
from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints.metrics import ServerMetrics
from pyllm.entrypoints.openai_protocol import RequestError
from pyllm.entrypoints.request_io import DONE, cancel_on_disconnect, event_stream, read_request, sse
from pyllm.entrypoints.response_logprobs import TokenText
from pyllm.entrypoints.server_config import ServerConfig
from pyllm.sampling.params import SamplingParams

# The engine settings a given request's output depends on, hashed into system_fingerprint.
FINGERPRINT_SETTINGS = ("model_path", "torch_dtype", "quantization", "torch_device", "kv_cache")


@dataclass
class Job:
    """One engine request: a prompt and its sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""
    priority: int = 0
    group: str | None = None  # the HTTP request: its prompts share the engine fairly


@dataclass
class Progress:
    """Times and counts of a (possibly multi-prompt) request, for usage and metrics."""

    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finals: dict[int, RequestOutput] = field(default_factory=dict)


@dataclass
class _Sent:
    """How much of one choice's output has been sent so far (streaming)."""

    text: int = 0
    tokens: int = 0
    done: bool = False


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into responses; one
    subclass per route family (serving_chat.py, serving_completion.py, serving_tokens.py)."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        metrics: ServerMetrics,
        max_bytes: int,
        max_seqs: int = ServerConfig.max_seqs_per_request,
    ):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_seqs = max_seqs
        self.fingerprint = system_fingerprint(getattr(engine.engine, "config", None))
        self.metrics = metrics
        self.max_bytes = max_bytes
        self.tokens = TokenText(self.tokenizer)

    # ---------------------------------------------------------- checking

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise RequestError(
                f"model {requested!r} does not exist; this server serves {self.model_name!r}",
                "model",
                status_code=404,  # as OpenAI: its clients raise NotFoundError
                code="model_not_found",
            )

    def _check_num_seqs(self, body, num_prompts: int) -> None:
        """Refuses more sequences than the limit, naming the field that asked for them."""
        best_of = getattr(body, "best_of", None) or 0
        per_prompt = max(body.n, best_of)
        if num_prompts * per_prompt <= self.max_seqs:
            return
        factor = "best_of" if best_of > body.n else "n"
        raise RequestError(
            f"prompts x {factor} must be at most {self.max_seqs} per request, "
            f"got {num_prompts} x {per_prompt}",
            "prompt" if num_prompts > self.max_seqs else factor,
        )

    async def _validate(self, body, ids: list[int], params: SamplingParams, prompt_field: str):
        """The engine's checks of one prompt, as a RequestError in the request's terms."""
        try:
            if params.structured_output is None:
                self.engine.validate(ids, params)
            else:  # compiles the grammar (cached): off the event loop
                await asyncio.to_thread(self.engine.validate, ids, params)
        except ValueError as error:
            fits = len(ids) < self.engine.max_model_len
            raise body.request_error(error, prompt_field, prompt_fits=fits) from None

    # ---------------------------------------------------------- running

    async def _respond(self, request: Request, model: type[BaseModel]) -> Response:
        """A request read as `model`, prepared into jobs (`_prepare`) and run: streamed
        as server-sent events (`_events`) if it asks, else one JSON body (`_response`)."""
        progress = Progress()  # arrival: before parsing and tokenizing
        body = await read_request(request, model, self.max_bytes)
        jobs = await self._prepare(body)
        created = api.now()
        if body.stream:
            return event_stream(self._events(body, jobs, created, progress))
        await self._collect(request, body, jobs, progress)
        response = self._response(body, jobs, created, progress)
        return Response(response.model_dump_json(), media_type="application/json")

    def _generate(self, job: Job) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(
            job.request_id, job.prompt_token_ids, job.params, job.priority, job.group
        )

    async def _outputs(self, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every job, as they come; aborts all on exit."""
        if len(jobs) == 1:
            async for output in self._generate(jobs[0]):
                yield 0, output
            return
        # A bounded queue: a slow consumer makes the pumps wait, and the engine's
        # per-request streams keep only the newest output meanwhile.
        merged: asyncio.Queue = asyncio.Queue(maxsize=len(jobs))

        async def pump(index: int, job: Job) -> None:
            try:
                async for output in self._generate(job):
                    await merged.put((index, output))
            except Exception as error:
                await merged.put((index, error))

        tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
        try:
            remaining = len(jobs)
            while remaining:
                index, item = await merged.get()
                if isinstance(item, Exception):
                    raise item
                remaining -= item.finished
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _track(self, progress: Progress, index: int, output: RequestOutput) -> None:
        first = output.metrics.get("first_token_time") or None
        if first and progress.first_token_time is None:
            progress.first_token_time = first
        if output.finished:
            progress.finals[index] = output

    def _observe(self, progress: Progress) -> None:
        outputs = [c for r in progress.finals.values() for c in r.outputs]
        self.metrics.observe_finished(
            progress.arrival_time,
            progress.first_token_time,
            time.time(),
            max((len(c.token_ids) for c in outputs), default=0),
            [c.finish_reason or "none" for c in outputs],
        )

    @staticmethod
    def _usage(progress: Progress, jobs: list[Job]) -> api.UsageInfo:
        prompt = sum(len(job.prompt_token_ids) for job in jobs)
        completion = sum(len(c.token_ids) for r in progress.finals.values() for c in r.outputs)
        return api.UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    async def _collect(self, request: Request, body, jobs: list[Job], progress: Progress) -> None:
        """Runs the jobs to the end; aborts them if the client disconnects first."""
        self.metrics.prompt_tokens.inc(sum(len(j.prompt_token_ids) for j in jobs))

        async def run() -> None:
            async for index, output in self._outputs(jobs):
                self._track(progress, index, output)
                _raise_failed(body, output)

        try:
            async with cancel_on_disconnect(request):
                await run()
        except ValueError as error:  # the engine refused the request
            if isinstance(error, RequestError):
                raise
            raise RequestError(str(error)) from None
        self._observe(progress)

    # ---------------------------------------------------------- streaming

    async def _stream(
        self,
        body: api.ChatCompletionRequest | api.CompletionRequest,
        jobs: list[Job],
        progress: Progress,
        chunk: Callable[..., BaseModel],
        opening: Iterable[BaseModel],
        choice: Callable[..., BaseModel | None],
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed request, each a chunk(choices=..., [usage=])
        of the API: the `opening` choices, then choice(prompt index, output, text, token
        ids, logprobs, text offset) per choice with news, then usage if asked, [DONE]."""
        self.metrics.prompt_tokens.inc(sum(len(j.prompt_token_ids) for j in jobs))
        sent = {(i, k): _Sent() for i in range(len(jobs)) for k in range(body.n)}
        for first in opening:
            yield sse(chunk(choices=[first]))
        async for index, output in self._outputs(jobs):
            self._track(progress, index, output)
            _raise_failed(body, output)
            for c in output.outputs:
                state = sent[(index, c.index)]
                offset = state.text
                delta = _delta(state, c)
                made = None if delta is None else choice(index, c, *delta, offset)
                if made is not None:  # None: held back (a tool call in the making)
                    yield sse(chunk(choices=[made]))
        self._observe(progress)
        if body.include_usage:
            yield sse(chunk(choices=[], usage=self._usage(progress, jobs)))
        yield DONE


def _raise_failed(body, output: RequestOutput) -> None:
    """A choice the engine ended with an error (its grammar went past the limits while
    generating) fails the request: a 400, or the stream's last event."""
    for c in output.outputs:
        if c.finish_reason == "error":
            field = body.structured_field() or "structured_output"
            message = (c.error or "generation failed").replace("structured_output", field, 1)
            raise RequestError(message, field, code="grammar_too_complex")


def _delta(state: _Sent, c: CompletionOutput):
    """(new text, new token ids, their logprobs) of a choice since the last chunk, or
    None when there is nothing to send. Text and tokens advance separately: text that
    may still turn out to be part of a stop string is held back by the engine."""
    if state.done:
        return None
    text = c.text[state.text :]
    token_ids = c.token_ids[state.tokens :]
    if not text and not token_ids and c.finish_reason is None:
        return None
    logprobs = (c.logprobs or [])[state.tokens : state.tokens + len(token_ids)]
    state.text = max(state.text, len(c.text))
    state.tokens += len(token_ids)
    state.done = c.finish_reason is not None
    return text, token_ids, logprobs


def system_fingerprint(config) -> str:
    """'pyllm-0.1.0-1a2b3c4d': the version and a hash of the engine settings, so a client
    can tell when outputs may differ for the same request (as with OpenAI's backends)."""
    settings = "\0".join(str(getattr(config, name, None)) for name in FINGERPRINT_SETTINGS)
    return f"pyllm-{__version__}-{hashlib.sha256(settings.encode()).hexdigest()[:8]}"
