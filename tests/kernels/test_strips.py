"""Strips (ops.pack_strips) of every type that has them: the same weight as its GGUF rows,
read by quant_linear and dequantize_rows on the CPU; compared with the GGUF rows'
results."""

from __future__ import annotations

import contextlib

import pytest
import torch

import pyllm.ops as ops
from pyllm.model.linear import _cpu_has_amx

from .test_moe import (
    FLOAT_TYPE,
    make_weights,
    packed_strips,
    router_logits,
    run_case,
    skewed_logits,
)
from .test_quant import random_weight
from .utils import kernel_threads, seed_and_single_thread

pytest.importorskip("gguf")
TYPES = [name for name, (i, _, _) in ops.QUANT_TYPES.items() if i in ops.STRIPS_TYPES]
# Whole strips, and whole strips with 8 rows after them (kept in GGUF's layout); K not
# a multiple of 256 where the block allows.
SHAPES = [(256, 32), (768, 40)]
BLOCK32_SHAPES = [(96, 32), (576, 40)]


def shapes(type_name):
    return SHAPES if ops.QUANT_TYPES[type_name][1] == 256 else BLOCK32_SHAPES


def weight(type_name, shape_index):
    """(GGUF rows, their type id, the strips, the strips' type id, in_features)."""
    in_features, out_features = shapes(type_name)[shape_index]
    qweight, _ = random_weight(type_name, out_features, in_features)
    type_id = ops.QUANT_TYPES[type_name][0]
    strips = ops.pack_strips(qweight, type_id)
    return qweight, type_id, strips, ops.STRIPS_TYPES[type_id], in_features


@pytest.fixture(autouse=True)
def _seed(request):
    yield from seed_and_single_thread(request)


def rows_tolerance(type_name, dtype):
    """How far the strips' int8 products may lie from the GGUF rows': float rounding.
    The GGUF rows' Q6_K kernel turns the 6-bit weights' sum and their -32 offset's sum
    into floats apart, and the two cancel; the strips subtract them as integers."""
    if dtype == torch.bfloat16:
        return 1e-2
    return 1e-4 if type_name == "Q6_K" else 1e-5


# Rows from which bf16 rows over strips take the AMX tiles (amx_min_rows).
AMX_STRIP_ROWS = 64


def strips_take_panels(dtype):
    """Whether many rows over strips take float products as over GGUF rows (bf16 on AMX
    tiles; or the strips are unpacked to rows every call); else they keep the int8
    products at every count."""
    return not ops.strips_native() or (_cpu_has_amx() and dtype == torch.bfloat16)


def strips_take_rows_path(dtype, rows, many):
    """Whether a call over strips takes the path the GGUF rows take."""
    if not ops.strips_native():
        return True
    return strips_take_panels(dtype) and (many > 0 or rows >= AMX_STRIP_ROWS)


@contextlib.contextmanager
def int8_products():
    """The batch-invariant mode: the int8 products at every count."""
    ops.set_batch_invariant(True)
    try:
        yield
    finally:
        ops.set_batch_invariant(False)


def int8_product(x, qweight, qtype, bias=None):
    with int8_products():
        return product(x, qweight, qtype, bias)


def product(x, qweight, qtype, bias=None, many_rows=0):
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype)
    with kernel_threads():
        ops.quant_linear(out, x, qweight, qtype, bias, many_rows)
    return out


@pytest.mark.parametrize("shape_index", [0, 1])
@pytest.mark.parametrize("type_name", TYPES)
def test_packing_keeps_the_weight(type_name, shape_index):
    """Same shape, different bytes, the same values; unpacking by dequantize_rows
    gives GGUF's values bit for bit, a row at a time too."""
    qweight, type_id, strips, strips_id, in_features = weight(type_name, shape_index)
    out_features = qweight.shape[0]
    assert strips.shape == qweight.shape and not torch.equal(strips, qweight)
    assert torch.equal(strips[32:], qweight[32:])  # the tail stays as it was
    plain = torch.empty(out_features, in_features)
    ops.dequantize_rows(plain, qweight, type_id)
    unpacked = torch.empty_like(plain)
    ops.dequantize_rows(unpacked, strips, strips_id)
    assert torch.equal(unpacked, plain)
    rows = torch.tensor([3, 17, out_features - 1, 3])
    some = torch.empty(4, in_features)
    ops.dequantize_rows(some, strips, strips_id, rows)
    assert torch.equal(some, plain[rows])


@pytest.mark.parametrize("bias", [False, True])
# The register tile heights, a partial tile after a whole one, many rows (64: AMX tiles).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 40, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape_index", [0, 1])
@pytest.mark.parametrize("type_name", TYPES)
def test_strips_compute_as_the_gguf_rows(type_name, shape_index, dtype, rows, bias):
    """The int8 products differ from the GGUF rows' only in float rounding order; where
    the strips take float products too (bf16, many rows), they are bit for bit the GGUF
    rows', and where they keep the int8 products, those of the batch-invariant mode."""
    qweight, type_id, strips, strips_id, in_features = weight(type_name, shape_index)
    out_features = qweight.shape[0]
    x = torch.randn(rows, in_features).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None
    tolerance = rows_tolerance(type_name, dtype)
    panels = ops.packed_linear_vectorized(dtype) and dtype == torch.bfloat16
    for many in (0, rows):
        got = product(x, strips, strips_id, b, many).float()
        same_path = strips_take_rows_path(dtype, rows, many)
        if not same_path:
            # The int8 products, whichever path the GGUF rows take.
            assert torch.equal(got, int8_product(x, strips, strips_id, b).float())
            want = int8_product(x, qweight, type_id, b).float()
        else:
            want = product(x, qweight, type_id, b, many).float()
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        floats = panels and (many or rows >= 32) and not ops.batch_invariant()
        if floats and same_path and out_features % 16 == 0:
            assert torch.equal(got, want)


@pytest.mark.parametrize("many_rows", [0, 5])
@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_computes_alike_in_any_call(type_name, many_rows):
    """Each row's result is the same alone, in a small call, or in a large one (the
    strip kernel's rows do not meet)."""
    _, _, strips, strips_id, in_features = weight(type_name, 1)
    x = torch.randn(24, in_features)
    whole = product(x, strips, strips_id, many_rows=many_rows)
    for first, last in ((0, 1), (5, 8), (5, 12), (9, 24)):
        many = max(0, min(many_rows, last) - first)
        part = product(x[first:last], strips, strips_id, many_rows=many)
        assert torch.equal(part, whole[first:last])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", TYPES)
def test_without_amx_a_row_computes_alike_at_any_count(type_name, dtype):
    """Where the strips keep the int8 products, the default mode is batch-invariant for
    them: 48 rows, a prompt of 40 among them, give each row bitwise what it gives alone."""
    if strips_take_panels(dtype):
        pytest.skip("many rows over strips take float products here")
    _, _, strips, strips_id, in_features = weight(type_name, 1)
    x = torch.randn(48, in_features).to(dtype)
    whole = product(x, strips, strips_id, many_rows=40)
    for row in (0, 39, 40, 47):
        assert torch.equal(product(x[row : row + 1], strips, strips_id), whole[row : row + 1])


def test_bad_arguments_raise():
    q4_k = ops.QUANT_TYPES["Q4_K"][0]
    with pytest.raises(ValueError, match="qweight must hold Q4_K rows"):
        ops.pack_strips(torch.zeros(16, 100, dtype=torch.uint8), q4_k)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        ops.pack_strips(torch.zeros(16, 144), q4_k)
    with pytest.raises(ValueError, match="qtype must be a supported GGML type id"):
        ops.pack_strips(torch.zeros(16, 22, dtype=torch.uint8), 1)  # F16
    strips_id = ops.STRIPS_TYPES[q4_k]
    weight = torch.zeros(16, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="qweight must be"):
        ops.quant_linear(torch.empty(1, 16), torch.randn(1, 512), weight, strips_id)
    assert ops.quant_row_bytes(strips_id, 512) == 288


@pytest.mark.parametrize("type_name", TYPES)
def test_many_strips_over_threads(type_name):
    """A weight large enough for every thread to take several fetches of strips, with
    a tail of rows in GGUF's layout."""
    in_features = 512
    qweight, _ = random_weight(type_name, 16 * 40 + 8, in_features)
    type_id = ops.QUANT_TYPES[type_name][0]
    strips = ops.pack_strips(qweight, type_id)
    for rows in (1, 3):
        x = torch.randn(rows, in_features)
        want = product(x, qweight, type_id)
        got = product(x, strips, ops.STRIPS_TYPES[type_id])
        tolerance = rows_tolerance(type_name, torch.float32)
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


native = pytest.mark.skipif(
    not ops.strips_native(), reason="fused_moe reads strips on AVX2 and AVX-512 builds"
)


@native
# One token; a few per expert; a busy expert past the many-row thresholds with idle ones.
@pytest.mark.parametrize("tokens", [1, 7, 150])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", TYPES)
def test_fused_moe_reads_strips(type_name, dtype, tokens):
    """Each expert's rows in strips of its own: fused_moe within the reference's bounds
    on the int8 tiles and the panels alike."""
    logits = skewed_logits(tokens, 8) if tokens > 100 else None
    run_case(type_name, dtype, 8, 2, tokens, "cpu", biases=True, logits=logits, strips=True)


@native
def test_fused_moe_strips_with_a_tail():
    """Float gate/up and a Q4_0 down of 104 rows an expert: 6 whole strips and 8 rows
    left in GGUF's layout, per expert."""
    for tokens in (3, 150):
        logits = skewed_logits(tokens, 8) if tokens > 100 else None
        run_case((FLOAT_TYPE, "Q4_0"), torch.bfloat16, 8, 2, tokens, "cpu", hidden=104, inter=96,
                 logits=logits, strips=True)  # fmt: skip


@native
@pytest.mark.parametrize("type_name", TYPES)
def test_fused_moe_strip_prompts_keep_the_int8_products(type_name):
    """A bf16 prompt over strips gives bitwise what the batch-invariant mode gives (the
    int8 products, which outrun the panels there), and close to the GGUF rows'
    panels."""
    if ops.batch_invariant() or not ops.packed_linear_vectorized(torch.bfloat16):
        pytest.skip("no bf16 panels in this build or mode")
    hidden, inter = (256, 256) if ops.QUANT_TYPES[type_name][1] == 256 else (96, 160)
    weights, ids, _ = make_weights(type_name, torch.bfloat16, 8, hidden, inter)
    packed, packed_ids = packed_strips(weights, ids)
    x, logits = torch.randn(40, hidden).to(torch.bfloat16), router_logits(40, 8)
    rows, got, int8 = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    ops.fused_moe(rows, x, logits, 2, *weights, *ids, many_rows=40)
    ops.fused_moe(got, x, logits, 2, *packed, *packed_ids, many_rows=40)
    with int8_products():
        ops.fused_moe(int8, x, logits, 2, *packed, *packed_ids, many_rows=40)
    assert torch.equal(got, int8)
    torch.testing.assert_close(got.float(), rows.float(), rtol=0.05, atol=0.05)


def test_fused_moe_refuses_strips_it_cannot_read():
    """Strips on a build without the strip kernels, or CUDA, raise and name the layout."""
    weights, ids, _ = make_weights("Q4_0", torch.float32, 4, 96, 64)
    packed, packed_ids = packed_strips(weights, ids)
    x, logits = torch.randn(2, 96), router_logits(2, 4)
    if ops.strips_native():
        ops.fused_moe(torch.empty_like(x), x, logits, 1, *packed, *packed_ids)
    else:
        with pytest.raises(ValueError, match="strips of GGML type 2"):
            ops.fused_moe(torch.empty_like(x), x, logits, 1, *packed, *packed_ids)
    if torch.cuda.is_available():
        on = [t.cuda() for t in (x, logits, *packed)]
        with pytest.raises(ValueError, match="is a CPU layout"):
            ops.fused_moe(torch.empty_like(on[0]), on[0], on[1], 1, *on[2:], *packed_ids)
    with pytest.raises(ValueError, match="qweight must be 2-D .* or 3-D"):
        ops.pack_strips(torch.zeros(2, 2, 16, 18, dtype=torch.uint8), ids[0])
