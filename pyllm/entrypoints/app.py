"""The FastAPI app: its routes, its errors in OpenAI's shape (Anthropic's on /v1/messages),
and the middleware every request passes first (outermost first: Anthropic's error shape,
CORS, cross-site checks, body timeout, drain, body size, API key)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pyllm.engine.async_engine import AsyncEngine, EngineDeadError
from pyllm.entrypoints.anthropic_serving import AnthropicErrors, MessagesServing
from pyllm.entrypoints.chat_ui import add_chat_ui
from pyllm.entrypoints.connections import BodyTimeout
from pyllm.entrypoints.lifecycle import RETRY_AFTER_S, Drain, DrainState, engine_lifespan
from pyllm.entrypoints.metrics import ServerMetrics
from pyllm.entrypoints.openai_protocol import RequestError, error_body
from pyllm.entrypoints.openapi import add_openapi_schemas
from pyllm.entrypoints.reasoning import reasoning_parser
from pyllm.entrypoints.responses_serving import ResponsesServing
from pyllm.entrypoints.routes import Servings, add_api_routes, add_status_routes
from pyllm.entrypoints.security import ApiKeyAuth, ContentLengthLimit, CrossSiteGuard, is_loopback
from pyllm.entrypoints.server_config import ServerConfig
from pyllm.entrypoints.serving_chat import ChatServing
from pyllm.entrypoints.serving_completion import CompletionServing
from pyllm.entrypoints.serving_embedding import EmbeddingServing
from pyllm.entrypoints.serving_tokens import TokenizeServing
from pyllm.entrypoints.tool_parsers import tool_parser

logger = logging.getLogger("pyllm")


def create_app(
    engine: AsyncEngine, served_model_name: str, config: ServerConfig | None = None
) -> FastAPI:
    """The app over a (started or not) AsyncEngine, serving it as `served_model_name`
    with `config`'s limits and protections; its lifespan starts and stops the engine
    thread. app.state.drain is what the server's shutdown drains (lifecycle.py)."""
    config = config or ServerConfig()
    app = FastAPI(title="pyllm", lifespan=engine_lifespan(engine), docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine, served_model_name)
    shared = (engine, served_model_name, metrics, config.max_request_bytes)
    # Chat and Messages read replies alike: thinking, content and tool calls.
    readers = {
        "reasoning": reasoning_parser(config.reasoning_parser),
        "tool_parser": tool_parser(config.tool_call_parser),
    }
    servings = Servings(
        chat=ChatServing(*shared, config.max_seqs_per_request, **readers),
        completion=CompletionServing(*shared, config.max_seqs_per_request),
        tokens=TokenizeServing(*shared, config.max_seqs_per_request),
        messages=MessagesServing(*shared, config.max_seqs_per_request, **readers),
        responses=ResponsesServing(*shared, config.max_seqs_per_request, **readers),
        embedding=EmbeddingServing(
            *shared,
            max_seqs=config.max_seqs_per_request,
            max_tokens=config.max_embedding_tokens,
        ),
    )
    app.state.drain = DrainState()
    _add_error_handlers(app)
    add_status_routes(app, engine, metrics)
    add_api_routes(app, servings)
    if config.ui:
        add_chat_ui(app)
    add_openapi_schemas(app)
    _add_middleware(app, config)
    return app


def _add_middleware(app: FastAPI, config: ServerConfig) -> None:
    """Each added outside the ones before: the size check runs before authentication
    reads anything, and CORS answers a preflight (which carries no API key) first."""
    if config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key)
    app.add_middleware(ContentLengthLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(Drain, state=app.state.drain)
    app.add_middleware(BodyTimeout, timeout=config.read_timeout)
    app.add_middleware(
        CrossSiteGuard,
        allowed_origins=config.allowed_origins or (),
        allowed_hosts=config.allowed_hosts or (),
        check_host=is_loopback(config.host),
    )
    if config.allowed_origins:
        # A page must read errors too: CORS headers on every answer, refusals included.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],
        )
    # Outermost: the Messages routes' errors in Anthropic's shape, whoever made them.
    app.add_middleware(AnthropicErrors)


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
