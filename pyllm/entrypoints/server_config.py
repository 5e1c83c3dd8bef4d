"""ServerConfig: the options of `pyllm serve` that are the server's own (the engine's are
EngineConfig's), each with its default and help text, checked once."""

from __future__ import annotations

from dataclasses import dataclass

from pyllm.engine.config import ConfigError, check_number, option
from pyllm.entrypoints.reasoning import REASONING_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error")


def comma_list(value: str) -> list[str]:
    """'a, b,c' -> ['a', 'b', 'c'] (origins or host names)."""
    return [item.strip() for item in value.split(",") if item.strip()]


@dataclass
class ServerConfig:
    host: str = option(
        "127.0.0.1",
        "address to listen on; on one that is not loopback (0.0.0.0) the Host check is "
        "off, so use --api-key there",
    )
    port: int = option(8000, "TCP port to listen on (0: any free one)")
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
        "(default: $PYLLM_API_KEY, else none)",
        env="PYLLM_API_KEY",
    )
    served_model_name: str | None = option(
        None, "the model's name in the API (default: its file or folder name)"
    )
    log_level: str = option("info", "what the server logs", choices=LOG_LEVELS)
    allowed_origins: list[str] | None = option(
        None,
        "browser origins allowed to call the API besides the server's own, "
        "comma-separated, or '*' for any (default: none; other origins get 403)",
        type=comma_list,
    )
    allowed_hosts: list[str] | None = option(
        None,
        "Host header names answered besides localhost, 127.0.0.1 and [::1], "
        "comma-separated, or '*' for any (checked only when --host is a loopback "
        "address; others get 421; default: none)",
        type=comma_list,
    )
    max_seqs_per_request: int = option(
        256,
        "the most sequences one request may ask for: prompts x n (or best_of)",
    )
    max_embedding_tokens: int = option(
        300_000,
        "the most tokens one /v1/embeddings request may hold, all its inputs together "
        "(as OpenAI's limit; more: 400)",
    )
    # Far above any prompt that fits a context window, far below what would hurt the server.
    max_request_bytes: int = option(
        4 * 2**20, "the largest request body read, in bytes (larger: 413)"
    )
    shutdown_timeout: float = option(
        30.0,
        "on SIGTERM/SIGINT, seconds running requests may go on before they are ended "
        "(new ones get 503 meanwhile)",
    )
    read_timeout: float = option(
        30.0,
        "seconds a client has to send a request's headers, and then its body; a "
        "connection that takes longer is closed with 408",
    )
    limit_concurrency: int | None = option(
        512, "open connections (or requests) served at once; past it, 503"
    )
    reasoning_parser: str | None = option(
        None,
        "return a reasoning model's <think>...</think> apart from its answer, as "
        "reasoning_content: deepseek_r1 (the template opens <think>) or qwen3 (default: "
        "none; gpt-oss's harmony channels are read apart anyway)",
    )
    tool_call_parser: str = option(
        "hermes",
        "the format the model writes its own tool calls in (tool_choice auto): hermes "
        "(<tool_call> JSON, Qwen's too), llama3_json, mistral or qwen3_coder",
    )
    ui: bool = option(
        True, "do not serve the chat page at / (then 404; default: served)", flag="--no-ui"
    )

    def __post_init__(self) -> None:
        port = self.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError("port", f"must be in [0, 65535], got {port!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError("log_level", f"must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ConfigError(
                "reasoning_parser", _not_one_of(REASONING_PARSERS, self.reasoning_parser)
            )
        # Imported here: the CLI builds its parser from this class, and `pyllm generate`
        # needs none of the tool parsers (~15 ms of its start).
        from pyllm.entrypoints.tool_parsers import TOOL_CALL_PARSERS

        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(
                "tool_call_parser", _not_one_of(TOOL_CALL_PARSERS, self.tool_call_parser)
            )
        check_number(self, "max_seqs_per_request", 1, integer=True)
        check_number(self, "max_request_bytes", 1, integer=True)
        check_number(self, "max_embedding_tokens", 1, integer=True)
        check_number(self, "limit_concurrency", 1, integer=True, optional=True)
        check_number(self, "shutdown_timeout", 0)
        check_number(self, "read_timeout", 0, above=True)


def _not_one_of(names: tuple[str, ...], value) -> str:
    return f"must be one of {', '.join(names)}; got {value!r}"
