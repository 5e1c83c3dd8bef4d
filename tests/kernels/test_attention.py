"""Paged attention (decode v1/v2 and causal prefill) against a float64 reference.

The reference works on the dense per-sequence keys/values that make_paged_kv wrote into
the cache, so it shares no code with the kernels. Cache slots no sequence owns are set
to NaN before each call, so a kernel that reads past a sequence's end, or masks by
arithmetic instead of selection, fails. Outputs are poisoned with NaN before each call.
Attention sinks run on a covering subset of each grid (SINK_GRID) and in the window,
alibi, long and empty-sequence cases.
"""

from __future__ import annotations

import math

import pytest
import torch

import pyllm.ops as ops
from tests.kernels.utils import (
    ALL_DEVICES,
    DTYPES,
    POISON,
    PagedKV,
    assert_close,
    kernel_threads,
    make_paged_kv,
    seed_and_single_thread,
)

HEAD_SIZES = list(ops.SUPPORTED_HEAD_SIZES)
BLOCK_SIZES = list(ops.SUPPORTED_BLOCK_SIZES)
# (num_heads, num_kv_heads): MHA, GQA with 4 query heads per kv head, and MQA with more
# query heads than one row tile of the CPU kernel (8), so its tail tile runs too.
HEAD_LAYOUTS = [(4, 4), (8, 2), (12, 1)]
PARTITION = ops.PARTITION_SIZE

# The grid cases that also run with sinks: one per (dtype, head size), the block size
# and head layout rotating with both indices so that any two values of any two of the
# four parameters meet in some case (18 cases instead of the grid's 162).
SINK_GRID = [
    (
        dtype,
        head_size,
        BLOCK_SIZES[(h + d) % len(BLOCK_SIZES)],
        HEAD_LAYOUTS[(h + 2 * d) % len(HEAD_LAYOUTS)],
    )
    for d, dtype in enumerate(DTYPES)
    for h, head_size in enumerate(HEAD_SIZES)
]
SINK_GRID_IDS = [f"{str(c[0])[6:]}-d{c[1]}-b{c[2]}-h{c[3][0]}kv{c[3][1]}" for c in SINK_GRID]


_seed_and_threads = pytest.fixture(autouse=True)(seed_and_single_thread)


# ---------------------------------------------------------------------------
# Reference.


def reference_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention in float64 for one sequence.

    query [n, Hq, D] at key positions `positions` [n]; keys/values [L, Hkv, D] at
    positions 0..L-1. Query i attends to keys at positions <= positions[i], and with a
    sliding window to those > positions[i] - sliding_window. sinks [Hq]: each head's
    sink joins the softmax as one more logit column, dropped after it (as HF's gpt-oss
    does), so its weight goes to no value.
    """
    num_heads = query.shape[1]
    if keys.shape[0] == 0:
        return torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    group = num_heads // keys.shape[1]
    q = query.double()
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    key_pos = torch.arange(keys.shape[0], device=query.device)
    query_pos = positions.to(query.device)
    if alibi_slopes is not None:
        distance = (key_pos[None, :] - query_pos[:, None]).double()
        scores = scores + alibi_slopes.double()[:, None, None] * distance[None]
    hidden = key_pos[None, :] > query_pos[:, None]
    if sliding_window:
        hidden |= key_pos[None, :] <= query_pos[:, None] - sliding_window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    if sinks is not None:
        column = sinks.double().to(query.device)[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def reference_decode(
    query, kv: PagedKV, scale, alibi_slopes=None, window=None, sinks=None
) -> torch.Tensor:
    outs = []
    for s, n in enumerate(kv.seq_lens.tolist()):
        positions = torch.tensor([n - 1])
        outs.append(
            reference_attention(
                query[s : s + 1],
                kv.keys[s],
                kv.values[s],
                positions,
                scale,
                alibi_slopes,
                window,
                sinks,
            )  # fmt: skip
        )
    return torch.cat(outs)


def reference_prefill(
    query, kv: PagedKV, seq_lens, q_lens, scale, alibi_slopes=None, window=None, sinks=None
):
    """Query tokens of sequence s are its last q_lens[s] tokens among its first
    seq_lens[s]; keys beyond seq_lens[s] (later chunks already in the cache) are unseen."""
    outs, start = [], 0
    for s, (n, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        positions = torch.arange(n - q_len, n)
        outs.append(
            reference_attention(
                query[start : start + q_len],
                kv.keys[s][:n],
                kv.values[s][:n],
                positions,
                scale,
                alibi_slopes,
                window,
                sinks,
            )
        )
        start += q_len
    return torch.cat(outs)


# ---------------------------------------------------------------------------
# Helpers.


def poison_unowned_slots(kv: PagedKV) -> None:
    """Sets every cache slot that holds none of the sequences' tokens to NaN."""
    block_size = kv.value_cache.shape[3]
    owned = torch.zeros(kv.value_cache.shape[0], block_size, dtype=torch.bool)
    tables = kv.block_tables.cpu().long()
    for s, n in enumerate(kv.seq_lens.tolist()):
        positions = torch.arange(n)
        owned[tables[s, positions // block_size], positions % block_size] = True
    unowned = (~owned).to(kv.value_cache.device)
    # key_cache [blocks, Hkv, D/x, block, x]; value_cache [blocks, Hkv, D, block].
    kv.key_cache.masked_fill_(unowned[:, None, None, :, None], float("nan"))
    kv.value_cache.masked_fill_(unowned[:, None, None, :], float("nan"))


def poison_blocks_before_window(kv: PagedKV, first_positions, window) -> None:
    """Sets to NaN each sequence's cache blocks that hold no key of any query's window
    (the first query, at first_positions[s], has the earliest window): a kernel must
    not read them, as they may belong to another sequence by then."""
    block_size = kv.value_cache.shape[3]
    tables = kv.block_tables.cpu().long()
    for s, first in enumerate(first_positions):
        for b in range(max(0, first - window + 1) // block_size):
            kv.key_cache[tables[s, b]] = float("nan")
            kv.value_cache[tables[s, b]] = float("nan")


def random_query(num_tokens, num_heads, head_size, dtype, device, strided=False):
    """[num_tokens, num_heads, head_size]; with strided=True a row view of a wider fused
    qkv tensor, as a model's attention layer passes it."""
    if not strided:
        return torch.randn(num_tokens, num_heads, head_size).to(dtype).to(device)
    width = num_heads * head_size
    fused = torch.randn(num_tokens, width + 2 * head_size).to(dtype).to(device)
    query = fused[:, :width].view(num_tokens, num_heads, head_size)
    assert query.stride(0) != width
    return query


def random_alibi(num_heads, device):
    return (-torch.rand(num_heads, dtype=torch.float32) * 0.5).to(device)


def random_sinks(num_heads, device):
    """float32 [num_heads], the heads cycling through +8 (the sink takes most of the
    weight), -8 (almost none), about 0 and 2 (a share comparable to the keys'), each
    jittered."""
    levels = torch.tensor([8.0, -8.0, 0.0, 2.0]).repeat(-(-num_heads // 4))[:num_heads]
    return (levels + 0.1 * torch.randn(num_heads)).to(device)


def run_v1(query, kv, num_kv_heads, scale, alibi_slopes=None, window=None, sinks=None):
    out = torch.full_like(query, POISON, memory_format=torch.contiguous_format)
    block_size = kv.value_cache.shape[3]
    max_seq_len = max(max(kv.seq_lens.tolist(), default=1), 1)
    with kernel_threads():
        ops.paged_attention_v1(
            out, query, kv.key_cache, kv.value_cache, num_kv_heads, scale, kv.block_tables,
            kv.seq_lens, block_size, max_seq_len, alibi_slopes, window, sinks,
        )  # fmt: skip
    return out


def run_v2(query, kv, num_kv_heads, scale, alibi_slopes=None, window=None, sinks=None):
    out = torch.full_like(query, POISON, memory_format=torch.contiguous_format)
    block_size = kv.value_cache.shape[3]
    max_seq_len = max(max(kv.seq_lens.tolist(), default=1), 1)
    exp_sums, max_logits, tmp_out = ops.paged_attention_v2_workspace(query, max_seq_len)
    for t in (exp_sums, max_logits, tmp_out):
        t.fill_(POISON)
    with kernel_threads():
        ops.paged_attention_v2(
            out, exp_sums, max_logits, tmp_out, query, kv.key_cache, kv.value_cache,
            num_kv_heads, scale, kv.block_tables, kv.seq_lens, block_size, max_seq_len,
            alibi_slopes, window, sinks,
        )  # fmt: skip
    return out


def run_prefill(
    query, kv, num_kv_heads, scale, seq_lens, q_lens, alibi_slopes=None, window=None, sinks=None
):
    device = query.device
    out = torch.full_like(query, POISON, memory_format=torch.contiguous_format)
    block_size = kv.value_cache.shape[3]
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]).int()
    with kernel_threads():
        ops.paged_attention_prefill(
            out, query, kv.key_cache, kv.value_cache, num_kv_heads, scale, kv.block_tables,
            torch.tensor(seq_lens, dtype=torch.int32, device=device), query_start_loc.to(device),
            block_size, max(max(q_lens, default=1), 1), alibi_slopes, window, sinks,
        )  # fmt: skip
    return out


def check_decode(
    seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device,
    alibi=False, strided=False, window=None, sinks=False,
):  # fmt: skip
    kv = make_paged_kv(seq_lens, num_kv_heads, head_size, block_size, dtype, device)
    poison_unowned_slots(kv)
    if window:
        poison_blocks_before_window(kv, [n - 1 for n in seq_lens], window)
    query = random_query(len(seq_lens), num_heads, head_size, dtype, device, strided)
    scale = 1.0 / math.sqrt(head_size)
    slopes = random_alibi(num_heads, device) if alibi else None
    sink_values = random_sinks(num_heads, device) if sinks else None
    expected = reference_decode(query, kv, scale, slopes, window, sink_values)
    out_v1 = run_v1(query, kv, num_kv_heads, scale, slopes, window, sink_values)
    assert_close(out_v1, expected, dtype)
    out_v2 = run_v2(query, kv, num_kv_heads, scale, slopes, window, sink_values)
    assert_close(out_v2, expected, dtype)
    # v2 rounds each partition's result to the dtype before merging; with one
    # partition it must match v1 exactly, with more within the dtype's tolerance.
    assert_close(out_v2, out_v1, dtype)


def check_prefill(
    seq_lens, q_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device,
    alibi=False, strided=False, cache_lens=None, window=None, sinks=False,
):  # fmt: skip
    """cache_lens: tokens written to the cache per sequence (>= seq_lens; the extra
    tokens stand for later chunks and must stay unseen)."""
    cache_lens = cache_lens or seq_lens
    kv = make_paged_kv(cache_lens, num_kv_heads, head_size, block_size, dtype, device)
    poison_unowned_slots(kv)
    if window:
        first_positions = [n - q for n, q in zip(seq_lens, q_lens, strict=True)]
        poison_blocks_before_window(kv, first_positions, window)
    query = random_query(sum(q_lens), num_heads, head_size, dtype, device, strided)
    scale = 1.0 / math.sqrt(head_size)
    slopes = random_alibi(num_heads, device) if alibi else None
    sink_values = random_sinks(num_heads, device) if sinks else None
    expected = reference_prefill(query, kv, seq_lens, q_lens, scale, slopes, window, sink_values)
    out = run_prefill(query, kv, num_kv_heads, scale, seq_lens, q_lens, slopes, window, sink_values)
    assert_close(out, expected, dtype)


# ---------------------------------------------------------------------------
# Decode.


def decode_lengths(block_size: int) -> list[int]:
    """One token, a short sequence, exactly two blocks, and one spanning three
    partitions of v2 with a partial last block."""
    return [1, 7, 2 * block_size, 2 * PARTITION + block_size + 3]


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_grid(dtype, head_size, block_size, heads, device):
    num_heads, num_kv_heads = heads
    check_decode(
        decode_lengths(block_size), num_heads, num_kv_heads, head_size, block_size, dtype,
        device,
    )  # fmt: skip


# A thinner selection at ~4000 tokens (8 partitions), including the two shapes the
# engine runs most: Llama-style GQA 32/8 x 128 and SmolLM2's 9/3 x 64.
LONG_CASES = [
    (torch.float32, 128, 16, (32, 8)),
    (torch.bfloat16, 128, 16, (32, 8)),
    (torch.bfloat16, 64, 16, (9, 3)),
    (torch.float16, 64, 32, (9, 3)),
    (torch.float16, 256, 8, (4, 4)),
    (torch.bfloat16, 80, 32, (12, 1)),
    (torch.float32, 112, 8, (8, 2)),
    (torch.float16, 96, 16, (6, 1)),
]


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize(
    "dtype, head_size, block_size, heads",
    LONG_CASES,
    ids=[f"{str(c[0])[6:]}-d{c[1]}-b{c[2]}-h{c[3][0]}kv{c[3][1]}" for c in LONG_CASES],
)
def test_decode_long(dtype, head_size, block_size, heads, device):
    num_heads, num_kv_heads = heads
    # Lengths around the partition boundaries too: exactly one and two partitions,
    # and one token past.
    seq_lens = [4000, PARTITION, 2 * PARTITION + 1, 3]
    check_decode(seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype, head_size, block_size, heads", SINK_GRID, ids=SINK_GRID_IDS)
def test_decode_grid_sinks(dtype, head_size, block_size, heads, device):
    """v1 and v2 (up to three partitions) with sinks of +8, -8, ~0 and 2 across the heads."""
    num_heads, num_kv_heads = heads
    check_decode(
        decode_lengths(block_size), num_heads, num_kv_heads, head_size, block_size, dtype,
        device, sinks=True,
    )  # fmt: skip


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize(
    "dtype, head_size, block_size, heads",
    [LONG_CASES[2], LONG_CASES[6]],
    ids=["bfloat16-d64-b16-h9kv3", "float32-d112-b8-h8kv2"],
)
def test_decode_long_sinks(dtype, head_size, block_size, heads, device):
    """Sinks merged once over v2's eight partitions."""
    num_heads, num_kv_heads = heads
    seq_lens = [4000, PARTITION, 2 * PARTITION + 1, 3]
    check_decode(
        seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device, sinks=True
    )


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("batch", [1, 3, 16, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_batch_sizes(dtype, batch, device):
    seq_lens = torch.randint(1, 300, (batch,)).tolist()
    check_decode(seq_lens, 8, 2, 64, 16, dtype, device)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_empty_sequence_gives_zeros(dtype, sinks, device):
    """A sequence with seq_len 0 attends to nothing; its output is defined as zeros
    (with a sink too: all the weight goes to the sink, which has no value)."""
    check_decode([0, 40, 0, 600], 8, 2, 64, 16, dtype, device, sinks=sinks)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_alibi(dtype, block_size, device):
    check_decode([1, 33, 1100], 8, 2, 128, block_size, dtype, device, alibi=True)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_v2_workspace_with_spare_partitions(dtype, device):
    """paged_attention_v2 accepts workspaces with more partitions than max_seq_len needs
    (each may differ, e.g. allocated once for the longest context); results are unchanged."""
    seq_lens, num_heads, num_kv_heads, head_size, block_size = [3, 1300, 700], 8, 2, 64, 16
    kv = make_paged_kv(seq_lens, num_kv_heads, head_size, block_size, dtype, device)
    poison_unowned_slots(kv)
    query = random_query(len(seq_lens), num_heads, head_size, dtype, device)
    scale = 1.0 / math.sqrt(head_size)
    parts = -(-max(seq_lens) // PARTITION)
    stats = dict(dtype=torch.float32, device=device)
    exp_sums = torch.full((len(seq_lens), num_heads, parts + 2), POISON, **stats)
    max_logits = torch.full((len(seq_lens), num_heads, parts + 1), POISON, **stats)
    tmp_out = torch.full(
        (len(seq_lens), num_heads, parts + 3, head_size), POISON, dtype=dtype, device=device
    )
    out = torch.full_like(query, POISON)
    with kernel_threads():
        ops.paged_attention_v2(
            out, exp_sums, max_logits, tmp_out, query, kv.key_cache, kv.value_cache,
            num_kv_heads, scale, kv.block_tables, kv.seq_lens, block_size, max(seq_lens),
        )  # fmt: skip
    assert_close(out, reference_decode(query, kv, scale), dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_strided_query(dtype, device):
    check_decode([5, 700], 8, 2, 64, 16, dtype, device, strided=True)


# ---------------------------------------------------------------------------
# Prefill.


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_of_one_sequence_compute_as_alone(dtype, block_size, window):
    """Rows at consecutive lengths over one sequence's blocks (proposals being verified,
    which the CPU kernel runs as one task reading the keys once) give bitwise what each
    gives alone, and the reference's values; a neighbour over other blocks stays apart."""
    num_heads, num_kv_heads, head_size, length = 8, 2, 64, 37
    kv = make_paged_kv([length + 4, length + 5], num_kv_heads, head_size, block_size, dtype, "cpu")
    rows = [0] * 5 + [1]  # five rows of sequence 0, then sequence 1 one longer
    kv = PagedKV(
        kv.key_cache, kv.value_cache, kv.block_tables[rows].contiguous(),
        torch.tensor([length + i for i in range(5)] + [length + 5], dtype=torch.int32),
        [kv.keys[r] for r in rows], [kv.values[r] for r in rows],
    )  # fmt: skip
    query = random_query(len(rows), num_heads, head_size, dtype, "cpu")
    scale = 1.0 / math.sqrt(head_size)
    together = run_v1(query, kv, num_kv_heads, scale, window=window)
    assert_close(together, reference_decode(query, kv, scale, window=window), dtype)
    for i in range(len(rows)):
        alone = PagedKV(
            kv.key_cache, kv.value_cache, kv.block_tables[i : i + 1], kv.seq_lens[i : i + 1],
            kv.keys[i : i + 1], kv.values[i : i + 1],
        )  # fmt: skip
        out = run_v1(query[i : i + 1], alone, num_kv_heads, scale, window=window)
        assert torch.equal(out, together[i : i + 1]), i


def prefill_cases(block_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens): a one-token prompt, a short prompt, a prompt of exactly two
    blocks, and a prefix-cache hit (cached tokens ending mid-block, new tokens after)."""
    seq_lens = [1, 19, 2 * block_size, block_size + 29]
    q_lens = [1, 19, 2 * block_size, 21]
    return seq_lens, q_lens


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("heads", HEAD_LAYOUTS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_grid(dtype, head_size, block_size, heads, device):
    num_heads, num_kv_heads = heads
    seq_lens, q_lens = prefill_cases(block_size)
    check_prefill(seq_lens, q_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype, head_size, block_size, heads", SINK_GRID, ids=SINK_GRID_IDS)
def test_prefill_grid_sinks(dtype, head_size, block_size, heads, device):
    num_heads, num_kv_heads = heads
    seq_lens, q_lens = prefill_cases(block_size)
    check_prefill(seq_lens, q_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device,
                  sinks=True)  # fmt: skip


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize(
    "dtype, head_size, block_size, heads, sinks",
    [
        (torch.float32, 64, 16, (9, 3), False),
        (torch.bfloat16, 128, 32, (8, 2), False),
        (torch.float16, 80, 8, (4, 4), False),
        (torch.bfloat16, 64, 16, (12, 1), False),
        (torch.float32, 64, 16, (9, 3), True),
        (torch.float16, 80, 8, (4, 4), True),
    ],
    ids=[
        "f32-d64-b16-h9kv3",
        "bf16-d128-b32-h8kv2",
        "f16-d80-b8-h4kv4",
        "bf16-d64-b16-h12kv1",
        "f32-d64-b16-h9kv3-sinks",
        "f16-d80-b8-h4kv4-sinks",
    ],
)
def test_prefill_long(dtype, head_size, block_size, heads, sinks, device):
    """Prompts longer than one 512-token chunk (several query tiles and key chunks
    merged online), and a short continuation of a ~4000-token cached prefix."""
    num_heads, num_kv_heads = heads
    seq_lens = [700, 3990, 9]
    q_lens = [700, 14, 9]
    check_prefill(seq_lens, q_lens, num_heads, num_kv_heads, head_size, block_size, dtype, device,
                  sinks=sinks)  # fmt: skip


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_chunked_equals_full_prompt(dtype, block_size, device):
    """A prompt fed as several chunks (earlier chunks already cached; seq_lens covers
    cached + new; the query holds only the new tokens) gives the same outputs as
    causal attention over the whole prompt at once, and as one prefill call."""
    num_heads, num_kv_heads, head_size = 8, 2, 64
    prompt_lens = [600, 45]
    chunks = [[250, 5], [300, 40], [50, 0]]  # new tokens per call; each column sums to its prompt
    kv = make_paged_kv(prompt_lens, num_kv_heads, head_size, block_size, dtype, device)
    poison_unowned_slots(kv)
    scale = 1.0 / math.sqrt(head_size)
    prompt_queries = [random_query(n, num_heads, head_size, dtype, device) for n in prompt_lens]

    full = run_prefill(torch.cat(prompt_queries), kv, num_kv_heads, scale, prompt_lens, prompt_lens)
    expected = reference_prefill(torch.cat(prompt_queries), kv, prompt_lens, prompt_lens, scale)
    assert_close(full, expected, dtype)

    done = [0] * len(prompt_lens)
    outputs = [[] for _ in prompt_lens]
    for step in chunks:
        seq_lens = [d + n for d, n in zip(done, step, strict=True)]
        query = torch.cat([q[d:e] for q, d, e in zip(prompt_queries, done, seq_lens, strict=True)])
        out = run_prefill(query, kv, num_kv_heads, scale, seq_lens, step)
        for s, part in enumerate(out.split(step)):
            outputs[s].append(part)
        done = seq_lens
    chunked = torch.cat([torch.cat(parts) for parts in outputs])
    assert_close(chunked, expected, dtype)
    assert_close(chunked, full, dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_alibi(dtype, device):
    check_prefill([40, 530], [40, 100], 8, 2, 64, 16, dtype, device, alibi=True)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_strided_query(dtype, device):
    check_prefill([30, 70], [30, 20], 8, 2, 64, 16, dtype, device, strided=True)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_sequence_without_new_tokens(dtype, device):
    """Sequences with no query tokens this step (q_len 0, even seq_len 0) are skipped
    and do not disturb their neighbours' rows."""
    check_prefill([0, 25, 12, 33], [0, 25, 0, 8], 8, 2, 64, 16, dtype, device)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_unseen_later_tokens(dtype, device):
    """Tokens cached beyond seq_lens (a later chunk written early) stay unseen."""
    check_prefill([20, 100], [20, 30], 8, 2, 64, 16, dtype, device, cache_lens=[64, 180])


# ---------------------------------------------------------------------------
# Sliding window.


def window_sizes(block_size: int) -> list[int]:
    """A window of one token, one smaller than a block, one a few blocks long, and one
    wider than a v2 partition (partitions wholly before it are skipped)."""
    return [1, block_size // 2 + 1, 3 * block_size + 5, PARTITION + 40]


def sink_window(dtype, block_size: int) -> int:
    """The window the (dtype, block_size) case also runs with sinks: each of
    window_sizes in turn across the cases."""
    windows = window_sizes(block_size)
    return windows[(DTYPES.index(dtype) + BLOCK_SIZES.index(block_size)) % len(windows)]


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_sliding_window(dtype, block_size, device):
    """v1 and v2 see only the last `window` positions; the blocks wholly before each
    window hold NaN, so a kernel that reads them fails."""
    seq_lens = [1, 7, 2 * block_size, 5 * block_size + 3, 2 * PARTITION + block_size + 3]
    for window in window_sizes(block_size):
        check_decode(seq_lens, 8, 2, 64, block_size, dtype, device, window=window)
    window = sink_window(dtype, block_size)
    check_decode(seq_lens, 8, 2, 64, block_size, dtype, device, window=window, sinks=True)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_sliding_window_heads_and_alibi(dtype, device):
    for (num_heads, num_kv_heads), head_size in [((12, 1), 128), ((4, 4), 80)]:
        check_decode([3, 300, 1100], num_heads, num_kv_heads, head_size, 16, dtype, device,
                     alibi=True, window=37)  # fmt: skip


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize(
    "heads", [(8, 2, 64), (12, 1, 128)], ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}"
)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_sliding_window(dtype, block_size, heads, device):
    """Prompts, a prefix-cache continuation and a long prompt, each query seeing only
    its own window; blocks before every window of a sequence hold NaN."""
    num_heads, num_kv_heads, head_size = heads
    seq_lens = [1, 19, 2 * block_size, block_size + 29, 700]
    q_lens = [1, 19, 2 * block_size, 21, 700]
    for window in window_sizes(block_size):
        check_prefill(seq_lens, q_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                      device, window=window)  # fmt: skip
    if num_kv_heads == 2:  # sinks on the cheaper head layout only
        check_prefill(seq_lens, q_lens, num_heads, num_kv_heads, head_size, block_size, dtype,
                      device, window=sink_window(dtype, block_size), sinks=True)  # fmt: skip


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("window", [5, 100])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_sliding_window_chunked(dtype, window, device):
    """A prompt fed in chunks larger than the window gives the whole prompt's outputs;
    before each chunk, the blocks outside its first query's window become NaN."""
    num_heads, num_kv_heads, head_size, block_size = 8, 2, 64, 16
    prompt_len, chunks = 600, [250, 300, 50]
    kv = make_paged_kv([prompt_len], num_kv_heads, head_size, block_size, dtype, device)
    scale = 1.0 / math.sqrt(head_size)
    query = random_query(prompt_len, num_heads, head_size, dtype, device)
    expected = reference_prefill(query, kv, [prompt_len], [prompt_len], scale, window=window)
    full = run_prefill(query, kv, num_kv_heads, scale, [prompt_len], [prompt_len], window=window)
    assert_close(full, expected, dtype)
    done, outputs = 0, []
    for n in chunks:
        poison_blocks_before_window(kv, [done], window)
        outputs.append(
            run_prefill(
                query[done : done + n], kv, num_kv_heads, scale, [done + n], [n], window=window
            )  # fmt: skip
        )
        done += n
    assert_close(torch.cat(outputs), expected, dtype)


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sinks_with_alibi_and_window(dtype, device):
    """Sinks beside alibi and a window that leaves v2 one partition of three (the merge
    still folds the sink in), and a prefill with all three."""
    check_decode([3, 300, 1100], 12, 1, 128, 16, dtype, device, alibi=True, window=37,
                 sinks=True)  # fmt: skip
    check_prefill([40, 530], [40, 100], 8, 2, 64, 16, dtype, device, alibi=True, window=37,
                  sinks=True)  # fmt: skip
