"""The contiguous KV layout: the virtual KV arena and its ops.

Every op is compared with a plain-PyTorch reference (float64 attention over the dense
per-sequence keys/values; indexing for the writes) and with the paged kernels on the
same K/V. The arena's committed tokens past each sequence's end hold NaN, so a kernel
that reads past a sequence, or masks by arithmetic, fails; outputs are poisoned with
NaN before each call. The arena tests reserve far more virtual KV than the machine's
memory and watch committed_bytes and the process's RSS follow the committed tokens.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

import pyllm.ops as ops
from tests.kernels.utils import (
    DEVICES,
    POISON,
    PagedKV,
    assert_close,
    device_param,
    kernel_threads,
    make_paged_kv,
    seed_and_single_thread,
)

TILE = ops.TOKEN_TILE
HEAD_SIZES = [64, 128, 256]
# (num_heads, num_kv_heads): MHA, GQA 4, and MQA past one row tile of the CPU kernel.
HEAD_LAYOUTS = [(4, 4), (8, 2), (12, 1)]
# float32 and bfloat16 everywhere, float16 on CUDA (the CPU grid stays short).
DEVICE_DTYPES = [
    pytest.param(device, dtype, id=f"{device}-{str(dtype).removeprefix('torch.')}", marks=marks)
    for device, dtype in [
        ("cpu", torch.float32),
        ("cpu", torch.bfloat16),
        ("cuda", torch.float32),
        ("cuda", torch.bfloat16),
        ("cuda", torch.float16),
    ]
    for marks in [device_param(device).marks]
]
# Lengths around one tile, past one kPartitionSize chunk, in non-trivial slots.
SEQ_LENS = [1, 15, 16, 17, 600]
SLOTS = [5, 2, 7, 0, 3]
MAX_NUM_SEQS = 8


def sink_cases():
    """The grid cases that also run with sinks: every (device, dtype) and head size, the
    head layout rotating with both."""
    cases = []
    for d, case in enumerate(DEVICE_DTYPES):
        for h, head_size in enumerate(HEAD_SIZES):
            heads = HEAD_LAYOUTS[(h + d) % len(HEAD_LAYOUTS)]
            name = f"{case.id}-d{head_size}-h{heads[0]}kv{heads[1]}"
            cases.append(pytest.param(*case.values, head_size, heads, id=name, marks=case.marks))
    return cases


SINK_CASES = sink_cases()


_seed_and_threads = pytest.fixture(autouse=True)(seed_and_single_thread)


# ---------------------------------------------------------------------------
# References and helpers (plain PyTorch).


def reference_attention(query, keys, values, positions, scale, window=None, sinks=None):
    """Causal attention in float64 for one sequence: query [n, Hq, D] at `positions`,
    keys/values [L, Hkv, D] at positions 0..L-1; with a window, only keys at positions
    > position - window; sinks [Hq]: one more logit column per head, dropped after the
    softmax."""
    if keys.shape[0] == 0:
        return torch.zeros(query.shape, dtype=torch.float64)
    group = query.shape[1] // keys.shape[1]
    q = query.double().cpu()
    k = keys.double().cpu().repeat_interleave(group, dim=1)
    v = values.double().cpu().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    key_pos, query_pos = torch.arange(keys.shape[0])[None, :], positions.cpu()[:, None]
    hidden = key_pos > query_pos
    if window:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    if sinks is not None:
        column = sinks.double().cpu()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def store_tokens(arena, layer, slot, first, keys, values):
    """Writes keys/values [n, Hkv, D] at positions first.. of the slot by indexing."""
    n, num_kv_heads, head_size = keys.shape
    pos = torch.arange(first, first + n, device=keys.device)
    key_cache, value_cache = arena.key_cache(layer), arena.value_cache(layer)
    x = key_cache.shape[-1]
    # Advanced indices around a slice put the token dimension first.
    key_cache[slot][:, pos // TILE, :, pos % TILE, :] = keys.reshape(
        n, num_kv_heads, head_size // x, x
    )
    value_cache[slot][:, pos // TILE, :, pos % TILE] = values


def read_tokens(arena, layer, slot, n):
    """(keys, values) [n, Hkv, D] of the slot's first n tokens, by indexing."""
    pos = torch.arange(n, device=arena.device)
    key_cache, value_cache = arena.key_cache(layer), arena.value_cache(layer)
    keys = key_cache[slot][:, pos // TILE, :, pos % TILE, :]
    return keys.flatten(2), value_cache[slot][:, pos // TILE, :, pos % TILE]


def commit_poisoned(arena, slot, num_tokens):
    """Commits the slot and fills every committed tile of every layer with NaN."""
    tiles = arena.commit(slot, num_tokens) // TILE
    for key_cache, value_cache in arena.kv_caches:
        key_cache[slot, :, :tiles].fill_(POISON)
        value_cache[slot, :, :tiles].fill_(POISON)


def arena_like(kv: PagedKV, slots, max_model_len, dtype, device):
    """An arena holding kv's sequences in the given slots (layer 0), NaN past each end."""
    num_kv_heads, head_size = kv.value_cache.shape[1:3]
    arena = ops.KVArena(1, MAX_NUM_SEQS, max_model_len, num_kv_heads, head_size, dtype, device)
    for slot in range(MAX_NUM_SEQS):  # slots no sequence uses hold NaN too
        commit_poisoned(arena, slot, TILE)
    for slot, keys, values in zip(slots, kv.keys, kv.values, strict=True):
        commit_poisoned(arena, slot, max(keys.shape[0], 1))
        store_tokens(arena, 0, slot, 0, keys, values)
    return arena


def random_query(num_tokens, num_heads, head_size, dtype, device):
    return torch.randn(num_tokens, num_heads, head_size).to(dtype).to(device)


def random_sinks(num_heads, device):
    """float32 [num_heads] cycling through +8, -8, about 0 and 2, jittered."""
    levels = torch.tensor([8.0, -8.0, 0.0, 2.0]).repeat(-(-num_heads // 4))[:num_heads]
    return (levels + 0.1 * torch.randn(num_heads)).to(device)


def poison_tiles_before_window(arena, slots, first_positions, window):
    """NaN in each slot's tiles that hold no key of any of its queries' windows."""
    for slot, first in zip(slots, first_positions, strict=True):
        tiles = max(0, first - window + 1) // TILE
        arena.key_cache(0)[slot, :, :tiles] = POISON
        arena.value_cache(0)[slot, :, :tiles] = POISON


def run_decode(arena, query, num_kv_heads, scale, slots, seq_lens, window=None, sinks=None):
    out = torch.full_like(query, POISON)
    device = query.device
    with kernel_threads():
        ops.contiguous_attention_decode(
            out, query, arena.key_cache(0), arena.value_cache(0), num_kv_heads, scale,
            torch.tensor(slots, dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), max(max(seq_lens), 1),
            window, sinks,
        )  # fmt: skip
    return out


def run_prefill(
    arena, query, num_kv_heads, scale, slots, seq_lens, q_lens, window=None, sinks=None
):
    out = torch.full_like(query, POISON)
    device = query.device
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    with kernel_threads():
        ops.contiguous_attention_prefill(
            out, query, arena.key_cache(0), arena.value_cache(0), num_kv_heads, scale,
            torch.tensor(slots, dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), starts.to(device),
            max(max(q_lens), 1), window, sinks,
        )  # fmt: skip
    return out


def paged_decode(kv, query, num_kv_heads, scale, window=None, sinks=None):
    out = torch.full_like(query, POISON)
    with kernel_threads():
        ops.paged_attention_v1(
            out, query, kv.key_cache, kv.value_cache, num_kv_heads, scale, kv.block_tables,
            kv.seq_lens, kv.value_cache.shape[3], max(kv.seq_lens.tolist()), None, window,
            sinks,
        )  # fmt: skip
    return out


def paged_prefill(kv, query, num_kv_heads, scale, seq_lens, q_lens, window=None, sinks=None):
    out = torch.full_like(query, POISON)
    device = query.device
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    with kernel_threads():
        ops.paged_attention_prefill(
            out, query, kv.key_cache, kv.value_cache, num_kv_heads, scale, kv.block_tables,
            torch.tensor(seq_lens, dtype=torch.int32, device=device), starts.to(device),
            kv.value_cache.shape[3], max(max(q_lens), 1), None, window, sinks,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------
# Decode and prefill against the reference and the paged kernels.


def check_decode(
    seq_lens, slots, heads, head_size, dtype, device, max_model_len, window=None, sinks=False
):
    num_heads, num_kv_heads = heads
    kv = make_paged_kv(seq_lens, num_kv_heads, head_size, TILE, dtype, device)
    arena = arena_like(kv, slots, max_model_len, dtype, device)
    if window:
        poison_tiles_before_window(arena, slots, [n - 1 for n in seq_lens], window)
    query = random_query(len(seq_lens), num_heads, head_size, dtype, device)
    scale = 1.0 / math.sqrt(head_size)
    sink_values = random_sinks(num_heads, device) if sinks else None
    out = run_decode(arena, query, num_kv_heads, scale, slots, seq_lens, window, sink_values)
    expected = torch.cat(
        [
            reference_attention(
                query[s : s + 1], k, v, torch.tensor([n - 1]), scale, window, sink_values
            )
            for s, (n, k, v) in enumerate(zip(seq_lens, kv.keys, kv.values, strict=True))
        ]
    )
    assert_close(out, expected, dtype)
    # The paged kernel with blocks of one tile runs the same arithmetic: bit-identical.
    # Not on CUDA, where contiguous decode splits long sequences into partitions when
    # the (sequence, head) pairs leave SMs idle, and paged v1 never splits.
    if device == "cpu":
        paged = paged_decode(kv, query, num_kv_heads, scale, window, sink_values)
        assert torch.equal(out, paged)


@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_decode_grid(device, dtype, head_size, heads):
    check_decode(SEQ_LENS, SLOTS, heads, head_size, dtype, device, max_model_len=640)


@pytest.mark.parametrize(("device", "dtype", "head_size", "heads"), SINK_CASES)
def test_decode_grid_sinks(device, dtype, head_size, heads):
    check_decode(SEQ_LENS, SLOTS, heads, head_size, dtype, device, max_model_len=640, sinks=True)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_decode_long(device, dtype):
    check_decode([4000, 33], [6, 1], (8, 2), 128, dtype, device, max_model_len=4096)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_decode_long_sinks(device, dtype):
    """On CUDA this call splits into partitions (few sequences leave SMs idle): the
    sinks join their merge."""
    check_decode([4000, 33], [6, 1], (8, 2), 128, dtype, device, max_model_len=4096, sinks=True)


def check_prefill(
    seq_lens, q_lens, slots, heads, head_size, dtype, device, max_model_len, window=None,
    sinks=False,
):  # fmt: skip
    num_heads, num_kv_heads = heads
    kv = make_paged_kv(seq_lens, num_kv_heads, head_size, TILE, dtype, device)
    arena = arena_like(kv, slots, max_model_len, dtype, device)
    if window:
        first_positions = [n - q for n, q in zip(seq_lens, q_lens, strict=True)]
        poison_tiles_before_window(arena, slots, first_positions, window)
    query = random_query(sum(q_lens), num_heads, head_size, dtype, device)
    scale = 1.0 / math.sqrt(head_size)
    sink_values = random_sinks(num_heads, device) if sinks else None
    out = run_prefill(
        arena, query, num_kv_heads, scale, slots, seq_lens, q_lens, window, sink_values
    )
    expected, start = [], 0
    for n, q_len, k, v in zip(seq_lens, q_lens, kv.keys, kv.values, strict=True):
        positions = torch.arange(n - q_len, n)
        q = query[start : start + q_len]
        expected.append(reference_attention(q, k, v, positions, scale, window, sink_values))
        start += q_len
    assert_close(out, torch.cat(expected), dtype)
    paged = paged_prefill(kv, query, num_kv_heads, scale, seq_lens, q_lens, window, sink_values)
    assert torch.equal(out, paged)


@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_prefill_grid(device, dtype, head_size, heads):
    # Whole prompts of 1, 15, 16, 17 tokens and the last 40 tokens of a 600-token one.
    q_lens = [1, 15, 16, 17, 40]
    check_prefill(SEQ_LENS, q_lens, SLOTS, heads, head_size, dtype, device, max_model_len=640)


@pytest.mark.parametrize(("device", "dtype", "head_size", "heads"), SINK_CASES)
def test_prefill_grid_sinks(device, dtype, head_size, heads):
    q_lens = [1, 15, 16, 17, 40]
    check_prefill(
        SEQ_LENS, q_lens, SLOTS, heads, head_size, dtype, device, max_model_len=640, sinks=True
    )


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_prefill_long(device, dtype):
    """A last chunk of 64 queries over ~4000 cached tokens, beside a 520-token prompt."""
    check_prefill([4000, 520], [64, 520], [1, 4], (8, 2), 128, dtype, device, max_model_len=4096)


@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_chunked_prefill_equals_one_shot(device, dtype):
    """A prompt written and attended in two chunks (write_kv_contiguous, then prefill
    with seq_lens covering both) gives the one-shot prompt's outputs."""
    num_heads, num_kv_heads, head_size = 8, 2, 64
    prompts, slots, first = [300, 45], [3, 6], [170, 20]
    scale = 1.0 / math.sqrt(head_size)

    def arena_with_prompts():
        arena = ops.KVArena(1, MAX_NUM_SEQS, 512, num_kv_heads, head_size, dtype, device)
        for slot, n in zip(slots, prompts, strict=True):
            commit_poisoned(arena, slot, n)
        return arena

    keys = [torch.randn(n, num_kv_heads, head_size).to(dtype).to(device) for n in prompts]
    values = [torch.randn(n, num_kv_heads, head_size).to(dtype).to(device) for n in prompts]
    queries = [random_query(n, num_heads, head_size, dtype, device) for n in prompts]

    def step(arena, begin, end):
        """Writes and attends tokens [begin[s], end[s]) of each prompt."""
        token_slots = torch.cat(
            [torch.full((e - b,), s) for s, b, e in zip(slots, begin, end, strict=True)]
        ).to(device)
        positions = torch.cat([torch.arange(b, e) for b, e in zip(begin, end, strict=True)])
        pick = lambda ts: torch.cat([t[b:e] for t, b, e in zip(ts, begin, end, strict=True)])  # noqa: E731
        with kernel_threads():
            ops.write_kv_contiguous(
                pick(keys), pick(values), arena.key_cache(0), arena.value_cache(0), token_slots,
                positions.to(device),
            )  # fmt: skip
        q_lens = [e - b for b, e in zip(begin, end, strict=True)]
        return run_prefill(arena, pick(queries), num_kv_heads, scale, slots, end, q_lens)

    one_shot = step(arena_with_prompts(), [0, 0], prompts)
    arena = arena_with_prompts()
    out1 = step(arena, [0, 0], first)
    out2 = step(arena, first, prompts)
    rest = [n - f for n, f in zip(prompts, first, strict=True)]
    chunked = [torch.cat([a, b]) for a, b in zip(out1.split(first), out2.split(rest), strict=True)]
    assert_close(torch.cat(chunked), one_shot, dtype)
    expected = [
        reference_attention(q, k, v, torch.arange(len(q)), scale)
        for q, k, v in zip(queries, keys, values, strict=True)
    ]
    assert_close(one_shot, torch.cat(expected), dtype)


@pytest.mark.parametrize(
    ("window", "sinks"),
    [(1, False), (9, False), (9, True), (40, False), (530, False), (530, True)],
    ids=["1", "9", "9-sinks", "40", "530", "530-sinks"],
)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_sliding_window(device, dtype, window, sinks):
    """Decode and prefill with windows smaller than a tile, a few tiles, and past one
    chunk; the tiles before each window hold NaN."""
    check_decode(SEQ_LENS, SLOTS, (8, 2), 64, dtype, device, max_model_len=640, window=window,
                 sinks=sinks)  # fmt: skip
    q_lens = [1, 15, 16, 17, 600]
    check_prefill(SEQ_LENS, q_lens, SLOTS, (12, 1), 128, dtype, device, max_model_len=640,
                  window=window, sinks=sinks)  # fmt: skip
    check_prefill([600], [40], [2], (8, 2), 64, dtype, device, max_model_len=640, window=window,
                  sinks=sinks)  # fmt: skip


# ---------------------------------------------------------------------------
# write_kv_contiguous.


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize(("device", "dtype"), DEVICE_DTYPES)
def test_write_kv_matches_indexing_and_skips(device, dtype, head_size):
    """Tokens land where plain indexing puts them, in two layers and several slots;
    tokens with slot -1 change nothing anywhere."""
    num_kv_heads, num_layers = 2, 2
    arena = ops.KVArena(num_layers, MAX_NUM_SEQS, 100, num_kv_heads, head_size, dtype, device)
    for slot in range(MAX_NUM_SEQS):
        arena.commit(slot, 100)
    for key_cache, value_cache in arena.kv_caches:  # a known background to compare against
        key_cache.copy_(torch.randn(key_cache.shape).to(dtype))
        value_cache.copy_(torch.randn(value_cache.shape).to(dtype))
    # Token 0 of slot 0, tile edges 15/16/17, the last position, and skipped tokens
    # that name positions a write would overwrite.
    token_slots = torch.tensor([0, 5, 5, 5, -1, 7, 2, -1, 3])
    positions = torch.tensor([0, 15, 16, 17, 16, 99, 31, 0, 64])
    num_tokens = len(token_slots)
    for layer in range(num_layers):
        key = torch.randn(num_tokens, num_kv_heads, head_size).to(dtype).to(device)
        value = torch.randn(num_tokens, num_kv_heads, head_size).to(dtype).to(device)
        expected_keys = arena.key_cache(layer).clone()
        expected_values = arena.value_cache(layer).clone()
        others = [(k.clone(), v.clone()) for k, v in arena.kv_caches]
        x = expected_keys.shape[-1]
        for t in range(num_tokens):
            slot, pos = int(token_slots[t]), int(positions[t])
            if slot < 0:
                continue
            expected_keys[slot, :, pos // TILE, :, pos % TILE, :] = key[t].reshape(
                num_kv_heads, head_size // x, x
            )
            expected_values[slot, :, pos // TILE, :, pos % TILE] = value[t]
        with kernel_threads():
            ops.write_kv_contiguous(
                key, value, arena.key_cache(layer), arena.value_cache(layer),
                token_slots.to(device), positions.to(device),
            )  # fmt: skip
        assert torch.equal(arena.key_cache(layer), expected_keys)
        assert torch.equal(arena.value_cache(layer), expected_values)
        for other, (k, v) in enumerate(others):
            if other != layer:
                assert torch.equal(arena.key_cache(other), k)
                assert torch.equal(arena.value_cache(other), v)
    # And back out through indexing, as the attention tests read it.
    keys, _ = read_tokens(arena, num_layers - 1, 3, 65)
    assert torch.equal(keys[64], key[8])


@pytest.mark.parametrize("device", [device_param("cpu"), device_param("cuda")])
def test_write_kv_all_skipped_leaves_arena_untouched(device):
    arena = ops.KVArena(1, 2, 64, 2, 64, torch.float32, device)
    arena.commit(0, 64)
    arena.key_cache(0)[0].normal_()
    arena.value_cache(0)[0].normal_()
    before = arena.key_cache(0)[0].clone(), arena.value_cache(0)[0].clone()
    committed = arena.committed_bytes
    key = torch.randn(3, 2, 64, device=device)
    ops.write_kv_contiguous(
        key, key, arena.key_cache(0), arena.value_cache(0),
        torch.full((3,), -1, device=device), torch.tensor([0, 1, 2], device=device),
    )  # fmt: skip
    assert torch.equal(arena.key_cache(0)[0], before[0])
    assert torch.equal(arena.value_cache(0)[0], before[1])
    assert arena.committed_bytes == committed


# ---------------------------------------------------------------------------
# The arena: commit, release, memory.


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_arena_reserves_far_more_than_memory_and_commits_by_tokens():
    """64 GiB of virtual KV on a machine with less; memory follows committed tokens."""
    # 32 layers x 8 kv heads x 128 x bf16: 16 KiB per token of K and V together.
    arena = ops.KVArena(32, 64, 8192, 8, 128, torch.bfloat16, "cpu")
    per_token = 32 * 8 * 128 * 2 * 2
    assert arena.reserved_bytes >= 64 * 2**30
    assert arena.committed_bytes == 0
    rss0 = rss_bytes()
    assert arena.commit(3, 1000) == 1008  # whole tiles (a tile here is 256 pages)
    assert arena.commit(60, 4000) == 4000
    expected = (1008 + 4000) * per_token
    assert arena.committed_bytes == expected
    grown = rss_bytes() - rss0
    assert 0.95 * expected <= grown <= 1.05 * expected + 8 * 2**20, (grown, expected)
    # The committed memory is usable and the slots are independent.
    arena.key_cache(31)[60, :, 249].fill_(1.5)
    assert float(arena.key_cache(31)[60, :, 249].float().mean()) == 1.5
    assert float(arena.key_cache(31)[3, :, 100].float().abs().sum()) == 0.0  # past its commit
    arena.release(60)
    assert arena.committed_bytes == 1008 * per_token
    assert arena.committed_tokens(60) == 0
    fallen = rss0 + grown - rss_bytes()
    assert fallen >= 0.95 * 4000 * per_token, (fallen, 4000 * per_token)
    # Released memory reads as zeros, and commits afresh as zeros.
    assert float(arena.key_cache(31)[60, :, 249].float().abs().sum()) == 0.0
    arena.release(3)
    assert arena.committed_bytes == 0


def test_commit_is_idempotent_rounded_and_never_shrinks():
    arena = ops.KVArena(2, 4, 100, 2, 64, torch.float32, "cpu")
    # One tile of both layers: 2 x 2 x 64 x 16 x 4 bytes = 16 KiB, four pages.
    tile_bytes = 2 * 2 * 64 * TILE * 4
    assert arena.granularity == 4096
    assert arena.commit(1, 0) == 0 and arena.committed_bytes == 0
    assert arena.commit(1, 1) == TILE
    assert arena.commit(1, TILE) == TILE  # nothing new
    assert arena.committed_bytes == 2 * tile_bytes
    assert arena.commit(1, TILE + 1) == 2 * TILE
    assert arena.commit(1, 5) == 2 * TILE  # never shrinks
    assert arena.commit(1, 100) == 100  # capped at max_model_len
    assert arena.committed_tokens(1) == 100 and arena.committed_tokens(0) == 0
    assert arena.committed_bytes == 2 * 7 * tile_bytes
    arena.release(1, keep_tokens=17)  # trims to whole tiles covering 17 tokens
    assert arena.committed_tokens(1) == 2 * TILE
    assert arena.committed_bytes == 2 * 2 * tile_bytes
    arena.release(1, keep_tokens=100)  # keeps more than is committed: nothing changes
    assert arena.committed_tokens(1) == 2 * TILE
    arena.release(1)
    arena.release(1)  # idempotent too
    assert arena.committed_bytes == 0 and arena.committed_tokens(1) == 0


def test_commit_cost_when_nothing_new_is_needed():
    """The engine may call commit every step for every sequence: cheap when the slot
    already holds the tokens (measured at a few microseconds; bounded loosely here)."""
    arena = ops.KVArena(4, 4, 4096, 2, 64, torch.float32, "cpu")
    arena.commit(2, 4096)
    start = time.perf_counter()
    for n in range(1, 2001):
        arena.commit(2, n)
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 200e-6, per_call


def test_views_outlive_the_arena_and_read_zeros_past_commit():
    arena = ops.KVArena(2, 3, 64, 1, 64, torch.float32, "cpu")
    arena.commit(1, 16)
    key_cache = arena.key_cache(1)
    key_cache[1, :, 0].fill_(2.0)
    del arena  # the view keeps the reservation alive
    assert float(key_cache[1, :, 0].sum()) == 2.0 * 64 * 16
    assert float(key_cache[2].abs().sum()) == 0.0  # never committed: zeros


def test_raw_read_past_committed_tokens_is_harmless_on_cpu():
    """The checked op refuses it; through torch.ops it reads zeros instead of crashing."""
    arena = ops.KVArena(1, 2, 256, 1, 64, torch.float32, "cpu")
    arena.commit(1, TILE)
    keys = torch.randn(TILE, 1, 64)
    values = torch.randn(TILE, 1, 64)
    store_tokens(arena, 0, 1, 0, keys, values)
    query = torch.randn(1, 1, 64)
    args = (arena.key_cache(0), arena.value_cache(0), 1, 0.125)
    slots, lens = torch.tensor([1], dtype=torch.int32), torch.tensor([200], dtype=torch.int32)
    with pytest.raises(ValueError, match="committed"):
        ops.contiguous_attention_decode(torch.empty_like(query), query, *args, slots, lens, 200)
    out = torch.full_like(query, POISON)
    torch.ops.pyllm.contiguous_attention_decode(out, query, *args, slots, lens, 200)
    zeros = torch.zeros(200 - TILE, 1, 64)
    expected = reference_attention(
        query, torch.cat([keys, zeros]), torch.cat([values, zeros]), torch.tensor([199]), 0.125
    )
    assert_close(out, expected, torch.float32)


@pytest.mark.skipif("cuda" not in DEVICES, reason="no CUDA device")
def test_cuda_arena_commit_and_release():
    arena = ops.KVArena(4, 8, 8192, 8, 128, torch.bfloat16, "cuda")
    assert arena.granularity >= 4096 and arena.reserved_bytes >= 2 * 8 * 8192 * 4 * 8 * 128 * 2
    assert arena.commit(5, 100) >= 100
    assert arena.committed_bytes % arena.granularity == 0 and arena.committed_bytes > 0
    arena.release(5)
    assert arena.committed_bytes == 0


# ---------------------------------------------------------------------------
# Bad arguments: one test each.


def small_arena():
    return ops.KVArena(2, 4, 64, 2, 64, torch.float32, "cpu")


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"num_layers": 0}, ValueError, "num_layers"),
        ({"max_num_seqs": -1}, ValueError, "max_num_seqs"),
        ({"max_model_len": 2.5}, ValueError, "max_model_len"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads"),
        ({"head_size": 72}, ValueError, "head_size"),
        ({"dtype": torch.int16}, TypeError, "dtype"),
        ({"device": "meta"}, ValueError, "device"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_arena_constructor_errors(change, error, match):
    args = dict(
        num_layers=2, max_num_seqs=4, max_model_len=64, num_kv_heads=2, head_size=64,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    with pytest.raises(error, match=match):
        ops.KVArena(**(args | change))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda a: a.commit(4, 1), ValueError, "slot"),
        (lambda a: a.commit(-1, 1), ValueError, "slot"),
        (lambda a: a.commit(True, 1), TypeError, "slot"),
        (lambda a: a.commit(0, 65), ValueError, "num_tokens"),
        (lambda a: a.commit(0, -1), ValueError, "num_tokens"),
        (lambda a: a.release(7), ValueError, "slot"),
        (lambda a: a.release(0, 65), ValueError, "keep_tokens"),
        (lambda a: a.release(0, keep_tokens=-1), ValueError, "keep_tokens"),
        (lambda a: a.committed_tokens(4), ValueError, "slot"),
        (lambda a: a.key_cache(2), ValueError, "layer"),
        (lambda a: a.value_cache(-1), ValueError, "layer"),
        (lambda a: a.key_cache(0.0), TypeError, "layer"),
        # The custom class checks too, for callers that reach it directly.
        (lambda a: a._arena.commit(9, 1), RuntimeError, "slot"),
        (lambda a: a._arena.release(0, 99), RuntimeError, "keep_tokens"),
        (lambda a: a._arena.key_cache(5), RuntimeError, "layer"),
    ],
)
def test_arena_method_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(small_arena())


def write_args(arena):
    return dict(
        key=torch.randn(2, 2, 64),
        value=torch.randn(2, 2, 64),
        key_cache=arena.key_cache(0),
        value_cache=arena.value_cache(0),
        token_slots=torch.tensor([1, -1]),
        positions=torch.tensor([3, 70]),
    )


def decode_args(arena):
    return dict(
        out=torch.empty(2, 4, 64),
        query=torch.randn(2, 4, 64),
        key_cache=arena.key_cache(0),
        value_cache=arena.value_cache(0),
        num_kv_heads=2,
        scale=0.125,
        seq_slots=torch.tensor([1, 3], dtype=torch.int32),
        seq_lens=torch.tensor([16, 5], dtype=torch.int32),
        max_seq_len=16,
    )


def prefill_args(arena):
    args = dict(
        decode_args(arena),
        out=torch.empty(5, 4, 64),
        query=torch.randn(5, 4, 64),
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        max_query_len=3,
    )
    del args["max_seq_len"]
    return args


OPS = {
    "write_kv_contiguous": write_args,
    "contiguous_attention_decode": decode_args,
    "contiguous_attention_prefill": prefill_args,
}


def call_op(name, arena, change):
    args = OPS[name](arena)
    for key, value in change.items():
        args[key] = value(args) if callable(value) else value
    getattr(ops, name)(**args)


def foreign_strides(args):
    """A value view whose outer strides differ from the key view's."""
    v = args["value_cache"]
    return torch.zeros(v.shape[2], v.shape[0], v.shape[1], *v.shape[3:]).permute(1, 2, 0, 3, 4)


@pytest.mark.parametrize(
    ("name", "change", "error", "match"),
    [
        ("write_kv_contiguous", {}, None, ""),
        ("write_kv_contiguous", {"token_slots": torch.tensor([4, 0])}, ValueError, "token_slots"),
        ("write_kv_contiguous", {"token_slots": torch.tensor([-2, 0])}, ValueError, "token_slots"),
        (
            "write_kv_contiguous",
            {"token_slots": torch.tensor([1, 0]).int()},
            TypeError,
            "token_slots",
        ),
        ("write_kv_contiguous", {"positions": torch.tensor([64, 0])}, ValueError, "positions"),
        ("write_kv_contiguous", {"positions": torch.tensor([20, 0])}, ValueError, "committed"),
        ("write_kv_contiguous", {"positions": torch.tensor([3])}, ValueError, "positions"),
        ("write_kv_contiguous", {"key": lambda a: a["key"][:, :1]}, ValueError, "key"),
        ("write_kv_contiguous", {"value_cache": foreign_strides}, ValueError, "strides"),
        (
            "write_kv_contiguous",
            {"key_cache": lambda a: torch.zeros(4, 2, 4, 16, 16, 4)},
            ValueError,
            "key_cache",
        ),
        ("contiguous_attention_decode", {}, None, ""),
        (
            "contiguous_attention_decode",
            {"seq_slots": torch.tensor([1, 4], dtype=torch.int32)},
            ValueError,
            "seq_slots",
        ),
        (
            "contiguous_attention_decode",
            {"seq_slots": torch.tensor([1, 3])},
            TypeError,
            "seq_slots",
        ),
        (
            "contiguous_attention_decode",
            {"seq_lens": torch.tensor([16, 17], dtype=torch.int32)},
            ValueError,
            "committed",
        ),
        (
            "contiguous_attention_decode",
            {"seq_lens": torch.tensor([16, 65], dtype=torch.int32), "max_seq_len": 65},
            ValueError,
            "seq_lens",
        ),
        ("contiguous_attention_decode", {"max_seq_len": 8}, ValueError, "max_seq_len"),
        ("contiguous_attention_decode", {"num_kv_heads": 4}, ValueError, "num_kv_heads"),
        ("contiguous_attention_decode", {"scale": float("nan")}, ValueError, "scale"),
        ("contiguous_attention_decode", {"value_cache": foreign_strides}, ValueError, "strides"),
        (
            "contiguous_attention_decode",
            {"query": lambda a: a["query"].double()},
            TypeError,
            "query",
        ),
        ("contiguous_attention_prefill", {}, None, ""),
        (
            "contiguous_attention_prefill",
            {"query_start_loc": torch.tensor([0, 3, 4], dtype=torch.int32)},
            ValueError,
            "query_start_loc",
        ),
        ("contiguous_attention_prefill", {"max_query_len": 2}, ValueError, "max_query_len"),
        (
            "contiguous_attention_prefill",
            {"seq_lens": torch.tensor([2, 5], dtype=torch.int32)},
            ValueError,
            "query length",
        ),
        (
            "contiguous_attention_prefill",
            {"seq_slots": torch.tensor([0, 3], dtype=torch.int32)},
            ValueError,
            "committed",
        ),
    ],
)
def test_op_argument_errors(name, change, error, match):
    """Each case changes one valid argument; the unchanged arguments run (error None)."""
    arena = small_arena()
    arena.commit(1, 16)
    arena.commit(3, 5)
    if error is None:
        call_op(name, arena, change)
        return
    with pytest.raises(error, match=match):
        call_op(name, arena, change)


@pytest.mark.parametrize(
    ("op", "args", "match"),
    [
        ("write_kv_contiguous", "slot", "token_slots"),
        ("write_kv_contiguous", "position", "positions"),
        ("contiguous_attention_decode", "slot", "seq_slots"),
        ("contiguous_attention_decode", "len", "seq_lens"),
        ("contiguous_attention_prefill", "slot", "seq_slots"),
    ],
)
def test_kernels_refuse_out_of_range_indices(op, args, match):
    """torch.ops.pyllm (no Python checks) still cannot write or read outside the views."""
    arena = small_arena()
    k, v = arena.key_cache(0), arena.value_cache(0)
    if op == "write_kv_contiguous":
        slots = torch.tensor([4 if args == "slot" else 0])
        positions = torch.tensor([64 if args == "position" else 0])
        call = lambda: torch.ops.pyllm.write_kv_contiguous(  # noqa: E731
            torch.randn(1, 2, 64), torch.randn(1, 2, 64), k, v, slots, positions
        )
    else:
        slots = torch.tensor([4 if args == "slot" else 0], dtype=torch.int32)
        lens = torch.tensor([65 if args == "len" else 1], dtype=torch.int32)
        q = torch.randn(1, 4, 64)
        if op == "contiguous_attention_decode":
            call = lambda: torch.ops.pyllm.contiguous_attention_decode(  # noqa: E731
                torch.empty_like(q), q, k, v, 2, 0.125, slots, lens, 65
            )
        else:
            starts = torch.tensor([0, 1], dtype=torch.int32)
            call = lambda: torch.ops.pyllm.contiguous_attention_prefill(  # noqa: E731
                torch.empty_like(q), q, k, v, 2, 0.125, slots, lens, starts, 1
            )
    with pytest.raises(RuntimeError, match=match):
        call()
