"""rms_norm, fused_add_rms_norm, silu_and_mul, gelu_tanh_and_mul and small_batch_linear
against plain-PyTorch float64 references.

Outputs are poisoned (NaN) before each call, so a row or element the kernel skips fails.
Hidden sizes include ones that are not multiples of the kernels' vector width or
staging chunk, and inputs include row views of wider tensors.
"""

from __future__ import annotations

import pytest
import torch

import pyllm.ops as ops
from tests.kernels.utils import ALL_DEVICES, DTYPES, POISON, assert_close

HIDDEN_SIZES = [64, 576, 1030, 4096]
NUM_TOKENS = [1, 7, 300]
EPS = 1e-6


def rows_input(shape, dtype, device, generator, layout, scale=1.0):
    """A [..., width] input: contiguous, a row view of a wider 2-D tensor, or a 3-D
    tensor whose dim 0 is strided (rows packed inside each index of dim 0)."""
    *lead, width = shape
    num_rows = 1
    for n in lead:
        num_rows *= n
    if layout == "contiguous":
        x = torch.randn(*shape, generator=generator) * scale
        return x.to(dtype).to(device)
    if layout == "row_view":
        wide = torch.randn(num_rows, width + 40, generator=generator) * scale
        return wide.to(dtype).to(device)[:, 8 : 8 + width].view(*lead, width)
    assert layout == "3d_view" and len(lead) == 1
    outer = 2 if num_rows % 2 == 0 else 1
    inner = num_rows // outer
    base = torch.randn(outer, inner * width + 24, generator=generator) * scale
    return base.to(dtype).to(device)[:, : inner * width].view(outer, inner, width)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.cpu().double()
    inv_rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return x * inv_rms * weight.cpu().double()


def act_and_mul_reference(x: torch.Tensor, op: str = "silu_and_mul") -> torch.Tensor:
    x = x.cpu().double()
    d = x.shape[-1] // 2
    gate = x[..., :d]
    if op == "silu_and_mul":
        return torch.nn.functional.silu(gate) * x[..., d:]
    return torch.nn.functional.gelu(gate, approximate="tanh") * x[..., d:]


ACT_OPS = ["silu_and_mul", "gelu_tanh_and_mul"]


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "row_view", "3d_view"])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, hidden_size, num_tokens, layout, device):
    generator = torch.Generator().manual_seed(hidden_size + num_tokens)
    x = rows_input((num_tokens, hidden_size), dtype, device, generator, layout)
    weight = (1 + 0.1 * torch.randn(hidden_size, generator=generator)).to(dtype).to(device)
    out = torch.full(x.shape, POISON, dtype=dtype, device=device)

    ops.rms_norm(out, x, weight, EPS)

    assert_close(out, rms_norm_reference(x, weight), dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_large_and_small_rows(dtype, device):
    """Rows of very different scales: the norm is per row, and eps matters for tiny rows."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4, 576, generator=generator)
    x *= torch.tensor([1e-3, 1.0, 30.0, 1e-8])[:, None]
    x = x.to(dtype).to(device)
    weight = torch.randn(576, generator=generator).to(dtype).to(device)
    out = torch.full(x.shape, POISON, dtype=dtype, device=device)

    ops.rms_norm(out, x, weight, EPS)

    assert_close(out, rms_norm_reference(x, weight), dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("hidden_size", HIDDEN_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype, hidden_size, num_tokens, device):
    generator = torch.Generator().manual_seed(hidden_size * 3 + num_tokens)
    x = rows_input((num_tokens, hidden_size), dtype, device, generator, "contiguous")
    residual = rows_input((num_tokens, hidden_size), dtype, device, generator, "contiguous", 4.0)
    weight = (1 + 0.1 * torch.randn(hidden_size, generator=generator)).to(dtype).to(device)
    # The sum is rounded once to the dtype (exact in float64), and the norm is taken
    # of that stored sum.
    expected_residual = (residual.cpu().double() + x.cpu().double()).to(dtype)
    expected_out = rms_norm_reference(expected_residual, weight)

    ops.fused_add_rms_norm(x, residual, weight, EPS)

    assert torch.equal(residual.cpu(), expected_residual)
    assert_close(x, expected_out, dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_3d(dtype, device):
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, 576, generator=generator).to(dtype).to(device)
    residual = torch.randn(2, 5, 576, generator=generator).to(dtype).to(device)
    weight = torch.randn(576, generator=generator).to(dtype).to(device)
    expected_residual = (residual.cpu().double() + x.cpu().double()).to(dtype)
    expected_out = rms_norm_reference(expected_residual, weight)

    ops.fused_add_rms_norm(x, residual, weight, EPS)

    assert torch.equal(residual.cpu(), expected_residual)
    assert_close(x, expected_out, dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "row_view", "3d_view"])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("d", [64, 1003, 1536])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ACT_OPS)
def test_act_and_mul(op, dtype, d, num_tokens, layout, device):
    generator = torch.Generator().manual_seed(d + num_tokens)
    # Scale 4 reaches well into both tails of the sigmoid.
    x = rows_input((num_tokens, 2 * d), dtype, device, generator, layout, scale=4.0)
    out = torch.full((*x.shape[:-1], d), POISON, dtype=dtype, device=device)

    getattr(ops, op)(out, x)

    assert_close(out, act_and_mul_reference(x, op), dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ACT_OPS)
def test_act_and_mul_extreme_gates(op, dtype, device):
    """Gates far in both tails, zero, and around the exp range limits of float32 (GELU's
    cubic takes -20 past them)."""
    gate = torch.tensor([-1e4, -200.0, -88.5, -87.0, -20.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 20.0,
                         88.5, 1e4])  # fmt: skip
    up = torch.linspace(-3, 3, gate.numel())
    x = torch.cat([gate, up])[None, :].to(dtype).to(device)
    out = torch.full((1, gate.numel()), POISON, dtype=dtype, device=device)

    getattr(ops, op)(out, x)

    assert_close(out, act_and_mul_reference(x, op), dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_layers_no_rows(device):
    x = torch.empty(0, 64, device=device)
    weight = torch.ones(64, device=device)
    ops.rms_norm(torch.empty_like(x), x, weight, EPS)
    ops.fused_add_rms_norm(x, torch.empty_like(x), weight, EPS)
    ops.silu_and_mul(torch.empty(0, 32, device=device), x)
    ops.gelu_tanh_and_mul(torch.empty(0, 32, device=device), x)


def linear_case(dtype, in_features, out_features, rows, bias, device):
    """Input (a row view of a wider tensor, as the model's inputs may be), weight, bias
    or None, and a poisoned out for the linear ops."""
    generator = torch.Generator().manual_seed(in_features * 10 + out_features + rows)
    wide = torch.randn(rows, in_features + 24, generator=generator)
    x = wide.to(dtype).to(device)[:, 8 : 8 + in_features]
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    weight = weight.to(dtype).to(device)
    b = torch.randn(out_features, generator=generator).to(dtype).to(device) if bias else None
    out = torch.full((rows, out_features), POISON, dtype=dtype, device=device)
    return x, weight, b, out


def assert_linear_close(out, x, weight, b, dtype):
    expected = x.cpu().double() @ weight.cpu().double().T
    if b is not None:
        expected += b.cpu().double()
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "in_features, out_features",
    # SmolLM2's projections; widths that leave a partial vector; fewer outputs than a
    # step of weight rows; a weight big enough to be split across threads.
    [(576, 960), (1536, 576), (100, 7), (64, 1), (17, 3), (2048, 4099)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_batch_linear(dtype, in_features, out_features, rows, bias, device):
    x, weight, b, out = linear_case(dtype, in_features, out_features, rows, bias, device)
    ops.small_batch_linear(out, x, weight, b)
    assert_linear_close(out, x, weight, b, dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_small_batch_linear_no_rows(device):
    out = torch.empty(0, 8, device=device)
    ops.small_batch_linear(
        out, torch.empty(0, 64, device=device), torch.randn(8, 64, device=device)
    )


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("bias", [False, True])
# One row to a decode batch of 70: every register tile height (1-8), whole tiles of 8
# with and without a partial one after.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 21, 70])
@pytest.mark.parametrize(
    "in_features, out_features",
    # SmolLM2's projections; column blocks not a multiple of the tile's (3 or 4); one
    # block; an odd number of words per column.
    [(576, 960), (1536, 576), (64, 16), (2, 48), (34, 80)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear(dtype, in_features, out_features, rows, bias, device):
    x, weight, b, out = linear_case(dtype, in_features, out_features, rows, bias, device)
    ops.packed_linear(out, x, ops.pack_weight_words(weight), b)
    assert_linear_close(out, x, weight, b, dtype)


def test_pack_weight_words_layout():
    """Element k of output column n sits at [n // 16, k // E, n % 16, k % E]."""
    for dtype, e in ((torch.float32, 1), (torch.bfloat16, 2)):
        weight = torch.arange(32 * 6, dtype=torch.float32).view(32, 6).to(dtype)
        words = ops.pack_weight_words(weight)
        assert words.shape == (2, 6 // e, 16, e)
        for n, k in ((0, 0), (5, 3), (17, 4), (31, 5)):
            assert words[n // 16, k // e, n % 16, k % e] == weight[n, k]


def test_rms_norm_kernel_rejects_mismatched_out():
    """The kernel itself refuses an out of the wrong shape when called without ops.py."""
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="out"):
        torch.ops.pyllm.rms_norm(torch.empty(3, 64), x, torch.ones(64), EPS)


def test_small_batch_linear_kernel_rejects_too_many_rows():
    """The kernel itself refuses more rows than it handles when called without ops.py."""
    rows = ops.SMALL_BATCH_MAX_ROWS + 1
    with pytest.raises(ValueError, match="rows"):
        torch.ops.pyllm.small_batch_linear(
            torch.empty(rows, 8), torch.randn(rows, 64), torch.randn(8, 64), None
        )
