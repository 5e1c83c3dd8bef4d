"""POST /v1/embeddings: the request and the response (OpenAI's shapes)."""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Literal

from pydantic import Field

from pyllm.engine.pooling import PoolingParams
from pyllm.entrypoints.openai_protocol.base import ResponseModel, StrictRequest
from pyllm.entrypoints.openai_protocol.errors import RequestError
from pyllm.sampling.errors import ParamError

# Declared in /openapi.json as checked: no empty text, list or token list; ids >= 0.
_Text = Annotated[str, Field(min_length=1)]
_TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(StrictRequest):
    # A string, a list of strings, one input's token ids, or a list of those.
    input: (
        _Text
        | Annotated[list[_Text], Field(min_length=1)]
        | _TokenIds
        | Annotated[list[_TokenIds], Field(min_length=1)]
    )
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    # Matryoshka: the first `dimensions` values, normalized again (at most the hidden size).
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None  # accepted, as OpenAI's; not used

    def inputs(self, max_inputs: int) -> list[str | list[int]]:
        """Each input: text, or token ids (none empty: the model refuses those); at most
        max_inputs of them."""
        if isinstance(self.input, str):
            items = [self.input]
        elif all(isinstance(t, int) for t in self.input):
            items = [list(self.input)]
        else:
            items = list(self.input)
        if len(items) > max_inputs:
            raise RequestError(
                f"input may hold at most {max_inputs} inputs per request, got {len(items)}",
                "input",
            )
        return items

    def to_pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(dimensions=self.dimensions)
        except ParamError as error:
            raise RequestError(str(error), "dimensions") from None


class Embedding(ResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # float: the values; base64: little-endian float32 bytes, base64-encoded (OpenAI's).
    embedding: list[float] | str


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def encode_embedding(values: list[float], encoding_format: str | None) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return values
