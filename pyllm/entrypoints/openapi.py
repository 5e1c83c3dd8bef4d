"""The OpenAPI document (/openapi.json): each route's request body, its 200 body (and
stream chunks) and its errors, in OpenAI's shape (Anthropic's on /v1/messages). The
handlers read their bodies themselves (bounded in size, errors in the API's shape), so
the document is told of them here rather than by FastAPI's parameters."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pyllm.entrypoints import anthropic_protocol as anthropic
from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints import responses_protocol

# What each error status means.
ERRORS = {
    400: "An invalid request; error.param names the field at fault",
    401: "A missing or wrong API key (when the server has one)",
    403: "An Origin that is not the server's own nor allowed (code origin_not_allowed)",
    404: "An unknown model (code model_not_found) or stored response (response_not_found)",
    408: "A request body not received within the read timeout (code request_timeout)",
    413: "A request body over the size limit",
    415: "A request body that is not application/json (code unsupported_media_type)",
    421: "A Host that is not a loopback name nor allowed (code host_not_allowed)",
    503: "The server is busy, shutting down, or its engine has stopped",
}
ANY = (403, 421, 503)  # what any route may answer (security.py, the drain)
WITH_BODY = (400, 401, 404, 408, 413, 415, *ANY)  # what a POST route may answer
_STREAM_DOC = "With stream: true, server-sent events: 'data: <{}>' each, then 'data: [DONE]'"
_ANTHROPIC_STREAM_DOC = (
    "With stream: true, Anthropic's server-sent events ('event: <type>' and 'data: <JSON>'): "
    "message_start, ping, per block content_block_start, content_block_delta (text_delta "
    "or input_json_delta) and content_block_stop, then message_delta and message_stop"
)
_RESPONSES_STREAM_DOC = (
    "With stream: true, the Responses API's server-sent events ('event: <type>' and "
    "'data: <JSON>' with type and sequence_number): response.created, response.in_progress, "
    "per output item response.output_item.added, its content part's added, delta and done "
    "events (response.output_text.*, response.reasoning_text.*) or a function call's "
    "response.function_call_arguments.delta and .done, response.output_item.done; then "
    "response.completed (or response.incomplete)"
)


def responses(ok: type[BaseModel], *errors: int, chunk: type[BaseModel] | None = None) -> dict:
    """The `responses` of a route: `ok` as the 200 body (and server-sent `chunk`s, if it
    streams), and the errors, each in OpenAI's shape."""
    documented: dict = {
        status: {"model": api.ErrorResponse, "description": ERRORS[status]} for status in errors
    }
    documented[200] = {"model": ok, "description": "Successful Response"}
    if chunk is not None:
        schema = {"type": "string", "description": _STREAM_DOC.format(chunk.__name__)}
        documented[200]["content"] = {"text/event-stream": {"schema": schema}}
    return documented


def anthropic_responses(ok: type[BaseModel], stream: bool = False) -> dict:
    """`responses` of a Messages route: its errors in Anthropic's shape."""
    documented = responses(ok, *WITH_BODY)
    for status in WITH_BODY:
        documented[status]["model"] = anthropic.ErrorResponse
    if stream:
        schema = {"type": "string", "description": _ANTHROPIC_STREAM_DOC}
        documented[200]["content"] = {"text/event-stream": {"schema": schema}}
    return documented


def responses_api_responses(ok: type[BaseModel]) -> dict:
    """`responses` of /v1/responses: the 200 body, or its typed events when streamed."""
    documented = responses(ok, *WITH_BODY)
    documented[200]["content"] = {"text/event-stream": {"schema": _EVENT}}
    return documented


# One server-sent event (OpenAPI 3.1: a text/event-stream schema describes each event).
_EVENT = {
    "type": "object",
    "description": _RESPONSES_STREAM_DOC,
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json"},
    },
    "required": ["data"],
}


def json_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` declaring a JSON request body that the handler reads itself."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_openapi_schemas(app: FastAPI) -> None:
    """Adds the request bodies (and stream chunks), which no route declares as a
    parameter, to the document's components."""
    generate = app.openapi
    models = [
        (api.ChatCompletionRequest, "validation"),
        (api.CompletionRequest, "validation"),
        (api.ChatCompletionChunk, "serialization"),
        (api.TokenizeRequest, "validation"),
        (api.DetokenizeRequest, "validation"),
        (api.EmbeddingRequest, "validation"),
        (anthropic.MessagesRequest, "validation"),
        (anthropic.CountTokensRequest, "validation"),
        (responses_protocol.ResponsesRequest, "validation"),
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
