"""Prompt lookup (n-gram) proposals: the sequence's last n tokens are looked up in its
own prompt + output, and the up-to-k tokens that followed their most recent earlier
occurrence are proposed. The longest n in [prompt_lookup_min, prompt_lookup_max] with
a match wins. No model runs: what is proposed is a guess the target model checks.

The search is vectorised over the last SEARCH_WINDOW tokens: one comparison pass per n,
so a proposal costs O(window * prompt_lookup_max) and stays in the tens of
microseconds whatever the context length.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np

from pyllm.engine.sequence import Sequence

SEARCH_WINDOW = 4096  # tokens searched, most recent first; older matches are missed


def propose_ngram(token_ids: SequenceOf[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix
    of token_ids of length in [min_n, max_n] that occurs earlier; [] if none does."""
    tokens = np.asarray(token_ids[-SEARCH_WINDOW:], dtype=np.int64)
    length = len(tokens)
    max_n = min(max_n, length - 1)
    if k < 1 or max_n < min_n:
        return []
    # match[e]: the n tokens ending at e equal the last n tokens. e stops at length - 2,
    # so the suffix itself never matches and at least one token follows a match.
    match = tokens[:-1] == tokens[-1]
    end = -1
    for n in range(1, max_n + 1):
        if n > 1:
            match[n - 1 :] &= tokens[: length - n] == tokens[length - n]
            match[: n - 1] = False
        hits = np.flatnonzero(match)
        if hits.size == 0:
            break  # no longer n-gram can match either
        if n >= min_n:
            end = int(hits[-1])
    if end < 0:
        return []
    return tokens[end + 1 : end + 1 + k].tolist()


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """The Speculator's proposer for method "ngram": nothing held between steps."""

    min_n: int
    max_n: int

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """Per sequence, up to its length of proposed tokens ([] when nothing matches)."""
        return [
            propose_ngram(seq.token_ids, k, self.min_n, self.max_n)
            for seq, k in zip(seqs, lengths, strict=True)
        ]

    def forget(self, seq: Sequence) -> None:
        """Nothing to release: proposals are looked up afresh each step."""
