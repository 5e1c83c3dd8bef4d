"""Speculative decoding's verification: the target model's rows at a draft's positions
-> how much of the draft is accepted, and the one token that follows it.

A sequence with draft d_1..d_k has k + 1 rows: row i is the target's distribution p_i
for the token after d_1..d_i (row 0: after the sequence's own tokens). Each row is
processed as the plain sampler would process it at that position (penalties over the
tokens as they stand there, temperature, top-k/top-p/min-p).

- Greedy rows: t_i = argmax p_i; d_{i+1} is accepted while it equals t_i, and t_a
  follows the a accepted tokens: exactly the tokens plain greedy decoding gives.
- Sampled rows, for a point-mass draft (q_i = one-hot at d_{i+1}, as n-gram proposals
  are): d_{i+1} is accepted with probability min(1, p_i / q_i) = p_i(d_{i+1}); at the
  first rejection the token is drawn from the residual max(0, p_i - q_i), which is p_i
  without d_{i+1}, renormalised; if all k are accepted, a bonus token is drawn from p_k.
  Each emitted token is then distributed exactly as plain sampling's (Leviathan et al.,
  2023, "Fast Inference from Transformers via Speculative Decoding").
"""

from __future__ import annotations

import torch


def accepted_greedy(targets: list[int], draft: list[int]) -> int:
    """How many of the draft's tokens equal the target's argmax at their position."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n


def accepted_sampled(draft_probs: list[float], uniforms: list[float]) -> int:
    """How many draft tokens pass in turn: the i-th when uniforms[i] < its probability
    under the target (the first failure ends the run)."""
    n = 0
    while n < len(draft_probs) and uniforms[n] < draft_probs[n]:
        n += 1
    return n


def final_weights(probs: torch.Tensor, draft: list[int], accepted: int) -> torch.Tensor:
    """The weights [vocab] the token after the accepted run is drawn from: the residual
    p_a with the rejected draft token removed, or p_k (the bonus) when all passed."""
    if accepted == len(draft):
        return probs[accepted]
    weights = probs[accepted].clone()
    weights[draft[accepted]] = 0.0
    return weights
