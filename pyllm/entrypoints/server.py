"""The OpenAI-compatible HTTP server: `pyllm serve`.

    POST /v1/chat/completions, POST /v1/completions   (stream: true -> server-sent events)
    POST /v1/embeddings                               (the engine's pooled hidden states)
    GET  /v1/models, GET /health, GET /metrics
    POST /tokenize, POST /detokenize, GET /version    (vLLM's)
    GET  /                                            (a chat page, chat_ui.py)

Before a route sees a request, connections.py bounds how long its client may take to
send it and how many are served at once, and security.py refuses what a cross-site page
would send (Content-Type, Origin, Host), bodies over the size limit and a wrong API key
(the stack: app.py). A request is parsed, checked, tokenized and validated against the
engine in its handler (serving_*.py over openai_protocol/), before anything reaches the
engine, so every client mistake is a 4xx in OpenAI's error shape {"error": {"message",
"type", "param", "code"}}. The engine runs in its own thread (AsyncEngine); a handler
only awaits its request's outputs. A client that goes away (a dropped stream, a closed
connection) has its request aborted, which frees its KV blocks. On SIGTERM the server
drains (lifecycle.py) and exits 0.
"""

from __future__ import annotations

import gc
import logging
import os
import socket

import uvicorn

from pyllm.engine.async_engine import AsyncEngine
from pyllm.engine.config import ConfigError, EngineConfig
from pyllm.entrypoints.app import create_app
from pyllm.entrypoints.connections import guarded_protocol
from pyllm.entrypoints.lifecycle import ABORT_GRACE_S, GracefulServer
from pyllm.entrypoints.server_config import ServerConfig

logger = logging.getLogger("pyllm")


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Takes the port, loads the engine, then serves until SIGINT/SIGTERM, draining as
    lifecycle.GracefulServer says; returns the exit code: 0, or 1 if the engine failed
    for good (a lost tensor-parallel rank). A port that cannot be had raises ConfigError
    before the model loads."""
    import prometheus_client

    from pyllm.engine.llm_engine import LLMEngine

    sockets = bind_sockets(config.host, config.port)
    try:
        prometheus_client.disable_created_metrics()  # no *_created series: this process is ours
        gc.freeze()  # the imports' objects live as long as the server: collections skip them
        engine = AsyncEngine(LLMEngine(engine_config))
        name = config.served_model_name or default_model_name(engine_config.model_path)
        app = create_app(engine, name, config)
        _log_addresses(name, config, sockets[0].getsockname()[1])
        server_config = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=ABORT_GRACE_S,
            http=guarded_protocol(config.read_timeout),
            limit_concurrency=config.limit_concurrency,
        )
        GracefulServer(server_config, engine, app.state.drain, config.shutdown_timeout).run(sockets)
    finally:
        for sock in sockets:
            sock.close()
    return 1 if engine.fatal_error else 0


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to host:port (one per address the host name has), as asyncio's
    create_server binds them, not yet listening; ConfigError if the port is taken."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ConfigError("host", f"{host!r} cannot be resolved: {error.strerror}") from None
    sockets = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as error:
        for sock in sockets:
            sock.close()
        raise ConfigError("port", f"{port} on {host} cannot be used: {error.strerror}") from None
    return sockets


def _log_addresses(name: str, config: ServerConfig, port: int) -> None:
    key = "required" if config.api_key else "off"
    logger.info("serving %r on http://%s:%d (api key %s)", name, config.host, port, key)
    if config.ui:
        logger.info("chat page: http://%s:%d/", config.host, port)


def default_model_name(model_path: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1' for .../SmolLM2-135M-Instruct.Q4_1.gguf."""
    name = os.path.basename(os.path.normpath(model_path))
    return name.removesuffix(".gguf")
