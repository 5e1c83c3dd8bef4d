"""What the engine hands back for a request: vLLM's RequestOutput shape (and
EmbeddingRequestOutput for an embedding request)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", "error" (see error) or None while running.
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that matched
    # Per generated token: (chosen token's logprob, {token_id: logprob} of the top k).
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    # With finish_reason "error": why (a grammar that went past its limits mid-way).
    error: str | None = None
    # LLM.chat with a reasoning_parser: the thinking, apart from the answer in `text`.
    reasoning_content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EmbeddingOutput:
    """An embedding request's vector (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What the engine hands back for an embedding request, once, finished (vLLM's
    EmbeddingRequestOutput: the vector is `outputs.embedding`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)
