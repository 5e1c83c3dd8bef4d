"""Logprobs: of the sampled tokens and of the prompt's own tokens. They describe the
model's own distribution: log_softmax of the raw logits, before penalties and
temperature."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from pyllm.sampling.batch import SamplingBatch, row_index, take_rows
from pyllm.sampling.select import small_topk

# (chosen token's logprob, {token: logprob} of the top k)
Logprobs = tuple[float, dict[int, float]]


def wants_logprobs(row) -> bool:
    """Whether a SamplingRow's sampled token needs its logprob."""
    return row.params.logprobs is not None or row.params.ranks_samples


def sampled_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
) -> list[Logprobs | None]:
    """Per row: Logprobs of its sampled token when its params ask for logprobs (top k =
    params.logprobs) or it ranks best_of samples (k = 0 unless logprobs asks more), else
    None."""
    out: list[Logprobs | None] = [None] * len(batch)
    rows = [i for i, row in enumerate(batch) if wants_logprobs(row)]
    if rows:
        index = row_index(rows, len(batch), logits.device)
        ks = [batch[i].params.logprobs or 0 for i in rows]
        found = _token_logprobs(take_rows(logits, index), take_rows(token_ids, index), ks)
        for row, entry in zip(rows, found, strict=True):
            out[row] = entry
    return out


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor | SequenceOf[int], k: int
) -> list[Logprobs]:
    """Per prompt position p: the logprob of next_token_ids[p] (the token that follows) under
    logits[p], and {token: logprob} of the k most likely tokens there (empty when k is 0).
    From the raw logits, like the sampler's logprobs."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(
            f"logits must be a float32 [positions, vocab] tensor, got {logits.dtype}"
            f" {list(logits.shape)}"
        )
    next_token_ids = torch.as_tensor(next_token_ids, dtype=torch.int64, device=logits.device)
    if next_token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"next_token_ids must have shape [{logits.shape[0]}], got {list(next_token_ids.shape)}"
        )
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return _token_logprobs(logits, next_token_ids, [k] * logits.shape[0])


def _token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[Logprobs]:
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1).tolist()
    k_max = min(max(ks), logits.shape[1])
    if k_max == 0:
        return [(lp, {}) for lp in chosen]
    top_values, top_ids = (t.tolist() for t in small_topk(logprobs, k_max))
    return [
        (lp, dict(zip(ids[:k], values[:k], strict=True)))
        for lp, ids, values, k in zip(chosen, top_ids, top_values, ks, strict=True)
    ]
