"""POST /v1/responses: OpenAI's Responses API, served as the chat route serves its
equivalent chat request (responses_protocol.py); replies as reasoning, message and
function_call output items, whole or as the API's typed stream of events; each reply
kept (responses_store.py) for a later request's previous_response_id and for GET and
DELETE /v1/responses/{id}."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pyllm.engine.outputs import CompletionOutput
from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints import responses_protocol as protocol
from pyllm.entrypoints.chat_reply import ReplyDelta, ReplyStream
from pyllm.entrypoints.harmony import HarmonyStream
from pyllm.entrypoints.responses_protocol import ResponsesRequest, responses_fields
from pyllm.entrypoints.responses_store import ResponseStore
from pyllm.entrypoints.serving import Job, Progress, _raise_failed
from pyllm.entrypoints.serving_chat import ChatServing
from pyllm.entrypoints.tool_stream import CallDelta


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesServing(ChatServing):
    """The Responses route over the chat route's machinery: a request is prepared, run,
    aborted on disconnect and counted in the metrics as its chat request would be."""

    def __init__(self, *args, store: ResponseStore | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.store = store or ResponseStore()

    async def responses(self, request: Request) -> Response:
        return await self._respond(request, ResponsesRequest)

    def retrieve(self, response_id: str) -> Response:
        """GET /v1/responses/{id}: the response object create returned."""
        return Response(self.store.response(response_id), media_type="application/json")

    def delete(self, response_id: str) -> protocol.DeletedResponse:
        """DELETE /v1/responses/{id}: forgets a stored response."""
        self.store.delete(response_id)
        return protocol.DeletedResponse(id=response_id)

    async def _prepare(self, body: ResponsesRequest) -> list[Job]:
        history = []
        if body.previous_response_id is not None:
            history = self.store.messages(body.previous_response_id)
        chat = body.chat(history)
        with responses_fields():
            jobs = await super()._prepare(chat)
        jobs[0].request_id = _id("resp")
        return jobs

    def _response(
        self, body: ResponsesRequest, jobs: list[Job], created: int, progress: Progress
    ) -> protocol.ResponseObject:
        c = progress.finals[0].outputs[0]
        reasoning, content, calls = self._parts(body, c)
        status = "incomplete" if c.finish_reason == "length" and not calls else "completed"
        output: list = []
        if reasoning:
            text = protocol.ReasoningText(text=reasoning)
            output.append(protocol.OutputReasoning(id=_id("rs"), content=[text], status=status))
        if content or not (calls or reasoning):
            text = protocol.OutputText(text=content or "")
            output.append(protocol.OutputMessage(id=_id("msg"), status=status, content=[text]))
        output += [_function_call(call, "completed") for call in calls]
        response = self._reply(body, jobs, created, progress, status, output)
        self._remember(body, response)
        return response

    def _parts(self, body: ResponsesRequest, c: CompletionOutput):
        """(reasoning, content, calls) of a finished reply, as the chat route reads it."""
        message = self._choice(body.chat(), c).message
        return message.reasoning_content, message.content, message.tool_calls or []

    def _reply(self, body, jobs, created, progress, status: str, output: list):
        """The response object; its usage once the reply is over."""
        usage = None
        if progress.finals:
            final = progress.finals[0]
            reasoning = "".join(
                part.text for item in output if item.type == "reasoning" for part in item.content
            )
            usage = _usage(
                final.num_cached_tokens, jobs[0], final.outputs[0], self._count(reasoning)
            )
        incomplete = protocol.IncompleteDetails(reason="max_output_tokens")
        return protocol.ResponseObject(
            id=jobs[0].request_id,
            created_at=created,
            status=status,
            incomplete_details=incomplete if status == "incomplete" else None,
            model=self.model_name,
            output=output,
            usage=usage,
            **body.echo(),
        )

    def _count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def _remember(self, body: ResponsesRequest, response: protocol.ResponseObject) -> None:
        """Keeps the conversation (less the instructions, which a later turn does not
        inherit) for a later previous_response_id."""
        if not body.store:
            return
        chat = body.chat()
        start = 0 if body.instructions is None else 1
        messages = [m.model_dump(exclude_none=True) for m in chat.messages[start:]]
        messages.append(_assistant_message(response.output))
        self.store.put(response.id, messages, response.model_dump_json())

    # ---------------------------------------------------------- streaming

    async def _events(
        self, body: ResponsesRequest, jobs: list[Job], created: int, progress: Progress
    ) -> AsyncIterator[str]:
        """response.created and .in_progress; per output item its added, content part,
        deltas and done events (a function call's name first, then its arguments as they
        are written); then response.completed (or .incomplete)."""
        chat = body.chat()
        self.metrics.prompt_tokens.inc(len(jobs[0].prompt_token_ids))
        events = _Events(self.reader.tools.new_id)
        snapshot = self._reply(body, jobs, created, progress, "in_progress", [])
        yield events.event("response.created", response=snapshot.model_dump())
        yield events.event("response.in_progress", response=snapshot.model_dump())
        reply = HarmonyStream() if self.harmony else ReplyStream(self.reader, chat)
        async for index, output in self._outputs(jobs):
            self._track(progress, index, output)
            _raise_failed(body, output)
            c = output.outputs[0]
            step = self._step(chat, reply, c)
            sent = events.text("reasoning", step.reasoning)
            sent += events.text("message", step.content or "")
            for call in step.calls:
                sent += events.call(call)
            if c.finish_reason is not None:
                sent += self._ending(body, jobs, created, progress, events, c, step.made_calls)
            for event in sent:
                yield event
        self._observe(progress)

    def _step(self, chat, reply, c: CompletionOutput) -> ReplyDelta:
        """What this step adds: reasoning, content, call deltas (a harmony reply's calls
        come whole at its end)."""
        if not self.harmony:
            return reply.step(c)
        reasoning, content = reply.delta(c.text)
        delta = ReplyDelta(reasoning, content)
        if c.finish_reason is not None:
            calls = self._harmony_parts(chat, c)[2]
            delta.calls = [CallDelta(i, call.name, call.arguments) for i, call in enumerate(calls)]
            delta.made_calls = bool(calls)
        return delta

    def _ending(self, body, jobs, created, progress, events: _Events, c, made_calls) -> list[str]:
        calls = made_calls or bool(events.calls)
        status = "incomplete" if c.finish_reason == "length" and not calls else "completed"
        if not calls and not events.items:
            sent = events.open_item("message")  # an empty reply is an empty message
        else:
            sent = []
        sent += events.close(status) + events.close_calls()
        response = self._reply(body, jobs, created, progress, status, events.items)
        self._remember(body, response)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return sent + [events.event(kind, response=response.model_dump())]


class _Events:
    """A stream's events: their sequence numbers, and the output items sent so far (the
    last one open while its text comes)."""

    PARTS = {
        "message": ("output_text", protocol.OutputText),
        "reasoning": ("reasoning_text", protocol.ReasoningText),
    }

    def __init__(self, new_call_id):
        self.new_call_id = new_call_id
        self.calls: dict[int, protocol.OutputFunctionCall] = {}  # by the call's index
        self.sequence_number = 0
        self.items: list = []
        self.open: Any = None  # the item whose text is streaming

    def event(self, kind: str, **data) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def text(self, kind: str, delta: str) -> list[str]:
        """A delta of the open item's text, opening a `kind` item first if needed."""
        if not delta:
            return []
        sent = [] if self.open is not None and self.open.type == kind else self.open_item(kind)
        self.open.content[0].text += delta
        extra = {"logprobs": []} if kind == "message" else {}
        name = self.PARTS[kind][0]
        return sent + [self.event(f"response.{name}.delta", **self._where(), delta=delta, **extra)]

    def open_item(self, kind: str) -> list[str]:
        sent = self.close("completed")
        if kind == "message":
            item = protocol.OutputMessage(id=_id("msg"), status="in_progress", content=[])
        else:
            item = protocol.OutputReasoning(id=_id("rs"), status="in_progress", content=[])
        self.items.append(item)
        self.open = item
        sent.append(self._item_event("response.output_item.added", item))
        part = self.PARTS[kind][1](text="")
        sent.append(
            self.event("response.content_part.added", **self._where(), part=part.model_dump())
        )
        item.content.append(part)
        return sent

    def close(self, status: str) -> list[str]:
        """The open item's done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        part = item.content[0]
        extra = {"logprobs": []} if item.type == "message" else {}
        where = {"item_id": item.id, "output_index": len(self.items) - 1, "content_index": 0}
        name = self.PARTS[item.type][0]
        item.status = status
        return [
            self.event(f"response.{name}.done", **where, text=part.text, **extra),
            self.event("response.content_part.done", **where, part=part.model_dump()),
            self._item_event("response.output_item.done", item),
        ]

    def call(self, call: CallDelta) -> list[str]:
        """A call's delta: its first opens a function_call item, the others add arguments."""
        sent = []
        if call.name is not None:
            sent = self.close("completed")
            item = protocol.OutputFunctionCall(
                id=_id("fc"), call_id=self.new_call_id(), name=call.name, arguments="",
                status="in_progress",
            )  # fmt: skip
            self.items.append(item)
            self.calls[call.index] = item
            sent.append(self._item_event("response.output_item.added", item))
        item = self.calls[call.index]
        if call.arguments:
            item.arguments += call.arguments
            where = {"item_id": item.id, "output_index": self.items.index(item)}
            sent.append(
                self.event("response.function_call_arguments.delta", **where, delta=call.arguments)
            )
        return sent

    def close_calls(self) -> list[str]:
        """Every call's done events, once the reply is over."""
        sent = []
        for item in self.calls.values():
            where = {"item_id": item.id, "output_index": self.items.index(item)}
            sent.append(
                self.event(
                    "response.function_call_arguments.done", **where, arguments=item.arguments
                )
            )
            item.status = "completed"
            sent.append(self._item_event("response.output_item.done", item))
        return sent

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open.id, "output_index": len(self.items) - 1, "content_index": 0}

    def _item_event(self, kind: str, item) -> str:
        return self.event(kind, output_index=self.items.index(item), item=item.model_dump())


def _function_call(call: api.ToolCall, status: str) -> protocol.OutputFunctionCall:
    function = call.function
    return protocol.OutputFunctionCall(
        id=_id("fc"),
        call_id=call.id,
        name=function.name,
        arguments=function.arguments,
        status=status,
    )


def _usage(cached: int, job: Job, c: CompletionOutput, reasoning_tokens: int):
    prompt, made = len(job.prompt_token_ids), len(c.token_ids)
    return protocol.ResponseUsage(
        input_tokens=prompt,
        input_tokens_details=protocol.InputTokensDetails(cached_tokens=cached),
        output_tokens=made,
        output_tokens_details=protocol.OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=prompt + made,
    )


def _assistant_message(output: list) -> dict[str, Any]:
    """A response's output as the assistant turn of a later request's chat."""
    text = "".join(p.text for item in output if item.type == "message" for p in item.content)
    calls = [
        {"id": item.call_id, "type": "function",
         "function": {"name": item.name, "arguments": item.arguments}}
        for item in output
        if item.type == "function_call"
    ]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message
