"""The sampler against a plain reference written here: each transform computed directly in
float64 with a full sort and Python loops over a small vocabulary, the draws checked by
chi-square tests, and seeded requests checked for batch independence."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest
import torch

from pyllm.engine.sequence import Sequence
from pyllm.sampling import sampler as sampler_module
from pyllm.sampling.batch import GREEDY_TEMPERATURE, SamplingRow, plain_greedy
from pyllm.sampling.cuts import candidate_pass, sampling_weights
from pyllm.sampling.draw import CHUNK, inverse_cdf, inverse_cdf_exact
from pyllm.sampling.logprobs import prompt_logprobs
from pyllm.sampling.params import SamplingParams
from pyllm.sampling.penalties import apply_penalties
from pyllm.sampling.sampler import Sampler
from pyllm.sampling.select import first_argmax, small_topk

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EOS = {0}
# Chi-square tests reject at this significance; the seeds are fixed, so a pass is stable.
ALPHA = 1e-3


def batch_of(seqs: list[Sequence]) -> list[SamplingRow]:
    """The sampler's input for these sequences' next step."""
    return [seq.sampling_row() for seq in seqs]


def make_seq(prompt, params, output=(), request_id="r"):
    seq = Sequence(request_id, list(prompt), params)
    for token in output:
        seq.append_token(token)
    return seq


# ----------------------------------------------------------------------------- reference


def reference_logits(row: torch.Tensor, seq: Sequence, eos: set[int]) -> list[float]:
    """Logits processing straight from the definitions, one token at a time, in float64."""
    p = seq.sampling_params
    x = [float(v) for v in row]
    for token, bias in p.logit_bias.items():
        x[token] += bias
    if len(seq.output_token_ids) < p.min_tokens:
        for token in eos | set(p.stop_token_ids):
            x[token] = -math.inf
    context = seq.token_ids if p.repeat_last_n == 0 else seq.token_ids[-p.repeat_last_n :]
    if p.repetition_penalty != 1.0:
        for token in set(context):
            if x[token] > 0:
                x[token] /= p.repetition_penalty
            else:
                x[token] *= p.repetition_penalty
    for token, count in Counter(seq.output_token_ids).items():
        x[token] -= p.presence_penalty + p.frequency_penalty * count
    return x


def reference_distribution(row: torch.Tensor, seq: Sequence, eos: set[int]) -> list[float]:
    """The probabilities the sampler must draw from, by full sorts over the vocabulary."""
    p = seq.sampling_params
    x = reference_logits(row, seq, eos)
    vocab = len(x)
    if p.temperature < GREEDY_TEMPERATURE:
        best = max(range(vocab), key=lambda t: (x[t], -t))  # first index of the max
        return [1.0 if t == best else 0.0 for t in range(vocab)]
    top = max(x) / p.temperature
    probs = [math.exp(v / p.temperature - top) for v in x]
    probs = [q / sum(probs) for q in probs]
    keep = [q > 0 for q in probs]
    if 0 < p.top_k < vocab:  # tokens at least as likely as the k-th most likely
        kth = sorted(probs, reverse=True)[p.top_k - 1]
        keep = [k and q >= kth for k, q in zip(keep, probs, strict=True)]
    if p.top_p < 1.0:  # of those, renormalized, the fewest most likely reaching top_p
        kept = sorted((q for k, q in zip(keep, probs, strict=True) if k), reverse=True)
        mass, before, last = sum(kept), 0.0, kept[0]
        for q in kept:
            if before >= p.top_p * mass:
                break
            last, before = q, before + q
        keep = [k and q >= last for k, q in zip(keep, probs, strict=True)]
    if p.min_p > 0:
        keep = [k and q >= p.min_p * max(probs) for k, q in zip(keep, probs, strict=True)]
    kept_probs = [q if k else 0.0 for k, q in zip(keep, probs, strict=True)]
    return [q / sum(kept_probs) for q in kept_probs]


def check_distribution(sampler, logits, seqs, atol=1e-6):
    got = sampler.distribution(logits, batch_of(seqs)).double().cpu()
    for i, seq in enumerate(seqs):
        want = reference_distribution(logits[i].cpu(), seq, set(sampler.eos_token_ids))
        want = torch.tensor(want, dtype=torch.float64)
        torch.testing.assert_close(
            got[i], want, atol=atol, rtol=1e-5, msg=lambda m, i=i: f"row {i}: {m}"
        )


# ----------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_reference(device):
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    cases = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(repetition_penalty=1.7, repeat_last_n=3),  # window: last 3 tokens only
        SamplingParams(repetition_penalty=0.6, repeat_last_n=50),  # window longer than context
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-0.5, frequency_penalty=2.0, repetition_penalty=1.3),
        SamplingParams(logit_bias={3: 5.0, 39: -100.0, 0: 2.5}),
        SamplingParams(max_tokens=10, min_tokens=5, stop_token_ids=[7, 9]),  # masked: 4 < 5
        SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[7, 9]),  # not: 4 >= 4
        SamplingParams(),
    ]
    seqs = [make_seq([5, 6, 7, 5, 8], p, output=[9, 5, 9, 9]) for p in cases]
    logits = torch.randn(len(seqs), vocab, generator=gen).to(device) * 3
    original = logits.clone()
    processed = apply_penalties(logits, batch_of(seqs), frozenset(EOS)).cpu()
    assert torch.equal(logits, original), "the caller's logits were modified"
    for i, seq in enumerate(seqs):
        want = torch.tensor(reference_logits(logits[i].cpu(), seq, EOS), dtype=torch.float64)
        torch.testing.assert_close(processed[i].double(), want, msg=lambda m, i=i: f"case {i}: {m}")
    # The window matters: token 6 is in the context but not in the last 3 tokens (9, 9, 9).
    assert processed[1, 6] == logits[1, 6].cpu() and processed[0, 6] != logits[0, 6].cpu()
    assert torch.isinf(processed[7, [0, 7, 9]]).all() and not torch.isinf(processed[8]).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0),
        dict(temperature=0.7),
        dict(top_k=1),
        dict(top_k=5),
        dict(top_k=5, temperature=2.0),
        dict(top_p=0.5),
        dict(top_p=0.9, temperature=0.5),
        dict(min_p=0.1),
        dict(top_k=20, temperature=0.02),  # most probabilities underflow to 0 in float32
        dict(top_k=8, top_p=0.6, min_p=0.05, temperature=0.8),
        dict(top_k=3, repetition_penalty=1.5, presence_penalty=1.0, logit_bias={2: 4.0}),
    ],
    ids=str,
)
def test_distribution_matches_reference(device, params):
    gen = torch.Generator().manual_seed(1)
    vocab, rows = 64, 6
    sampler = Sampler(vocab, EOS)
    seqs = [make_seq([1, 2, 3, 2], SamplingParams(**params), output=[4, 4]) for _ in range(rows)]
    logits = (torch.randn(rows, vocab, generator=gen) * 2.5).to(device)
    check_distribution(sampler, logits, seqs)


def test_mixed_batch_matches_reference():
    """Every row its own random options, so each transform meets rows that skip it."""
    rng = random.Random(2)
    vocab, rows = 300, 40
    sampler = Sampler(vocab, {0, 1})
    seqs = []
    for i in range(rows):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.3, 1.0, 1.5]),
            top_k=rng.choice([-1, 0, 1, 10, 100, 299, 300, 1000]),
            top_p=rng.choice([1.0, 0.95, 0.5, 0.1]),
            min_p=rng.choice([0.0, 0.0, 0.02, 0.3]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            repeat_last_n=rng.choice([0, 4]),
            presence_penalty=rng.choice([0.0, 0.4]),
            frequency_penalty=rng.choice([0.0, -0.3]),
            logit_bias=rng.choice([{}, {5: 3.0, 17: -2.0}]),
            max_tokens=20,
            min_tokens=rng.choice([0, 5]),
            stop_token_ids=[2],
            seed=rng.choice([None, i]),
        )
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        seqs.append(make_seq(prompt, params, output))
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 4
    check_distribution(sampler, logits, seqs)


def test_top_p_on_flat_distribution_grows_past_first_k():
    """A nearly flat 5000-token distribution: top-p keeps thousands of tokens, so the
    threshold search must grow its top-K prefix up to the whole vocabulary."""
    vocab = 5000
    sampler = Sampler(vocab, EOS)
    seqs = [make_seq([1], SamplingParams(top_p=p, top_k=k)) for p, k in [(0.9, -1), (0.3, 2000)]]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4)) * 0.1
    check_distribution(sampler, logits, seqs)
    kept = (sampler.distribution(logits, batch_of(seqs)) > 0).sum(-1)
    assert kept[0] > 4000 and 500 < kept[1] < 2000


@pytest.mark.parametrize("device", DEVICES)
def test_ties_at_the_boundary_are_all_kept(device):
    """Integer logits tie often (as bf16 logits do): every token tied with the last kept
    one is kept, so the result does not depend on how a sort orders ties."""
    vocab = 200
    logits = torch.randint(0, 4, (4, vocab), generator=torch.Generator().manual_seed(5))
    logits = logits.float().to(device)
    sampler = Sampler(vocab, EOS)
    seqs = [
        make_seq([1], SamplingParams(**p))
        for p in [dict(top_k=1), dict(top_k=30), dict(top_p=0.2), dict(top_k=70, top_p=0.5)]
    ]
    check_distribution(sampler, logits, seqs)
    # top_k=1 keeps every token tied for the maximum.
    dist = sampler.distribution(logits, batch_of(seqs)).cpu()
    assert (dist[0] > 0).sum() == (logits[0] == logits[0].max()).sum().cpu()


def test_strided_logits():
    """Logits sliced from a wider tensor (a vocabulary padded for the matmul), all options."""
    vocab = 300
    padded = torch.randn(4, 384, generator=torch.Generator().manual_seed(11)) * 3
    logits = padded[:, :vocab]
    params = SamplingParams(
        top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3, logit_bias={4: 2.0}, seed=3
    )
    seqs = [make_seq([1, 4, 9], params, output=[4]) for _ in range(4)]
    sampler = Sampler(vocab, EOS)
    check_distribution(sampler, logits, seqs)
    fresh = [make_seq([1, 4, 9], params, output=[4]) for _ in range(4)]
    # Contiguous logits are penalized in place and restored: same draws, same logits after.
    with torch.inference_mode():  # as the model runner makes them
        contiguous = logits.contiguous()
    original = contiguous.clone()
    want = Sampler(vocab, EOS)(contiguous, batch_of(fresh))
    assert torch.equal(contiguous, original), "the caller's logits were left modified"
    assert sampler(logits, batch_of(seqs)).token_ids == want.token_ids


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    vocab = 20
    sampler = Sampler(vocab, {0, 1})
    logits = torch.zeros(1, vocab)
    logits[0, [0, 1, 6]] = 50.0  # EOS ids and a stop id dominate unless masked
    params = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[6], temperature=0)
    for n_out, masked in [(0, True), (2, True), (3, False)]:
        seq = make_seq([4], params, output=[5] * n_out)
        token = sampler(logits, batch_of([seq])).token_ids[0]
        assert (token not in (0, 1, 6)) == masked, (n_out, token)


def test_greedy_picks_argmax_and_logprobs_are_raw_log_softmax():
    gen = torch.Generator().manual_seed(6)
    vocab, rows = 1000, 12
    logits = torch.randn(rows, vocab, generator=gen) * 3
    sampler = Sampler(vocab, EOS)
    seqs = [make_seq([1, 2], SamplingParams(temperature=0.0, logprobs=3)) for _ in range(6)]
    # Sampled rows with temperature and penalties: logprobs still describe the raw logits.
    seqs += [
        make_seq(
            [1, 2],
            SamplingParams(temperature=0.5, top_k=5, repetition_penalty=2.0, logprobs=k),
            output=[3],
        )
        for k in (0, 1, 5, 20, 3, 2)
    ]
    seqs.insert(3, make_seq([1], SamplingParams(temperature=0.0)))  # no logprobs asked
    logits = torch.cat([logits[:3], logits[:1] + 1, logits[3:]])
    out = sampler(logits, batch_of(seqs))
    want_lp = torch.log_softmax(logits.double(), -1)
    for i, seq in enumerate(seqs):
        token = out.token_ids[i]
        if seq.sampling_params.temperature == 0:
            assert token == int(logits[i].argmax())
        if seq.sampling_params.logprobs is None:
            assert out.logprobs[i] is None
            continue
        chosen, top = out.logprobs[i]
        assert chosen == pytest.approx(float(want_lp[i, token]), abs=1e-5)
        k = seq.sampling_params.logprobs
        values, ids = want_lp[i].topk(k)
        assert list(top) == ids.tolist()
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-5)


def test_small_top_k_path_matches_reference(monkeypatch):
    """Rows with a small top_k take the block path (the cuts and the draw on the top_k
    blocks only); everything else, and rows whose boundary ties span more blocks, the
    full one. Both against the reference, in one mixed batch over a vocabulary with a
    partial last block."""
    vocab = 8 * 1024 + 77
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(9, vocab, generator=gen) * 3
    logits[5] = torch.randint(0, 3, (vocab,), generator=gen).float()  # ties in every block
    logits[6, -3:] = 20.0  # the top tokens in the partial last block
    # Ranks 3-6 tied in four blocks (as bf16 logits tie): top_k=5 keeps all seven.
    logits[8, [100, 2000, 5000]] = 30.0
    logits[8, [7, 1500, 4000, vocab - 1]] = 25.0
    cases = [
        dict(top_k=1),
        dict(top_k=5, temperature=0.7),
        dict(top_k=20, top_p=0.6),
        dict(top_k=24, top_p=0.9, min_p=0.02, temperature=1.3),
        dict(top_k=8, repetition_penalty=1.5, presence_penalty=1.0, logit_bias={9: 6.0}),
        dict(top_k=10),  # ties across every block: the full path
        dict(top_k=4, top_p=0.5),
        dict(top_p=0.8),  # no top_k: the full path
        dict(top_k=5, temperature=9.0),
    ]
    seqs = [make_seq([9, 2, 3], SamplingParams(**p), output=[9, 4]) for p in cases]
    full_rows = []
    real = sampling_weights

    def spy(logits, seqs):
        full_rows.append(len(seqs))
        return real(logits, seqs)

    monkeypatch.setattr(sampler_module, "sampling_weights", spy)
    sampler = Sampler(vocab, EOS)
    check_distribution(sampler, logits, seqs)
    assert full_rows == [2], "rows 5 (ties) and 7 (no top_k) alone take the full path"
    original = logits.clone()
    sampler(logits, batch_of(seqs))
    assert torch.equal(logits, original), "the caller's logits were left modified"
    assert int((sampler.distribution(logits, batch_of(seqs))[8] > 0).sum()) == 7
    # Draws come from the kept tokens only.
    dist = sampler.distribution(logits, batch_of(seqs))
    for _ in range(5):
        tokens = torch.tensor(sampler(logits, batch_of(seqs)).token_ids)
        assert (dist.gather(1, tokens[:, None]) > 0).all()


def test_candidate_pass_and_full_path_agree():
    """The cuts are computed twice: on a row's top-k candidates (candidate_pass) and on the
    whole row (sampling_weights). Over random batches both keep the same tokens and, given
    the same uniforms, draw the same ones."""
    vocab, num_rows = 32 * 1024 + 77, 16
    gen = torch.Generator().manual_seed(31)
    rng = random.Random(31)
    for _ in range(6):
        params = [
            SamplingParams(
                temperature=rng.choice([0.3, 1.0, 1.7]),
                top_k=rng.choice([1, 3, 8, 20, 40]),
                top_p=rng.choice([1.0, 0.9, 0.5]),
                min_p=rng.choice([0.0, 0.05]),
            )
            for _ in range(num_rows)
        ]
        batch = batch_of([make_seq([1], p) for p in params])
        logits = torch.randn(num_rows, vocab, generator=gen) * rng.choice([1.0, 3.0])
        found, full = candidate_pass(logits, batch, list(range(num_rows)))
        assert found is not None and full == [], "no ties: every row takes the fast path"
        rows, columns, weights = found
        exact = sampling_weights(logits[rows], [batch[i] for i in rows.tolist()])
        for i in range(len(rows)):
            assert columns[i][weights[i] > 0].tolist() == exact[i].nonzero().squeeze(1).tolist()
        uniforms = torch.rand(len(rows), generator=gen, dtype=torch.float64)
        fast = columns.gather(1, inverse_cdf_exact(weights, uniforms)).squeeze(1)
        assert fast.tolist() == inverse_cdf(exact, uniforms).tolist()


def test_small_top_k_path_draws_follow_the_distribution():
    """Mass on tokens at block edges in several blocks; top_k=5 of them kept."""
    vocab, num_draws = 4096, 20_000
    logits = torch.full((vocab,), -5.0)
    hot = [0, 127, 128, 1000, 2047, 2048, 4095]
    logits[hot] = torch.tensor([0.5, 1.0, 0.2, 0.9, -0.3, 0.7, 0.4])
    sampler = Sampler(vocab, {3}, seed=7)
    counts, probs = draw_counts(
        sampler, logits, dict(top_k=5, temperature=1.0), num_draws, vocab, seeded=True
    )
    assert int((probs > 0).sum()) == 5
    assert counts[probs == 0].sum() == 0, "drew a token the cuts removed"
    assert chi_square_p_value(counts, probs) > ALPHA


def test_small_top_k_path_is_independent_of_the_batch():
    """A seeded top_k=4 row alone, and next to a top_k=60 row (more blocks gathered)."""
    vocab = 16384
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(13))
    tokens = []
    for batch_k in (None, 60):
        params = [SamplingParams(top_k=4, seed=5)]
        if batch_k:
            params.append(SamplingParams(top_k=batch_k, seed=6))
        seqs = [make_seq([1], p) for p in params]
        sampler = Sampler(vocab, EOS)
        row = []
        for _ in range(30):
            row.append(sampler(logits[: len(seqs)], batch_of(seqs)).token_ids[0])
        tokens.append(row)
    assert tokens[0] == tokens[1] and len(set(tokens[0])) > 1


@pytest.mark.parametrize("vocab", [100, 600, 5121, 49152, 50001])
def test_block_selection_equals_argmax_and_topk(vocab):
    """The block-maxima shortcuts against torch's own argmax and topk, with ties, a row of
    -inf, a row of zeros, and maxima in the partial last block."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(6, vocab, generator=gen)
    x[1] = 0.0
    x[2] = float("-inf")
    x[2, -1] = 1.0  # fewer finite values than k, in the partial last block
    x[3, -1] = 50.0
    x[4] = torch.randint(0, 3, (vocab,), generator=gen).float()  # ties everywhere
    x[5, [7, vocab - 2]] = 9.0  # the max twice: the first one wins
    assert torch.equal(first_argmax(x), x.argmax(-1))
    for k in (1, 5, 20):
        values, ids = small_topk(x, k)
        assert torch.equal(values, x.topk(k).values)
        assert torch.equal(x.gather(1, ids), values)
        assert all(len(set(row)) == k for row in ids.tolist()) and int(ids.max()) < vocab


@pytest.mark.parametrize(
    "asks",
    [
        dict(temperature=0.5),
        dict(logprobs=0),
        dict(best_of=2),
        dict(logit_bias={3: 1.0}),
        dict(min_tokens=1),
        dict(repetition_penalty=1.1),
        dict(presence_penalty=0.5),
        dict(frequency_penalty=0.5),
        dict(structured_output="matcher"),
    ],
)
def test_plain_greedy_rows_take_one_argmax(asks):
    """A step of greedy rows that ask nothing else is one argmax; a row that asks for
    anything more sends the step down the full path; the greedy rows' tokens are the same
    either way (the first of tied maxima)."""
    vocab = 49152  # whole blocks of select.BLOCK: the block search for > 2 rows
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(5, vocab, generator=gen)
    logits[1, [5, 900]] = 20.0
    sampler = Sampler(vocab, EOS)
    greedy = [make_seq([1, 2], SamplingParams(temperature=0.0)) for _ in range(4)]
    assert all(plain_greedy(row) for row in batch_of(greedy))
    params = {"temperature": 0.0, **asks}
    matcher = params.pop("structured_output", None)
    other = batch_of([make_seq([1, 2], SamplingParams(**params))])[0]
    other.matcher = matcher
    assert not plain_greedy(other)
    fast = sampler(logits[:4], batch_of(greedy))
    assert fast.token_ids == logits[:4].argmax(-1).tolist() and fast.logprobs == [None] * 4
    if matcher is None:  # (masks by a real matcher: tests/engine/test_structured.py)
        full = sampler(logits, batch_of(greedy) + [other])
        assert full.token_ids[:4] == fast.token_ids


def test_first_argmax_of_few_rows_and_strided_rows():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(6, 2 * 49152, generator=gen)
    x[0, [10, 20000]] = 9.0
    for rows in (x[:1, :49152], x[:2, :49152], x[:, ::2], x[:, 49152:]):
        assert torch.equal(first_argmax(rows), rows.argmax(-1))


def test_prompt_logprobs():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(9, 100, generator=gen)
    next_ids = torch.randint(0, 100, (9,), generator=gen)
    want = torch.log_softmax(logits.double(), -1)
    for k in (0, 4):
        got = prompt_logprobs(logits, next_ids.tolist(), k)
        for p, (lp, top) in enumerate(got):
            assert lp == pytest.approx(float(want[p, next_ids[p]]), abs=1e-5)
            assert list(top) == want[p].topk(k).indices.tolist()
    with pytest.raises(ValueError, match="next_token_ids"):
        prompt_logprobs(logits, next_ids[:3], 1)


def test_check_params_and_input_errors():
    sampler = Sampler(100, EOS)
    sampler.check_params(SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99]))
    with pytest.raises(ValueError, match="logit_bias.*100"):
        sampler.check_params(SamplingParams(logit_bias={100: 1.0}))
    with pytest.raises(ValueError, match="stop_token_ids.*\\[250\\]"):
        sampler.check_params(SamplingParams(stop_token_ids=[3, 250]))
    with pytest.raises(ValueError, match="eos_token_ids"):
        Sampler(10, {10})
    seq = make_seq([1], SamplingParams())
    with pytest.raises(ValueError, match="shape"):
        sampler(torch.zeros(1, 99), batch_of([seq]))
    with pytest.raises(ValueError, match="float32"):
        sampler(torch.zeros(1, 100, dtype=torch.bfloat16), batch_of([seq]))


# ----------------------------------------------------------------------------- the draw


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against probabilities (cells with p > 0; the caller
    checks that cells with p = 0 were never drawn). chi2 survival = Q(df/2, x/2)."""
    kept = probs > 0
    n = counts.sum()
    expected = probs[kept].double() * n
    assert expected.min() >= 5, "too few draws per cell for the chi-square approximation"
    statistic = ((counts[kept].double() - expected) ** 2 / expected).sum()
    df = int(kept.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), statistic / 2))


def draw_counts(sampler, logits_row, params, num_draws, vocab, seeded=False):
    """num_draws draws as one batch of num_draws identical rows (one step each)."""
    seqs = [
        make_seq([1], SamplingParams(**params, seed=i if seeded else None))
        for i in range(num_draws)
    ]
    logits = logits_row.expand(num_draws, vocab).contiguous()
    tokens = torch.tensor(sampler(logits, batch_of(seqs)).token_ids)
    probs = sampler.distribution(logits[:1], batch_of(seqs[:1]))[0].cpu()
    return torch.bincount(tokens, minlength=vocab), probs


@pytest.mark.parametrize(
    "params, seeded",
    [
        (dict(temperature=1.0), False),
        (dict(temperature=0.6), False),
        (dict(temperature=1.0), True),  # 20k requests, each with its own seed
        (dict(top_k=4, temperature=1.3), False),
        (dict(top_p=0.7), False),
        (dict(top_k=6, top_p=0.8, min_p=0.05), True),
    ],
    ids=str,
)
def test_draws_follow_the_distribution(params, seeded):
    vocab, num_draws = 10, 20_000
    logits = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.6, 0.5, 0.1, -0.3, -0.4, -1.0])
    sampler = Sampler(vocab, EOS, seed=1234)
    counts, probs = draw_counts(sampler, logits, params, num_draws, vocab, seeded)
    assert counts[probs == 0].sum() == 0, "drew a token the cuts removed"
    assert chi_square_p_value(counts, probs) > ALPHA
    # The test has power: the same draws against the untransformed softmax are rejected
    # (every case above changes the distribution noticeably).
    if params != dict(temperature=1.0):
        assert chi_square_p_value(counts, torch.softmax(logits.double(), -1)) < ALPHA


def test_draws_across_chunk_boundaries():
    """Two whole inverse-CDF chunks and a partial one, with the mass on tokens at chunk
    edges."""
    vocab, num_draws = 2 * CHUNK + CHUNK * 15 // 16, 20_000
    logits = torch.full((vocab,), -1e4)
    hot = [0, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK, vocab - 2, vocab - 1]
    logits[hot] = torch.tensor([0.5, 1.0, 0.2, -0.3, 0.9, 0.0, 0.7, 0.4])
    sampler = Sampler(vocab, {5}, seed=99)
    counts, probs = draw_counts(sampler, logits, dict(temperature=1.0), num_draws, vocab)
    assert counts[probs == 0].sum() == 0
    assert chi_square_p_value(counts, probs) > ALPHA


def test_inverse_cdf_never_picks_a_zero_weight():
    """Uniforms at both extremes, and weights with zero runs at the starts and ends of
    chunks: the pick always has a positive weight, at the right end of the range."""
    c = CHUNK
    vocab = 2 * c + c // 2  # two whole chunks and a partial one
    weights = torch.zeros(5, vocab)
    weights[0, 5] = 1.0
    weights[1, [0, vocab - 1]] = torch.tensor([1.0, 1e-6])
    weights[2, [c - 1, c]] = 1.0
    weights[3, c // 2 : c + c // 2] = torch.rand(c, generator=torch.Generator().manual_seed(8))
    weights[4, c + c // 2] = 1.0  # the first chunk is empty
    lowest = [5, 0, c - 1, c // 2, c + c // 2]
    highest = [5, vocab - 1, c, c + c // 2 - 1, c + c // 2]
    for u, want in [(0.0, lowest), (1.0 - 2.0**-53, highest)]:
        uniforms = torch.full((5,), u, dtype=torch.float64)
        assert inverse_cdf(weights, uniforms).tolist() == want
    # A partial last chunk whose float32 mass rounds above the float64 sum of its weights:
    # the largest uniform must still land on a real token, not past the vocabulary.
    weights = torch.zeros(1, vocab)
    for value in (0.1, 0.3, 0.017, 0.7, 0.013, 0.023, 0.05, 0.2):
        weights[0, 2 * c :] = value
        if float(weights[:, 2 * c :].sum(-1)) > float(weights[0, 2 * c :].double().sum()):
            break
    else:
        raise AssertionError("no weight found whose float32 chunk sum rounds up")
    assert inverse_cdf(weights, torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)) == vocab - 1


# ----------------------------------------------------------------------------- seeds


def run_steps(sampler, batch, logits_per_step, steps):
    """Samples `steps` steps for the batch, appending each token to its sequence."""
    for step in range(steps):
        out = sampler(logits_per_step(step, batch), batch_of(batch))
        for seq, token in zip(batch, out.token_ids, strict=True):
            seq.append_token(token)


def test_seeded_request_is_independent_of_the_batch():
    vocab, steps = 500, 8
    target_params = SamplingParams(
        seed=42, temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.1, max_tokens=64
    )
    gen = torch.Generator().manual_seed(9)
    # Logits are a fixed function of (request, step), so every run shows a request the
    # same logits wherever it sits in the batch.
    table = torch.randn(20, steps, vocab, generator=gen) * 2

    def logits_per_step(step, batch):
        return torch.stack([table[int(seq.request_id), step] for seq in batch])

    def run(position, num_others, other_seed_base):
        rng = random.Random(position)
        target = make_seq([3, 1, 4], target_params, request_id="0")
        others = [
            make_seq(
                [rng.randrange(vocab)],
                SamplingParams(
                    temperature=rng.choice([0.0, 0.7, 1.2]),
                    top_p=rng.choice([1.0, 0.8]),
                    min_p=rng.choice([0.0, 0.1]),
                    seed=rng.choice([None, other_seed_base + i]),
                    max_tokens=64,
                ),
                request_id=str(i + 1),
            )
            for i in range(num_others)
        ]
        batch = others[:position] + [target] + others[position:]
        run_steps(Sampler(vocab, EOS), batch, logits_per_step, steps)
        return target.output_token_ids

    alone = run(0, 0, 0)
    assert len(set(alone)) > 1, "the draw looks constant"
    for position, base in [(0, 100), (4, 200), (8, 300)]:
        assert run(position, 8, base) == alone, f"target at position {position}"
    # Another seed gives another sequence.
    other = make_seq([3, 1, 4], dataclasses.replace(target_params, seed=43), request_id="0")
    run_steps(Sampler(vocab, EOS), [other], logits_per_step, steps)
    assert other.output_token_ids != alone


def test_unseeded_requests_differ_across_runs():
    vocab, rows, steps = 1000, 16, 3
    logits = torch.zeros(rows, vocab)  # uniform: two runs agree by chance with p ~ 1e-48

    def run():
        batch = [make_seq([1], SamplingParams()) for _ in range(rows)]
        run_steps(Sampler(vocab, EOS), batch, lambda step, b: logits, steps)
        return [seq.output_token_ids for seq in batch]

    assert run() != run()


def test_forget_drops_the_generator():
    sampler = Sampler(10, EOS)
    row = make_seq([1], SamplingParams(seed=5)).sampling_row()
    sampler(torch.zeros(1, 10), [row])
    assert row.key in sampler._generators.seeded
    sampler.forget(row.key)
    assert row.key not in sampler._generators.seeded
