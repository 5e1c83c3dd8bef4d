"""The OpenAI-compatible HTTP server: `pyllm serve`.

    POST /v1/chat/completions, POST /v1/completions   (stream: true -> server-sent events)
    GET  /v1/models, GET /health, GET /metrics
    POST /tokenize, POST /detokenize, GET /version    (vLLM's)
    GET  /                                            (a chat page, chat_ui.py)

Before a route sees a request, connections.py bounds how long its client may take to
send it and how many are served at once, and security.py refuses what a cross-site page
would send (Content-Type, Origin, Host), bodies over the size limit and a wrong API key.
A request is parsed, checked, tokenized and validated against the engine in its
handler, before anything reaches the engine, so every client mistake is a 4xx in
OpenAI's error shape {"error": {"message", "type", "param", "code"}}. The engine runs
in its own thread (AsyncEngine); a handler only awaits its request's outputs. A client
that goes away (a dropped stream, a closed connection) has its request aborted, which
frees its KV blocks. On SIGTERM the server drains (_GracefulServer) and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pyllm import __version__
from pyllm.engine.async_engine import AsyncEngine, EngineDeadError
from pyllm.engine.outputs import CompletionOutput, RequestOutput
from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints.chat_ui import add_chat_ui
from pyllm.entrypoints.connections import (
    LIMIT_CONCURRENCY,
    READ_TIMEOUT_S,
    BodyTimeout,
    guarded_protocol,
)
from pyllm.entrypoints.harmony import HarmonyStream, speaks_harmony
from pyllm.entrypoints.harmony import parse as parse_harmony
from pyllm.entrypoints.metrics import ServerMetrics
from pyllm.entrypoints.openai_protocol import RequestError, error_body
from pyllm.entrypoints.security import (
    ApiKeyAuth,
    ContentLengthLimit,
    CrossSiteGuard,
    is_loopback,
    send_json,
)
from pyllm.entrypoints.tool_calls import (
    Call,
    call_id,
    may_be_hermes,
    parse_hermes,
    parse_named,
    parse_required,
)
from pyllm.sampling.params import SamplingParams

logger = logging.getLogger("pyllm")

# Far above any prompt that fits a context window, far below what would hurt the server.
MAX_REQUEST_BYTES = 4 * 2**20
# JSON cannot carry -inf: a logprob of -inf (a token masked out) is sent as this.
MIN_LOGPROB = -9999.0
# The engine settings a given request's output depends on, hashed into system_fingerprint.
FINGERPRINT_SETTINGS = ("model_path", "torch_dtype", "quantization", "torch_device", "kv_cache")
SHUTTING_DOWN = "the server is shutting down"
RETRY_AFTER_S = 5  # what a 503 during shutdown tells the client to wait
ABORT_GRACE_S = 5  # for streams to send their last event once the engine ends them


# ----------------------------------------------------------------- middleware


@dataclass
class DrainState:
    """HTTP requests in flight, and whether the server has begun to shut down."""

    draining: bool = False
    in_flight: int = 0


class _Drain:
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


# ------------------------------------------------------------- request parsing

_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|[\[\]-]")


def _param_of(loc: tuple) -> str | None:
    """'messages[0].role' from pydantic's ('messages', 0, 'role'); union tags dropped."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _TYPE_TAG.search(part):
            break  # the name of a union member, not a field
        else:
            param += f".{part}" if param else part
    return param or None


def _describe(error: ValidationError) -> RequestError:
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {first['msg']}")
    param = _param_of(first["loc"])
    message = first["msg"]
    if first["type"] != "missing":
        message += f" (got {repr(first.get('input'))[:80]})"
    return RequestError(f"{param}: {message}" if param else message, param)


async def _read_request(request: Request, model: type[BaseModel], max_bytes: int):
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
        raise _describe(error) from None


# ------------------------------------------------------------------ responses


def _sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def _finite(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB


@dataclass
class _Choice:
    """How much of one choice's output has been sent so far (streaming)."""

    text_sent: int = 0
    tokens_sent: int = 0
    done: bool = False


@dataclass
class _Job:
    """One engine request: a prompt and its sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str = ""
    priority: int = 0
    group: str | None = None  # the HTTP request: its prompts share the engine fairly


@dataclass
class _Progress:
    """Times and counts of a (possibly multi-prompt) request, for usage and metrics."""

    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    finals: dict[int, RequestOutput] = field(default_factory=dict)


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into responses."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        metrics: ServerMetrics,
        max_bytes: int,
        max_seqs: int = api.MAX_SEQS_PER_REQUEST,
    ):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.max_seqs = max_seqs
        self.fingerprint = system_fingerprint(getattr(engine.engine, "config", None))
        self.metrics = metrics
        self.max_bytes = max_bytes
        self._token_strings: dict[int, str] = {}
        self._byte_decoder = _byte_level_decoder(self.tokenizer)
        # gpt-oss: replies in channels, read out of text decoded with its markers kept.
        self.harmony = speaks_harmony(self.tokenizer)

    # ---------------------------------------------------------- checking

    def _check_model(self, requested: str | None) -> None:
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
        try:
            if params.structured_output is None:
                self.engine.validate(ids, params)
            else:  # compiles the grammar (cached): off the event loop
                await asyncio.to_thread(self.engine.validate, ids, params)
        except ValueError as error:
            message = str(error)
            max_tokens_name, max_tokens = body._max_tokens_field()
            name = getattr(error, "param", None)
            param = body._param_of(name, max_tokens_name) or prompt_field
            if name and name != param and message.startswith(name):
                message = param + message[len(name) :]  # in the request's own terms
            code = getattr(error, "code", None)
            if "context length" in message:
                code = "context_length_exceeded"
                # The prompt fits alone: what the client asked for on top is too much.
                fits = len(ids) < self.engine.max_model_len
                param = max_tokens_name if fits and max_tokens is not None else prompt_field
            raise RequestError(message, param, code=code) from None

    async def _prepare_chat(self, body: api.ChatCompletionRequest) -> list[_Job]:
        body.check()
        self._check_model(body.model)
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
        return [_Job(api.random_id("chatcmpl"), ids, params, priority=body.priority)]

    async def _prepare_completion(self, body: api.CompletionRequest) -> list[_Job]:
        body.check()
        self._check_model(body.model)
        prompts = body.prompts()
        self._check_num_seqs(body, len(prompts))
        params = body.to_sampling_params()
        base_id = api.random_id("cmpl")
        jobs = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                ids = await asyncio.to_thread(self.tokenizer.encode, prompt)
                text = prompt
            else:
                ids, text = prompt, ""
            await self._validate(body, ids, params, "prompt")
            if body.echo and not text:
                text = self.tokenizer.decode(ids)
            jobs.append(_Job(f"{base_id}-{i}", ids, params, text, body.priority, base_id))
        return jobs

    # ---------------------------------------------------------- running

    def _generate(self, job: _Job) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(
            job.request_id, job.prompt_token_ids, job.params, job.priority, job.group
        )

    async def _outputs(self, jobs: list[_Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) of every job, as they come; aborts all on exit."""
        if len(jobs) == 1:
            job = jobs[0]
            async for output in self._generate(job):
                yield 0, output
            return
        # A bounded queue: a slow consumer makes the pumps wait, and the engine's
        # per-request streams keep only the newest output meanwhile.
        merged: asyncio.Queue = asyncio.Queue(maxsize=len(jobs))

        async def pump(index: int, job: _Job) -> None:
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

    def _track(self, progress: _Progress, index: int, output: RequestOutput) -> None:
        first = output.metrics.get("first_token_time") or None
        if first and progress.first_token_time is None:
            progress.first_token_time = first
        if output.finished:
            progress.finals[index] = output

    def _observe(self, progress: _Progress) -> None:
        outputs = [c for r in progress.finals.values() for c in r.outputs]
        self.metrics.observe_finished(
            progress.arrival_time,
            progress.first_token_time,
            time.time(),
            max((len(c.token_ids) for c in outputs), default=0),
            [c.finish_reason or "none" for c in outputs],
        )

    @staticmethod
    def _usage(progress: _Progress, jobs: list[_Job]) -> api.UsageInfo:
        prompt = sum(len(job.prompt_token_ids) for job in jobs)
        completion = sum(len(c.token_ids) for r in progress.finals.values() for c in r.outputs)
        return api.UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    async def _collect(self, request: Request, body, jobs: list[_Job], progress: _Progress) -> None:
        """Runs the jobs to the end; aborts them if the client disconnects first."""
        self.metrics.prompt_tokens.inc(sum(len(j.prompt_token_ids) for j in jobs))

        async def run() -> None:
            async for index, output in self._outputs(jobs):
                self._track(progress, index, output)
                _raise_failed(body, output)

        try:
            async with _cancel_on_disconnect(request):
                await run()
        except ValueError as error:  # the engine refused the request
            if isinstance(error, RequestError):
                raise
            raise RequestError(str(error)) from None
        self._observe(progress)

    # ---------------------------------------------------------- logprobs

    def _token_string(self, token_id: int) -> str:
        text = self._token_strings.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_strings[token_id] = text
        return text

    def _token_bytes(self, token_id: int) -> list[int]:
        if self._byte_decoder is not None:
            spelling = self.tokenizer.convert_ids_to_tokens([token_id])[0]
            if spelling is not None and all(ch in self._byte_decoder for ch in spelling):
                return [self._byte_decoder[ch] for ch in spelling]
        return list(self._token_string(token_id).encode("utf-8"))

    def _chat_logprobs(
        self, token_ids: list[int], logprobs: list[tuple[float, dict[int, float]]]
    ) -> api.ChatLogprobs:
        content = []
        for token_id, (chosen, top) in zip(token_ids, logprobs, strict=True):
            ranked = sorted(top.items(), key=lambda kv: -kv[1])
            content.append(
                api.ChatTokenLogprob(
                    token=self._token_string(token_id),
                    logprob=_finite(chosen),
                    bytes=self._token_bytes(token_id),
                    top_logprobs=[
                        api.TopLogprob(
                            token=self._token_string(t),
                            logprob=_finite(lp),
                            bytes=self._token_bytes(t),
                        )
                        for t, lp in ranked
                    ],
                )
            )
        return api.ChatLogprobs(content=content)

    def _completion_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[tuple[float, dict[int, float]]],
        text_offset: int,
    ) -> api.CompletionLogprobs:
        result = api.CompletionLogprobs()
        for token_id, (chosen, top) in zip(token_ids, logprobs, strict=True):
            token = self._token_string(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(_finite(chosen))
            ranked = sorted(top.items(), key=lambda kv: -kv[1])
            result.top_logprobs.append({self._token_string(t): _finite(lp) for t, lp in ranked})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    def _echo_logprobs(
        self,
        prompt_token_ids: list[int],
        prompt_logprobs: list[tuple[float, dict[int, float]] | None],
        k: int,
    ) -> api.CompletionLogprobs:
        """The prompt tokens in the legacy completions format (offsets from 0): no logprob
        for the first token, the top k for the others."""
        result = api.CompletionLogprobs()
        text_offset = 0
        for token_id, entry in zip(prompt_token_ids, prompt_logprobs, strict=True):
            token = self._token_string(token_id)
            result.tokens.append(token)
            result.text_offset.append(text_offset)
            text_offset += len(token)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            chosen, top = entry
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            result.token_logprobs.append(_finite(chosen))
            result.top_logprobs.append({self._token_string(t): _finite(lp) for t, lp in ranked})
        return result

    def _prompt_logprobs(
        self,
        prompt_token_ids: list[int],
        prompt_logprobs: list[tuple[float, dict[int, float]] | None],
        k: int,
    ) -> list[dict[int, api.PromptLogprob] | None]:
        """vLLM's prompt_logprobs: per token, the prompt token's logprob and the top k."""
        result: list[dict[int, api.PromptLogprob] | None] = []
        for token_id, entry in zip(prompt_token_ids, prompt_logprobs, strict=True):
            if entry is None:
                result.append(None)
                continue
            chosen, top = entry
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k]
            rank_of = {t: rank for rank, (t, _) in enumerate(ranked, start=1)}
            found = {
                t: api.PromptLogprob(
                    logprob=_finite(lp), rank=rank_of[t], decoded_token=self._token_string(t)
                )
                for t, lp in ranked
            }
            found[token_id] = api.PromptLogprob(
                logprob=_finite(chosen),
                rank=rank_of.get(token_id),
                decoded_token=self._token_string(token_id),
            )
            result.append(found)
        return result

    # ---------------------------------------------------------- tokenizer

    async def tokenize(self, request: Request) -> api.TokenizeResponse:
        body = await _read_request(request, api.TokenizeRequest, self.max_bytes)
        body.check()
        self._check_model(body.model)
        if body.messages is not None:
            messages = body.template_messages()
            try:
                text = await asyncio.to_thread(
                    self.tokenizer.apply_chat_template,
                    messages,
                    add_generation_prompt=body.add_generation_prompt,
                )
            except Exception as error:  # the template refused these messages
                raise RequestError(f"messages could not be rendered: {error}", "messages") from None
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = await asyncio.to_thread(self.tokenizer.encode, text, special)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return api.TokenizeResponse(
            count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, request: Request) -> api.DetokenizeResponse:
        body = await _read_request(request, api.DetokenizeRequest, self.max_bytes)
        self._check_model(body.model)
        try:
            text = await asyncio.to_thread(self.tokenizer.decode, body.tokens)
        except ValueError as error:  # an id outside the vocabulary
            raise RequestError(str(error), "tokens") from None
        return api.DetokenizeResponse(prompt=text)

    # ---------------------------------------------------------- chat

    async def chat(self, request: Request) -> Response:
        progress = _Progress()  # arrival: before parsing and tokenizing
        body = await _read_request(request, api.ChatCompletionRequest, self.max_bytes)
        jobs = await self._prepare_chat(body)
        created = api.now()
        if body.stream:
            return _event_stream(self._chat_stream(body, jobs, created, progress))
        await self._collect(request, body, jobs, progress)
        choices = []
        for c in progress.finals[0].outputs:
            logprobs = None
            if body.logprobs:
                logprobs = self._chat_logprobs(c.token_ids, c.logprobs or [])
            reasoning = None
            if self.harmony:
                reasoning, content, calls = _harmony_parts(body, c)
            else:
                content, calls = _tool_calls(body, c)
            tool_calls = [_api_call(call) for call in calls] or None
            message = api.AssistantMessage(
                content=content, tool_calls=tool_calls, reasoning_content=reasoning
            )
            choices.append(
                api.ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason="tool_calls" if calls else c.finish_reason,
                )
            )
        response = api.ChatCompletionResponse(
            id=jobs[0].request_id,
            created=created,
            model=self.model_name,
            system_fingerprint=self.fingerprint,
            choices=choices,
            usage=self._usage(progress, jobs),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    def _chat_stream(
        self,
        body: api.ChatCompletionRequest,
        jobs: list[_Job],
        created: int,
        progress: _Progress,
    ) -> AsyncIterator[str]:
        streaming: set[int] = set()  # choices sending content although tools were offered
        channels: dict[int, HarmonyStream] = {}  # harmony: what each choice has sent

        def choice(
            index: int, c: CompletionOutput, text: str, token_ids: list[int], logprobs, offset: int
        ) -> api.ChatChunkChoice | None:
            if self.harmony:
                stream = channels.setdefault(c.index, HarmonyStream())
                return _harmony_chunk(body, c, stream.delta(c.text))
            if body.tool_mode != "none" and c.index not in streaming:
                # Held back while it may be a tool call, which is sent whole at the end.
                if c.finish_reason is None:
                    if body.tool_mode != "auto" or may_be_hermes(c.text):
                        return None
                else:
                    _, calls = _tool_calls(body, c)
                    if calls:
                        delta = [_api_call(call, i) for i, call in enumerate(calls)]
                        return api.ChatChunkChoice(
                            index=c.index,
                            delta=api.DeltaMessage(tool_calls=delta),
                            finish_reason="tool_calls",
                        )
                text = c.text  # plain content after all: all of it so far
                streaming.add(c.index)
            return api.ChatChunkChoice(
                index=c.index,
                delta=api.DeltaMessage(content=text),
                logprobs=self._chat_logprobs(token_ids, logprobs) if body.logprobs else None,
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

    # ---------------------------------------------------------- completions

    async def completions(self, request: Request) -> Response:
        progress = _Progress()  # arrival: before parsing and tokenizing
        body = await _read_request(request, api.CompletionRequest, self.max_bytes)
        jobs = await self._prepare_completion(body)
        created = api.now()
        if body.stream:
            return _event_stream(self._completion_stream(body, jobs, created, progress))
        await self._collect(request, body, jobs, progress)
        choices = []
        for index, job in enumerate(jobs):
            prefix = job.prompt_text if body.echo else ""
            final = progress.finals[index]
            prompt_lps = final.prompt_logprobs
            for c in final.outputs:
                choices.append(
                    api.CompletionChoice(
                        index=index * body.n + c.index,
                        text=prefix + c.text,
                        logprobs=self._choice_logprobs(body, job, prompt_lps, c, len(prefix)),
                        finish_reason=c.finish_reason,
                        prompt_logprobs=None
                        if body.prompt_logprobs is None
                        else self._prompt_logprobs(
                            job.prompt_token_ids, prompt_lps, body.prompt_logprobs
                        ),
                    )
                )
        response = api.CompletionResponse(
            id=jobs[0].request_id.rsplit("-", 1)[0],
            created=created,
            model=self.model_name,
            system_fingerprint=self.fingerprint,
            choices=choices,
            usage=self._usage(progress, jobs),
        )
        return Response(response.model_dump_json(), media_type="application/json")

    def _choice_logprobs(
        self,
        body: api.CompletionRequest,
        job: _Job,
        prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None,
        c: CompletionOutput,
        text_offset: int,
    ) -> api.CompletionLogprobs | None:
        """A whole choice's logprobs; with echo, the prompt's first, then the generated
        tokens' from text_offset (the echoed prompt's length)."""
        if body.echo_logprobs:
            logprobs = self._echo_logprobs(job.prompt_token_ids, prompt_logprobs, body.logprobs)
            generated = self._completion_logprobs(c.token_ids, c.logprobs or [], text_offset)
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, name).extend(getattr(generated, name))
            return logprobs
        if body.logprobs is not None:
            return self._completion_logprobs(c.token_ids, c.logprobs or [], 0)
        return None

    def _completion_stream(
        self,
        body: api.CompletionRequest,
        jobs: list[_Job],
        created: int,
        progress: _Progress,
    ) -> AsyncIterator[str]:
        def choice(
            index: int, c: CompletionOutput, text: str, token_ids: list[int], logprobs, offset: int
        ) -> api.CompletionChoice:
            return api.CompletionChoice(
                index=index * body.n + c.index,
                text=text,
                logprobs=self._completion_logprobs(token_ids, logprobs, offset)
                if body.logprobs is not None
                else None,
                finish_reason=c.finish_reason,
            )

        echoes = (
            api.CompletionChoice(
                index=i * body.n + k, text=jobs[i].prompt_text, logprobs=None, finish_reason=None
            )
            for i in range(len(jobs))
            for k in range(body.n)
        )
        opening = echoes if body.echo else ()
        response_id = jobs[0].request_id.rsplit("-", 1)[0]
        chunk = functools.partial(
            api.CompletionResponse,
            id=response_id,
            created=created,
            model=self.model_name,
            system_fingerprint=self.fingerprint,
        )
        return self._stream(body, jobs, progress, chunk, opening, choice)

    # ---------------------------------------------------------- streaming

    async def _stream(
        self,
        body: api.ChatCompletionRequest | api.CompletionRequest,
        jobs: list[_Job],
        progress: _Progress,
        chunk: Callable[..., BaseModel],
        opening: Iterable[BaseModel],
        choice: Callable[..., BaseModel],
    ) -> AsyncIterator[str]:
        """The server-sent events of a streamed request, each a chunk(choices=..., [usage=])
        of the API: the `opening` choices, then choice(prompt index, output, text, token
        ids, logprobs, text offset) per choice with news, then usage if asked, [DONE]."""
        self.metrics.prompt_tokens.inc(sum(len(j.prompt_token_ids) for j in jobs))
        state = {(i, k): _Choice() for i in range(len(jobs)) for k in range(body.n)}
        for first in opening:
            yield _sse(chunk(choices=[first]))
        async for index, output in self._outputs(jobs):
            self._track(progress, index, output)
            _raise_failed(body, output)
            for c in output.outputs:
                choice_state = state[(index, c.index)]
                offset = choice_state.text_sent
                delta = _delta(choice_state, c)
                made = None if delta is None else choice(index, c, *delta, offset)
                if made is not None:  # None: held back (a tool call in the making)
                    yield _sse(chunk(choices=[made]))
        self._observe(progress)
        if body.include_usage:
            yield _sse(chunk(choices=[], usage=self._usage(progress, jobs)))
        yield "data: [DONE]\n\n"


def _raise_failed(body, output: RequestOutput) -> None:
    """A choice the engine ended with an error (its grammar went past the limits while
    generating) fails the request: a 400, or the stream's last event."""
    for c in output.outputs:
        if c.finish_reason == "error":
            field = body.structured_field() or "structured_output"
            message = (c.error or "generation failed").replace("structured_output", field, 1)
            raise RequestError(message, field, code="grammar_too_complex")


def _delta(state: _Choice, c: CompletionOutput):
    """(new text, new token ids, their logprobs) of a choice since the last chunk, or
    None when there is nothing to send. Text and tokens advance separately: text that
    may still turn out to be part of a stop string is held back by the engine."""
    if state.done:
        return None
    text = c.text[state.text_sent :]
    token_ids = c.token_ids[state.tokens_sent :]
    if not text and not token_ids and c.finish_reason is None:
        return None
    logprobs = (c.logprobs or [])[state.tokens_sent : state.tokens_sent + len(token_ids)]
    state.text_sent = max(state.text_sent, len(c.text))
    state.tokens_sent += len(token_ids)
    state.done = c.finish_reason is not None
    return text, token_ids, logprobs


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


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    async def guarded() -> AsyncIterator[str]:
        # The status line is already sent: an error can only be reported in the stream.
        try:
            async for event in events:
                yield event
        except RequestError as error:
            yield _sse(error_body(error.message, error.type, error.param, error.code))
            yield "data: [DONE]\n\n"
        except ValueError as error:
            yield _sse(error_body(str(error), "invalid_request_error", None, None))
            yield "data: [DONE]\n\n"
        except EngineDeadError as error:  # shut down (or the engine stopped): expected
            yield _sse(error_body(str(error), "server_error", None, error.code))
            yield "data: [DONE]\n\n"
        except Exception as error:
            logger.exception("stream failed")  # the details: in the log, not to the client
            message = f"internal error: {type(error).__name__}"
            yield _sse(error_body(message, "server_error", None, None))
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()  # aborts the engine requests if they are still running

    return StreamingResponse(
        guarded(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@contextlib.asynccontextmanager
async def _cancel_on_disconnect(request: Request):
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


def system_fingerprint(config) -> str:
    """'pyllm-0.1.0-1a2b3c4d': the version and a hash of the engine settings, so a client
    can tell when outputs may differ for the same request (as with OpenAI's backends)."""
    settings = "\0".join(str(getattr(config, name, None)) for name in FINGERPRINT_SETTINGS)
    return f"pyllm-{__version__}-{hashlib.sha256(settings.encode()).hexdigest()[:8]}"


def _byte_level_decoder(tokenizer) -> dict[str, int] | None:
    """GPT-2's map from a byte-level BPE token's characters back to bytes, if the
    vocabulary is byte-level (a space is spelled 'Ġ'); else None."""
    try:
        spelling = tokenizer.convert_ids_to_tokens(tokenizer.encode(" ", add_special_tokens=False))
    except Exception:
        return None
    if spelling != ["Ġ"]:
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    decoder, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            decoder[chr(256 + extra)] = b
            extra += 1
    return decoder


# ---------------------------------------------------------------------- app


def create_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    allowed_origins: list[str] | None = None,
    max_seqs_per_request: int = api.MAX_SEQS_PER_REQUEST,
    ui: bool = True,
    allowed_hosts: list[str] | None = None,
    check_host: bool = True,
    read_timeout: float = READ_TIMEOUT_S,
) -> FastAPI:
    """The FastAPI app over a (started or not) AsyncEngine; its lifespan starts and
    stops the engine thread. `allowed_origins`: the browser origins besides its own
    allowed to call it (["*"]: any), with CORS headers; others get 403.
    `allowed_hosts`: Host names besides loopback ones it answers to, when `check_host`
    (it listens on loopback only; security.CrossSiteGuard). `max_seqs_per_request`: the
    most sequences (prompts x n, or best_of if larger) one request may ask for. `ui`:
    serve the chat page at /. `read_timeout`: seconds a request's body may take to
    arrive (its headers: connections.guarded_protocol, in run_server)."""
    if max_seqs_per_request < 1:
        raise ValueError(f"max_seqs_per_request must be positive, got {max_seqs_per_request}")
    app = FastAPI(title="pyllm", lifespan=_lifespan(engine), docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine, served_model_name)
    serving = OpenAIServing(
        engine, served_model_name, metrics, max_request_bytes, max_seqs_per_request
    )
    app.state.serving = serving
    app.state.drain = DrainState()
    _add_error_handlers(app)
    _add_status_routes(app, engine, metrics)
    _add_api_routes(app, serving)
    if ui:
        add_chat_ui(app)
    _add_openapi_schemas(app)
    # Outermost last: the size check runs before authentication reads anything.
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.add_middleware(ContentLengthLimit, max_bytes=max_request_bytes)
    app.add_middleware(_Drain, state=app.state.drain)
    app.add_middleware(BodyTimeout, timeout=read_timeout)
    app.add_middleware(
        CrossSiteGuard,
        allowed_origins=allowed_origins or (),
        allowed_hosts=allowed_hosts or (),
        check_host=check_host,
    )
    if allowed_origins:
        # Outermost: a preflight carries no API key, and a page must read errors too.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
        )
    return app


def _lifespan(engine: AsyncEngine):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_running:
            engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape."""

    @app.exception_handler(RequestError)
    async def request_error(_: Request, error: RequestError):
        return JSONResponse(
            error_body(error.message, error.type, error.param, error.code),
            status_code=error.status_code,
        )

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException):
        body = error_body(str(error.detail), "invalid_request_error", None, None)
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError):
        body = error_body(str(error), "server_error", None, error.code)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception):
        logger.exception("request failed")
        body = error_body(f"internal error: {type(error).__name__}", "server_error", None, None)
        return JSONResponse(body, status_code=500)


# What each error status means, for the OpenAPI document.
_ERRORS = {
    400: "An invalid request; error.param names the field at fault",
    401: "A missing or wrong API key (when the server has one)",
    403: "An Origin that is not the server's own nor allowed (code origin_not_allowed)",
    404: "An unknown model (code model_not_found)",
    408: "A request body not received within the read timeout (code request_timeout)",
    413: "A request body over the size limit",
    415: "A request body that is not application/json (code unsupported_media_type)",
    421: "A Host that is not a loopback name nor allowed (code host_not_allowed)",
    503: "The server is busy, shutting down, or its engine has stopped",
}
_ANY = (403, 421, 503)  # what any route may answer (security.py, the drain)
_WITH_BODY = (400, 401, 404, 408, 413, 415, *_ANY)  # what a POST route may answer
_STREAM_DOC = "With stream: true, server-sent events: 'data: <{}>' each, then 'data: [DONE]'"


def _responses(ok: type[BaseModel], *errors: int, chunk: type[BaseModel] | None = None):
    """The `responses` of a route for the OpenAPI document: `ok` as the 200 body (and
    server-sent `chunk`s, if it streams), and the errors, each in OpenAI's shape."""
    responses: dict = {
        status: {"model": api.ErrorResponse, "description": _ERRORS[status]} for status in errors
    }
    responses[200] = {"model": ok, "description": "Successful Response"}
    if chunk is not None:
        schema = {"type": "string", "description": _STREAM_DOC.format(chunk.__name__)}
        responses[200]["content"] = {"text/event-stream": {"schema": schema}}
    return responses


def _json_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` declaring a JSON request body: the handler reads and checks it
    itself (bounded in size, errors in OpenAI's shape), so FastAPI must not."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _add_openapi_schemas(app: FastAPI) -> None:
    """Adds the request bodies (and stream chunks), which no route declares as a
    parameter, to the document's components."""
    generate = app.openapi
    models = [
        (api.ChatCompletionRequest, "validation"),
        (api.CompletionRequest, "validation"),
        (api.ChatCompletionChunk, "serialization"),
        (api.TokenizeRequest, "validation"),
        (api.DetokenizeRequest, "validation"),
    ]

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = generate()
            _, schemas = models_json_schema(models, ref_template="#/components/schemas/{model}")
            components = document.setdefault("components", {}).setdefault("schemas", {})
            components.update(schemas["$defs"])
            _drop_422(document)
        return app.openapi_schema

    app.openapi = openapi


def _drop_422(document: dict) -> None:
    """FastAPI documents a 422 for every route with a parameter; the only one here is a
    path string, which nothing refuses, and the server's own errors are never 422."""
    for operations in document["paths"].values():
        for operation in operations.values():
            operation["responses"].pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        document["components"]["schemas"].pop(name, None)


def _add_status_routes(app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics) -> None:
    health_503 = {"model": api.HealthStatus, "description": _ERRORS[503]}

    @app.get("/health", responses={200: {"model": api.HealthStatus}, 503: health_503})
    async def health():
        if not engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)


def _add_api_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """The /v1/ routes."""
    created = api.now()

    def model_card() -> api.ModelCard:
        return api.ModelCard(
            id=serving.model_name, created=created, max_model_len=serving.engine.max_model_len
        )

    @app.get("/v1/models", responses=_responses(api.ModelList, 401, *_ANY))
    async def list_models():
        return Response(
            api.ModelList(data=[model_card()]).model_dump_json(), media_type="application/json"
        )

    @app.get("/v1/models/{model_id:path}", responses=_responses(api.ModelCard, 401, 404, *_ANY))
    async def get_model(model_id: str):
        serving._check_model(model_id)
        return Response(model_card().model_dump_json(), media_type="application/json")

    @app.post(
        "/tokenize",
        openapi_extra=_json_body(api.TokenizeRequest),
        responses=_responses(api.TokenizeResponse, *_WITH_BODY),
    )
    async def tokenize(request: Request):
        response = await serving.tokenize(request)
        return Response(response.model_dump_json(), media_type="application/json")

    @app.post(
        "/detokenize",
        openapi_extra=_json_body(api.DetokenizeRequest),
        responses=_responses(api.DetokenizeResponse, *_WITH_BODY),
    )
    async def detokenize(request: Request):
        response = await serving.detokenize(request)
        return Response(response.model_dump_json(), media_type="application/json")

    @app.get("/version", responses=_responses(api.VersionResponse, *_ANY))
    async def version():
        return api.VersionResponse(version=__version__)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=_json_body(api.ChatCompletionRequest),
        responses=_responses(
            api.ChatCompletionResponse, *_WITH_BODY, chunk=api.ChatCompletionChunk
        ),
    )
    async def chat_completions(request: Request):
        return await serving.chat(request)

    @app.post(
        "/v1/completions",
        openapi_extra=_json_body(api.CompletionRequest),
        responses=_responses(api.CompletionResponse, *_WITH_BODY, chunk=api.CompletionResponse),
    )
    async def completions(request: Request):
        return await serving.completions(request)


def default_model_name(model_path: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1' for .../SmolLM2-135M-Instruct.Q4_1.gguf."""
    name = os.path.basename(os.path.normpath(model_path))
    return name.removesuffix(".gguf")


class _GracefulServer(uvicorn.Server):
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


def run_server(
    engine_options: dict,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    allowed_origins: list[str] | None = None,
    max_seqs_per_request: int = api.MAX_SEQS_PER_REQUEST,
    shutdown_timeout: float = 30.0,
    ui: bool = True,
    allowed_hosts: list[str] | None = None,
    read_timeout: float = READ_TIMEOUT_S,
    limit_concurrency: int | None = LIMIT_CONCURRENCY,
) -> int:
    """Loads the engine, then serves until SIGINT/SIGTERM, draining as _GracefulServer
    says; returns the exit code: 0, or 1 if the engine failed for good (a lost
    tensor-parallel rank)."""
    import prometheus_client

    from pyllm.engine.config import EngineConfig
    from pyllm.engine.llm_engine import LLMEngine

    if not shutdown_timeout >= 0:
        raise ValueError(f"shutdown_timeout must be >= 0, got {shutdown_timeout}")
    if not read_timeout > 0:
        raise ValueError(f"read_timeout must be positive, got {read_timeout}")
    if limit_concurrency is not None and limit_concurrency < 1:
        raise ValueError(f"limit_concurrency must be positive, got {limit_concurrency}")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    prometheus_client.disable_created_metrics()  # no *_created series: this process is ours
    config = EngineConfig(**engine_options)
    engine = AsyncEngine(LLMEngine(config))
    name = served_model_name or default_model_name(config.model_path)
    app = create_app(
        engine,
        name,
        api_key=api_key,
        allowed_origins=allowed_origins,
        max_seqs_per_request=max_seqs_per_request,
        ui=ui,
        allowed_hosts=allowed_hosts,
        check_host=is_loopback(host),
        read_timeout=read_timeout,
    )
    logger.info("serving %r on http://%s:%d (api key %s)", name, host, port,
                "required" if api_key else "off")  # fmt: skip
    if ui:
        logger.info("chat page: http://%s:%d/", host, port)
    server_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=ABORT_GRACE_S,
        http=guarded_protocol(read_timeout),
        limit_concurrency=limit_concurrency,
    )
    _GracefulServer(server_config, engine, app.state.drain, shutdown_timeout).run()
    return 1 if engine.fatal_error else 0
