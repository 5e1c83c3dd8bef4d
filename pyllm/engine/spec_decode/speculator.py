"""Speculative decoding in the engine's step: which decoding sequences carry proposed
tokens this step (`Speculator.propose`, before scheduling), and the step's sampling
with drafts verified (`sample_with_drafts`, after the model ran).

A sequence speculates unless that could change what it generates or what the engine
promises of it: a seeded sequence that samples decodes normally (its tokens must not
depend on the batch, and whether a step speculates does). Under a grammar (structured
output) a proposal is cut to the prefix the grammar allows, and each verified position
is masked as it would be when decoded. Proposals are skipped for a whole step when
more sequences run than disable_by_batch_size: a large batch already keeps the cores
busy. The proposals come from the proposer config.method names: n-gram lookup or a
draft model.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from pyllm.engine.sequence import Sequence
from pyllm.engine.spec_decode.adaptive import AcceptanceRecord, best_length
from pyllm.engine.spec_decode.config import SpeculativeConfig
from pyllm.engine.spec_decode.draft_loader import Target, load_draft
from pyllm.engine.spec_decode.ngram import NgramProposer
from pyllm.sampling.batch import GREEDY_TEMPERATURE, SamplingRow, row_index, take_rows
from pyllm.sampling.logprobs import Logprobs
from pyllm.sampling.sampler import Sampler
from pyllm.sampling.structured import allowed_prefix

# Per sampled sequence: the tokens it emits this step, and their logprobs.
Emitted = tuple[list[int], list[Logprobs | None]]


class Proposer(Protocol):
    """Where proposals come from: ngram.NgramProposer or draft.DraftProposer."""

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """Per sequence, at most its length of proposed tokens."""
        ...

    def forget(self, seq: Sequence) -> None:
        """Releases what is held for seq (finished or aborted)."""
        ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, target: Target):
        """target: the engine's model and settings, which a draft model is checked
        against and sized from."""
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer = (
            load_draft(config, target)
            if config.method == "draft_model"
            else NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        )
        self.records: dict[int, AcceptanceRecord] = {}  # by seq.arrival (adaptive_length)

    def propose(self, running: list[Sequence]) -> None:
        """Sets each running decode's spec_token_ids for the coming step ([] for one
        that does not speculate)."""
        active = len(running) <= self.config.disable_by_batch_size
        chosen, lengths = [], []
        for seq in running:
            # Past its prompt: a prompt's last token computes as a prompt row, never
            # in a chunk with proposals (ScheduledBatch.add).
            if seq.num_pending_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.spec_token_ids = []
                k = self._length(seq)
                if active and k > 0 and speculates(seq):
                    chosen.append(seq)
                    lengths.append(k)
        for seq, tokens in zip(chosen, self.proposer.propose(chosen, lengths), strict=True):
            seq.spec_token_ids = (
                tokens if seq.matcher is None else allowed_prefix(seq.matcher, tokens)
            )
            if self.config.adaptive_length:
                # The very list the scheduler trims in place and the step verifies.
                record = self.records[seq.arrival]
                record.proposed, record.position = seq.spec_token_ids, seq.num_tokens

    def forget(self, seq: Sequence) -> None:
        """seq finished or was aborted: the proposer's state for it goes."""
        self.proposer.forget(seq)
        self.records.pop(seq.arrival, None)

    def _length(self, seq: Sequence) -> int:
        """The most tokens seq may be proposed: never past max_tokens (the token after
        the draft is emitted too) nor the context (a proposed token's position must
        exist), and with adaptive_length what its acceptance so far makes worth it."""
        most = self.config.num_speculative_tokens
        if self.config.adaptive_length:
            record = self.records.setdefault(seq.arrival, AcceptanceRecord())
            record.observe(seq.token_ids)
            most = best_length(record.rate, most)
            if most == 0:
                record.idle()
        return min(
            most,
            seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens,
        )


def speculates(seq: Sequence) -> bool:
    params = seq.sampling_params
    seeded_draw = params.seed is not None and params.temperature >= GREEDY_TEMPERATURE
    return not seeded_draw


def draft_rows(seq: Sequence) -> list[SamplingRow]:
    """The sampler's rows for seq's pending token and each proposed token after it:
    the tokens as they stand at that position (penalties and min_tokens see them)."""
    rows = [seq.sampling_row()]
    tokens = seq.token_ids
    for i, token in enumerate(seq.spec_token_ids, start=1):
        tokens = [*tokens, token]
        num_output = seq.num_output_tokens + i
        rows.append(SamplingRow(seq.sampling_params, tokens, num_output, seq.arrival))
    return rows


@torch.inference_mode()
def sample_with_drafts(
    sampler: Sampler, logits: torch.Tensor, sampled: list[Sequence]
) -> list[Emitted]:
    """The step's tokens when some sampled sequences carry drafts: logits has one row per
    sequence without and 1 + len(draft) rows per sequence with (the model runner's
    order). Sequences without a draft are sampled as in a plain step."""
    starts = list(itertools.accumulate((1 + len(s.spec_token_ids) for s in sampled), initial=0))
    plain = [i for i, s in enumerate(sampled) if not s.spec_token_ids]
    drafted = [i for i, s in enumerate(sampled) if s.spec_token_ids]
    out: list[Emitted | None] = [None] * len(sampled)
    device = logits.device
    if plain:
        index = torch.tensor([starts[i] for i in plain], dtype=torch.int64, device=device)
        result = sampler(logits[index], [sampled[i].sampling_row() for i in plain])
        for i, token, logprob in zip(plain, result.token_ids, result.logprobs, strict=True):
            out[i] = ([token], [logprob])
    if drafted:
        rows = [r for i in drafted for r in range(starts[i], starts[i + 1])]
        index = row_index(rows, logits.shape[0], device)
        batch = [row for i in drafted for row in draft_rows(sampled[i])]
        drafts = [sampled[i].spec_token_ids for i in drafted]
        result = sampler.verify(take_rows(logits, index), batch, drafts)
        for i, tokens, logprobs in zip(drafted, result.token_ids, result.logprobs, strict=True):
            out[i] = (tokens, logprobs)
    return out
