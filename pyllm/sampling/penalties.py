"""Step 1 of sampling, logits processing, on a copy of the logits (or in place, undone
after the draw):

- logit_bias is added;
- while a sequence has fewer than min_tokens outputs its EOS and stop_token_ids get -inf;
- repetition_penalty (CTRL: a positive logit is divided by it, a negative one multiplied)
  over the last repeat_last_n tokens of prompt + output (all of them when repeat_last_n
  is 0);
- presence_penalty and frequency_penalty over the generated tokens (OpenAI: logit -=
  presence * (count > 0) + frequency * count).

Nothing loops over the vocabulary in Python: the penalties touch only the (row, token)
pairs that occur in the context, as flat addresses row * vocab + token.
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass

import torch

from pyllm.sampling.batch import SamplingBatch

# (flat ids, the values there before a change), for restore to put back.
UndoLog = list[tuple[torch.Tensor, torch.Tensor]]


def apply_penalties(
    logits: torch.Tensor, batch: SamplingBatch, eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """Step 1 (the module docstring). Returns `logits` itself when no sequence asks for
    any of it, else a processed copy."""
    return penalize(logits, batch, eos_token_ids, None)


def penalize(
    logits: torch.Tensor,
    batch: SamplingBatch,
    eos_token_ids: frozenset[int],
    undo: UndoLog | None,
) -> torch.Tensor:
    """apply_penalties; with an `undo` list and contiguous logits, in place instead of on a
    copy (a full copy costs as much as a softmax pass): the values it overwrites are
    appended to `undo` first, for restore to put back."""
    vocab = logits.shape[1]
    asks = _gather_asks(batch, vocab, eos_token_ids)
    if asks is None:
        return logits
    if undo is None or not logits.is_contiguous():
        logits = logits.clone(memory_format=torch.contiguous_format)
        undo = None
    flat = logits.view(-1)
    device = logits.device
    if asks.bias_ids:
        ids = _save(flat, torch.tensor(asks.bias_ids, dtype=torch.int64, device=device), undo)
        flat.index_add_(0, ids, torch.tensor(asks.bias_values, dtype=flat.dtype, device=device))
    if asks.masked_rows:
        ids = _save(flat, _flat_ids(asks.masked_rows, asks.masked_tokens, vocab, device), undo)
        flat.index_fill_(0, ids, float("-inf"))
    if asks.repeat_rows:
        _repetition_penalty(flat, asks, vocab, len(batch), undo)
    if asks.output_rows:
        _presence_frequency(flat, asks, vocab, len(batch), undo)
    return logits


@dataclass(slots=True)
class _Asks:
    """What the rows of a batch ask of step 1, as flat lists: logit_bias at flat ids,
    EOS masks, and the rows with a repetition or a presence/frequency penalty."""

    bias_ids: list[int]
    bias_values: list[float]
    masked_rows: list[int]
    masked_tokens: list[list[int]]
    repeat_rows: list[int]
    repeat_tokens: list[list[int]]
    repeat_penalties: list[float]
    output_rows: list[int]
    output_tokens: list[list[int]]
    presence: list[float]
    frequency: list[float]


def _gather_asks(batch: SamplingBatch, vocab: int, eos_token_ids: frozenset[int]) -> _Asks | None:
    """One pass over the batch; None when no row asks for any of step 1."""
    bias_ids: list[int] = []
    bias_values: list[float] = []
    masked_rows, masked_tokens = [], []
    repeat_rows, repeat_tokens, repeat_penalties = [], [], []
    output_rows, output_tokens, presence, frequency = [], [], [], []
    for row, entry in enumerate(batch):
        params = entry.params
        for token, bias in params.logit_bias.items():
            bias_ids.append(row * vocab + token)
            bias_values.append(bias)
        if entry.num_output_tokens < params.min_tokens:
            masked_rows.append(row)
            masked_tokens.append([*eos_token_ids, *params.stop_token_ids])
        if params.repetition_penalty != 1.0:
            n = params.repeat_last_n
            repeat_rows.append(row)
            repeat_tokens.append(entry.token_ids[-n:] if n else entry.token_ids)
            repeat_penalties.append(params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            output_rows.append(row)
            output_tokens.append(entry.output_token_ids)
            presence.append(params.presence_penalty)
            frequency.append(params.frequency_penalty)
    if not (bias_ids or masked_rows or repeat_rows or output_rows):
        return None
    return _Asks(
        bias_ids, bias_values, masked_rows, masked_tokens, repeat_rows, repeat_tokens,
        repeat_penalties, output_rows, output_tokens, presence, frequency,
    )  # fmt: skip


def _save(flat: torch.Tensor, ids: torch.Tensor, undo: UndoLog | None) -> torch.Tensor:
    """ids, after appending the values at them to `undo` (if any) for restore."""
    if undo is not None:
        undo.append((ids, flat[ids]))
    return ids


def _repetition_penalty(
    flat: torch.Tensor, asks: _Asks, vocab: int, num_rows: int, undo: UndoLog | None
) -> None:
    # Each distinct token once per row: the penalty scales a logit once, however often
    # the token occurs.
    ids = _flat_ids(asks.repeat_rows, asks.repeat_tokens, vocab, flat.device)
    ids = _save(flat, torch.unique(ids), undo)
    penalty = _per_row(asks.repeat_rows, asks.repeat_penalties, num_rows, 1.0, flat.device)
    penalty = penalty[ids // vocab]
    values = flat[ids]
    flat[ids] = torch.where(values > 0, values / penalty, values * penalty)


def _presence_frequency(
    flat: torch.Tensor, asks: _Asks, vocab: int, num_rows: int, undo: UndoLog | None
) -> None:
    ids, counts = torch.unique(
        _flat_ids(asks.output_rows, asks.output_tokens, vocab, flat.device), return_counts=True
    )
    _save(flat, ids, undo)
    rows = ids // vocab
    presence = _per_row(asks.output_rows, asks.presence, num_rows, 0.0, flat.device)[rows]
    frequency = _per_row(asks.output_rows, asks.frequency, num_rows, 0.0, flat.device)[rows]
    flat.index_add_(0, ids, -(frequency * counts + presence))


def restore(logits: torch.Tensor, undo: UndoLog) -> None:
    """Undoes penalize in place: the saved values back, the last change first (an id
    repeated within one change was saved with the same value each time)."""
    flat = logits.view(-1) if undo else None
    for ids, values in reversed(undo):
        flat[ids] = values


def _flat_ids(
    rows: list[int], token_lists: list[list[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """row * vocab + token for every token of every listed row: addresses in logits.view(-1)."""
    lengths = torch.tensor([len(tokens) for tokens in token_lists], dtype=torch.int64)
    if int(lengths.sum()) == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    # array() packs the Python ints in C, several times faster than torch.tensor(list).
    packed = array.array("q", itertools.chain.from_iterable(token_lists))
    tokens = torch.frombuffer(packed, dtype=torch.int64)
    offsets = (torch.tensor(rows, dtype=torch.int64) * vocab).repeat_interleave(lengths)
    return (tokens + offsets).to(device)


def _per_row(
    rows: list[int], values: list[float], num_rows: int, default: float, device: torch.device
) -> torch.Tensor:
    out = torch.full((num_rows,), default, dtype=torch.float32)
    out[rows] = torch.tensor(values, dtype=torch.float32)
    return out.to(device)
