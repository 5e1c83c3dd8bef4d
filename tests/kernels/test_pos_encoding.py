"""rotary_embedding against a plain-PyTorch float64 reference.

query/key are taken as views of one fused qkv projection (as the model passes them),
so the test also checks that the value part and the unrotated tail of each head
(dims rot_dim..head_size) come out bit-for-bit unchanged.
"""

from __future__ import annotations

import pytest
import torch

import pyllm.ops as ops
from tests.kernels.utils import ALL_DEVICES, DTYPES, assert_close

NUM_HEADS, NUM_KV_HEADS = 4, 2
MAX_POSITION = 1024


def make_cos_sin_cache(rot_dim: int, dtype: torch.dtype, base: float = 10000.0) -> torch.Tensor:
    """[MAX_POSITION, rot_dim]: cos(p * theta_i) then sin(p * theta_i)."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.arange(MAX_POSITION, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def rotary_reference(
    positions: torch.Tensor, x: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor, is_neox
) -> torch.Tensor:
    """x [T, H * head_size] rotated in float64, returned as [T, H, head_size] float64."""
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    cos_sin = cos_sin_cache.double().cpu()[positions.cpu()]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    x = x.cpu().double().reshape(x.shape[0], -1, head_size).clone()
    rot = x[..., :rot_dim]
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if is_neox:
        x[..., :rot_dim] = torch.cat([y1, y2], dim=-1)
    else:
        x[..., :rot_dim] = torch.stack([y1, y2], dim=-1).flatten(-2)
    return x


def fused_qkv(num_tokens, head_size, dtype, device, generator):
    """One [T, (Hq + 2 Hkv) * D] projection and its query/key column views."""
    q_width, kv_width = NUM_HEADS * head_size, NUM_KV_HEADS * head_size
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=generator)
    qkv = qkv.to(dtype).to(device)
    return qkv, qkv[:, :q_width], qkv[:, q_width : q_width + kv_width]


def check_rotary(
    dtype, head_size, rot_dim, is_neox, num_tokens, layout, device, cache_dtype, seed=0
):
    generator = torch.Generator().manual_seed(seed)
    qkv, query, key = fused_qkv(num_tokens, head_size, dtype, device, generator)
    if layout == "3d":
        query = query.view(num_tokens, NUM_HEADS, head_size)
        key = key.view(num_tokens, NUM_KV_HEADS, head_size)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=generator)
    positions[-1] = MAX_POSITION - 1
    cos_sin_cache = make_cos_sin_cache(rot_dim, cache_dtype).to(device)
    before = qkv.clone()
    q_width, kv_width = NUM_HEADS * head_size, NUM_KV_HEADS * head_size
    expected_q = rotary_reference(positions, before[:, :q_width], head_size, cos_sin_cache, is_neox)
    expected_k = rotary_reference(
        positions, before[:, q_width : q_width + kv_width], head_size, cos_sin_cache, is_neox
    )

    ops.rotary_embedding(positions.to(device), query, key, head_size, cos_sin_cache, is_neox)

    actual_q = qkv[:, :q_width].reshape(num_tokens, NUM_HEADS, head_size)
    actual_k = qkv[:, q_width : q_width + kv_width].reshape(num_tokens, NUM_KV_HEADS, head_size)
    # One comparison for both (each assert_close call has a fixed cost).
    assert_close(
        torch.cat([actual_q[..., :rot_dim], actual_k[..., :rot_dim]], dim=1),
        torch.cat([expected_q[..., :rot_dim], expected_k[..., :rot_dim]], dim=1),
        dtype,
    )
    # Exact: dims past rot_dim, and the value columns next to key.
    before_q = before[:, :q_width].reshape(num_tokens, NUM_HEADS, head_size)
    before_k = before[:, q_width : q_width + kv_width].reshape(num_tokens, NUM_KV_HEADS, head_size)
    assert torch.equal(actual_q[..., rot_dim:], before_q[..., rot_dim:])
    assert torch.equal(actual_k[..., rot_dim:], before_k[..., rot_dim:])
    assert torch.equal(qkv[:, q_width + kv_width :], before[:, q_width + kv_width :])


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("partial", [False, True], ids=["full_rot", "partial_rot"])
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding(dtype, head_size, partial, is_neox, num_tokens, device):
    # Partial rotation as in GPT-NeoX / Phi (rotary_pct < 1); 80 * 0.4 = 32, and
    # 128 * 0.4 -> 50 gives an odd number of pairs.
    rot_dim = int(head_size * 0.4) // 2 * 2 if partial else head_size
    check_rotary(dtype, head_size, rot_dim, is_neox, num_tokens, "2d", device, cache_dtype=dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("num_tokens", [1, 300])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_embedding_3d_views(dtype, is_neox, num_tokens, device):
    """query/key given as [num_tokens, num_heads, head_size] views."""
    check_rotary(dtype, 128, 64, is_neox, num_tokens, "3d", device, cache_dtype=dtype, seed=4)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_embedding_float32_cache(dtype, is_neox, device):
    check_rotary(dtype, 128, 128, is_neox, 33, "2d", device, cache_dtype=torch.float32, seed=1)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding_rot_dim_over_256(is_neox, device):
    """rot_dim 384 > 256: the kernel rotates in more than one pass over the pairs."""
    check_rotary(torch.float32, 512, 384, is_neox, 5, "2d", device, torch.float32, seed=2)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_rotary_embedding_strided_positions(device):
    """positions may be a strided view (e.g. one column of a [T, 2] tensor)."""
    generator = torch.Generator().manual_seed(3)
    head_size = 64
    qkv, query, key = fused_qkv(9, head_size, torch.float32, device, generator)
    pairs = torch.randint(0, MAX_POSITION, (9, 2), generator=generator)
    cos_sin_cache = make_cos_sin_cache(head_size, torch.float32).to(device)
    expected_q = rotary_reference(pairs[:, 1], query, head_size, cos_sin_cache, True)

    ops.rotary_embedding(pairs[:, 1].to(device), query, key, head_size, cos_sin_cache, True)

    assert_close(query.reshape(9, NUM_HEADS, head_size), expected_q, torch.float32)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_rotary_embedding_no_tokens(device):
    query = torch.empty(0, NUM_HEADS * 64, device=device)
    key = torch.empty(0, NUM_KV_HEADS * 64, device=device)
    positions = torch.empty(0, dtype=torch.int64, device=device)
    cos_sin_cache = make_cos_sin_cache(64, torch.float32).to(device)
    ops.rotary_embedding(positions, query, key, 64, cos_sin_cache, True)


def test_rotary_embedding_kernel_rejects_out_of_range_position():
    """The kernel itself refuses positions past cos_sin_cache when called without ops.py."""
    query, key = torch.randn(3, 128), torch.randn(3, 64)
    cos_sin_cache = make_cos_sin_cache(64, torch.float32)
    positions = torch.tensor([0, MAX_POSITION, 1])
    with pytest.raises(RuntimeError, match="positions"):
        torch.ops.pyllm.rotary_embedding(positions, query, key, 64, cos_sin_cache, True)
