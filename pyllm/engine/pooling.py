"""Embedding requests: `PoolingParams`, and a prompt's final hidden states (after the
final norm, before the LM head) pooled into one vector.

The pooling is the engine's (`EngineConfig.pooling`): `last`, the hidden state of the
prompt's last token (how Qwen3-Embedding is used), or `mean`, the mean over every
prompt token. A prompt may be computed over several steps (chunked prefill): each step
gives its chunk's part (`chunk_part`), float32 so that a long prompt's sum does not
round away, and the parts add up to the pooled vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyllm.engine.config import POOLING_TYPES
from pyllm.engine.outputs import EmbeddingOutput
from pyllm.sampling.errors import ParamError

__all__ = ["POOLING_TYPES", "PoolingParams", "chunk_part", "embedding"]


@dataclass(slots=True)
class PoolingParams:
    """What one embedding request asks (vLLM's PoolingParams): `dimensions` keeps the
    first that many values and normalizes again (Matryoshka), None: all of them;
    `normalize` scales the vector to unit L2 norm."""

    dimensions: int | None = None
    normalize: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ParamError(
                f"normalize must be True or False, got {self.normalize!r}", "normalize"
            )
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ParamError(f"dimensions must be a positive integer, got {d!r}", "dimensions")

    def check(self, hidden_size: int) -> None:
        """Raises ParamError if the model's vector cannot be cut to `dimensions`."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ParamError(
                f"dimensions must be at most the model's hidden size {hidden_size}, "
                f"got {self.dimensions}",
                "dimensions",
            )


def chunk_part(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """A chunk's part of its prompt's pooled vector, from its rows [n, hidden]: the sum
    of the rows (mean), or the last row (last; only the prompt's last chunk is asked)."""
    if pooling == "mean":
        return hidden.float().sum(dim=0)
    return hidden[-1].float()


def embedding(
    pooled: torch.Tensor, num_tokens: int, pooling: str, params: PoolingParams
) -> EmbeddingOutput:
    """A computed prompt's vector: its parts' sum divided by the prompt's length
    (mean), cut to params.dimensions and normalized as asked."""
    vector = pooled / num_tokens if pooling == "mean" else pooled
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return EmbeddingOutput(vector.cpu().tolist())
