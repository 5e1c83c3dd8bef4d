"""reshape_and_cache, copy_blocks and swap_blocks against plain-PyTorch references.

These ops only move values, so every comparison is bit-for-bit over the whole cache:
slots, blocks and padding tokens the op must not touch keep their random contents.
"""

from __future__ import annotations

import pytest
import torch

import pyllm.ops as ops
from tests.kernels.utils import ALL_DEVICES, DEVICES, DTYPES, scatter_into_cache

HEAD_SIZES = list(ops.SUPPORTED_HEAD_SIZES)
BLOCK_SIZES = list(ops.SUPPORTED_BLOCK_SIZES)
NUM_TOKENS = [1, 7, 300]
NUM_KV_HEADS = 2
NUM_HEADS = 4  # query heads in the fused qkv rows the key/value views come from


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t, so that equality is exact (NaN and -0.0 included)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    actual, expected = bits(actual.cpu()), bits(expected.cpu())
    if not torch.equal(actual, expected):
        mismatched = (actual != expected).sum().item()
        raise AssertionError(f"{mismatched} of {actual.numel()} elements differ")


def random_cache(num_blocks, num_kv_heads, head_size, block_size, dtype, device, generator):
    key_cache, value_cache = ops.allocate_kv_cache(
        num_blocks, num_kv_heads, head_size, block_size, dtype, device
    )
    key_cache.copy_(torch.randn(key_cache.shape, generator=generator))
    value_cache.copy_(torch.randn(value_cache.shape, generator=generator))
    return key_cache, value_cache


def token_kv(num_tokens, num_kv_heads, head_size, dtype, device, generator, layout):
    """key/value [T, Hkv, D]: contiguous, or views into one fused qkv projection."""
    if layout == "contiguous":
        key = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator)
        value = torch.randn(num_tokens, num_kv_heads, head_size, generator=generator)
        return key.to(dtype).to(device), value.to(dtype).to(device)
    q_width, kv_width = NUM_HEADS * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=generator)
    qkv = qkv.to(dtype).to(device)
    key = qkv[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, q_width + kv_width :].view(num_tokens, num_kv_heads, head_size)
    assert num_tokens == 1 or not key.is_contiguous()
    return key, value


def random_slots(num_tokens, num_blocks, block_size, generator, padding_every=0):
    """Distinct random slots; every padding_every-th token gets -1 (skipped)."""
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    if padding_every:
        slots[::padding_every] = -1
    return slots


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "qkv_view"])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(dtype, head_size, block_size, num_tokens, layout, device):
    generator = torch.Generator().manual_seed(num_tokens * 1000 + head_size + block_size)
    num_blocks = -(-num_tokens // block_size) + 3
    key_cache, value_cache = random_cache(
        num_blocks, NUM_KV_HEADS, head_size, block_size, dtype, device, generator
    )
    key, value = token_kv(num_tokens, NUM_KV_HEADS, head_size, dtype, device, generator, layout)
    slots = random_slots(num_tokens, num_blocks, block_size, generator, padding_every=5)
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()
    scatter_into_cache(expected_key_cache, expected_value_cache, key, value, slots.to(device))

    ops.reshape_and_cache(key, value, key_cache, value_cache, slots.to(device))

    assert_same_bits(key_cache, expected_key_cache)
    assert_same_bits(value_cache, expected_value_cache)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads", [1, 3, 8])
def test_reshape_and_cache_kv_heads_and_full_blocks(num_kv_heads, dtype, device):
    """Every slot of every block written once, in a random order."""
    generator = torch.Generator().manual_seed(num_kv_heads)
    head_size, block_size, num_blocks = 128, 16, 6
    key_cache, value_cache = random_cache(
        num_blocks, num_kv_heads, head_size, block_size, dtype, device, generator
    )
    num_tokens = num_blocks * block_size
    key, value = token_kv(num_tokens, num_kv_heads, head_size, dtype, device, generator, "qkv_view")
    slots = random_slots(num_tokens, num_blocks, block_size, generator)
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()
    scatter_into_cache(expected_key_cache, expected_value_cache, key, value, slots.to(device))

    ops.reshape_and_cache(key, value, key_cache, value_cache, slots.to(device))

    assert_same_bits(key_cache, expected_key_cache)
    assert_same_bits(value_cache, expected_value_cache)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_all_padding_leaves_cache_untouched(dtype, device):
    generator = torch.Generator().manual_seed(1)
    key_cache, value_cache = random_cache(4, NUM_KV_HEADS, 64, 8, dtype, device, generator)
    key, value = token_kv(9, NUM_KV_HEADS, 64, dtype, device, generator, "contiguous")
    before = key_cache.clone(), value_cache.clone()

    ops.reshape_and_cache(key, value, key_cache, value_cache, torch.full((9,), -1).to(device))

    assert_same_bits(key_cache, before[0])
    assert_same_bits(value_cache, before[1])


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_reshape_and_cache_no_tokens(device):
    generator = torch.Generator().manual_seed(2)
    key_cache, value_cache = random_cache(2, 1, 64, 8, torch.float32, device, generator)
    before = key_cache.clone(), value_cache.clone()
    empty = torch.empty(0, 1, 64, device=device)
    slots = torch.empty(0, dtype=torch.int64, device=device)

    ops.reshape_and_cache(empty, empty, key_cache, value_cache, slots)

    assert_same_bits(key_cache, before[0])
    assert_same_bits(value_cache, before[1])


def test_reshape_and_cache_kernel_rejects_out_of_range_slot():
    """The kernel itself refuses slots past the cache when called without ops.py."""
    key_cache, value_cache = ops.allocate_kv_cache(2, 1, 64, 8)
    before = key_cache.clone(), value_cache.clone()
    key = torch.randn(3, 1, 64)
    slots = torch.tensor([0, 16, 1])  # 2 blocks of 8: slot 16 is one past the end
    with pytest.raises(RuntimeError, match="slot_mapping"):
        torch.ops.pyllm.reshape_and_cache(key, key, key_cache, value_cache, slots, "auto")
    # The check runs before any write.
    assert_same_bits(key_cache, before[0])
    assert_same_bits(value_cache, before[1])


def copy_pairs(num_blocks, num_pairs, generator):
    """(src, dst) pairs with distinct destinations that are never also sources, so
    the result does not depend on the order the pairs are applied in."""
    order = torch.randperm(num_blocks, generator=generator)
    src = order[:num_pairs]
    dst = order[num_pairs : 2 * num_pairs]
    # Some blocks are copied to more than one destination.
    src[num_pairs // 2 :] = src[0]
    return torch.stack([src, dst], dim=1).contiguous()


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("num_pairs", [1, 6])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks(dtype, head_size, block_size, num_pairs, device):
    generator = torch.Generator().manual_seed(num_pairs * 100 + head_size + block_size)
    num_layers, num_blocks = 3, 14
    layers = [
        random_cache(num_blocks, NUM_KV_HEADS, head_size, block_size, dtype, device, generator)
        for _ in range(num_layers)
    ]
    key_caches = [k for k, _ in layers]
    value_caches = [v for _, v in layers]
    block_mapping = copy_pairs(num_blocks, num_pairs, generator)
    expected_keys = [k.clone() for k in key_caches]
    expected_values = [v.clone() for v in value_caches]
    for src, dst in block_mapping.tolist():
        for expected in expected_keys + expected_values:
            expected[dst] = expected[src]

    ops.copy_blocks(key_caches, value_caches, block_mapping)

    for actual, expected in zip(
        key_caches + value_caches, expected_keys + expected_values, strict=True
    ):
        assert_same_bits(actual, expected)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_copy_blocks_empty_mapping(device):
    generator = torch.Generator().manual_seed(3)
    key_cache, value_cache = random_cache(4, 2, 64, 16, torch.bfloat16, device, generator)
    before = key_cache.clone(), value_cache.clone()

    ops.copy_blocks([key_cache], [value_cache], torch.empty(0, 2, dtype=torch.int64))

    assert_same_bits(key_cache, before[0])
    assert_same_bits(value_cache, before[1])


def test_copy_blocks_kernel_rejects_out_of_range_block():
    key_cache, value_cache = ops.allocate_kv_cache(4, 1, 64, 8)
    with pytest.raises(RuntimeError, match="block_mapping"):
        torch.ops.pyllm.copy_blocks([key_cache], [value_cache], torch.tensor([[0, 4]]))


NO_CUDA = pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
SWAP_DEVICES = [
    ("cpu", "cpu"),
    pytest.param("cpu", "cuda", marks=NO_CUDA),
    pytest.param("cuda", "cpu", marks=NO_CUDA),
    pytest.param("cuda", "cuda", marks=NO_CUDA),
]


@pytest.mark.parametrize(("src_device", "dst_device"), SWAP_DEVICES)
@pytest.mark.parametrize("which", ["key_cache", "value_cache"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks(dtype, block_size, which, src_device, dst_device):
    generator = torch.Generator().manual_seed(block_size)
    head_size = 128
    src = random_cache(10, NUM_KV_HEADS, head_size, block_size, dtype, src_device, generator)
    dst = random_cache(7, NUM_KV_HEADS, head_size, block_size, dtype, dst_device, generator)
    src, dst = (src[0], dst[0]) if which == "key_cache" else (src[1], dst[1])
    block_mapping = torch.tensor([[9, 0], [3, 6], [0, 2], [3, 3]])
    expected = dst.cpu().clone()
    for s, d in block_mapping.tolist():
        expected[d] = src[s].cpu()
    src_before = src.cpu().clone()

    ops.swap_blocks(src, dst, block_mapping)

    assert_same_bits(dst, expected)
    assert_same_bits(src, src_before)


def test_swap_blocks_kernel_rejects_out_of_range_block():
    src, dst = torch.zeros(4, 2, 64, 8), torch.zeros(2, 2, 64, 8)
    with pytest.raises(RuntimeError, match="block_mapping"):
        torch.ops.pyllm.swap_blocks(src, dst, torch.tensor([[3, 2]]))


def _transparent_huge_pages_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _anon_huge_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.skipif(
    _transparent_huge_pages_mode() not in ("always", "madvise"),
    reason="transparent huge pages are off (or this is not Linux)",
)
def test_cpu_kv_cache_is_zeroed_and_backed_by_huge_pages():
    before = _anon_huge_bytes()
    key_cache, value_cache = ops.allocate_kv_cache(1024, 8, 128, 16, torch.bfloat16, "cpu")
    # Nothing is committed until the cache is written (the pool holds what sequences use).
    assert _anon_huge_bytes() - before < 8 * 2**20
    assert key_cache.shape == (1024, 8, 16, 16, 8) and value_cache.shape == (1024, 8, 128, 16)
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert not key_cache.any() and not value_cache.any()
    key_cache.fill_(1.0)  # writable, and still readable after the allocation returns
    value_cache.fill_(2.0)
    after = _anon_huge_bytes()
    # 2 x 32 MiB of cache: all but the first 2 MiB (SMALL_PAGES_FIRST) and a partial
    # 2 MiB page at each end can be huge pages.
    assert after - before >= 48 * 2**20, (before, after)
    assert key_cache.sum().item() == key_cache.numel()
