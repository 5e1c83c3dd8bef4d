"""The sampler's input, a SamplingBatch: one SamplingRow per sequence that samples this
step. Plain data, so the sampler needs nothing of the engine. Also the row-index helpers
the sampler's modules share."""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from pyllm.sampling.params import SamplingParams

# Temperatures below this are treated as 0 (greedy): dividing logits by them could overflow.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs of one sequence for one step."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (the caller's list: not copied)
    num_output_tokens: int
    # Stable for the sequence's whole life: the key of its seeded generator.
    key: Hashable
    # Structured output: the sequence's grammar matcher (structured.py), else None.
    matcher: object = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_output_tokens :]


# The rows of one step, in the order of the logits rows.
SamplingBatch = SequenceOf[SamplingRow]


def split_greedy(batch: SamplingBatch) -> tuple[list[int], list[int]]:
    """(indices of greedy rows, indices of sampled rows)."""
    greedy, sampled = [], []
    for i, row in enumerate(batch):
        (greedy if row.params.temperature < GREEDY_TEMPERATURE else sampled).append(i)
    return greedy, sampled


def plain_greedy(row: SamplingRow) -> bool:
    """Whether the row is greedy and asks nothing else of the sampler (no grammar, bias,
    min_tokens mask, penalty or logprobs): its token is its logits' argmax."""
    p = row.params
    return (
        p.temperature < GREEDY_TEMPERATURE
        and row.matcher is None
        and p.logprobs is None
        and not p.ranks_samples
        and not p.logit_bias
        and row.num_output_tokens >= p.min_tokens
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )


def row_index(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """Index tensor of `rows`, or None when they are all rows in order (no gather needed)."""
    if len(rows) == num_rows:
        return None
    return torch.tensor(rows, dtype=torch.int64, device=device)


def take_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def put_rows(x: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> None:
    if rows is None:
        x.copy_(values)
    else:
        x[rows] = values
