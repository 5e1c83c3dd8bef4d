"""Sampler.verify, speculative decoding's verification, against the plain sampler: greedy
rows accept the draft's prefix that matches the argmaxes; sampled rows emit each token
with the plain sampler's probabilities (chi-square tests over fixed seeds), whether the
draft is likely or not."""

from __future__ import annotations

import pytest
import torch

from pyllm.sampling.batch import SamplingRow
from pyllm.sampling.params import SamplingParams
from pyllm.sampling.sampler import Sampler
from tests.sampling.test_sampler import ALPHA, EOS, chi_square_p_value

VOCAB = 10
# Three positions: the pending token's, then after each of two draft tokens.
LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.4, 1.0, 0.6, 0.5, 0.1, -0.3, -0.4, -1.0],
        [0.2, 0.1, 2.5, 0.3, 1.9, -0.5, 0.0, 0.4, -1.0, 0.8],
        [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1],
    ]
)


def _rows(params: SamplingParams, draft: list[int], prompt=(5, 6)) -> list[SamplingRow]:
    tokens = list(prompt)
    rows = []
    for i in range(len(draft) + 1):
        rows.append(SamplingRow(params, tokens, i, key="seq"))
        tokens = tokens + draft[i : i + 1]
    return rows


@pytest.mark.parametrize("draft", [[0, 2], [0, 4], [3, 2], [9, 9]])
def test_greedy_accepts_the_matching_prefix(draft):
    params = SamplingParams(temperature=0.0)
    out = Sampler(VOCAB, EOS).verify(LOGITS.clone(), _rows(params, draft), [draft])
    argmaxes = [0, 2, 0]
    accepted = 0
    while accepted < 2 and draft[accepted] == argmaxes[accepted]:
        accepted += 1
    assert out.token_ids == [argmaxes[: accepted + 1]]
    assert out.logprobs == [[None] * (accepted + 1)]


def test_greedy_rows_see_the_draft_tokens_before_them():
    # At row 2 the context holds both draft tokens: the repetition penalty divides
    # token 0's 1.0 and token 2's 0.8 by 3, and token 1 (0.9) wins; a row that did not
    # see the draft would pick token 0.
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    out = Sampler(VOCAB, EOS).verify(LOGITS.clone(), _rows(params, [0, 2]), [[0, 2]])
    assert out.token_ids == [[0, 2, 1]]


@pytest.mark.parametrize("draft", [[0, 2], [9, 8], [1, 4]], ids=str)
def test_sampling_emits_the_plain_distribution(draft):
    # 20k sequences with the same rows: the first emitted token must follow row 0's
    # distribution; after an accepted draft token, the next must follow the next row's.
    num, params = 20_000, SamplingParams(temperature=1.0)
    sampler = Sampler(VOCAB, EOS, seed=7)
    logits = LOGITS.repeat(num, 1)
    out = sampler.verify(logits, _rows(params, draft) * num, [draft] * num)
    probs = torch.softmax(LOGITS.double(), -1)
    emitted = out.token_ids
    assert all(1 <= len(t) <= 3 and t[: len(t) - 1] == draft[: len(t) - 1] for t in emitted)
    for position in range(3):
        # Sequences whose draft passed up to this position.
        drawn = [t[position] for t in emitted if len(t) > position]
        counts = torch.bincount(torch.tensor(drawn), minlength=VOCAB)
        if counts.sum() >= 2000:
            assert chi_square_p_value(counts, probs[position]) > ALPHA, position
    accepted = sum(len(t) - 1 for t in emitted)
    assert accepted == pytest.approx(num * _expected_accepted(probs, draft), rel=0.05)


def _expected_accepted(probs: torch.Tensor, draft: list[int]) -> float:
    first = float(probs[0, draft[0]])
    return first + first * float(probs[1, draft[1]])


def test_top_k_rows_reject_drafts_outside_the_cut():
    params = SamplingParams(temperature=1.0, top_k=2)
    sampler = Sampler(VOCAB, EOS, seed=3)
    out = sampler.verify(LOGITS.repeat(500, 1), _rows(params, [9, 0]) * 500, [[9, 0]] * 500)
    assert {tuple(t) for t in out.token_ids} <= {(0,), (1,)}


def test_rows_must_match_the_drafts():
    with pytest.raises(ValueError, match="drafts need 3 rows"):
        Sampler(VOCAB, EOS).verify(LOGITS[:2].clone(), _rows(SamplingParams(), [1]), [[1, 2]])
