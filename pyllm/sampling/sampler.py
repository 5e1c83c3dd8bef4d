"""The sampler: one batched pass from a step's logits [num_seqs, vocab] to one token per sequence.

Each sequence's SamplingParams shape its own distribution, in vLLM's order:

1. logits processing, on a copy of the logits: logit_bias is added; while a sequence has
   fewer than min_tokens outputs its EOS and stop_token_ids get -inf; repetition_penalty
   (CTRL: a positive logit is divided by it, a negative one multiplied) over the last
   repeat_last_n tokens of prompt + output (all of them when repeat_last_n is 0);
   presence_penalty and frequency_penalty over the generated tokens (OpenAI: logit -=
   presence * (count > 0) + frequency * count).
2. greedy sequences (temperature below GREEDY_TEMPERATURE) take the argmax; the others divide
   by their temperature and keep, of the resulting softmax,
   - top_k: the tokens at least as likely as the k-th most likely one;
   - top_p: of those, renormalized, the most likely ones until their mass reaches top_p;
   - min_p: the tokens at least min_p times as likely as the most likely one.
   Every cut is a threshold on the probability, so tokens tied at a boundary are all kept
   and the result does not depend on how a sort orders ties.
3. one uniform number per sequence picks a token by inverse CDF over the kept
   probabilities in token-id order.

Nothing loops over the vocabulary in Python: penalties touch only the (row, token) pairs
that occur in the context, the cuts and the draw are batched tensor ops, and transforms no
sequence of the step asks for are skipped (an all-greedy step is one argmax).

Rows with a small top_k take a narrower path (_candidate_pass): one block-maxima pass finds
their top_k tokens (plus a few tied with the k-th), and the cuts and the draw run on those
candidates only. There top-k keeps the tokens whose processed logit is at least the k-th
largest: the same set as the probability threshold, except where float32 rounding of the
softmax would tie distinct logits. Rows whose boundary ties are too many go the full way.

Reproducibility: a request with a seed draws from its own CPU torch.Generator, advanced once
per sampled step of that sequence only, and its row is computed row-wise, so its tokens are
the same whatever else is in the batch and in whatever order requests arrive. Unseeded
requests share one generator seeded from the OS. Logprobs describe the model's own
distribution: log_softmax of the raw logits, before penalties and temperature.
"""

from __future__ import annotations

import array
import itertools
import weakref
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pyllm.sampling.params import ParamError, SamplingParams

if TYPE_CHECKING:
    from pyllm.engine.sequence import Sequence

# Temperatures below this are treated as 0 (greedy): dividing logits by them could overflow.
GREEDY_TEMPERATURE = 1e-5
# Chunk length of the two-level inverse CDF (see _inverse_cdf). About sqrt(vocab), and
# small enough that the per-chunk work of up to 128 rows stays below torch's 32768-element
# grain (one thread, no wake-up cost).
_CHUNK = 256
# Rows are read in blocks of _BLOCK for argmax and small top-k: block maxima first.
_BLOCK = 128
# Top-k/top-p thresholds come from the K largest probabilities: K = top_k + 1 settles a
# top-k row; rows with top-p alone start at _FIRST_K. K grows _GROWTH x for rows whose kept
# set turns out larger. torch.topk's cost grows with K (on this CPU, K=128 about twice
# K=32, K=1024 about seven times), and a full sort costs ~100 times K=32.
_FIRST_K = 128
_GROWTH = 4

Logprobs = tuple[float, dict[int, float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per sequence: (chosen token's logprob, {token: logprob} of the top k) when its
    # sampling_params.logprobs is k (0: an empty dict) or its request ranks best_of
    # samples (k = 0 unless logprobs asks more), else None.
    logprobs: list[Logprobs | None]


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
        # Unseeded requests share this generator; seed it from the OS unless told otherwise.
        self._shared = torch.Generator()
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        # Seeded sequences' own generators. Weak keys: a sequence dropped without forget()
        # does not leak its generator.
        self._generators: weakref.WeakKeyDictionary[Sequence, torch.Generator] = (
            weakref.WeakKeyDictionary()
        )

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

    def forget(self, seq: Sequence) -> None:
        """Drop the sequence's state (its generator); call when it finishes or is aborted."""
        self._generators.pop(seq, None)

    # Inference mode: the model runner's logits are inference tensors, which may only be
    # updated in place inside it.
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> SamplerOutput:
        self._check_logits(logits, seqs)
        # Penalties go into the caller's logits in place and are undone before returning
        # (logprobs then read the raw logits): it saves copying the whole tensor.
        undo: list[tuple[torch.Tensor, torch.Tensor]] = []
        processed = _penalize(logits, seqs, self.eos_token_ids, undo)
        try:
            token_ids = self._sample(processed, seqs)
        finally:
            _restore(logits, undo)
        return SamplerOutput(token_ids.tolist(), self._logprobs(logits, token_ids, seqs))

    def _sample(self, processed: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        greedy, sampled = _split_greedy(seqs)
        token_ids = torch.empty(len(seqs), dtype=torch.int64, device=processed.device)
        if greedy:
            rows = _rows(greedy, len(seqs), processed.device)
            _put_rows(token_ids, rows, first_argmax(_take_rows(processed, rows)))
        if sampled:
            # One uniform per sampled sequence, drawn before the rows split into paths, so
            # each generator advances once per step whichever path its row takes.
            uniforms = torch.zeros(len(seqs), dtype=torch.float64)
            uniforms[sampled] = self._uniforms([seqs[i] for i in sampled])
            uniforms = uniforms.to(processed.device)
            found, full = _candidate_pass(processed, seqs, sampled)
            if found is not None:
                rows, columns, weights = found
                picks = _inverse_cdf_exact(weights, uniforms[rows])
                token_ids[rows] = columns.gather(1, picks).squeeze(1)
            if full:
                rows = _rows(full, len(seqs), processed.device)
                weights = sampling_weights(_take_rows(processed, rows), [seqs[i] for i in full])
                _put_rows(token_ids, rows, _inverse_cdf(weights, _take_rows(uniforms, rows)))
        return token_ids

    def distribution(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        """The probabilities [num_seqs, vocab] each sequence would draw from this step
        (one-hot for greedy ones), without drawing: for tests and debugging."""
        self._check_logits(logits, seqs)
        processed = apply_penalties(logits, seqs, self.eos_token_ids)
        probs = torch.zeros_like(logits)
        greedy, sampled = _split_greedy(seqs)
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            probs[rows, processed[rows].argmax(-1)] = 1.0
        found, full = _candidate_pass(processed, seqs, sampled)
        if found is not None:
            rows, columns, weights = found
            kept = torch.zeros(len(rows), logits.shape[1], dtype=torch.float64, device=rows.device)
            kept.scatter_add_(1, columns.clamp(max=logits.shape[1] - 1), weights)
            probs[rows] = (kept / kept.sum(-1, keepdim=True)).float()
        if full:
            rows = torch.tensor(full, device=logits.device)
            weights = sampling_weights(processed[rows], [seqs[i] for i in full])
            probs[rows] = weights / weights.sum(-1, keepdim=True)
        return probs

    def _check_logits(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> None:
        if logits.dim() != 2 or logits.shape != (len(seqs), self.vocab_size):
            raise ValueError(
                f"logits must have shape [num_seqs={len(seqs)}, vocab_size={self.vocab_size}],"
                f" got {list(logits.shape)}"
            )
        if logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32, got {logits.dtype}")

    def _uniforms(self, seqs: list[Sequence]) -> torch.Tensor:
        """One uniform in [0, 1) per sequence (float64, on the CPU): from the sequence's
        own generator when it has a seed, else from the shared one."""
        uniforms = torch.empty(len(seqs), dtype=torch.float64)
        unseeded = [i for i, seq in enumerate(seqs) if seq.sampling_params.seed is None]
        if unseeded:
            draws = torch.rand(len(unseeded), generator=self._shared, dtype=torch.float64)
            uniforms[unseeded] = draws
        for i, seq in enumerate(seqs):
            if seq.sampling_params.seed is not None:
                uniforms[i] = torch.rand(1, generator=self._generator(seq), dtype=torch.float64)
        return uniforms

    def _generator(self, seq: Sequence) -> torch.Generator:
        generator = self._generators.get(seq)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(seq.sampling_params.seed)
            self._generators[seq] = generator
        return generator

    def _logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, seqs: SequenceOf[Sequence]
    ) -> list[Logprobs | None]:
        out: list[Logprobs | None] = [None] * len(seqs)
        rows = [
            i
            for i, seq in enumerate(seqs)
            if seq.sampling_params.logprobs is not None or seq.sampling_params.ranks_samples
        ]
        if rows:
            index = _rows(rows, len(seqs), logits.device)
            ks = [seqs[i].sampling_params.logprobs or 0 for i in rows]
            found = _token_logprobs(_take_rows(logits, index), _take_rows(token_ids, index), ks)
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


# ----------------------------------------------------------------------------- penalties


def apply_penalties(
    logits: torch.Tensor, seqs: SequenceOf[Sequence], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """Step 1 of the module docstring. Returns `logits` itself when no sequence asks for any
    of it, else a processed copy. Works on flat addresses row * vocab + token of the tokens
    that occur, so its cost follows the context length, not the vocabulary."""
    return _penalize(logits, seqs, eos_token_ids, None)


def _penalize(
    logits: torch.Tensor,
    seqs: SequenceOf[Sequence],
    eos_token_ids: frozenset[int],
    undo: list[tuple[torch.Tensor, torch.Tensor]] | None,
) -> torch.Tensor:
    """apply_penalties; with an `undo` list and contiguous logits, in place instead of on a
    copy (a full copy costs as much as a softmax pass): the values it overwrites are
    appended to `undo` first, for _restore to put back."""
    vocab = logits.shape[1]
    bias_ids: list[int] = []
    bias_values: list[float] = []
    masked_rows, masked_tokens = [], []
    repeat_rows, repeat_tokens, repeat_penalties = [], [], []
    output_rows, output_tokens, presence, frequency = [], [], [], []
    for row, seq in enumerate(seqs):
        params = seq.sampling_params
        for token, bias in params.logit_bias.items():
            bias_ids.append(row * vocab + token)
            bias_values.append(bias)
        if seq.num_output_tokens < params.min_tokens:
            masked_rows.append(row)
            masked_tokens.append([*eos_token_ids, *params.stop_token_ids])
        if params.repetition_penalty != 1.0:
            n = params.repeat_last_n
            repeat_rows.append(row)
            repeat_tokens.append(seq.token_ids[-n:] if n else seq.token_ids)
            repeat_penalties.append(params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            output_rows.append(row)
            output_tokens.append(seq.output_token_ids)
            presence.append(params.presence_penalty)
            frequency.append(params.frequency_penalty)
    if not (bias_ids or masked_rows or repeat_rows or output_rows):
        return logits

    device = logits.device
    if undo is None or not logits.is_contiguous():
        logits = logits.clone(memory_format=torch.contiguous_format)
        undo = None
    flat = logits.view(-1)

    def save(ids: torch.Tensor) -> torch.Tensor:
        if undo is not None:
            undo.append((ids, flat[ids]))
        return ids

    if bias_ids:
        ids = save(torch.tensor(bias_ids, dtype=torch.int64, device=device))
        flat.index_add_(0, ids, torch.tensor(bias_values, dtype=flat.dtype, device=device))
    if masked_rows:
        ids = save(_flat_ids(masked_rows, masked_tokens, vocab, device))
        flat.index_fill_(0, ids, float("-inf"))
    if repeat_rows:
        # Each distinct token once per row: the penalty scales a logit once, however often
        # the token occurs.
        ids = save(torch.unique(_flat_ids(repeat_rows, repeat_tokens, vocab, device)))
        penalty = _per_row(repeat_rows, repeat_penalties, len(seqs), 1.0, device)[ids // vocab]
        values = flat[ids]
        flat[ids] = torch.where(values > 0, values / penalty, values * penalty)
    if output_rows:
        ids, counts = torch.unique(
            _flat_ids(output_rows, output_tokens, vocab, device), return_counts=True
        )
        save(ids)
        rows = ids // vocab
        presence_t = _per_row(output_rows, presence, len(seqs), 0.0, device)[rows]
        frequency_t = _per_row(output_rows, frequency, len(seqs), 0.0, device)[rows]
        flat.index_add_(0, ids, -(frequency_t * counts + presence_t))
    return logits


def _restore(logits: torch.Tensor, undo: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Undoes _penalize in place: the saved values back, the last change first (an id
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


# ----------------------------------------------------------------------------- the cuts


def _split_greedy(seqs: SequenceOf[Sequence]) -> tuple[list[int], list[int]]:
    greedy, sampled = [], []
    for i, seq in enumerate(seqs):
        (greedy if seq.sampling_params.temperature < GREEDY_TEMPERATURE else sampled).append(i)
    return greedy, sampled


def sampling_weights(logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
    """The kept probabilities [num_seqs, vocab] of sampled (non-greedy) rows, step 2 of the
    module docstring: softmax(logits / temperature), zero where top-k, top-p or min-p cut
    (not renormalized: the draw only needs proportions)."""
    num_seqs, vocab = logits.shape
    device = logits.device
    params = [seq.sampling_params for seq in seqs]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    # softmax is one fused row-wise kernel: faster than exp(x - max) in separate ops, and
    # each row's result does not depend on the other rows.
    probs = torch.softmax(logits / temperature.to(device)[:, None], dim=-1)

    # top_k 0 means off; so does a k that keeps the whole vocabulary.
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    top_p = [p.top_p for p in params]
    cut = [i for i in range(num_seqs) if top_k[i] or top_p[i] < 1.0]
    if not cut and not any(p.min_p for p in params):
        return probs
    threshold = torch.zeros(num_seqs, dtype=torch.float32, device=device)
    if any(p.min_p for p in params):  # relative to the most likely token
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        threshold = min_p * probs.amax(-1)
    if cut:
        rows = _rows(cut, num_seqs, device)
        found = _top_k_top_p_thresholds(
            _take_rows(probs, rows),
            torch.tensor([top_k[i] for i in cut], device=device),
            torch.tensor([top_p[i] for i in cut], dtype=torch.float64, device=device),
            max(top_k[i] for i in cut),
        )
        _put_rows(threshold, rows, torch.maximum(_take_rows(threshold, rows), found))
    return _zero_below(probs, threshold)


def _zero_below(probs: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """probs with entries below their row's threshold set to 0 (in place on the CPU)."""
    if probs.device.type != "cpu":
        return torch.where(probs >= threshold[:, None], probs, torch.zeros_like(probs[:1, :1]))
    # On the CPU one in-place pass per row beats where() (a mask pass, then a select pass)
    # and masked_fill_ (no vectorized kernel) by 2-5x. threshold_ keeps x > t, so t is the
    # largest float32 below the threshold, to keep x >= threshold.
    below = torch.nextafter(threshold, torch.zeros_like(threshold)).tolist()
    for row, (t, cut) in enumerate(zip(below, threshold.tolist(), strict=True)):
        if cut > 0:
            torch.nn.functional.threshold_(probs[row], t, 0.0)
    return probs


def _top_k_top_p_thresholds(
    weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k_max: int
) -> torch.Tensor:
    """Per row, the smallest weight that top-k then top-p keep (top_k 0: off, top_p 1: off).

    Looks only at the K largest weights, growing K for the rows it cannot settle. The
    result equals a full sort's: it depends on the sorted values only, which a top-K prefix
    has exactly.
    """
    num_rows, vocab = weights.shape
    thresholds = weights.new_empty(num_rows)
    total = _chunk_mass(weights).double().sum(-1)  # what top-p is relative to, without top-k
    rows = torch.arange(num_rows, device=weights.device)
    candidates = weights  # the rows still unsettled
    k = min(vocab, max(k_max + 1, _FIRST_K if bool((top_k == 0).any()) else 1))
    while True:
        values = candidates.topk(k, dim=-1).values  # descending
        found, settled = _thresholds_from_prefix(values, top_k[rows], top_p[rows], total[rows])
        if k == vocab:
            thresholds[rows] = found
            return thresholds
        thresholds[rows[settled]] = found[settled]
        rows = rows[~settled]
        if rows.numel() == 0:
            return thresholds
        candidates = weights.index_select(0, rows)
        k = min(vocab, k * _GROWTH)


def _thresholds_from_prefix(
    values: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, total: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds from the K largest weights of each row (descending), and whether each row
    is settled, i.e. the weights past the prefix cannot change its threshold."""
    k_on = top_k > 0
    at_k = values.gather(1, (top_k.clamp(min=1) - 1)[:, None]).squeeze(1)  # k <= K
    k_threshold = torch.where(k_on, at_k, torch.zeros_like(at_k))
    kept = values * (values >= k_threshold[:, None])
    kept = kept.double()
    # Sequential prefix sums: the kept mass and each rank's mass do not depend on K (the
    # zeros past the kept ranks add nothing), so neither does the result.
    cumulative = kept.cumsum(-1)
    mass = torch.where(k_on, cumulative[:, -1], total)
    # Mass strictly before each rank: a token is needed while what precedes it is < p * mass.
    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
    needed = (before < (top_p * mass)[:, None]) | (top_p >= 1.0)[:, None]
    num_kept = ((kept > 0) & needed).sum(-1)  # >= 1: rank 0 has nothing before it
    threshold = values.gather(1, (num_kept - 1)[:, None]).squeeze(1)
    # With top-k, the prefix must hold every token >= the k-th weight (ties included) for
    # the renormalized mass to be right; without it, top-p must stop inside the prefix.
    # A prefix ending in a zero weight holds every positive weight: nothing is left out.
    last = values[:, -1]
    settled = torch.where(k_on, last < k_threshold, num_kept < values.shape[1]) | (last == 0)
    return threshold, settled


# ----------------------------------------------------------------------------- small top-k


def _candidate_pass(
    processed: torch.Tensor, seqs: SequenceOf[Sequence], sampled: list[int]
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, list[int]]:
    """The fast path of sampled rows with a small top_k: only their top_k tokens (and those
    tied with the k-th) can be kept, so the cuts and the draw run on a few dozen
    candidates per row, never on the whole vocabulary (no softmax over it, no full-row
    top-k, threshold or prefix-sum pass: one vectorized block-maxima pass finds them).

    Returns ((rows, columns, weights) or None, the other sampled rows): columns [rows, W]
    ascending token ids of the candidates, weights [rows, W] float64 kept weights
    proportional to the probabilities (zero where a cut removed the token, or for a
    padding column, whose id may lie past the vocabulary). A row goes to the full path
    instead when more than _slack(top_k) tokens or blocks beyond its top_k tie at the
    boundary (bf16 logits tie often; a few such ties are handled here).

    Weights are softmax(x / T) up to a row factor: exp((x - max) / T). top-k keeps the
    tokens whose processed logit is at least the k-th largest (ties kept); top-p and min-p
    then cut on the weights, as in sampling_weights. Whether a row is settled here depends
    on its own top_k only, never on the other rows, and nothing it computes does either.
    """
    vocab = processed.shape[1]
    params = {i: seqs[i].sampling_params for i in sampled}
    limit = {i: params[i].top_k + _slack(params[i].top_k) for i in sampled if params[i].top_k > 0}
    # Gather at most half the vocabulary; smaller vocabularies go the full way.
    fast = [i for i in sampled if i in limit and limit[i] * _BLOCK * 2 <= vocab]
    fast_set = set(fast)
    full = [i for i in sampled if i not in fast_set]
    if not fast:
        return None, full
    device = processed.device
    rows = torch.tensor(fast, dtype=torch.int64, device=device)
    x = _take_rows(processed, _rows(fast, processed.shape[0], device))
    top_k = torch.tensor([params[i].top_k for i in fast], device=device)
    own = torch.tensor([limit[i] for i in fast], device=device)
    num_blocks = max(limit[i] for i in fast)

    maxima = _block_maxima(x)
    blocks = maxima.topk(num_blocks, dim=-1).indices
    if vocab % _BLOCK == 0:
        # Whole blocks: one copy of contiguous block rows, no index arithmetic per column.
        row_ids = torch.arange(len(fast), device=device)[:, None]
        values = x.unflatten(1, (-1, _BLOCK))[row_ids, blocks].flatten(1)
        columns = None
    else:
        columns, values = _gather_blocks(x, blocks)
    # The largest `width` gathered values: the row's own limit plus one (to see whether the
    # ties end within it), rounded up to whole 16-lane vectors so every elementwise op
    # below runs the same vector code on every column, whatever the batch's width.
    width = min(-(-(num_blocks + 1) // 16) * 16, values.shape[1])
    top_values, where = values.topk(width, dim=-1)
    kth = top_values.gather(1, (top_k - 1)[:, None])
    # Settled when every block holding a token >= kth was gathered (at most `own` blocks
    # have such a max, and the `own` largest maxima were gathered), and every such token
    # is among the top values (the one after the row's own limit is below kth).
    after = top_values.gather(1, own.clamp(max=width - 1)[:, None])
    settled = ((maxima >= kth).sum(-1) <= own) & ((after < kth).squeeze(1) | (own >= width))

    # Candidates in token-id order (the draw's order); those below kth get weight 0.
    if columns is None:
        candidates = blocks.gather(1, where // _BLOCK) * _BLOCK + where % _BLOCK
    else:
        candidates = columns.gather(1, where)
    candidates, order = candidates.sort(dim=-1)
    top_values = top_values.gather(1, order)
    temperature = torch.tensor([params[i].temperature for i in fast], device=device)
    row_max = maxima.amax(-1, keepdim=True)
    weights = torch.exp((top_values - row_max) / temperature[:, None])
    weights = torch.where(top_values >= kth, weights, torch.zeros_like(weights)).double()
    threshold = _top_p_threshold(weights, [params[i].top_p for i in fast])
    # min_p is relative to the most likely token, whose weight is exp(0) = 1.
    min_p = torch.tensor([params[i].min_p for i in fast], dtype=torch.float64, device=device)
    threshold = torch.maximum(threshold, min_p)
    weights = torch.where(weights >= threshold[:, None], weights, torch.zeros_like(weights))
    if bool(settled.all()):
        return (rows, candidates, weights), full
    unsettled = (~settled).nonzero().squeeze(1).tolist()
    full = sorted(full + [fast[i] for i in unsettled])
    keep = settled.nonzero().squeeze(1)
    if keep.numel() == 0:
        return None, full
    return (rows[keep], candidates[keep], weights[keep]), full


def _slack(top_k: int) -> int:
    """How many tokens (and blocks) tied with the k-th largest the fast path takes beyond
    top_k before handing the row to the full path."""
    return max(8, top_k // 4)


def _top_p_threshold(weights: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Per row, the smallest weight top-p keeps of `weights` (float64, the top-k survivors
    positive, the rest zero; narrow), or 0 when top_p is 1."""
    device = weights.device
    if all(p >= 1.0 for p in top_p):
        return torch.zeros(weights.shape[0], dtype=torch.float64, device=device)
    values = weights.sort(dim=-1, descending=True).values
    p = torch.tensor(top_p, dtype=torch.float64, device=device)
    # Zeros past the survivors add nothing to the prefix sums: the mass is the survivors'.
    found, _ = _thresholds_from_prefix(
        values, torch.zeros_like(p, dtype=torch.int64), p, values.cumsum(-1)[:, -1]
    )
    return torch.where(p < 1.0, found, torch.zeros_like(found))


# ----------------------------------------------------------------------------- the draw


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative weight exceeds uniform * total weight: a draw
    proportional to the weights, in token-id order, so ties cannot reorder it.

    weights: [rows, vocab] >= 0, each row with a positive entry; uniforms: [rows] float64 in
    [0, 1). Two levels, chunk masses then the prefix sums of one chunk, so the row is read
    once rather than prefix-summed whole; sums are float64. Targets are clamped below each
    total so rounding can never land past the last positive weight: the chosen token always
    has a positive weight.
    """
    num_rows, vocab = weights.shape
    chunk_cdf = _chunk_mass(weights).double().cumsum(-1)  # [rows, chunks]
    target = (uniforms * chunk_cdf[:, -1])[:, None]
    target = torch.minimum(target, _below(chunk_cdf[:, -1:]))
    chunk = torch.searchsorted(chunk_cdf, target, right=True)  # [rows, 1]
    mass_before = chunk_cdf.gather(1, (chunk - 1).clamp(min=0))
    target = target - torch.where(chunk > 0, mass_before, torch.zeros_like(mass_before))
    columns = chunk * _CHUNK + torch.arange(_CHUNK, device=weights.device)  # [rows, _CHUNK]
    local = weights.gather(1, columns.clamp(max=vocab - 1)).double()
    local_cdf = torch.where(columns < vocab, local, torch.zeros_like(local)).cumsum(-1)
    target = torch.minimum(target, _below(local_cdf[:, -1:]))
    offset = torch.searchsorted(local_cdf, target, right=True)
    return (chunk * _CHUNK + offset).squeeze(1)


def _inverse_cdf_exact(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """_inverse_cdf for narrow float64 weights [rows, C], as [rows, 1] indices: one
    sequential prefix sum per row. Zero weights add exactly nothing to it, so the pick does
    not depend on how many zero columns surround the kept tokens (how many blocks the
    batch gathered)."""
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, _below(total))
    return torch.searchsorted(cdf, target, right=True)


def _chunk_mass(weights: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(vocab / _CHUNK)]: the sum of each chunk of _CHUNK columns (the last one
    possibly partial). Each chunk is one reduction of its own, so a row's sums are the same
    whatever other rows the tensor holds (a whole-row sum may be split across threads when
    there is a single row, and round differently)."""
    whole = weights.shape[1] // _CHUNK * _CHUNK
    mass = weights[:, :whole].unflatten(1, (-1, _CHUNK)).sum(-1)
    if whole < weights.shape[1]:
        mass = torch.cat([mass, weights[:, whole:].sum(-1, keepdim=True)], dim=1)
    return mass


def _below(x: torch.Tensor) -> torch.Tensor:
    """The largest float64 below x (x > 0)."""
    return torch.nextafter(x, torch.zeros_like(x))


# ----------------------------------------------------------------------------- selection
# torch's CPU argmax and topk do scalar work per element (several times slower than a max
# reduction over a [64, 49152] row set). Block maxima, a fast vectorized reduction, narrow
# the search to a few blocks first; the answers are exactly those of the whole rows.


def _block_maxima(x: torch.Tensor) -> torch.Tensor:
    """[rows, ceil(n / _BLOCK)]: the max of each block of _BLOCK columns (the last one
    possibly partial)."""
    whole = x.shape[1] // _BLOCK * _BLOCK
    maxima = x[:, :whole].unflatten(1, (-1, _BLOCK)).amax(-1)
    if whole < x.shape[1]:
        maxima = torch.cat([maxima, x[:, whole:].amax(-1, keepdim=True)], dim=1)
    return maxima


def _gather_blocks(x: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The columns of the given blocks [rows, b] and x's values there, -inf past the row."""
    columns = (blocks[:, :, None] * _BLOCK + torch.arange(_BLOCK, device=x.device)).flatten(1)
    values = x.gather(1, columns.clamp(max=x.shape[1] - 1))
    return columns, torch.where(columns < x.shape[1], values, float("-inf"))


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (the first index of each row's max): the first block holding the row
    max, then the first max inside it."""
    if x.shape[1] < 4 * _BLOCK:
        return x.argmax(-1)
    block = _block_maxima(x).argmax(-1)
    columns, values = _gather_blocks(x, block[:, None])
    return columns.gather(1, values.argmax(-1, keepdim=True)).squeeze(1)


def small_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(k, -1) for small k: the k largest values lie in the k blocks with the largest
    maxima (a block holding one of them has a max at least that large), so only those
    blocks are searched. Values are exactly topk's; among tied values the ids may differ."""
    if x.shape[1] < 8 * _BLOCK * k:
        return x.topk(k, dim=-1)
    columns, values = _gather_blocks(x, _block_maxima(x).topk(k, dim=-1).indices)
    top_values, where = values.topk(k, dim=-1)
    if bool((top_values[:, -1] == float("-inf")).any()):
        # Fewer than k finite values: a -inf padding column past the row could be picked.
        return x.topk(k, dim=-1)
    return top_values, columns.gather(1, where)


# ----------------------------------------------------------------------------- helpers


def _rows(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """Index tensor of `rows`, or None when they are all rows in order (no gather needed)."""
    if len(rows) == num_rows:
        return None
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _take_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


def _put_rows(x: torch.Tensor, rows: torch.Tensor | None, values: torch.Tensor) -> None:
    if rows is None:
        x.copy_(values)
    else:
        x[rows] = values
