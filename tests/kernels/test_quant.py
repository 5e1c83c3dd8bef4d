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

# Byte offsets of each block's fp16 scale fields, and of MXFP4's E8M0 exponent byte:
# random bytes elsewhere are valid quants, but a random fp16 may be inf or NaN, and a
# random exponent scales by up to 2^127.
HALF_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "MXFP4": (),
}
EXPONENT_FIELDS = {"MXFP4": (0,)}
TYPES = list(ops.QUANT_TYPES)
MXFP4 = ops.QUANT_TYPES["MXFP4"][0]


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
    for offset in EXPONENT_FIELDS.get(type_name, ()):
        # MXFP4's scale is 2^(e - 128) (its codes are doubled E2M1 values): the power of
        # two nearest the same target.
        scale = rng.uniform(0.5, 1.5, size=raw.shape[:2]) / (levels * in_features**0.5)
        raw[:, :, offset] = np.round(np.log2(scale)) + 128
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
    qweight, dense = random_weight(type_name, out_features, in_features)
    # A row view of a wider tensor, as the model's inputs may be.
    x = torch.randn(rows, in_features + 16).to(dtype).to(device)[:, 8 : 8 + in_features]
    b = torch.randn(out_features).to(dtype).to(device) if bias else None
    expect_quant_linear(type_name, qweight.to(device), dense, x, b)


def expect_quant_linear(type_name, qweight, dense, x, b):
    """quant_linear(x, qweight) (+ b) against x @ dense.T in float64, within the
    activation error bound."""
    type_id = ops.QUANT_TYPES[type_name][0]
    dtype, device = x.dtype, x.device
    rows, out_features = x.shape[0], qweight.shape[0]
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


def flushed_on(device, values):
    """values as the kernels on `device` produce them: the CUDA build's --use_fast_math
    flushes subnormal floats (below 2^-126) to zero; the CPU kernels keep them."""
    if str(device).startswith("cuda"):
        return values * (abs(values) >= 2.0**-126)
    return values


def mxfp4_blocks(exponents: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """MXFP4 blocks [..., 17] from exponent bytes [...] and codes [..., 32]: code l in
    the low nibble of byte l, code l + 16 in its high nibble."""
    codes = codes.astype(np.uint8)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([exponents[..., None].astype(np.uint8), packed], axis=-1)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_every_exponent_and_code(dtype, device):
    """Every E8M0 byte (e < 2 gives subnormal scales, e = 255 is 2^127, not NaN) with
    every code, against gguf's dequantizer: exactly, inf where 12 * 2^(e - 128)
    overflows float32 as there (on CUDA with subnormal weights flushed to zero)."""
    exponents = np.arange(256)
    every_code = np.concatenate([np.arange(16), np.arange(16)[::-1]])
    rng = np.random.default_rng(39)
    codes = np.stack([np.broadcast_to(every_code, (256, 32)), rng.integers(0, 16, (256, 32))], 1)
    raw = mxfp4_blocks(np.stack([exponents, exponents[::-1]], 1), codes).reshape(256, 34)
    with np.errstate(over="ignore"):
        expected = gguf.quants.dequantize(raw, GGMLType.MXFP4).reshape(256, 64)
    expected = torch.from_numpy(expected)
    # Row r: block 0 scaled by exponent r, block 1 by 255 - r.
    assert expected[:2, :32].ne(0).any() and (expected[:2, :32].abs() < 2**-123).all()
    assert expected.isinf().any()
    out = torch.full((256, 64), POISON, dtype=dtype, device=device)
    ops.dequantize_rows(out, torch.from_numpy(raw).to(device), MXFP4)
    assert torch.equal(out.cpu(), flushed_on(device, expected).to(dtype))


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("tiny", [True, False])
def test_mxfp4_extreme_exponents_in_quant_linear(tiny, rows, device):
    """Scales at both ends of E8M0's range (subnormal 2^-128, 2^-127; 2^124-2^126)
    against inputs scaled the other way, so that the products are ordinary floats:
    every path of quant_linear decodes the scales, not only dequantize_rows. Codes of
    the large scales stay within |value| <= 3, so that every weight is a finite float.
    (float32: a bf16 weight panel would flush the subnormal weights to zero.)"""
    in_features, out_features = 576, 40  # 16 blocks at a time and a tail of 2
    rng = np.random.default_rng(rows + 2 * tiny)
    shape = (out_features, in_features // 32)
    if tiny:
        exponents = rng.integers(0, 4, shape)
        codes = rng.integers(0, 16, (*shape, 32))
        x_scale = 2.0**120
    else:
        exponents = rng.integers(252, 255, shape)
        codes = rng.choice([0, 1, 2, 3, 8, 9, 10, 11], (*shape, 32))
        x_scale = 2.0**-100
    raw = mxfp4_blocks(exponents, codes).reshape(out_features, -1)
    dense = gguf.quants.dequantize(raw, GGMLType.MXFP4).reshape(out_features, in_features)
    assert np.isfinite(dense).all() and (np.abs(dense) > 0).any()
    x = (torch.randn(rows, in_features, dtype=torch.float64) * x_scale).float().to(device)
    dense = flushed_on(device, dense.astype(np.float64))
    expect_quant_linear("MXFP4", torch.from_numpy(raw).to(device), dense, x, None)


def test_quant_row_bytes():
    assert ops.quant_row_bytes(ops.QUANT_TYPES["Q4_K"][0], 4096) == 16 * 144
    assert ops.quant_row_bytes(ops.QUANT_TYPES["Q8_0"][0], 64) == 2 * 34
    assert ops.quant_row_bytes(MXFP4, 2880) == 90 * 17
    with pytest.raises(ValueError, match="multiple of Q4_K's block of 256"):
        ops.quant_row_bytes(ops.QUANT_TYPES["Q4_K"][0], 96)


def test_quant_types_match_gguf():
    # The list the library exports (csrc/quantization/gguf_formats.h) against gguf's.
    assert len(ops.QUANT_TYPES) == 9
    for name, (type_id, block, nbytes) in ops.QUANT_TYPES.items():
        assert GGMLType[name].value == type_id
        assert gguf.GGML_QUANT_SIZES[GGMLType[name]] == (block, nbytes)


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
        ("qweight must be \\[out_features, 34\\] \\(MXFP4", dict(qtype=MXFP4)),
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


@pytest.fixture
def batch_invariant():
    ops.set_batch_invariant(True)
    yield
    ops.set_batch_invariant(False)


def weight_and_rows(type_name, dtype, rows):
    """(product, x): product(x_rows, many_rows=0) multiplies x_rows by a random weight
    of the type (shapes()'s second) with quant_linear; x: `rows` random input rows."""
    in_features, out_features = shapes(type_name)[1]
    type_id = ops.QUANT_TYPES[type_name][0]
    qweight, _ = random_weight(type_name, out_features, in_features)

    def product(x, many_rows=0):
        out = torch.empty(x.shape[0], out_features, dtype=dtype)
        ops.quant_linear(out, x.clone(), qweight, type_id, many_rows=many_rows)
        return out

    return product, torch.randn(rows, in_features).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", TYPES)
def test_batch_invariant_rows_do_not_depend_on_the_others(type_name, dtype, batch_invariant):
    """64 rows (past where panels, AMX tiles or GEMMs would take over) give each row
    bitwise what that row gives alone or in a small call."""
    product, x = weight_and_rows(type_name, dtype, 64)
    whole = product(x)
    for first, last in ((0, 1), (5, 12), (31, 64)):
        assert torch.equal(product(x[first:last]), whole[first:last]), (first, last)


def test_batch_invariant_switch():
    assert ops.batch_invariant() is False
    ops.set_batch_invariant(True)
    try:
        assert ops.batch_invariant() is True
    finally:
        ops.set_batch_invariant(False)
    with pytest.raises(ValueError, match="on must be True or False"):
        ops.set_batch_invariant(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("type_name", TYPES)
def test_many_rows_compute_as_a_many_row_call(type_name, dtype):
    """Rows passed as many_rows give bitwise what the same rows give in a call of 40
    (past where panels or AMX tiles take over, short of ATen's GEMM), alone or ahead of
    rows that take the path of their own count."""
    product, x = weight_and_rows(type_name, dtype, 40)
    whole, few = product(x), product(x[37:])
    for first, last in ((0, 1), (5, 12), (20, 37)):
        n = last - first
        assert torch.equal(product(x[first:last], n), whole[first:last]), (first, last)
        # Followed by three rows of their own count.
        mixed = product(torch.cat([x[first:last], x[37:]]), n)
        assert torch.equal(mixed[:n], whole[first:last]), (first, last)
        assert torch.equal(mixed[n:], few), (first, last)
