"""POST /v1/completions: the request, and the response (its stream chunks too)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from pyllm.entrypoints.openai_protocol.base import MAX_N, ResponseModel
from pyllm.entrypoints.openai_protocol.errors import RequestError
from pyllm.entrypoints.openai_protocol.responses import UsageInfo
from pyllm.entrypoints.openai_protocol.sampling import SamplingRequest
from pyllm.sampling.params import SamplingParams


class CompletionRequest(SamplingRequest):
    # A string, a list of strings, one prompt's token ids, or a list of those.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's extension: the top k logprobs of every prompt token, in choices[].prompt_logprobs.
    prompt_logprobs: int | None = None

    def _logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: the prompt tokens' logprobs come first in choices[].logprobs."""
        return self.echo and self.logprobs is not None

    def to_sampling_params(self) -> SamplingParams:
        params = super().to_sampling_params()
        if self.best_of is not None:
            try:
                params = dataclasses.replace(params, best_of=self.best_of)
            except ValueError as error:
                raise RequestError(str(error), "best_of") from None
        # The engine computes the prompt's logprobs once, for the larger of the two asks.
        asked = [k for k in (self.prompt_logprobs, self.echo_logprobs and self.logprobs) if k]
        if self.prompt_logprobs is None and not self.echo_logprobs:
            return params
        try:
            return dataclasses.replace(params, prompt_logprobs=max(asked, default=0))
        except ValueError as error:
            raise RequestError(str(error), "prompt_logprobs") from None

    def check(self) -> None:
        if self.suffix:
            raise RequestError("suffix is not supported by this server", "suffix")
        if self.best_of is not None and not 1 <= self.best_of <= MAX_N:
            raise RequestError(f"best_of must be in [1, {MAX_N}], got {self.best_of}", "best_of")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            # As OpenAI: the best samples are known only when all have finished.
            raise RequestError("best_of larger than n cannot be streamed", "best_of")
        if self.stream and (self.echo_logprobs or self.prompt_logprobs is not None):
            raise RequestError(
                "prompt logprobs (echo with logprobs, or prompt_logprobs) need stream: false",
                "prompt_logprobs" if self.prompt_logprobs is not None else "echo",
            )
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("prompt must not be an empty list", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


# ------------------------------------------------------------------- responses


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    # None for the first prompt token under echo (nothing precedes it).
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """vLLM's Logprob: rank is 1 for the most likely token; None for a prompt token
    outside the top k (its rank is not computed)."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # vLLM's extension, when asked: per prompt token, {token id: logprob} of the prompt
    # token and the top k; None for the first.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str
