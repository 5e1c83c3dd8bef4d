"""Q4_K strips (ops.pack_q4k_strips): the same weight as its GGUF rows, read by
quant_linear and dequantize_rows on the CPU; compared with the GGUF rows' results."""

from __future__ import annotations

import pytest
import torch

import pyllm.ops as ops

from .test_quant import random_weight
from .utils import kernel_threads, seed_and_single_thread

pytest.importorskip("gguf")
Q4_K = ops.QUANT_TYPES["Q4_K"][0]
STRIPS = ops.Q4_K_STRIPS
# Whole strips, and whole strips with 8 rows after them (kept in GGUF's layout).
SHAPES = [(256, 32), (768, 40)]


@pytest.fixture(autouse=True)
def _seed(request):
    yield from seed_and_single_thread(request)


def product(x, qweight, qtype, bias=None, many_rows=0):
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
    with kernel_threads():
        ops.quant_linear(out, x, qweight, qtype, bias, many_rows)
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_packing_keeps_the_weight(shape):
    """Same shape, different bytes, the same values; unpacking by dequantize_rows
    gives GGUF's values bit for bit, a row at a time too."""
    in_features, out_features = shape
    qweight, _ = random_weight("Q4_K", out_features, in_features)
    strips = ops.pack_q4k_strips(qweight)
    assert strips.shape == qweight.shape and not torch.equal(strips, qweight)
    assert torch.equal(strips[32:], qweight[32:])  # the tail stays as it was
    plain = torch.empty(out_features, in_features)
    ops.dequantize_rows(plain, qweight, Q4_K)
    unpacked = torch.empty_like(plain)
    ops.dequantize_rows(unpacked, strips, STRIPS)
    assert torch.equal(unpacked, plain)
    rows = torch.tensor([3, 17, out_features - 1, 3])
    some = torch.empty(4, in_features)
    ops.dequantize_rows(some, strips, STRIPS, rows)
    assert torch.equal(some, plain[rows])


@pytest.mark.parametrize("bias", [False, True])
# The register tile heights, a partial tile after a whole one, many rows.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_strips_compute_as_the_gguf_rows(shape, dtype, rows, bias):
    """The int8 products differ from the GGUF rows' only in float rounding order; the
    dequantized panels (bf16, many rows) are bit for bit the GGUF rows'."""
    in_features, out_features = shape
    qweight, _ = random_weight("Q4_K", out_features, in_features)
    strips = ops.pack_q4k_strips(qweight)
    x = torch.randn(rows, in_features).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    for many in (0, rows):
        want = product(x, qweight, Q4_K, b, many).float()
        got = product(x, strips, STRIPS, b, many).float()
        torch.testing.assert_close(
            got,
            want,
            rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
            atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
        )
        panels = ops.packed_linear_vectorized(dtype) and dtype == torch.bfloat16
        if panels and (many or rows >= 32) and out_features % 16 == 0 and not ops.batch_invariant():
            assert torch.equal(got, want)


@pytest.mark.parametrize("many_rows", [0, 5])
def test_a_row_computes_alike_in_any_call(many_rows):
    """Each row's result is the same alone, in a small call, or in a large one (the
    strip kernel's rows do not meet)."""
    qweight, _ = random_weight("Q4_K", 40, 768)
    strips = ops.pack_q4k_strips(qweight)
    x = torch.randn(24, 768)
    whole = product(x, strips, STRIPS, many_rows=many_rows)
    for first, last in ((0, 1), (5, 8), (5, 12), (9, 24)):
        many = max(0, min(many_rows, last) - first)
        assert torch.equal(
            product(x[first:last], strips, STRIPS, many_rows=many), whole[first:last]
        )


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="qweight must hold Q4_K rows"):
        ops.pack_q4k_strips(torch.zeros(16, 100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="qweight must be uint8"):
        ops.pack_q4k_strips(torch.zeros(16, 144))
    with pytest.raises(ValueError, match="qweight must be"):
        ops.quant_linear(
            torch.empty(1, 16), torch.randn(1, 512), torch.zeros(16, 144, dtype=torch.uint8), STRIPS
        )
    assert ops.quant_row_bytes(STRIPS, 512) == 288
