"""apply_token_bitmask against a plain-PyTorch reference: vocabularies that are and are
not multiples of the 32-token mask word or the 16-lane vector, masks with all-zero,
all-one and mixed words, a subset of rows in any order, and masks shorter than the
vocabulary."""

from __future__ import annotations

import pytest
import torch

import pyllm.ops as ops
from tests.kernels.utils import ALL_DEVICES, DTYPES, kernel_threads, seed_and_single_thread

VOCABS = [1, 16, 31, 32, 33, 100, 49152 + 7]


@pytest.fixture(autouse=True)
def _seed(request):
    yield from seed_and_single_thread(request)


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    for i, row in enumerate(rows.tolist()):
        for t in range(vocab):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[i, word]) >> (t % 32)) & 1
            if not allowed:
                out[row, t] = float("-inf")
    return out


def random_bitmask(n: int, words: int) -> torch.Tensor:
    """Mixed words, with whole words of zeros and of ones in between."""
    mask = torch.randint(-(2**31), 2**31, (n, words), dtype=torch.int64).to(torch.int32)
    kinds = torch.randint(0, 3, (n, words))
    mask[kinds == 0] = 0
    mask[kinds == 1] = -1
    return mask


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_apply_token_bitmask(device, dtype, vocab):
    num_seqs = 5
    logits = torch.randn(num_seqs, vocab).to(dtype)
    rows = torch.tensor([4, 0, 2])
    words = (vocab + 31) // 32
    bitmask = random_bitmask(len(rows), words)
    if vocab > 64:  # a mask shorter than the vocabulary: the rest is disallowed
        bitmask = bitmask[:, : words - 1].contiguous()
    expected = reference(logits, bitmask, rows) if vocab < 1000 else None
    actual = logits.to(device)
    with kernel_threads():
        ops.apply_token_bitmask(actual, bitmask.to(device), rows.to(device))
    if expected is None:  # the reference loop is slow at 49k: a vectorized one
        bits = (bitmask.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
        allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
        allowed[:, : bits.shape[1] * 32] = bits.flatten(1).bool()[:, :vocab]
        expected = logits.clone()
        expected[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    assert torch.equal(actual.cpu(), expected)  # a mask changes values to -inf, nothing else


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_apply_token_bitmask_on_a_row_view(device):
    wide = torch.randn(3, 100)
    logits = wide[:, 10:90]  # rows packed, row stride 100
    bitmask = random_bitmask(2, 3)
    rows = torch.tensor([1, 2])
    expected = reference(logits, bitmask, rows)
    actual = wide.to(device)
    ops.apply_token_bitmask(actual[:, 10:90], bitmask.to(device), rows.to(device))
    assert torch.equal(actual[:, 10:90].cpu(), expected)
    assert torch.equal(actual[:, :10].cpu(), wide[:, :10])  # nothing outside the view


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, 40)
    before = logits.clone()
    ops.apply_token_bitmask(
        logits, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    )
    assert torch.equal(logits, before)
