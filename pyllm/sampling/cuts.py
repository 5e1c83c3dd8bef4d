"""Step 2 of sampling, the cuts: greedy sequences (temperature below GREEDY_TEMPERATURE)
take the argmax; the others divide by their temperature and keep, of the resulting
softmax,

- top_k: the tokens at least as likely as the k-th most likely one;
- top_p: of those, renormalized, the most likely ones until their mass reaches top_p;
- min_p: the tokens at least min_p times as likely as the most likely one.

Every cut is a threshold on the probability, so tokens tied at a boundary are all kept
and the result does not depend on how a sort orders ties. The cuts are batched tensor
ops; a transform no sequence of the step asks for is skipped.

Two paths compute them. sampling_weights, the full one, works on whole rows. Rows with a
small top_k take a narrower one (candidate_pass): one block-maxima pass finds their top_k
tokens (plus a few tied with the k-th), and the cuts and the draw run on those candidates
only. There top-k keeps the tokens whose processed logit is at least the k-th largest:
the same set as the probability threshold, except where float32 rounding of the softmax
would tie distinct logits. Rows whose boundary ties are too many go the full way.
tests/sampling/test_sampler.py pins the two paths to each other.
"""

from __future__ import annotations

import torch

from pyllm.sampling.batch import SamplingBatch, put_rows, row_index, take_rows
from pyllm.sampling.draw import chunk_mass
from pyllm.sampling.params import SamplingParams
from pyllm.sampling.select import BLOCK, block_maxima, gather_blocks

# Top-k/top-p thresholds come from the K largest probabilities: K = top_k + 1 settles a
# top-k row; rows with top-p alone start at _FIRST_K. K grows _GROWTH x for rows whose kept
# set turns out larger. torch.topk's cost grows with K (on this CPU, K=128 about twice
# K=32, K=1024 about seven times), and a full sort costs ~100 times K=32.
_FIRST_K = 128
_GROWTH = 4


def sampling_weights(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The kept probabilities [num_seqs, vocab] of sampled (non-greedy) rows, step 2 of the
    module docstring: softmax(logits / temperature), zero where top-k, top-p or min-p cut
    (not renormalized: the draw only needs proportions)."""
    num_seqs, vocab = logits.shape
    device = logits.device
    params = [row.params for row in batch]
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
        rows = row_index(cut, num_seqs, device)
        found = _top_k_top_p_thresholds(
            take_rows(probs, rows),
            torch.tensor([top_k[i] for i in cut], device=device),
            torch.tensor([top_p[i] for i in cut], dtype=torch.float64, device=device),
            max(top_k[i] for i in cut),
        )
        put_rows(threshold, rows, torch.maximum(take_rows(threshold, rows), found))
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
    total = chunk_mass(weights).double().sum(-1)  # what top-p is relative to, without top-k
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


def candidate_pass(
    processed: torch.Tensor, batch: SamplingBatch, sampled: list[int]
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
    params = {i: batch[i].params for i in sampled}
    fast, full, limits = _fast_rows(params, sampled, processed.shape[1])
    if not fast:
        return None, full
    device = processed.device
    rows = torch.tensor(fast, dtype=torch.int64, device=device)
    x = take_rows(processed, row_index(fast, processed.shape[0], device))
    fast_params = [params[i] for i in fast]
    top_k = torch.tensor([p.top_k for p in fast_params], device=device)
    maxima = block_maxima(x)
    ids, values = _largest_in_top_blocks(x, maxima, max(limits))
    kth = values.gather(1, (top_k - 1)[:, None])
    settled = _settled(maxima, values, kth, torch.tensor(limits, device=device))
    candidates, weights = _candidate_weights(ids, values, kth, maxima, fast_params)
    return _keep_settled(rows, candidates, weights, settled, fast, full)


def _fast_rows(
    params: dict[int, SamplingParams], sampled: list[int], vocab: int
) -> tuple[list[int], list[int], list[int]]:
    """(rows for the fast path, the other sampled rows, each fast row's limit: top_k plus
    its slack)."""
    limit = {i: params[i].top_k + _slack(params[i].top_k) for i in sampled if params[i].top_k > 0}
    # Gather at most half the vocabulary; smaller vocabularies go the full way.
    fast = [i for i in sampled if i in limit and limit[i] * BLOCK * 2 <= vocab]
    fast_set = set(fast)
    full = [i for i in sampled if i not in fast_set]
    return fast, full, [limit[i] for i in fast]


def _largest_in_top_blocks(
    x: torch.Tensor, maxima: torch.Tensor, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, logits) [rows, width] of the largest logits in each row's num_blocks
    blocks with the largest maxima, logits descending."""
    blocks = maxima.topk(num_blocks, dim=-1).indices
    if x.shape[1] % BLOCK == 0:
        # Whole blocks: one copy of contiguous block rows, no index arithmetic per column.
        row_ids = torch.arange(x.shape[0], device=x.device)[:, None]
        values = x.unflatten(1, (-1, BLOCK))[row_ids, blocks].flatten(1)
        columns = None
    else:
        columns, values = gather_blocks(x, blocks)
    # The largest `width` gathered values: the row's own limit plus one (to see whether the
    # ties end within it), rounded up to whole 16-lane vectors so every elementwise op on
    # them runs the same vector code on every column, whatever the batch's width.
    width = min(-(-(num_blocks + 1) // 16) * 16, values.shape[1])
    top_values, where = values.topk(width, dim=-1)
    if columns is None:
        return blocks.gather(1, where // BLOCK) * BLOCK + where % BLOCK, top_values
    return columns.gather(1, where), top_values


def _settled(
    maxima: torch.Tensor, top_values: torch.Tensor, kth: torch.Tensor, own: torch.Tensor
) -> torch.Tensor:
    """Per row, whether the gathered top values hold every token >= kth: every block
    holding such a token was gathered (at most `own` blocks have such a max, and the `own`
    largest maxima were gathered), and every such token is among the top values (the one
    after the row's own limit is below kth)."""
    width = top_values.shape[1]
    after = top_values.gather(1, own.clamp(max=width - 1)[:, None])
    return ((maxima >= kth).sum(-1) <= own) & ((after < kth).squeeze(1) | (own >= width))


def _candidate_weights(
    ids: torch.Tensor,
    top_values: torch.Tensor,
    kth: torch.Tensor,
    maxima: torch.Tensor,
    params: list[SamplingParams],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates in token-id order (the draw's order) and their kept weights: those
    below kth, or cut by top-p or min-p, get weight 0."""
    candidates, order = ids.sort(dim=-1)
    top_values = top_values.gather(1, order)
    device = top_values.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    row_max = maxima.amax(-1, keepdim=True)
    weights = torch.exp((top_values - row_max) / temperature[:, None])
    weights = torch.where(top_values >= kth, weights, torch.zeros_like(weights)).double()
    threshold = _top_p_threshold(weights, [p.top_p for p in params])
    # min_p is relative to the most likely token, whose weight is exp(0) = 1.
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64, device=device)
    threshold = torch.maximum(threshold, min_p)
    weights = torch.where(weights >= threshold[:, None], weights, torch.zeros_like(weights))
    return candidates, weights


def _keep_settled(
    rows: torch.Tensor,
    candidates: torch.Tensor,
    weights: torch.Tensor,
    settled: torch.Tensor,
    fast: list[int],
    full: list[int],
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, list[int]]:
    """candidate_pass's result: the settled rows' candidates, the unsettled rows moved to
    the full path."""
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
