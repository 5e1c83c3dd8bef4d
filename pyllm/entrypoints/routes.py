"""The routes: /health and /metrics, the /v1/ API (OpenAI's /v1/responses, with GET and
DELETE of a stored one, and Anthropic's /v1/messages too), vLLM's /tokenize, /detokenize
and /version, each documented for /openapi.json."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

from pyllm import __version__
from pyllm.engine.async_engine import AsyncEngine
from pyllm.entrypoints import anthropic_protocol as anthropic
from pyllm.entrypoints import openai_protocol as api
from pyllm.entrypoints import responses_protocol
from pyllm.entrypoints.anthropic_serving import MessagesServing
from pyllm.entrypoints.metrics import ServerMetrics
from pyllm.entrypoints.openapi import (
    ANY,
    ERRORS,
    WITH_BODY,
    anthropic_responses,
    json_body,
    responses,
    responses_api_responses,
)
from pyllm.entrypoints.responses_serving import ResponsesServing
from pyllm.entrypoints.serving_chat import ChatServing
from pyllm.entrypoints.serving_completion import CompletionServing
from pyllm.entrypoints.serving_embedding import EmbeddingServing
from pyllm.entrypoints.serving_tokens import TokenizeServing


@dataclass
class Servings:
    """What answers each family of routes."""

    chat: ChatServing
    completion: CompletionServing
    tokens: TokenizeServing
    messages: MessagesServing
    responses: ResponsesServing
    embedding: EmbeddingServing


def add_status_routes(app: FastAPI, engine: AsyncEngine, metrics: ServerMetrics) -> None:
    health_503 = {"model": api.HealthStatus, "description": ERRORS[503]}

    @app.get("/health", responses={200: {"model": api.HealthStatus}, 503: health_503})
    async def health():
        if not engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        payload, content_type = metrics.render()
        return Response(payload, media_type=content_type)


def add_api_routes(app: FastAPI, servings: Servings) -> None:
    """The /v1/ routes and vLLM's."""
    _add_model_routes(app, servings.chat)
    _add_token_routes(app, servings.tokens)
    _add_messages_routes(app, servings.messages)
    _add_stored_response_routes(app, servings.responses)

    @app.post(
        "/v1/responses",
        openapi_extra=json_body(responses_protocol.ResponsesRequest),
        responses=responses_api_responses(responses_protocol.ResponseObject),
    )
    async def create_response(request: Request):
        return await servings.responses.responses(request)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=json_body(api.ChatCompletionRequest),
        responses=responses(api.ChatCompletionResponse, *WITH_BODY, chunk=api.ChatCompletionChunk),
    )
    async def chat_completions(request: Request):
        return await servings.chat.chat(request)

    @app.post(
        "/v1/completions",
        openapi_extra=json_body(api.CompletionRequest),
        responses=responses(api.CompletionResponse, *WITH_BODY, chunk=api.CompletionResponse),
    )
    async def completions(request: Request):
        return await servings.completion.completions(request)

    @app.post(
        "/v1/embeddings",
        openapi_extra=json_body(api.EmbeddingRequest),
        responses=responses(api.EmbeddingResponse, *WITH_BODY),
    )
    async def embeddings(request: Request):
        return await servings.embedding.embeddings(request)


def _add_stored_response_routes(app: FastAPI, serving: ResponsesServing) -> None:
    """A response kept with store: true (responses_store.py), read back or forgotten."""

    @app.get(
        "/v1/responses/{response_id}",
        responses=responses(responses_protocol.ResponseObject, 401, 404, *ANY),
    )
    async def retrieve_response(response_id: str):
        return serving.retrieve(response_id)

    @app.delete(
        "/v1/responses/{response_id}",
        responses=responses(responses_protocol.DeletedResponse, 401, 404, *ANY),
    )
    async def delete_response(response_id: str):
        return _json(serving.delete(response_id))


def _add_messages_routes(app: FastAPI, serving: MessagesServing) -> None:
    """Anthropic's Messages API (anthropic_serving.py)."""

    @app.post(
        "/v1/messages",
        openapi_extra=json_body(anthropic.MessagesRequest),
        responses=anthropic_responses(anthropic.MessagesResponse, stream=True),
    )
    async def messages(request: Request):
        return await serving.messages(request)

    @app.post(
        "/v1/messages/count_tokens",
        openapi_extra=json_body(anthropic.CountTokensRequest),
        responses=anthropic_responses(anthropic.CountTokensResponse),
    )
    async def count_tokens(request: Request):
        return _json(await serving.count_tokens(request))


def _add_model_routes(app: FastAPI, serving: ChatServing) -> None:
    created = api.now()

    def model_card() -> api.ModelCard:
        return api.ModelCard(
            id=serving.model_name, created=created, max_model_len=serving.engine.max_model_len
        )

    @app.get("/v1/models", responses=responses(api.ModelList, 401, *ANY))
    async def list_models():
        return _json(api.ModelList(data=[model_card()]))

    @app.get("/v1/models/{model_id:path}", responses=responses(api.ModelCard, 401, 404, *ANY))
    async def get_model(model_id: str):
        serving.check_model(model_id)
        return _json(model_card())


def _add_token_routes(app: FastAPI, serving: TokenizeServing) -> None:
    @app.post(
        "/tokenize",
        openapi_extra=json_body(api.TokenizeRequest),
        responses=responses(api.TokenizeResponse, *WITH_BODY),
    )
    async def tokenize(request: Request):
        return _json(await serving.tokenize(request))

    @app.post(
        "/detokenize",
        openapi_extra=json_body(api.DetokenizeRequest),
        responses=responses(api.DetokenizeResponse, *WITH_BODY),
    )
    async def detokenize(request: Request):
        return _json(await serving.detokenize(request))

    @app.get("/version", responses=responses(api.VersionResponse, *ANY))
    async def version():
        return api.VersionResponse(version=__version__)


def _json(body: BaseModel):
    return Response(body.model_dump_json(), media_type="application/json")
