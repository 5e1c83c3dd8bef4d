"""quantize_weight: GGML blocks that gguf's reference dequantizer reads back, byte for
byte equal to gguf's own quantizers where it has them (Q8_0, Q4_0, MXFP4)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape, quants

from pyllm.model import quantize
from pyllm.model.quantize import QUANT_TYPES_BY_NAME, quantize_weight, quantized_shape

# Relative RMS round-trip error bounds for Gaussian weights; measured over seeds:
# q8_0 0.53-0.54%, q4_0 8.56-8.68%, q4_k 7.08-7.13% (a single min/max grid with its
# least-squares fit gives 7.4%, the plain min/max fit 7.85%), q6_k 1.74-1.77%, mxfp4
# 11.39-11.46% (power-of-two scales, eight magnitudes, the block's max often clipped).
ERROR_BOUNDS = {"q8_0": 0.006, "q4_0": 0.090, "q4_k": 0.073, "q6_k": 0.019, "mxfp4": 0.118}
REFERENCE_TYPES = ("q8_0", "q4_0", "mxfp4")  # gguf.quants can quantize these


def ggml_type(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType(QUANT_TYPES_BY_NAME[name])


def round_trip(weight: torch.Tensor, name: str) -> np.ndarray:
    packed = quantize_weight(weight, name)
    assert packed.dtype == torch.uint8
    assert tuple(packed.shape) == quant_shape_to_byte_shape(weight.shape, ggml_type(name))
    return quants.dequantize(packed.numpy(), ggml_type(name))


def relative_rms(approx: np.ndarray, exact: torch.Tensor) -> float:
    exact = exact.float().numpy()
    return float(np.sqrt(np.mean((approx - exact) ** 2) / np.mean(exact**2)))


def gaussian(rows: int, cols: int, seed: int = 0, std: float = 0.02) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * std


def test_type_table_matches_gguf():
    for name, type_id in QUANT_TYPES_BY_NAME.items():
        qtype = GGMLQuantizationType(type_id)
        assert qtype.name.lower() == name
        assert quantize._BLOCK_SIZES[name] == GGML_QUANT_SIZES[qtype]
        assert quantized_shape((3, 512), name) == quant_shape_to_byte_shape((3, 512), qtype)


@pytest.mark.parametrize("name", sorted(QUANT_TYPES_BY_NAME))
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_error_on_gaussian_weights(name, seed):
    weight = gaussian(64, 1024, seed)
    error = relative_rms(round_trip(weight, name), weight)
    assert error < ERROR_BOUNDS[name], f"{name}: relative RMS error {error:.4%}"


@pytest.mark.parametrize("name", sorted(QUANT_TYPES_BY_NAME))
def test_blocks_have_their_own_scales(name):
    # Rows and super-blocks five orders of magnitude apart (all within the range of
    # fp16 scales): one shared scale would flush the small ones to zero.
    weight = gaussian(8, 1024, seed=3, std=1.0)
    weight *= torch.logspace(0, 3, 8).unsqueeze(1)
    weight[:, 512:] *= 1e-2
    back = round_trip(weight, name)
    for row in range(8):
        for cols in (slice(0, 512), slice(512, 1024)):
            error = relative_rms(back[row, cols], weight[row, cols])
            assert error < ERROR_BOUNDS[name] * 1.2, f"{name} row {row} {cols}: {error:.4%}"


@pytest.mark.parametrize("name", sorted(QUANT_TYPES_BY_NAME))
def test_constant_and_zero_blocks(name):
    weight = torch.zeros(4, 512)
    weight[1] = 0.25
    weight[2] = -0.75
    weight[3, :256] = 3.0
    back = round_trip(weight, name)
    # fp16 scales of these values are exact, so every type gets them back (nearly) exactly.
    np.testing.assert_allclose(back, weight.numpy(), rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("name", REFERENCE_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bytes_equal_gguf_reference(name, seed):
    weight = gaussian(32, 1024, seed, std=1.0)
    expected = quants.quantize(weight.numpy(), ggml_type(name))
    np.testing.assert_array_equal(quantize_weight(weight, name).numpy(), expected)


def special_blocks() -> torch.Tensor:
    """Blocks that probe the reference's rounding and sign choices."""
    blocks = []
    # Scale exactly 1 (max 127), values on .5: C's roundf rounds away from zero.
    halves = torch.arange(-16, 16, dtype=torch.float32) + 0.5
    halves[0] = -127.0
    blocks.append(halves)
    blocks.append(-halves)
    # Equal magnitudes of both signs: the first one decides Q4_0's sign.
    tie = torch.linspace(-0.5, 0.5, 32)
    tie[3], tie[20] = 2.0, -2.0
    blocks.append(tie)
    tie = tie.clone()
    tie[3], tie[20] = -2.0, 2.0
    blocks.append(tie)
    # Q4_0 at -8 exactly: values on the 8.5 truncation boundaries.
    steps = torch.arange(32, dtype=torch.float32) % 16 - 8
    blocks.append(steps)
    blocks.append(steps + 0.5)
    blocks.append(torch.zeros(32))
    blocks.append(torch.full((32,), 1e-7))  # scale below fp16's normal range
    blocks.append(torch.full((32,), -3.0e4))
    blocks.append(torch.randn(32, generator=torch.Generator().manual_seed(5)) * 1e-3)
    # MXFP4 (scale 1 for a max in [8, 16)): midpoints between its values (0, 1, 2, 3,
    # 4, 6, 8, 12), the first code wins a tie; and a max clipped to 12.
    mids = torch.tensor([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0, 8.0])
    blocks.append(torch.cat([mids, -mids, mids * 1.0001, -mids * 0.9999]))
    blocks.append(torch.linspace(-15.9, 15.9, 32))
    # Maxima one and two float32 steps below a power of two, where float32 log2 rounds
    # up to the power (MXFP4's exponent takes its floor), and a little further below.
    below = torch.full((32,), 2.0**-7).nextafter(torch.tensor(0.0))
    blocks.append(below * torch.linspace(-1, 1, 32))
    blocks.append(below.nextafter(torch.tensor(0.0)) * torch.linspace(1, -1, 32))
    blocks.append(torch.full((32,), 2.0**10 * (1 - 2.0**-22)))
    blocks.append(torch.full((32,), -(2.0**-120) * (1 - 2.0**-12)))
    return torch.cat(blocks).reshape(2, -1)


@pytest.mark.parametrize("name", REFERENCE_TYPES)
def test_special_blocks_equal_gguf_reference(name):
    weight = special_blocks()
    expected = quants.quantize(weight.numpy(), ggml_type(name))
    np.testing.assert_array_equal(quantize_weight(weight, name).numpy(), expected)


@pytest.mark.parametrize("name", REFERENCE_TYPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_equal_reference_of_their_float32(name, dtype):
    weight = gaussian(16, 512, seed=4, std=1.0).to(dtype)
    expected = quants.quantize(weight.float().numpy(), ggml_type(name))
    np.testing.assert_array_equal(quantize_weight(weight, name).numpy(), expected)


@pytest.mark.parametrize("name", sorted(QUANT_TYPES_BY_NAME))
def test_chunked_rows_match_one_chunk(name, monkeypatch):
    weight = gaussian(10, 512, seed=6)
    whole = quantize_weight(weight, name)
    # Three rows per chunk: several chunks and a short last one.
    monkeypatch.setitem(quantize._CHUNK_ELEMENTS, name, 3 * 512)
    torch.testing.assert_close(quantize_weight(weight, name), whole, rtol=0, atol=0)
    # A row's bytes do not depend on the other rows.
    torch.testing.assert_close(quantize_weight(weight[7:8], name), whole[7:8], rtol=0, atol=0)


def test_parameter_input_keeps_no_graph():
    weight = torch.nn.Parameter(gaussian(4, 256, seed=8))
    packed = quantize_weight(weight, "q4_k")
    assert not packed.requires_grad
    assert relative_rms(round_trip(weight.detach(), "q4_k"), weight.detach()) < 0.08


def test_mxfp4_blocks_below_its_exponent_range():
    """A block whose max is below 2^-125 has no exponent of gguf's rule (its uint8 cast
    would wrap): it takes exponent 0, scale 2^-128, the nearest values of that."""
    weight = torch.zeros(2, 64)
    weight[0, :32] = torch.linspace(-(2.0**-126), 2.0**-126, 32)
    weight[0, 32:] = 2.0**-140
    weight[1] = torch.linspace(-1.5 * 2.0**-125, 1.5 * 2.0**-125, 64)
    packed = quantize_weight(weight, "mxfp4").view(2, 2, 17)
    assert packed[:, :, 0].tolist() == [[0, 0], [0, 0]]
    back = quants.dequantize(packed.reshape(2, 34).numpy(), GGMLQuantizationType.MXFP4)
    # Steps of 2^-128 up to 4 of them, 2^-127 up to 8, 2^-126 up to 12: half a step off
    # at most.
    assert (np.abs(back - weight.numpy()) <= 2.0**-127).all()


def test_upper_case_name_and_non_contiguous_weight():
    weight = gaussian(256, 64, seed=7).t()  # [64, 256], column-major
    expected = quants.quantize(weight.contiguous().numpy(), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(quantize_weight(weight, "Q8_0").numpy(), expected)


@pytest.mark.parametrize(
    ("shape", "name", "block"),
    [
        ((4, 48), "q8_0", 32),
        ((4, 100), "q4_0", 32),
        ((4, 288), "q4_k", 256),
        ((4, 0), "q6_k", 256),
        ((4, 2890), "mxfp4", 32),
    ],
)
def test_row_length_not_a_multiple_of_the_block_raises(shape, name, block):
    with pytest.raises(ValueError, match=rf"{re.escape(str(shape))}.*{name}.*block size {block}"):
        quantize_weight(torch.zeros(shape), name)
    with pytest.raises(ValueError, match=name):
        quantized_shape(shape, name)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="qtype must be one of .*'q3_k'"):
        quantize_weight(torch.zeros(4, 256), "q3_k")
    with pytest.raises(ValueError, match="qtype"):
        quantize_weight(torch.zeros(4, 256), 8)
    with pytest.raises(ValueError, match=r"2-D.*\(256,\)"):
        quantize_weight(torch.zeros(256), "q8_0")
    with pytest.raises(ValueError, match=r"2-D.*\(2, 2, 256\)"):
        quantize_weight(torch.zeros(2, 2, 256), "q4_k")
    with pytest.raises(ValueError, match="floating-point.*torch.int32"):
        quantize_weight(torch.zeros(4, 256, dtype=torch.int32), "q8_0")
    with pytest.raises(ValueError, match="torch.Tensor"):
        quantize_weight(np.zeros((4, 256), dtype=np.float32), "q8_0")
    weight = torch.zeros(4, 256)
    weight[2, 7] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_weight(weight, "q4_0")
