"""pyllm's kernels: thin Python wrappers over ``torch.ops.pyllm``.

Each op's argument contract (device, dtype, shape, layout, supported sizes, scalar
arguments) is checked in C++ by both its CPU and CUDA implementation, one checks header
per family (``csrc/<family>/<family>_checks.h``): a bad argument raises
``TypeError``/``ValueError`` naming it, however the op is called. The wrappers here add
the arguments' Python types and the values of index tensors (slot and block numbers in
range, seq_lens, query_start_loc, ...), which they read: a device sync on CUDA. Engines
that validate their batch metadata once per step may call ``torch.ops.pyllm.<name>``
directly, skipping these value checks.

KV cache layout, one pair of tensors per layer (``x = 16 // element_size``):
- ``key_cache``:   ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``
- ``value_cache``: ``[num_blocks, num_kv_heads, head_size, block_size]``

Contiguous KV layout (the virtual KV arena, ``pyllm.kv_cache.KVArena``), one pair of views
per layer, indexed by sequence slot instead of through a block table (``TOKEN_TILE = 16``):

- ``key_cache``:   ``[max_num_seqs, num_kv_heads, num_tiles, head_size // x, TOKEN_TILE, x]``
- ``value_cache``: ``[max_num_seqs, num_kv_heads, num_tiles, head_size, TOKEN_TILE]``

Token t of a slot sits in tile ``t // TOKEN_TILE`` at offset ``t % TOKEN_TILE``; each tile
is dense and laid out like a paged block of TOKEN_TILE tokens; the outer (slot, kv head,
tile) strides are the arena's choice, the same for the key and the value view.

Token-major inputs (``query``, ``key``, ``value``) may be row views of a larger tensor
(for example the q/k/v parts of one fused projection): their token stride is free, but
the heads and head dimension of one token must be packed (``[H, D]`` contiguous).
Outputs must be contiguous. The quantized-weight ops are ``pyllm.ops_quant``'s, re-exported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import pyllm._C  # noqa: F401  (loads the library, which registers torch.ops.pyllm)
from pyllm._checks import (  # noqa: F401  (constants re-exported)
    BUILT_WITH_CUDA,
    PARTITION_SIZE,
    SMALL_BATCH_MAX_ROWS,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_SIZES,
    TOKEN_TILE,
    _check_args,
    _check_block_mapping,
    _check_block_tables,
    _check_max_len,
    _check_query_lens,
    _check_range,
    _float_dtype,
    _ndim,
    _positive_int,
    _tensor,
    kv_cache_x,
)
from pyllm.kv_cache import (
    KVArena,
    _check_seq_slots,
    _check_token_slots,
    allocate_kv_cache,
    allocate_kv_scales,
)
from pyllm.ops_quant import (
    FLOAT_WEIGHT_TYPES,
    QUANT_TYPES,
    STRIPS_TYPES,
    batch_invariant,
    dequantize_rows,
    fused_moe,
    moe_topk,
    pack_strips,
    quant_linear,
    quant_row_bytes,
    set_batch_invariant,
    strips_native,
)

_C = torch.ops.pyllm


__all__ = [
    "FLOAT_WEIGHT_TYPES", "PARTITION_SIZE", "QUANT_TYPES", "SMALL_BATCH_MAX_ROWS",
    "STRIPS_TYPES", "SUPPORTED_BLOCK_SIZES", "SUPPORTED_DTYPES", "SUPPORTED_HEAD_SIZES",
    "TOKEN_TILE", "KVArena", "allocate_kv_cache", "allocate_kv_scales", "apply_token_bitmask",
    "batch_invariant", "contiguous_attention_decode", "contiguous_attention_prefill",
    "copy_blocks", "dequantize_rows", "fused_add_rms_norm", "fused_moe", "gelu_tanh_and_mul",
    "kv_cache_x", "moe_topk", "pack_strips", "pack_weight_words", "packed_linear",
    "packed_linear_vectorized", "paged_attention_prefill", "paged_attention_v1",
    "paged_attention_v2", "paged_attention_v2_workspace", "quant_linear", "quant_row_bytes",
    "reshape_and_cache", "rms_norm", "rotary_embedding", "set_batch_invariant", "silu_and_mul",
    "small_batch_linear", "strips_native", "swap_blocks", "write_kv_contiguous",
]  # fmt: skip


# ---------------------------------------------------------------------------
# Cache ops.


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes each token's key/value into the paged cache at its slot.

    key, value: ``[num_tokens, num_kv_heads, head_size]``; slot_mapping:
    ``[num_tokens]`` int64, slot = block_number * block_size + offset_in_block;
    a slot of -1 skips that token (padding). "int8": ``round(x / s)``, ``s = fp16(absmax / 127)``.
    """
    _check_args(
        _C.reshape_and_cache, key=key, value=value, key_cache=key_cache,
        value_cache=value_cache, slot_mapping=slot_mapping, kv_cache_dtype=kv_cache_dtype,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if value_cache.dim() == 4:
        num_blocks, _, _, block_size = value_cache.shape
        note = f" ({num_blocks} blocks of {block_size})"
        _check_range("slot_mapping", slot_mapping, torch.int64, -1, num_blocks * block_size, note)
    _C.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copies whole blocks within each layer's cache (copy-on-write of shared blocks).

    block_mapping: ``[num_pairs, 2]`` int64 on the CPU, rows of (src_block, dst_block),
    applied to every layer's key and value cache. The pairs are copied in parallel, in
    no set order: a block must not be both a source and a destination in one call.
    """
    _check_args(
        _C.copy_blocks, key_caches=key_caches, value_caches=value_caches,
        block_mapping=block_mapping,
    )  # fmt: skip
    if key_caches and key_caches[0].dim():
        _check_block_mapping(block_mapping, key_caches[0].shape[0], key_caches[0].shape[0])
    _C.copy_blocks(list(key_caches), list(value_caches), block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies blocks ``src[s] -> dst[d]`` for each (s, d) row of block_mapping.

    src and dst are caches of the same layout and dtype (one key or one value cache),
    on the same or different devices (CPU <-> CUDA swaps where CUDA is built).
    """
    _check_args(_C.swap_blocks, src=src, dst=dst, block_mapping=block_mapping)
    if src.dim() and dst.dim():
        _check_block_mapping(block_mapping, src.shape[0], dst.shape[0])
    _C.swap_blocks(src, dst, block_mapping)


# ---------------------------------------------------------------------------
# Attention.


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode attention: one query token per sequence over its paged KV.

    out, query: ``[num_seqs, num_heads, head_size]``; block_tables:
    ``[num_seqs, max_num_blocks_per_seq]`` int32; seq_lens: ``[num_seqs]`` int32 (the
    number of cached tokens, including this step's); max_seq_len >= max(seq_lens).
    GQA/MQA when num_heads is a multiple of num_kv_heads. alibi_slopes:
    ``[num_heads]`` float32, adds ``slope * (key_position - query_position)``.
    sliding_window: None or 0 for full causal attention; otherwise the query at position
    p sees only keys at positions ``> p - sliding_window`` (its last sliding_window
    positions). Cache blocks that hold no key of any query's window are never read, so
    their block_tables entries may name blocks the sequence no longer owns.
    sinks: None, or ``[num_heads]`` float32 on the query's device: one learned logit per
    query head that joins each softmax as an extra column with no value (gpt-oss's
    attention sinks), so a query's weights sum to less than 1.
    k_scale, v_scale: an int8 cache's scales (reshape_and_cache), None for a float cache.
    """
    sliding_window = sliding_window or 0
    _check_args(
        _C.paged_attention_v1, out=out, query=query, key_cache=key_cache,
        value_cache=value_cache, num_kv_heads=num_kv_heads, scale=scale,
        block_tables=block_tables, seq_lens=seq_lens, block_size=block_size,
        max_seq_len=max_seq_len, alibi_slopes=alibi_slopes, sliding_window=sliding_window,
        sinks=sinks, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _check_block_tables(block_tables, seq_lens, value_cache, block_size)
    _check_max_len("max_seq_len", max_seq_len, seq_lens)
    _C.paged_attention_v1(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        block_size, max_seq_len, alibi_slopes, sliding_window, sinks, k_scale, v_scale,
    )  # fmt: skip


def paged_attention_v2_workspace(
    query: torch.Tensor, max_seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocates (exp_sums, max_logits, tmp_out) for paged_attention_v2."""
    _tensor("query", query)
    _ndim("query", query, 3, "[num_seqs, num_heads, head_size]")
    _positive_int("max_seq_len", max_seq_len)
    num_seqs, num_heads, head_size = query.shape
    partitions = max(1, -(-max_seq_len // PARTITION_SIZE))
    stats = dict(dtype=torch.float32, device=query.device)
    exp_sums = torch.empty(num_seqs, num_heads, partitions, **stats)
    max_logits = torch.empty(num_seqs, num_heads, partitions, **stats)
    tmp_out = torch.empty(
        num_seqs, num_heads, partitions, head_size, dtype=query.dtype, device=query.device
    )
    return exp_sums, max_logits, tmp_out


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode attention split into partitions of PARTITION_SIZE tokens, then merged.

    Same result as paged_attention_v1; better parallelism for long contexts.
    exp_sums, max_logits: ``[num_seqs, num_heads, num_partitions]`` float32; tmp_out:
    ``[num_seqs, num_heads, num_partitions, head_size]`` in the query's dtype, with
    num_partitions = ceil(max_seq_len / PARTITION_SIZE) (see paged_attention_v2_workspace).
    With a sliding window, partitions wholly before it are neither computed nor merged.
    sinks: as for paged_attention_v1; they join the merge of the partitions, once.
    """
    sliding_window = sliding_window or 0
    _check_args(
        _C.paged_attention_v2, out=out, exp_sums=exp_sums, max_logits=max_logits,
        tmp_out=tmp_out, query=query, key_cache=key_cache, value_cache=value_cache,
        num_kv_heads=num_kv_heads, scale=scale, block_tables=block_tables, seq_lens=seq_lens,
        block_size=block_size, max_seq_len=max_seq_len, alibi_slopes=alibi_slopes,
        sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _check_block_tables(block_tables, seq_lens, value_cache, block_size)
    _check_max_len("max_seq_len", max_seq_len, seq_lens)
    _C.paged_attention_v2(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
        scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, sliding_window,
        sinks, k_scale, v_scale,
    )  # fmt: skip


def paged_attention_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    max_query_len: int,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Causal attention for several query tokens per sequence over its paged KV.

    out, query: ``[num_tokens, num_heads, head_size]``, the query tokens of all
    sequences back to back; query_start_loc: ``[num_seqs + 1]`` int32 offsets into
    them. Query token i of sequence s sits at position
    ``seq_lens[s] - q_len_s + i`` and attends to the cached keys at positions up to
    its own, so this step's keys must already be written by reshape_and_cache. Used
    for prompts, prompt chunks after earlier chunks, and prefix-cache hits.
    sliding_window, sinks, k_scale, v_scale: as for paged_attention_v1.
    """
    sliding_window = sliding_window or 0
    _check_args(
        _C.paged_attention_prefill, out=out, query=query, key_cache=key_cache,
        value_cache=value_cache, num_kv_heads=num_kv_heads, scale=scale,
        block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
        block_size=block_size, max_query_len=max_query_len, alibi_slopes=alibi_slopes,
        sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _check_block_tables(block_tables, seq_lens, value_cache, block_size)
    _check_query_lens(query_start_loc, seq_lens, query, max_query_len)
    _C.paged_attention_prefill(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        query_start_loc, block_size, max_query_len, alibi_slopes, sliding_window, sinks,
        k_scale, v_scale,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# Rotary embedding, norms, activation.


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Applies rotary position embeddings to query and key in place.

    positions: ``[num_tokens]`` int64; query: ``[num_tokens, num_heads * head_size]``
    (or ``[num_tokens, num_heads, head_size]``); key likewise with num_kv_heads;
    cos_sin_cache: ``[max_position, rot_dim]``, cos in the first rot_dim / 2 columns and
    sin in the rest, in the query's dtype (or float32). The first rot_dim dimensions of
    each head rotate: neox style pairs (i, i + rot_dim/2), GPT-J style pairs (2i, 2i+1).
    """
    _check_args(
        _C.rotary_embedding, positions=positions, query=query, key=key, head_size=head_size,
        cos_sin_cache=cos_sin_cache, is_neox=is_neox,
    )  # fmt: skip
    if cos_sin_cache.dim():
        _check_range(
            "positions", positions, torch.int64, 0, cos_sin_cache.shape[0], " (cos_sin_cache rows)"
        )
    _C.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out = input / sqrt(mean(input^2, -1) + eps) * weight, computed in float32.

    input: ``[..., hidden_size]`` with packed rows; out: same shape, contiguous.
    """
    _check_args(_C.rms_norm, out=out, input=input, weight=weight, eps=eps)
    _C.rms_norm(out, input, weight, eps)


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual += input; input = rms_norm(residual) * weight``.

    input, residual: ``[..., hidden_size]``, same shape and dtype, contiguous.
    """
    _check_args(_C.fused_add_rms_norm, input=input, residual=residual, weight=weight, eps=eps)
    _C.fused_add_rms_norm(input, residual, weight, eps)


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out = silu(input[..., :d]) * input[..., d:] for input ``[..., 2 * d]``."""
    _check_args(_C.silu_and_mul, out=out, input=input)
    _C.silu_and_mul(out, input)


def gelu_tanh_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out = gelu(input[..., :d], approximate="tanh") * input[..., d:] for input
    ``[..., 2 * d]`` (Gemma's MLP)."""
    _check_args(_C.gelu_tanh_and_mul, out=out, input=input)
    _C.gelu_tanh_and_mul(out, input)


def small_batch_linear(
    out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """out = input @ weight.T (+ bias) for a few rows: ``input [M, K]`` with
    ``M <= SMALL_BATCH_MAX_ROWS``, ``weight [N, K]`` (as nn.Linear stores it), ``bias [N]``,
    ``out [M, N]``, all one dtype. Accumulates in float32.

    A decode step of a few sequences: on the CPU a kernel that streams the weight once at
    memory bandwidth, with none of a GEMM library's per-call cost; on CUDA, cuBLAS.
    Input rows may be strided (a row view); their elements must be packed.
    """
    _check_args(_C.small_batch_linear, out=out, input=input, weight=weight, bias=bias)
    _C.small_batch_linear(out, input, weight, bias)


def pack_weight_words(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (as nn.Linear stores it) in packed_linear's layout,
    ``[N / 16, K / E, 16, E]`` with E = 4 / element size (1 float32, 2 bf16 or f16): the
    32-bit words of 16 consecutive output columns at one step of K are one 64-byte
    vector. A new tensor; N must be a multiple of 16 and K of E."""
    _tensor("weight", weight)
    _float_dtype("weight", weight)
    _ndim("weight", weight, 2, "[out_features, in_features]")
    n, k = weight.shape
    e = 4 // weight.dtype.itemsize  # elements per 32-bit word
    if n % 16 or k % e:
        raise ValueError(
            f"weight must be [N, K] with N a multiple of 16 and K of {e} to pack, "
            f"got {tuple(weight.shape)}"
        )
    return weight.detach().reshape(n // 16, 16, k // e, e).permute(0, 2, 1, 3).contiguous()


def packed_linear_vectorized(dtype: torch.dtype) -> bool:
    """Whether this build's CPU packed_linear has a vector kernel for dtype: float32 on
    AVX-512, bf16 with AVX512-BF16 too. Elsewhere it runs a plain loop (correct, slow),
    so callers should keep their weights for another path."""
    return bool(_C.packed_linear_vectorized(dtype))


def packed_linear(
    out: torch.Tensor,
    input: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """out = input @ W.T (+ bias) with W given as ``pack_weight_words(W)``:
    ``input [M, K]``, ``packed_weight [N / 16, K / E, 16, E]``, ``bias [N]``,
    ``out [M, N]``, all one dtype. Accumulates in float32.

    On the CPU a GEMM micro-kernel over the packed words (an FMA per float, vdpbf16ps
    per bf16 pair): at decode batch sizes it streams the weight once per call without a
    GEMM library's per-call cost. On CUDA the weight is unpacked for cuBLAS. Input rows
    may be strided (a row view); their elements must be packed.
    """
    _check_args(_C.packed_linear, out=out, input=input, packed_weight=packed_weight, bias=bias)
    _C.packed_linear(out, input, packed_weight, bias)


# ---------------------------------------------------------------------------
# Contiguous KV layout: the ops over a KVArena's views (pyllm.kv_cache).


def write_kv_contiguous(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    token_slots: torch.Tensor,
    positions: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes each token's key/value into the contiguous cache at (slot, position).

    key, value: ``[num_tokens, num_kv_heads, head_size]``; key_cache/value_cache: one
    layer's views of the contiguous layout (``KVArena.key_cache(layer)``);
    token_slots: ``[num_tokens]`` int64, each token's sequence slot, -1 to skip the
    token (padding); positions: ``[num_tokens]`` int64, each token's position in its
    sequence (below the slots' capacity, and below the slot's committed tokens when the
    cache is a KVArena view).
    """
    _check_args(
        _C.write_kv_contiguous, key=key, value=value, key_cache=key_cache,
        value_cache=value_cache, token_slots=token_slots, positions=positions,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _check_token_slots(key_cache, value_cache, token_slots, positions)
    _C.write_kv_contiguous(
        key, value, key_cache, value_cache, token_slots, positions, k_scale, v_scale
    )


def contiguous_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    seq_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Decode attention over the contiguous cache: paged_attention_v1 with slots.

    out, query: ``[num_seqs, num_heads, head_size]``; key_cache/value_cache: one layer's
    contiguous views; seq_slots: ``[num_seqs]`` int32, each sequence's slot; seq_lens:
    ``[num_seqs]`` int32, cached tokens including this step's (at most the slot's
    committed tokens when the cache is a KVArena view); max_seq_len >= max(seq_lens).
    GQA/MQA when num_heads is a multiple of num_kv_heads. sliding_window, sinks: as for
    paged_attention_v1.
    """
    sliding_window = sliding_window or 0
    _check_args(
        _C.contiguous_attention_decode, out=out, query=query, key_cache=key_cache,
        value_cache=value_cache, num_kv_heads=num_kv_heads, scale=scale, seq_slots=seq_slots,
        seq_lens=seq_lens, max_seq_len=max_seq_len, sliding_window=sliding_window, sinks=sinks,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _check_seq_slots(key_cache, value_cache, seq_slots, seq_lens)
    _check_max_len("max_seq_len", max_seq_len, seq_lens)
    _C.contiguous_attention_decode(
        out, query, key_cache, value_cache, num_kv_heads, scale, seq_slots, seq_lens,
        max_seq_len, sliding_window, sinks, k_scale, v_scale,
    )  # fmt: skip


def contiguous_attention_prefill(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    seq_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Causal prefill over the contiguous cache: paged_attention_prefill with slots.

    out, query: ``[num_tokens, num_heads, head_size]``, the query tokens of all sequences
    back to back; query_start_loc: ``[num_seqs + 1]`` int32 offsets into them;
    seq_slots, seq_lens: ``[num_seqs]`` int32. Query token i of sequence s sits at
    position ``seq_lens[s] - q_len_s + i`` and attends to the cached keys up to its own
    (written first by write_kv_contiguous): prompts, later chunks of a chunked prefill.
    sliding_window, sinks: as for paged_attention_prefill.
    """
    sliding_window = sliding_window or 0
    _check_args(
        _C.contiguous_attention_prefill, out=out, query=query, key_cache=key_cache,
        value_cache=value_cache, num_kv_heads=num_kv_heads, scale=scale, seq_slots=seq_slots,
        seq_lens=seq_lens, query_start_loc=query_start_loc, max_query_len=max_query_len,
        sliding_window=sliding_window, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    _check_seq_slots(key_cache, value_cache, seq_slots, seq_lens)
    _check_query_lens(query_start_loc, seq_lens, query, max_query_len)
    _C.contiguous_attention_prefill(
        out, query, key_cache, value_cache, num_kv_heads, scale, seq_slots, seq_lens,
        query_start_loc, max_query_len, sliding_window, sinks, k_scale, v_scale,
    )  # fmt: skip


# Sampling.


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place, the grammar masks of structured output: ``logits[rows[i], t] = -inf``
    wherever bit ``t % 32`` of ``bitmask[i, t // 32]`` is 0, and for the tokens past
    the mask's words.

    logits: ``[num_seqs, vocab_size]`` with packed rows; bitmask: int32
    ``[num_masked_rows, ceil(vocab_size / 32)]`` (llguidance's and xgrammar's layout),
    contiguous; rows: int64 ``[num_masked_rows]``, the logits row of each mask; all on
    logits' device. On CUDA the row ids are not checked against num_seqs.
    """
    _check_args(_C.apply_token_bitmask, logits=logits, bitmask=bitmask, rows=rows)
    _C.apply_token_bitmask(logits, bitmask, rows)
