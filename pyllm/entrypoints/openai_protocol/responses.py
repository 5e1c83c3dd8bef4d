"""Response bodies every route shares or that stand alone: usage, models, errors, status."""

from __future__ import annotations

from typing import Literal

from pyllm.entrypoints.openai_protocol.base import ResponseModel


class UsageInfo(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pyllm"
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(ResponseModel):
    """The body of every 4xx and 5xx, as error_body builds it."""

    error: ErrorInfo


class HealthStatus(ResponseModel):
    status: str


class VersionResponse(ResponseModel):
    version: str
