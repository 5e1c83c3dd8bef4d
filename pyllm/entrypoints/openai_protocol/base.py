"""The two kinds of model: requests, parsed strictly, and responses; a request's limits."""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, model_validator

# Limits a single request may not exceed, so that no client can make the engine's
# per-token work (stop-string scans, logit bias) arbitrarily expensive for everyone.
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_SEED = 2**63 - 1


class StrictRequest(BaseModel):
    """A request body: a string is not an integer, unknown fields are ignored, and a null
    where OpenAI marks the field nullable means its default."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Clients that serialize every field send null for those they leave unset; OpenAI's
        # spec marks them nullable, meaning the default.
        if not isinstance(data, dict):
            return data
        defaulted = _nullable_with_default(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


@functools.cache
def _nullable_with_default(model: type[BaseModel]) -> frozenset[str]:
    """The fields typed `X | None` whose default is not None: null there means the default."""
    return frozenset(
        name
        for name, field in model.model_fields.items()
        if field.default is not None and type(None) in get_args(field.annotation)
    )


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
