"""quant_linear and dequantize_rows against gguf's own dequantizer and a float64 matmul,
over every GGUF block type pyllm multiplies as stored."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import pyllm.ops as ops

from .utils import ALL_DEVICES, DTYPES, POISON, TOLERANCES, kernel_threads, seed_and_single_thread

gguf = pytest.importorskip("gguf")
GGMLType = gguf.GGMLQuantizationType

# Byte offsets of each block's fp16 scale fields: random bytes elsewhere are valid
# quants, but a random fp16 may be inf or NaN.
HALF_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
TYPES = list(ops.QUANT_TYPES)


@pytest.fixture(autouse=True)
def _seed(request):
    yield from seed_and_single_thread(request)


@functools.lru_cache(maxsize=64)
def random_weight(type_name: str, rows: int, in_features: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random valid blocks (uint8 [rows, row bytes]) and gguf's float64 dequantization."""
    type_id, block, nbytes = ops.QUANT_TYPES[type_name]
    rng = np.random.default_rng(rows * 7919 + in_features + type_id)
    raw = rng.integers(0, 256, size=(rows, in_features // block, nbytes), dtype=np.uint8)
    # Scales near 1 / (levels * sqrt(K)), so that outputs stay near unit size.
    levels = 16 if block == 256 else 8
    for offset in HALF_FIELDS[type_name]:
        scale = rng.uniform(0.5, 1.5, size=raw.shape[:2]) / (levels * in_features**0.5)
        raw[:, :, offset : offset + 2] = (
            scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
        )
    raw = raw.reshape(rows, -1)
    dense = gguf.quants.dequantize(raw, GGMLType(type_id)).reshape(rows, in_features)
    return torch.from_numpy(raw), dense.astype(np.float64)


def activation_error_bound(x: torch.Tensor, dense: np.ndarray, span: int) -> np.ndarray:
    """The CPU kernel rounds each input to a step of (max |x| of its span) / 127, the
    span being the format's block (32, or 256 for the K formats): the output's error is
    at most half a step times |w|, summed ([M, N])."""
    xf = x.double().cpu().numpy()
    step = np.abs(xf.reshape(xf.shape[0], -1, span)).max(axis=2) / 127.0
    return 0.5 * np.repeat(step, span, axis=1) @ np.abs(dense).T


def check_quant_linear(type_name, in_features, out_features, rows, bias, dtype, device):
    type_id = ops.QUANT_TYPES[type_name][0]
    qweight, dense = random_weight(type_name, out_features, in_features)
    qweight = qweight.to(device)
    # A row view of a wider tensor, as the model's inputs may be.
    x = torch.randn(rows, in_features + 16).to(dtype).to(device)[:, 8 : 8 + in_features]
    b = torch.randn(out_features).to(dtype).to(device) if bias else None
    out = torch.full((rows, out_features), POISON, dtype=dtype, device=device)
    with kernel_threads():
        ops.quant_linear(out, x, qweight, type_id, b)
    expected = x.double().cpu().numpy() @ dense.T
    if b is not None:
        expected += b.double().cpu().numpy()
    atol, rtol = TOLERANCES[dtype]
    span = ops.QUANT_TYPES[type_name][1]
    allowed = activation_error_bound(x, dense, span) + atol + rtol * np.abs(expected)
    error = np.abs(out.double().cpu().numpy() - expected)
    worst = np.unravel_index(np.argmax(error - allowed), error.shape)
    assert (error <= allowed).all(), (
        f"{type_name}: out{list(worst)} = {out[worst].item()}, expected {expected[worst]} "
        f"(allowed error {allowed[worst]:.3g})"
    )


def shapes(type_name):
    """[K, N] pairs: K not a multiple of 256 where the block allows, N odd-sized."""
    if ops.QUANT_TYPES[type_name][1] == 256:
        return [(256, 40), (768, 72)]
    return [(96, 40), (576, 72)]


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("bias", [False, True])
# Every register tile height (1-8), whole tiles with a partial one after, a prefill.
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 33])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", TYPES)
def test_quant_linear(type_name, dtype, rows, bias, device):
    for in_features, out_features in shapes(type_name):
        check_quant_linear(type_name, in_features, out_features, rows, bias, dtype, device)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("type_name", TYPES)
def test_quant_linear_512_rows(type_name, device):
    in_features, out_features = shapes(type_name)[1]
    check_quant_linear(type_name, in_features, out_features, 512, True, torch.float32, device)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("type_name", TYPES)
def test_quant_linear_writes_column_views(type_name, device):
    """A fused projection's parts each write their columns of one output."""
    type_id = ops.QUANT_TYPES[type_name][0]
    in_features = shapes(type_name)[0][0]
    qweight, dense = random_weight(type_name, 48, in_features)
    x = torch.randn(3, in_features, device=device)
    out = torch.full((3, 80), POISON, device=device)
    with kernel_threads():
        ops.quant_linear(out[:, 16:64], x, qweight.to(device), type_id)
    assert out[:, :16].isnan().all() and out[:, 64:].isnan().all()
    expected = x.double().cpu().numpy() @ dense.T
    span = ops.QUANT_TYPES[type_name][1]
    allowed = activation_error_bound(x, dense, span) + 1e-4 + 1e-4 * np.abs(expected)
    assert (np.abs(out[:, 16:64].double().cpu().numpy() - expected) <= allowed).all()


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_rows(type_name, dtype, device):
    type_id = ops.QUANT_TYPES[type_name][0]
    in_features = shapes(type_name)[1][0]
    qweight, dense = random_weight(type_name, 37, in_features)
    qweight = qweight.to(device)
    rows = torch.tensor([5, 0, 36, 5, 17], device=device)
    out = torch.full((5, in_features), POISON, dtype=dtype, device=device)
    ops.dequantize_rows(out, qweight, type_id, rows)
    expected = torch.from_numpy(dense[rows.cpu().numpy()]).to(dtype)
    assert torch.equal(out.cpu(), expected)
    whole = torch.empty(37, in_features, dtype=torch.float32, device=device)
    ops.dequantize_rows(whole, qweight, type_id)
    assert torch.equal(whole.cpu().double(), torch.from_numpy(dense))


def test_quant_row_bytes():
    assert ops.quant_row_bytes(ops.QUANT_TYPES["Q4_K"][0], 4096) == 16 * 144
    assert ops.quant_row_bytes(ops.QUANT_TYPES["Q8_0"][0], 64) == 2 * 34
    with pytest.raises(ValueError, match="multiple of Q4_K's block of 256"):
        ops.quant_row_bytes(ops.QUANT_TYPES["Q4_K"][0], 96)


def bad_quant_linear_cases():
    q8 = ops.QUANT_TYPES["Q8_0"][0]
    qweight, _ = random_weight("Q8_0", 8, 64)
    x = torch.randn(2, 64)
    out = torch.empty(2, 8)
    return [
        ("qtype", dict(qtype=99)),
        ("qtype", dict(qtype=True)),
        ("qweight must be uint8", dict(qweight=qweight.view(torch.int8))),
        ("qweight must be \\[out_features, 68\\]", dict(qweight=qweight[:, :34].contiguous())),
        ("in_features \\(64\\) must be a multiple of Q4_K", dict(qtype=12)),
        ("out must have shape \\(2, 8\\)", dict(out=torch.empty(2, 9))),
        ("out has dtype torch.float64 but must match", dict(out=out.double())),
        ("input has dtype torch.int32", dict(input=x.to(torch.int32))),
        ("bias must have shape \\(8,\\)", dict(bias=torch.zeros(7))),
        ("qweight must be contiguous", dict(qweight=qweight.t().contiguous().t())),
    ], dict(out=out, input=x, qweight=qweight, qtype=q8, bias=None)


def test_quant_linear_bad_arguments():
    cases, good = bad_quant_linear_cases()
    ops.quant_linear(**good)
    for message, change in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            ops.quant_linear(**{**good, **change})


def test_dequantize_rows_bad_arguments():
    qweight, _ = random_weight("Q4_0", 8, 64)
    q4 = ops.QUANT_TYPES["Q4_0"][0]
    with pytest.raises(ValueError, match="rows must lie in \\[0, 8\\)"):
        ops.dequantize_rows(torch.empty(1, 64), qweight, q4, torch.tensor([8]))
    with pytest.raises(TypeError, match="rows must have dtype torch.int64"):
        ops.dequantize_rows(torch.empty(1, 64), qweight, q4, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="out must have qweight's 8 rows"):
        ops.dequantize_rows(torch.empty(3, 64), qweight, q4)
    with pytest.raises(TypeError, match="out has dtype torch.int32"):
        ops.dequantize_rows(torch.empty(8, 64, dtype=torch.int32), qweight, q4)
