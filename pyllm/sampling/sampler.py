"""The sampler: one batched pass from a step's logits [num_seqs, vocab] to one token per
sequence, each row shaped by its own SamplingParams, in vLLM's order:

1. logits processing: the grammar masks of structured output (structured.py), bias,
   min_tokens mask, penalties (penalties.py);
2. greedy rows take the argmax, the others temperature, then the top-k, top-p and min-p
   cuts (cuts.py);
3. one uniform number per row picks a token by inverse CDF (draw.py), from the request's
   own generator when it has a seed.

Speculative decoding's drafts are verified by `verify` (rejection.py): every position
of a draft processed as above, greedy rows by matching argmaxes, sampled ones by
rejection sampling.

Logprobs (logprobs.py) describe the raw logits. Nothing loops over the vocabulary in
Python: penalties touch only the (row, token) pairs in the context, the cuts and the
draw are batched tensor ops, and transforms no row of the step asks for are skipped (an
all-greedy step is one argmax).

The caller hands a SamplingBatch (batch.py): plain rows, so nothing here depends on the
engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from pyllm.sampling.batch import (
    SamplingBatch,
    plain_greedy,
    put_rows,
    row_index,
    split_greedy,
    take_rows,
)
from pyllm.sampling.cuts import candidate_pass, sampling_weights
from pyllm.sampling.draw import Generators, inverse_cdf, inverse_cdf_exact
from pyllm.sampling.logprobs import Logprobs, sampled_logprobs, wants_logprobs
from pyllm.sampling.params import ParamError, SamplingParams
from pyllm.sampling.penalties import apply_penalties, penalize, restore
from pyllm.sampling.rejection import accepted_greedy, accepted_sampled, final_weights
from pyllm.sampling.select import first_argmax
from pyllm.sampling.structured import mask_draft_logits, mask_logits


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (chosen token's logprob, {token: logprob} of the top k) when its
    # params.logprobs is k (0: an empty dict) or its request ranks best_of samples
    # (k = 0 unless logprobs asks more), else None.
    logprobs: list[Logprobs | None]


@dataclass
class VerifyOutput:
    # Per sequence: its accepted draft tokens, then the token drawn after them.
    token_ids: list[list[int]]
    logprobs: list[list[Logprobs | None]]  # per emitted token, as SamplerOutput's


class Sampler:
    def __init__(
        self, vocab_size: int, eos_token_ids: set[int], *, seed: int | None = None
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        bad = sorted(t for t in self.eos_token_ids if not 0 <= t < vocab_size)
        if bad:
            raise ValueError(f"eos_token_ids {bad} out of range for vocab_size {vocab_size}")
        self._generators = Generators(seed)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot validate alone: token ids against the vocabulary."""
        bad = sorted(t for t in params.logit_bias if t >= self.vocab_size)
        if bad:
            raise ParamError(
                f"logit_bias token ids {bad} out of range for vocab {self.vocab_size}",
                "logit_bias",
            )
        bad = sorted(t for t in params.stop_token_ids if t >= self.vocab_size)
        if bad:
            raise ParamError(
                f"stop_token_ids {bad} out of range for vocab {self.vocab_size}", "stop_token_ids"
            )

    def forget(self, key: Hashable) -> None:
        """Drop a sequence's state (its generator), by its rows' key; call when it finishes
        or is aborted."""
        self._generators.forget(key)

    # Inference mode: the model runner's logits are inference tensors, which may only be
    # updated in place inside it.
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        self._check_logits(logits, batch)
        if all(plain_greedy(row) for row in batch):  # the usual greedy step: one argmax
            return SamplerOutput(first_argmax(logits).tolist(), [None] * len(batch))
        # Grammar masks stay in the logits: logprobs then describe what could be drawn.
        self._mask_by_grammar(logits, batch)
        # Penalties go into the caller's logits in place and are undone before returning
        # (logprobs then read the raw logits): it saves copying the whole tensor.
        undo: list[tuple[torch.Tensor, torch.Tensor]] = []
        processed = penalize(logits, batch, self.eos_token_ids, undo)
        try:
            token_ids = self._sample(processed, batch)
        finally:
            restore(logits, undo)
        return SamplerOutput(token_ids.tolist(), sampled_logprobs(logits, token_ids, batch))

    def _sample(self, processed: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy, sampled = split_greedy(batch)
        token_ids = torch.empty(len(batch), dtype=torch.int64, device=processed.device)
        if greedy:
            rows = row_index(greedy, len(batch), processed.device)
            put_rows(token_ids, rows, first_argmax(take_rows(processed, rows)))
        if sampled:
            # One uniform per sampled sequence, drawn before the rows split into paths, so
            # each generator advances once per step whichever path its row takes.
            uniforms = torch.zeros(len(batch), dtype=torch.float64)
            uniforms[sampled] = self._generators.uniforms([batch[i] for i in sampled])
            uniforms = uniforms.to(processed.device)
            found, full = candidate_pass(processed, batch, sampled)
            if found is not None:
                rows, columns, weights = found
                picks = inverse_cdf_exact(weights, uniforms[rows])
                token_ids[rows] = columns.gather(1, picks).squeeze(1)
            if full:
                rows = row_index(full, len(batch), processed.device)
                weights = sampling_weights(take_rows(processed, rows), [batch[i] for i in full])
                put_rows(token_ids, rows, inverse_cdf(weights, take_rows(uniforms, rows)))
        return token_ids

    @torch.inference_mode()
    def verify(
        self, logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]]
    ) -> VerifyOutput:
        """Speculative decoding (rejection.py): drafts[j] proposes tokens after sequence
        j; its len(drafts[j]) + 1 rows of logits and batch, in order, are the positions
        from its pending token on, each row's SamplingRow as the sequence stands there;
        the first row's grammar matcher, if any, masks every position (the draft must be
        one the grammar allows). Returns the accepted prefix of each draft and one more
        token, with logprobs."""
        self._check_logits(logits, batch)
        starts = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
        if starts[-1] != len(batch):
            raise ValueError(f"drafts need {starts[-1]} rows, got {len(batch)}")
        self._mask_drafts_by_grammar(logits, batch, drafts, starts)
        greedy, sampled = split_greedy([batch[start] for start in starts[:-1]])
        tokens: list[list[int]] = [[] for _ in drafts]
        if greedy:
            self._verify_greedy(logits, batch, drafts, starts, greedy, tokens)
        if sampled:
            self._verify_sampled(logits, batch, drafts, starts, sampled, tokens)
        if not any(wants_logprobs(row) for row in batch):
            return VerifyOutput(tokens, [[None] * len(ts) for ts in tokens])
        rows = [starts[j] + i for j, emitted in enumerate(tokens) for i in range(len(emitted))]
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        emitted = torch.tensor([t for ts in tokens for t in ts], device=logits.device)
        found = iter(sampled_logprobs(logits[index], emitted, [batch[r] for r in rows]))
        return VerifyOutput(tokens, [[next(found) for _ in ts] for ts in tokens])

    def _verify_greedy(self, logits, batch, drafts, starts, seqs, tokens) -> None:
        rows = [r for j in seqs for r in range(starts[j], starts[j + 1])]
        index = row_index(rows, len(batch), logits.device)
        processed = apply_penalties(take_rows(logits, index), [batch[r] for r in rows],
                                    self.eos_token_ids)  # fmt: skip
        targets = iter(first_argmax(processed).tolist())
        for j in seqs:
            row_targets = [next(targets) for _ in range(len(drafts[j]) + 1)]
            tokens[j] = row_targets[: accepted_greedy(row_targets, drafts[j]) + 1]

    def _verify_sampled(self, logits, batch, drafts, starts, seqs, tokens) -> None:
        rows = [r for j in seqs for r in range(starts[j], starts[j + 1])]
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        probs = self.distribution(logits[index], [batch[r] for r in rows])
        # One uniform per draft token (its test) and one for the final draw, from the
        # sequence's own generator when it has a seed.
        uniforms = self._generators.uniforms([batch[r] for r in rows]).tolist()
        local = list(itertools.accumulate((len(drafts[j]) + 1 for j in seqs), initial=0))
        draft_rows = [local[n] + i for n, j in enumerate(seqs) for i in range(len(drafts[j]))]
        draft_ids = [t for j in seqs for t in drafts[j]]
        draft_probs = iter(probs[draft_rows, draft_ids].tolist())
        weights, finals = [], []
        for n, j in enumerate(seqs):
            draft, start = drafts[j], local[n]
            passed = accepted_sampled(
                [next(draft_probs) for _ in draft], uniforms[start : start + len(draft)]
            )
            weights.append(final_weights(probs[start : local[n + 1]], draft, passed))
            finals.append(uniforms[start + len(draft)])
            tokens[j] = draft[:passed]
        finals = torch.tensor(finals, dtype=torch.float64, device=probs.device)
        drawn = inverse_cdf(torch.stack(weights), finals)
        for j, token in zip(seqs, drawn.tolist(), strict=True):
            tokens[j].append(token)

    def _mask_by_grammar(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        rows = [i for i, row in enumerate(batch) if row.matcher is not None]
        if rows:
            mask_logits(logits, rows, [batch[i].matcher for i in rows], self.eos_token_ids)

    def _mask_drafts_by_grammar(self, logits, batch, drafts, starts) -> None:
        seqs = [j for j in range(len(drafts)) if batch[starts[j]].matcher is not None]
        if seqs:
            matchers = [batch[starts[j]].matcher for j in seqs]
            chosen = [drafts[j] for j in seqs]
            mask_draft_logits(logits, [starts[j] for j in seqs], matchers, chosen,
                              self.eos_token_ids)  # fmt: skip

    def distribution(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The probabilities [num_seqs, vocab] each sequence would draw from this step
        (one-hot for greedy ones), without drawing: for tests and debugging."""
        self._check_logits(logits, batch)
        logits = logits.clone()
        self._mask_by_grammar(logits, batch)
        processed = apply_penalties(logits, batch, self.eos_token_ids)
        probs = torch.zeros_like(logits)
        greedy, sampled = split_greedy(batch)
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            probs[rows, processed[rows].argmax(-1)] = 1.0
        found, full = candidate_pass(processed, batch, sampled)
        if found is not None:
            rows, columns, weights = found
            kept = torch.zeros(len(rows), logits.shape[1], dtype=torch.float64, device=rows.device)
            kept.scatter_add_(1, columns.clamp(max=logits.shape[1] - 1), weights)
            probs[rows] = (kept / kept.sum(-1, keepdim=True)).float()
        if full:
            rows = torch.tensor(full, device=logits.device)
            weights = sampling_weights(processed[rows], [batch[i] for i in full])
            probs[rows] = weights / weights.sum(-1, keepdim=True)
        return probs

    def _check_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        if logits.dim() != 2 or logits.shape != (len(batch), self.vocab_size):
            raise ValueError(
                f"logits must have shape [num_seqs={len(batch)}, vocab_size={self.vocab_size}],"
                f" got {list(logits.shape)}"
            )
        if logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32, got {logits.dtype}")
