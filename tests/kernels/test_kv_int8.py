"""The int8 KV cache (kv_cache_dtype "int8"): writes against a plain-PyTorch
quantization, exactly, and every attention kernel over an int8 cache against a float64
reference over the dequantized keys and values.

The attention tests build the paged cache in plain PyTorch (no pyllm kernel), set the
scales of slots no sequence owns to NaN (a kernel must mask them by selection) and
poison outputs with NaN, as tests/kernels/test_attention.py does for float caches.
Every case runs on the CPU and, where a GPU is present, on CUDA against the same
references.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import pyllm.ops as ops
from tests.kernels.test_attention import (
    random_sinks,
    reference_decode,
    reference_prefill,
)
from tests.kernels.utils import (
    POISON,
    PagedKV,
    assert_close,
    device_param,
    kernel_threads,
    scatter_into_cache,
    seed_and_single_thread,
)

HEAD_SIZES = [64, 128]
BLOCK_SIZES = list(ops.SUPPORTED_BLOCK_SIZES)
HEAD_LAYOUTS = [(4, 4), (8, 2), (12, 1)]  # MHA, GQA, MQA past one row tile
QUERY_DTYPES = [torch.float32, torch.bfloat16]
# Decode lengths: one token, around a block, and past one and two v2 partitions.
DECODE_LENS = [1, 15, 17, ops.PARTITION_SIZE + 9, 2 * ops.PARTITION_SIZE + 40]

ALL_DEVICES = [device_param("cpu"), device_param("cuda")]

_seed_and_threads = pytest.fixture(autouse=True)(seed_and_single_thread)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference int8 quantization of rows [..., D]: (q int8, scale float16 [...]), q
    divided by the stored (float16-rounded) scale; a scale of 0 gives zeros."""
    x = x.float()
    scale = (x.abs().amax(-1) / 127).clamp(max=65504).half()
    s = scale.float()[..., None]
    q = torch.where(s > 0, torch.round(x / s).clamp(-127, 127), 0.0)
    return q.to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.double() * scale.double()[..., None]


@dataclass
class Int8KV:
    kv: PagedKV  # int8 caches; keys/values hold the dequantized rows (float64)
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def make_int8_kv(seq_lens, num_kv_heads, head_size, block_size, device, extra_blocks=3) -> Int8KV:
    """Random keys/values quantized in plain PyTorch into randomly permuted blocks;
    scales of unowned slots NaN."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    key_cache, value_cache = ops.allocate_kv_cache(
        num_blocks, num_kv_heads, head_size, block_size, torch.int8, device
    )
    key_cache.random_(-128, 128)
    value_cache.random_(-128, 128)
    k_scale, v_scale = ops.allocate_kv_scales((num_blocks, num_kv_heads, block_size), device)
    k_scale.fill_(float("nan"))
    v_scale.fill_(float("nan"))
    order = torch.randperm(num_blocks).tolist()
    block_tables = torch.zeros(len(seq_lens), max(max(blocks_per_seq), 1), dtype=torch.int32)
    keys, values = [], []
    for s, n in enumerate(seq_lens):
        table = [order.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
        slots = torch.tensor(
            [table[i // block_size] * block_size + i % block_size for i in range(n)]
        )
        (kq, ks), (vq, vs) = (quantize(torch.randn(n, num_kv_heads, head_size)) for _ in range(2))
        scatter_into_cache(key_cache, value_cache, kq.to(device), vq.to(device), slots.to(device))
        blocks, offsets = slots // block_size, slots % block_size
        k_scale[blocks.to(device), :, offsets.to(device)] = ks.to(device)
        v_scale[blocks.to(device), :, offsets.to(device)] = vs.to(device)
        keys.append(dequantize(kq, ks).to(device))
        values.append(dequantize(vq, vs).to(device))
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    kv = PagedKV(key_cache, value_cache, block_tables.to(device), seq_lens_t, keys, values)
    return Int8KV(kv, k_scale, v_scale)


def random_query(num_tokens, num_heads, head_size, dtype, device):
    return torch.randn(num_tokens, num_heads, head_size).to(dtype).to(device)


# ---------------------------------------------------------------------------
# Writes.


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", QUERY_DTYPES + [torch.float16])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_reshape_and_cache_int8_matches_reference(device, dtype, head_size, block_size):
    num_kv_heads, num_blocks, T = 2, 5, 11
    key = torch.randn(T, num_kv_heads, head_size).to(dtype)
    value = torch.randn(T, num_kv_heads, head_size).to(dtype)
    key[3, 1] = 0  # a zero row: scale 0, zeros
    key[4, 0] = 1e-9  # absmax / 127 underflows float16: scale 0, zeros
    big = dtype != torch.float16  # float16 rows cannot reach a scale past its largest
    if big:
        value[6, 1] *= 1e7  # absmax / 127 past float16's largest: the scale saturates
    slots = torch.randperm(num_blocks * block_size)[:T]
    slots[5] = -1  # padding: not written
    key_cache, value_cache = ops.allocate_kv_cache(
        num_blocks, num_kv_heads, head_size, block_size, torch.int8, device
    )
    k_scale, v_scale = ops.allocate_kv_scales((num_blocks, num_kv_heads, block_size), device)
    with kernel_threads():
        ops.reshape_and_cache(
            key.to(device), value.to(device), key_cache, value_cache, slots.to(device), "int8",
            k_scale, v_scale,
        )  # fmt: skip
    expected = ops.allocate_kv_cache(
        num_blocks, num_kv_heads, head_size, block_size, torch.int8, "cpu"
    )
    expected_scales = ops.allocate_kv_scales((num_blocks, num_kv_heads, block_size))
    (kq, ks), (vq, vs) = quantize(key), quantize(value)
    scatter_into_cache(*expected, kq, vq, slots)
    keep = slots >= 0
    for scales, s in zip(expected_scales, (ks, vs), strict=True):
        scales[slots[keep] // block_size, :, slots[keep] % block_size] = s[keep]
    assert ks[3, 1] == 0 and (kq[3, 1] == 0).all()
    assert ks[4, 0] == 0 and (kq[4, 0] == 0).all()
    assert not big or (vs[6, 1] == 65504 and vq[6, 1].abs().max() == 127)
    for actual, wanted in zip((key_cache, value_cache, k_scale, v_scale),
                              (*expected, *expected_scales), strict=True):  # fmt: skip
        assert torch.equal(actual.cpu(), wanted)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_write_kv_contiguous_int8_round_trip(device, head_size):
    num_kv_heads, T = 2, 40
    arena = ops.KVArena(1, 3, 64, num_kv_heads, head_size, torch.int8, device)
    for slot in range(3):
        arena.commit(slot, 64)
    key_cache, value_cache, k_scale, v_scale = arena.kv_caches[0]
    key = torch.randn(T, num_kv_heads, head_size)
    value = torch.randn(T, num_kv_heads, head_size)
    slots = torch.randint(0, 3, (T,))
    positions = torch.randperm(64)[:T]
    slots[7] = -1
    with kernel_threads():
        ops.write_kv_contiguous(
            key.to(device), value.to(device), key_cache, value_cache, slots.to(device),
            positions.to(device), k_scale, v_scale,
        )  # fmt: skip
    (kq, ks), (vq, vs) = quantize(key), quantize(value)
    for t in range(T):
        slot, pos = int(slots[t]), int(positions[t])
        if slot < 0:
            continue
        tile, off = pos // ops.TOKEN_TILE, pos % ops.TOKEN_TILE
        stored_key = key_cache[slot, :, tile, :, off, :].reshape(num_kv_heads, head_size)
        assert torch.equal(stored_key.cpu(), kq[t])
        assert torch.equal(value_cache[slot, :, tile, :, off].cpu(), vq[t])
        assert torch.equal(k_scale[slot, :, tile, off].cpu(), ks[t])
        assert torch.equal(v_scale[slot, :, tile, off].cpu(), vs[t])


def test_kv_cache_dtype_refused_by_name():
    key = torch.randn(1, 1, 64)
    key_cache, value_cache = ops.allocate_kv_cache(1, 1, 64, 16, torch.float32)
    with pytest.raises(
        ValueError, match="kv_cache_dtype 'fp8' is not supported; choices: 'auto'.*'int8'"
    ):
        ops.reshape_and_cache(key, key, key_cache, value_cache, torch.zeros(1, dtype=torch.int64),
                              "fp8")  # fmt: skip


def test_int8_cache_needs_its_scales():
    key = torch.randn(1, 1, 64)
    key_cache, value_cache = ops.allocate_kv_cache(1, 1, 64, 16, torch.int8)
    with pytest.raises(ValueError, match="k_scale"):
        ops.reshape_and_cache(key, key, key_cache, value_cache, torch.zeros(1, dtype=torch.int64),
                              "int8")  # fmt: skip


# ---------------------------------------------------------------------------
# Attention.


def run_decode(version, query, q8: Int8KV, num_kv_heads, scale, window=None, sinks=None):
    kv = q8.kv
    out = torch.full_like(query, POISON)
    block_size, max_len = kv.value_cache.shape[3], max(kv.seq_lens.tolist())
    common = (kv.key_cache, kv.value_cache, num_kv_heads, scale, kv.block_tables, kv.seq_lens,
              block_size, max_len, None, window, sinks, q8.k_scale, q8.v_scale)  # fmt: skip
    with kernel_threads():
        if version == 1:
            ops.paged_attention_v1(out, query, *common)
        else:
            workspace = ops.paged_attention_v2_workspace(query, max_len)
            ops.paged_attention_v2(out, *workspace, query, *common)
    return out


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("version", [1, 2])
def test_paged_decode_int8(device, dtype, head_size, block_size, version):
    for h, (num_heads, num_kv_heads) in enumerate(HEAD_LAYOUTS):
        q8 = make_int8_kv(DECODE_LENS, num_kv_heads, head_size, block_size, device)
        query = random_query(len(DECODE_LENS), num_heads, head_size, dtype, device)
        sinks = random_sinks(num_heads, device) if h == 1 else None
        out = run_decode(version, query, q8, num_kv_heads, head_size**-0.5, sinks=sinks)
        expected = reference_decode(query, q8.kv, head_size**-0.5, sinks=sinks)
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("window", [1, 40, 600])
def test_paged_decode_int8_sliding_window(device, version, window):
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 64, 16
    q8 = make_int8_kv(DECODE_LENS, num_kv_heads, head_size, block_size, device)
    query = random_query(len(DECODE_LENS), num_heads, head_size, torch.float32, device)
    sinks = random_sinks(num_heads, device)
    out = run_decode(version, query, q8, num_kv_heads, 0.125, window, sinks)
    assert_close(out, reference_decode(query, q8.kv, 0.125, None, window, sinks), torch.float32)


def prefill_case(device, dtype, head_size, block_size, num_heads, num_kv_heads):
    seq_lens, q_lens = [40, 300, 17, 5], [40, 120, 1, 5]  # later chunks, whole prompts
    q8 = make_int8_kv(seq_lens, num_kv_heads, head_size, block_size, device)
    query = random_query(sum(q_lens), num_heads, head_size, dtype, device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q8, query, seq_lens, q_lens, starts.to(device)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("window", [0, 33])
def test_paged_prefill_int8(device, dtype, head_size, block_size, window):
    for h, (num_heads, num_kv_heads) in enumerate(HEAD_LAYOUTS):
        q8, query, seq_lens, q_lens, starts = prefill_case(
            device, dtype, head_size, block_size, num_heads, num_kv_heads
        )
        sinks = random_sinks(num_heads, device) if h == 2 else None
        kv, out = q8.kv, torch.full_like(query, POISON)
        with kernel_threads():
            ops.paged_attention_prefill(
                out, query, kv.key_cache, kv.value_cache, num_kv_heads, 0.1, kv.block_tables,
                kv.seq_lens, starts, block_size, max(q_lens), None, window, sinks,
                q8.k_scale, q8.v_scale,
            )  # fmt: skip
        expected = reference_prefill(query, kv, seq_lens, q_lens, 0.1, None, window, sinks)
        assert_close(out, expected, dtype)


def int8_arena(q8: Int8KV, device):
    """The sequences of q8 written into an int8 KVArena (slot s = sequence s) by
    write_kv_contiguous, from the dequantized rows (which quantize back exactly)."""
    kv = q8.kv
    num_kv_heads, head_size = kv.value_cache.shape[1:3]
    longest = max(kv.seq_lens.tolist())
    arena = ops.KVArena(1, len(kv.keys), longest, num_kv_heads, head_size, torch.int8, device)
    for s, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
        n = k.shape[0]
        arena.commit(s, n)
        slots = torch.full((n,), s, dtype=torch.int64, device=device)
        positions = torch.arange(n, device=device)
        ops.write_kv_contiguous(k.float(), v.float(), *arena.kv_caches[0][:2], slots, positions,
                                *arena.kv_caches[0][2:])  # fmt: skip
    return arena


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("window", [0, 40])
def test_contiguous_decode_and_prefill_int8(device, dtype, head_size, window):
    num_heads, num_kv_heads = 8, 2
    q8 = make_int8_kv(DECODE_LENS, num_kv_heads, head_size, 16, device)
    arena = int8_arena(q8, device)
    caches = arena.kv_caches[0]
    slots = torch.arange(len(DECODE_LENS), dtype=torch.int32, device=device)
    sinks = random_sinks(num_heads, device)
    query = random_query(len(DECODE_LENS), num_heads, head_size, dtype, device)
    out = torch.full_like(query, POISON)
    with kernel_threads():
        ops.contiguous_attention_decode(
            out, query, caches[0], caches[1], num_kv_heads, 0.1, slots, q8.kv.seq_lens,
            max(DECODE_LENS), window, sinks, caches[2], caches[3],
        )  # fmt: skip
    assert_close(out, reference_decode(query, q8.kv, 0.1, None, window, sinks), dtype)

    q_lens = [min(n, 70) for n in DECODE_LENS]
    query = random_query(sum(q_lens), num_heads, head_size, dtype, device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.full_like(query, POISON)
    with kernel_threads():
        ops.contiguous_attention_prefill(
            out, query, caches[0], caches[1], num_kv_heads, 0.1, slots, q8.kv.seq_lens,
            starts.to(device), max(q_lens), window, None, caches[2], caches[3],
        )  # fmt: skip
    expected = reference_prefill(query, q8.kv, DECODE_LENS, q_lens, 0.1, None, window)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_block_copies_move_int8_blocks_and_their_scales(device):
    """copy_blocks takes int8 caches; an int8 cache's scales ([num_blocks, ...] float16)
    move with swap_blocks like any cache."""
    q8 = make_int8_kv([40], 2, 64, 16, device, extra_blocks=4)
    kv = q8.kv
    source, owned = int(kv.block_tables[0, 1]), set(kv.block_tables[0].tolist())
    free = min(set(range(kv.key_cache.shape[0])) - owned)  # holds other random bytes
    mapping = torch.tensor([[source, free]])
    ops.copy_blocks([kv.key_cache], [kv.value_cache], mapping)
    for scales in (q8.k_scale, q8.v_scale):
        moved = torch.zeros_like(scales)
        ops.swap_blocks(scales, moved, mapping)
        assert torch.equal(moved[free], scales[source]) and not moved[free].isnan().any()
    assert torch.equal(kv.key_cache[free], kv.key_cache[source])
    assert torch.equal(kv.value_cache[free], kv.value_cache[source])
