"""pyllm's kernels: the checked Python API over ``torch.ops.pyllm``.

Every function here validates its arguments (device, dtype, shape, layout and the
values of index tensors) and raises ``TypeError``/``ValueError`` naming the argument,
then calls the compiled op. Engines that validate their batch metadata once per step
may call ``torch.ops.pyllm.<name>`` directly with the same arguments to skip these
checks; the value checks below read index tensors, which costs a device sync on CUDA.

KV cache layout, one pair of tensors per layer (``x = 16 // element_size``):

- ``key_cache``:   ``[num_blocks, num_kv_heads, head_size // x, block_size, x]``
- ``value_cache``: ``[num_blocks, num_kv_heads, head_size, block_size]``

Contiguous KV layout (the virtual KV arena, ``KVArena``), one pair of views per layer,
indexed by sequence slot instead of through a block table (``TOKEN_TILE = 16``):

- ``key_cache``:   ``[max_num_seqs, num_kv_heads, num_tiles, head_size // x, TOKEN_TILE, x]``
- ``value_cache``: ``[max_num_seqs, num_kv_heads, num_tiles, head_size, TOKEN_TILE]``

Token t of a slot sits in tile ``t // TOKEN_TILE`` at offset ``t % TOKEN_TILE``; each
tile is dense and laid out like a paged block of TOKEN_TILE tokens, while the outer
(slot, kv head, tile) strides are the arena's choice and must be the same for the key
and the value view.

Token-major inputs (``query``, ``key``, ``value``) may be row views of a larger
tensor (for example the q/k/v parts of one fused projection): their token stride is
free, but the heads and head dimension of one token must be packed (``[H, D]``
contiguous). Outputs must be contiguous.
"""

from __future__ import annotations

import math
import mmap
import weakref
from collections.abc import Sequence

import torch

import pyllm._C  # noqa: F401  (loads the library, which registers torch.ops.pyllm)

_C = torch.ops.pyllm

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
# paged_attention_v2 reduces each partition of this many tokens separately.
PARTITION_SIZE: int = int(_C.partition_size())
BUILT_WITH_CUDA: bool = bool(_C.built_with_cuda())
# Tokens per tile of the contiguous KV layout.
TOKEN_TILE: int = int(_C.token_tile())
# Most input rows small_batch_linear takes.
SMALL_BATCH_MAX_ROWS: int = int(_C.small_batch_max_rows())

__all__ = [
    "KVArena",
    "PARTITION_SIZE",
    "QUANT_TYPES",
    "SMALL_BATCH_MAX_ROWS",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_SIZES",
    "TOKEN_TILE",
    "allocate_kv_cache",
    "contiguous_attention_decode",
    "contiguous_attention_prefill",
    "copy_blocks",
    "dequantize_rows",
    "fused_add_rms_norm",
    "kv_cache_x",
    "pack_weight_words",
    "packed_linear",
    "packed_linear_vectorized",
    "paged_attention_prefill",
    "paged_attention_v1",
    "paged_attention_v2",
    "paged_attention_v2_workspace",
    "quant_linear",
    "quant_row_bytes",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "small_batch_linear",
    "swap_blocks",
    "write_kv_contiguous",
]


# ---------------------------------------------------------------------------
# Argument checks: each raises naming the argument and the value that was wrong.


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other tensors are on {device}")


def _supported_device(name: str, t: torch.Tensor) -> None:
    if t.device.type == "cuda" and not BUILT_WITH_CUDA:
        raise ValueError(
            f"{name} is on {t.device} but pyllm was built without CUDA kernels "
            "(rebuild with PYLLM_TARGET=cuda)"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}; pyllm ops run on cpu and cuda")


def _float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float32, float16, bfloat16")


def _same_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but must match the others ({dtype})")


def _index_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")


def _ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _packed_rows(name: str, t: torch.Tensor) -> None:
    """Rows (dim 0) may be strided, as in a view of a wider tensor; the elements
    inside one row must be packed."""
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] > 1 and t.stride(dim) != expected:
            raise ValueError(
                f"{name} must have each row's elements packed (all dims but the first "
                f"contiguous), got shape {tuple(t.shape)} with strides {t.stride()}"
            )
        expected *= t.shape[dim]
    if t.dim() == 1 and t.numel() > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")


def _shape(name: str, t: torch.Tensor, expected: Sequence[int], layout: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} {layout}, got {tuple(t.shape)}")


def _head_size(head_size: int) -> None:
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(
            f"head_size {head_size} is not supported; supported: {SUPPORTED_HEAD_SIZES}"
        )


def _block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size {block_size!r} is not supported; supported: {SUPPORTED_BLOCK_SIZES}"
        )


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _finite_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def kv_cache_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte group in the key cache's last dimension."""
    return 16 // dtype.itemsize


def _check_kv_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int]:
    """Validates a cache pair; returns (num_blocks, num_kv_heads, head_size, block_size)."""
    _tensor("key_cache", key_cache)
    _tensor("value_cache", value_cache)
    _device("key_cache", key_cache, device)
    _device("value_cache", value_cache, device)
    _same_dtype("key_cache", key_cache, dtype)
    _same_dtype("value_cache", value_cache, dtype)
    _ndim("key_cache", key_cache, 5, "[num_blocks, num_kv_heads, head_size // x, block_size, x]")
    _ndim("value_cache", value_cache, 4, "[num_blocks, num_kv_heads, head_size, block_size]")
    _contiguous("key_cache", key_cache)
    _contiguous("value_cache", value_cache)
    num_blocks, num_kv_heads, head_size, block_size = value_cache.shape
    x = kv_cache_x(dtype)
    _shape(
        "key_cache",
        key_cache,
        (num_blocks, num_kv_heads, head_size // x, block_size, x),
        f"(x = {x} for {dtype}, matching value_cache {tuple(value_cache.shape)})",
    )
    _head_size(head_size)
    _block_size(block_size)
    return num_blocks, num_kv_heads, head_size, block_size


def _check_block_tables(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    num_blocks: int,
    block_size: int,
    device: torch.device,
) -> None:
    _tensor("block_tables", block_tables)
    _tensor("seq_lens", seq_lens)
    _device("block_tables", block_tables, device)
    _device("seq_lens", seq_lens, device)
    _index_dtype("block_tables", block_tables, torch.int32)
    _index_dtype("seq_lens", seq_lens, torch.int32)
    _ndim("block_tables", block_tables, 2, "[num_seqs, max_num_blocks_per_seq]")
    _contiguous("block_tables", block_tables)
    _contiguous("seq_lens", seq_lens)
    _shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs]")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows but there are {num_seqs} sequences"
        )
    if num_seqs == 0:
        return
    max_len = block_tables.shape[1] * block_size
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0 or hi > max_len:
        raise ValueError(
            f"seq_lens must lie in [0, {max_len}] (block_tables holds "
            f"{block_tables.shape[1]} blocks of {block_size}), got values in [{lo}, {hi}]"
        )
    # Only the blocks that hold tokens are read; unused table entries may be anything.
    used = torch.arange(block_tables.shape[1], device=device)[None, :] * block_size
    used = used < seq_lens[:, None]
    if bool(used.any()):
        entries = block_tables[used]
        if int(entries.min()) < 0 or int(entries.max()) >= num_blocks:
            raise ValueError(
                f"block_tables holds block numbers outside [0, {num_blocks}) "
                f"(got {int(entries.min())}..{int(entries.max())})"
            )


def _check_attention_io(
    out: torch.Tensor, query: torch.Tensor, num_kv_heads: int
) -> tuple[int, int, int]:
    """Checks out/query; returns (num_tokens, num_heads, head_size)."""
    _tensor("query", query)
    _tensor("out", out)
    _supported_device("query", query)
    _float_dtype("query", query)
    _ndim("query", query, 3, "[num_tokens, num_heads, head_size]")
    _packed_rows("query", query)
    _device("out", out, query.device)
    _same_dtype("out", out, query.dtype)
    _shape("out", out, query.shape, "(same as query)")
    _contiguous("out", out)
    num_tokens, num_heads, head_size = query.shape
    _head_size(head_size)
    _positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_kv_heads ({num_kv_heads}) must divide the query's num_heads ({num_heads})"
        )
    return num_tokens, num_heads, head_size


def _check_alibi(alibi_slopes: torch.Tensor | None, num_heads: int, device: torch.device) -> None:
    if alibi_slopes is None:
        return
    _tensor("alibi_slopes", alibi_slopes)
    _device("alibi_slopes", alibi_slopes, device)
    _index_dtype("alibi_slopes", alibi_slopes, torch.float32)
    _shape("alibi_slopes", alibi_slopes, (num_heads,), "[num_heads]")
    _contiguous("alibi_slopes", alibi_slopes)


def _check_attention_common(
    out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
    block_size, alibi_slopes,
) -> tuple[int, int, int]:  # fmt: skip
    num_tokens, num_heads, head_size = _check_attention_io(out, query, num_kv_heads)
    num_blocks, cache_kv_heads, cache_head_size, cache_block_size = _check_kv_cache(
        key_cache, value_cache, query.dtype, query.device
    )
    if cache_kv_heads != num_kv_heads:
        raise ValueError(
            f"num_kv_heads is {num_kv_heads} but the cache holds {cache_kv_heads} kv heads"
        )
    if cache_head_size != head_size:
        raise ValueError(
            f"query head_size {head_size} does not match the cache's head_size {cache_head_size}"
        )
    _block_size(block_size)
    if block_size != cache_block_size:
        raise ValueError(
            f"block_size is {block_size} but the cache's blocks hold {cache_block_size} tokens"
        )
    _finite_float("scale", scale)
    _check_alibi(alibi_slopes, num_heads, query.device)
    return num_tokens, num_heads, num_blocks


def _check_max_seq_len(max_seq_len: int, seq_lens: torch.Tensor) -> None:
    _positive_int("max_seq_len", max_seq_len)
    if seq_lens.numel() and int(seq_lens.max()) > max_seq_len:
        raise ValueError(
            f"max_seq_len ({max_seq_len}) is smaller than the longest of seq_lens "
            f"({int(seq_lens.max())})"
        )


def _query_start_loc(query_start_loc: torch.Tensor, device: torch.device) -> int:
    """Checks query_start_loc's tensor properties; returns num_seqs."""
    _tensor("query_start_loc", query_start_loc)
    _device("query_start_loc", query_start_loc, device)
    _index_dtype("query_start_loc", query_start_loc, torch.int32)
    _ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    _contiguous("query_start_loc", query_start_loc)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0:
        raise ValueError("query_start_loc must hold num_seqs + 1 offsets, got an empty tensor")
    return num_seqs


def _check_query_lens(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, max_query_len: int
) -> None:
    """Prefill's query offsets against the tokens, max_query_len and seq_lens."""
    _positive_int("max_query_len", max_query_len)
    # Checked for zero sequences too: query tokens that no sequence covers would
    # leave their rows of out unwritten.
    if int(query_start_loc[0]) != 0 or int(query_start_loc[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc must start at 0 and end at num_tokens ({num_tokens}), got "
            f"{int(query_start_loc[0])}..{int(query_start_loc[-1])}"
        )
    if query_start_loc.shape[0] > 1:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        if int(q_lens.min()) < 0:
            raise ValueError("query_start_loc must be non-decreasing")
        if int(q_lens.max()) > max_query_len:
            raise ValueError(
                f"max_query_len ({max_query_len}) is smaller than the longest query "
                f"({int(q_lens.max())})"
            )
        if bool((q_lens > seq_lens).any()):
            raise ValueError("each sequence's query length must be <= its seq_lens entry")


# ---------------------------------------------------------------------------
# Cache ops.


def allocate_kv_cache(
    num_blocks: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocates one layer's (key_cache, value_cache) in the layout the kernels read.

    Zero-filled, so the memory is committed here rather than page-faulted in by the
    first writes of each new block, which would land on the step's critical path
    (on the CPU a fault per 4 KiB page tripled reshape_and_cache's time in prefill)."""
    _positive_int("num_blocks", num_blocks)
    _positive_int("num_kv_heads", num_kv_heads)
    _head_size(head_size)
    _block_size(block_size)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; supported: float32, float16, bfloat16")
    x = kv_cache_x(dtype)
    key_shape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    value_shape = (num_blocks, num_kv_heads, head_size, block_size)
    if torch.device(device).type == "cpu":
        return _zeros_on_huge_pages(key_shape, dtype), _zeros_on_huge_pages(value_shape, dtype)
    return (
        torch.zeros(key_shape, dtype=dtype, device=device),
        torch.zeros(value_shape, dtype=dtype, device=device),
    )


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in anonymous memory marked MADV_HUGEPAGE, which Linux backs with
    2 MiB pages where transparent huge pages are enabled ("madvise" or "always").

    Attention reads a sequence's blocks scattered over the whole cache, so with 4 KiB
    pages nearly every block is a TLB miss; measured on this project's 2-core CPU
    (benchmarks/bench_ops.py, bf16, the same memory with THP_MEM_ALLOC_ENABLE=1 vs 0):
    decode attention over 1 GiB of KV (32 x 8192) 11.0-11.4 -> 13.0-13.4 GB/s. Without
    MADV_HUGEPAGE (not Linux) this is torch.zeros."""
    numel = math.prod(shape)
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    nbytes = numel * dtype.itemsize
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds a reference to `memory`, which is unmapped when both are gone.
    # Anonymous pages read as zero; they are committed as blocks are first written, so
    # the process holds only the part of the pool its sequences have used.
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(shape)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
) -> None:
    """Writes each token's key/value into the paged cache at its slot.

    key, value: ``[num_tokens, num_kv_heads, head_size]``; slot_mapping:
    ``[num_tokens]`` int64, slot = block_number * block_size + offset_in_block;
    a slot of -1 skips that token (padding).
    """
    _tensor("key", key)
    _tensor("value", value)
    _supported_device("key", key)
    _float_dtype("key", key)
    _ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    _device("value", value, key.device)
    _same_dtype("value", value, key.dtype)
    _shape("value", value, key.shape, "(same as key)")
    _packed_rows("key", key)
    _packed_rows("value", value)
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; only 'auto' "
            "(the cache has the model's dtype)"
        )
    num_blocks, num_kv_heads, head_size, block_size = _check_kv_cache(
        key_cache, value_cache, key.dtype, key.device
    )
    if tuple(key.shape[1:]) != (num_kv_heads, head_size):
        raise ValueError(
            f"key has {tuple(key.shape[1:])} [num_kv_heads, head_size] per token but the cache "
            f"holds ({num_kv_heads}, {head_size})"
        )
    _tensor("slot_mapping", slot_mapping)
    _device("slot_mapping", slot_mapping, key.device)
    _index_dtype("slot_mapping", slot_mapping, torch.int64)
    _shape("slot_mapping", slot_mapping, (key.shape[0],), "[num_tokens]")
    _contiguous("slot_mapping", slot_mapping)
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_blocks * block_size:
            raise ValueError(
                f"slot_mapping values must lie in [-1, {num_blocks * block_size}) "
                f"({num_blocks} blocks of {block_size}), got values in [{lo}, {hi}]"
            )
    _C.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype)


def _check_block_mapping(block_mapping: torch.Tensor, num_src: int, num_dst: int) -> None:
    _tensor("block_mapping", block_mapping)
    if block_mapping.device.type != "cpu":
        raise ValueError("block_mapping must be a CPU tensor")
    _index_dtype("block_mapping", block_mapping, torch.int64)
    _ndim("block_mapping", block_mapping, 2, "[num_pairs, 2] of (src, dst) block numbers")
    if block_mapping.shape[1] != 2:
        raise ValueError(
            f"block_mapping must have shape [num_pairs, 2], got {tuple(block_mapping.shape)}"
        )
    _contiguous("block_mapping", block_mapping)
    if block_mapping.numel():
        for column, limit, side in ((0, num_src, "source"), (1, num_dst, "destination")):
            values = block_mapping[:, column]
            if int(values.min()) < 0 or int(values.max()) >= limit:
                raise ValueError(
                    f"block_mapping {side} block numbers must lie in [0, {limit}), got "
                    f"{int(values.min())}..{int(values.max())}"
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
    if not isinstance(key_caches, (list, tuple)) or not isinstance(value_caches, (list, tuple)):
        raise TypeError("key_caches and value_caches must be lists of tensors")
    if len(key_caches) != len(value_caches):
        raise ValueError(
            f"key_caches has {len(key_caches)} layers but value_caches has {len(value_caches)}"
        )
    if not key_caches:
        raise ValueError("key_caches must hold at least one layer")
    first = _tensor("key_caches[0]", key_caches[0])
    _supported_device("key_caches[0]", first)
    _float_dtype("key_caches[0]", first)
    # Every layer, layer 0 included, is checked against layer 0's dtype and device,
    # so each error says which layer it is about.
    for i, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        try:
            layer = _check_kv_cache(k, v, first.dtype, first.device)
        except (TypeError, ValueError) as error:
            raise type(error)(f"layer {i}: {error}") from None
        if i == 0:
            num_blocks = layer[0]
        elif layer[0] != num_blocks or k.shape != first.shape:
            raise ValueError(f"layer {i}'s cache shape differs from layer 0's")
    _check_block_mapping(block_mapping, num_blocks, num_blocks)
    _C.copy_blocks(list(key_caches), list(value_caches), block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies blocks ``src[s] -> dst[d]`` for each (s, d) row of block_mapping.

    src and dst are caches of the same layout and dtype (one key or one value cache),
    on the same or different devices (CPU <-> CUDA swaps where CUDA is built).
    """
    _tensor("src", src)
    _tensor("dst", dst)
    _supported_device("src", src)
    _supported_device("dst", dst)
    _float_dtype("src", src)
    _same_dtype("dst", dst, src.dtype)
    _contiguous("src", src)
    _contiguous("dst", dst)
    if src.dim() < 2 or tuple(src.shape[1:]) != tuple(dst.shape[1:]):
        raise ValueError(
            f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must have the same block shape"
        )
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
) -> None:
    """Decode attention: one query token per sequence over its paged KV.

    out, query: ``[num_seqs, num_heads, head_size]``; block_tables:
    ``[num_seqs, max_num_blocks_per_seq]`` int32; seq_lens: ``[num_seqs]`` int32 (the
    number of cached tokens, including this step's); max_seq_len >= max(seq_lens).
    GQA/MQA when num_heads is a multiple of num_kv_heads. alibi_slopes:
    ``[num_heads]`` float32, adds ``slope * (key_position - query_position)``.
    """
    num_seqs, _, num_blocks = _check_attention_common(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        block_size, alibi_slopes,
    )  # fmt: skip
    _check_block_tables(block_tables, seq_lens, num_seqs, num_blocks, block_size, query.device)
    _check_max_seq_len(max_seq_len, seq_lens)
    _C.paged_attention_v1(
        out, query, key_cache, value_cache, num_kv_heads, float(scale), block_tables,
        seq_lens, block_size, max_seq_len, alibi_slopes,
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
) -> None:
    """Decode attention split into partitions of PARTITION_SIZE tokens, then merged.

    Same result as paged_attention_v1; better parallelism for long contexts.
    exp_sums, max_logits: ``[num_seqs, num_heads, num_partitions]`` float32; tmp_out:
    ``[num_seqs, num_heads, num_partitions, head_size]`` in the query's dtype, with
    num_partitions = ceil(max_seq_len / PARTITION_SIZE) (see paged_attention_v2_workspace).
    """
    num_seqs, num_heads, num_blocks = _check_attention_common(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        block_size, alibi_slopes,
    )  # fmt: skip
    _check_block_tables(block_tables, seq_lens, num_seqs, num_blocks, block_size, query.device)
    _check_max_seq_len(max_seq_len, seq_lens)
    partitions = -(-max_seq_len // PARTITION_SIZE)
    head_size = query.shape[2]
    for name, t, dtype, shape in (
        ("exp_sums", exp_sums, torch.float32, (num_seqs, num_heads, partitions)),
        ("max_logits", max_logits, torch.float32, (num_seqs, num_heads, partitions)),
        ("tmp_out", tmp_out, query.dtype, (num_seqs, num_heads, partitions, head_size)),
    ):
        _tensor(name, t)
        _device(name, t, query.device)
        _index_dtype(name, t, dtype)
        _contiguous(name, t)
        if (
            t.dim() != len(shape)
            or tuple(t.shape[:2]) != shape[:2]
            or t.shape[2] < partitions
            or (len(shape) == 4 and t.shape[3] != head_size)
        ):
            raise ValueError(
                f"{name} must have shape {shape} (num_partitions = ceil(max_seq_len / "
                f"{PARTITION_SIZE}) = {partitions}), got {tuple(t.shape)}"
            )
    _C.paged_attention_v2(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
        float(scale), block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
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
) -> None:
    """Causal attention for several query tokens per sequence over its paged KV.

    out, query: ``[num_tokens, num_heads, head_size]``, the query tokens of all
    sequences back to back; query_start_loc: ``[num_seqs + 1]`` int32 offsets into
    them. Query token i of sequence s sits at position
    ``seq_lens[s] - q_len_s + i`` and attends to the cached keys at positions up to
    its own, so this step's keys must already be written by reshape_and_cache. Used
    for prompts, prompt chunks after earlier chunks, and prefix-cache hits.
    """
    num_tokens, _, num_blocks = _check_attention_common(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        block_size, alibi_slopes,
    )  # fmt: skip
    num_seqs = _query_start_loc(query_start_loc, query.device)
    _check_block_tables(block_tables, seq_lens, num_seqs, num_blocks, block_size, query.device)
    _check_query_lens(query_start_loc, seq_lens, num_tokens, max_query_len)
    _C.paged_attention_prefill(
        out, query, key_cache, value_cache, num_kv_heads, float(scale), block_tables,
        seq_lens, query_start_loc, block_size, max_query_len, alibi_slopes,
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
    _tensor("positions", positions)
    _tensor("query", query)
    _tensor("key", key)
    _tensor("cos_sin_cache", cos_sin_cache)
    _supported_device("query", query)
    _float_dtype("query", query)
    device = query.device
    for name, t in (("key", key), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        _device(name, t, device)
    _same_dtype("key", key, query.dtype)
    _index_dtype("positions", positions, torch.int64)
    _ndim("positions", positions, 1, "[num_tokens]")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    _positive_int("head_size", head_size)
    num_tokens = positions.shape[0]
    for name, t in (("query", query), ("key", key)):
        if t.dim() not in (2, 3) or t.shape[0] != num_tokens:
            raise ValueError(
                f"{name} must be [num_tokens={num_tokens}, num_heads * head_size] or "
                f"[num_tokens, num_heads, head_size], got {tuple(t.shape)}"
            )
        if t.dim() == 3 and t.shape[2] != head_size:
            raise ValueError(f"{name}'s last dimension {t.shape[2]} is not head_size {head_size}")
        if t.shape[-1] % head_size:
            raise ValueError(
                f"{name}'s width {t.shape[-1]} is not a multiple of head_size {head_size}"
            )
        _packed_rows(name, t)
    _ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rot_dim]")
    _contiguous("cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.dtype not in (query.dtype, torch.float32):
        raise TypeError(
            f"cos_sin_cache has dtype {cos_sin_cache.dtype}; use the query's dtype or float32"
        )
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim < 2 or rot_dim > head_size:
        raise ValueError(
            f"cos_sin_cache's rot_dim {rot_dim} must be even and <= head_size {head_size}"
        )
    if num_tokens:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError(
                f"positions must lie in [0, {cos_sin_cache.shape[0]}) (cos_sin_cache rows), "
                f"got values in [{lo}, {hi}]"
            )
    _C.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def _check_norm_weight(weight: torch.Tensor, t: torch.Tensor, name: str) -> None:
    _tensor("weight", weight)
    _device("weight", weight, t.device)
    _same_dtype("weight", weight, t.dtype)
    _ndim("weight", weight, 1, "[hidden_size]")
    _contiguous("weight", weight)
    if t.dim() < 1 or weight.shape[0] != t.shape[-1]:
        raise ValueError(
            f"weight has {weight.shape[0]} elements but {name}'s last dimension is "
            f"{t.shape[-1] if t.dim() else 'missing'}"
        )


def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out = input / sqrt(mean(input^2, -1) + eps) * weight, computed in float32.

    input: ``[..., hidden_size]`` with packed rows; out: same shape, contiguous.
    """
    _tensor("input", input)
    _tensor("out", out)
    _supported_device("input", input)
    _float_dtype("input", input)
    _packed_rows("input", input)
    _device("out", out, input.device)
    _same_dtype("out", out, input.dtype)
    _shape("out", out, input.shape, "(same as input)")
    _contiguous("out", out)
    _check_norm_weight(weight, input, "input")
    if _finite_float("eps", eps) <= 0:
        raise ValueError(f"eps must be positive, got {eps}")
    _C.rms_norm(out, input, weight, float(eps))


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual += input; input = rms_norm(residual) * weight``.

    input, residual: ``[..., hidden_size]``, same shape and dtype, contiguous.
    """
    _tensor("input", input)
    _tensor("residual", residual)
    _supported_device("input", input)
    _float_dtype("input", input)
    _contiguous("input", input)
    _device("residual", residual, input.device)
    _same_dtype("residual", residual, input.dtype)
    _shape("residual", residual, input.shape, "(same as input)")
    _contiguous("residual", residual)
    _check_norm_weight(weight, input, "input")
    if _finite_float("eps", eps) <= 0:
        raise ValueError(f"eps must be positive, got {eps}")
    _C.fused_add_rms_norm(input, residual, weight, float(eps))


def silu_and_mul(out: torch.Tensor, input: torch.Tensor) -> None:
    """out = silu(input[..., :d]) * input[..., d:] for input ``[..., 2 * d]``."""
    _tensor("input", input)
    _tensor("out", out)
    _supported_device("input", input)
    _float_dtype("input", input)
    _packed_rows("input", input)
    if input.dim() < 1 or input.shape[-1] % 2:
        raise ValueError(
            f"input's last dimension must be even (gate and up halves), got {tuple(input.shape)}"
        )
    _device("out", out, input.device)
    _same_dtype("out", out, input.dtype)
    _shape(
        "out", out, (*input.shape[:-1], input.shape[-1] // 2), "(input's with the last dim halved)"
    )
    _contiguous("out", out)
    _C.silu_and_mul(out, input)


def _check_linear_input(
    input: torch.Tensor, weight_name: str, weight: torch.Tensor, out: torch.Tensor
) -> None:
    """The linear ops' input [rows, in_features] (rows may be strided, elements packed),
    and that the weight and out are tensors."""
    _tensor("input", input)
    _tensor(weight_name, weight)
    _tensor("out", out)
    _supported_device("input", input)
    _float_dtype("input", input)
    _ndim("input", input, 2, "[rows, in_features]")
    _packed_rows("input", input)


def _check_linear_output(
    out: torch.Tensor, bias: torch.Tensor | None, input: torch.Tensor, rows: int, features: int
) -> None:
    """out [rows, features] and bias [features] of the linear ops (out's dtype and device
    are checked beside the weight's)."""
    _shape("out", out, (rows, features), "[rows, out_features]")
    _contiguous("out", out)
    _check_linear_bias(bias, input, features)


def _check_linear_bias(bias: torch.Tensor | None, input: torch.Tensor, features: int) -> None:
    if bias is not None:
        _tensor("bias", bias)
        _device("bias", bias, input.device)
        _same_dtype("bias", bias, input.dtype)
        _shape("bias", bias, (features,), "[out_features]")
        _contiguous("bias", bias)


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
    _check_linear_input(input, "weight", weight, out)
    rows, in_features = input.shape
    if rows > SMALL_BATCH_MAX_ROWS:
        raise ValueError(
            f"input has {rows} rows; small_batch_linear takes at most {SMALL_BATCH_MAX_ROWS}"
        )
    for name, t in (("weight", weight), ("out", out)):
        _device(name, t, input.device)
        _same_dtype(name, t, input.dtype)
    _ndim("weight", weight, 2, "[out_features, in_features]")
    if weight.shape[1] != in_features:
        raise ValueError(
            f"weight must be [out_features, {in_features}] (input's in_features), "
            f"got {tuple(weight.shape)}"
        )
    _contiguous("weight", weight)
    _check_linear_output(out, bias, input, rows, weight.shape[0])
    _C.small_batch_linear(out, input, weight, bias)


def _words_per_element(dtype: torch.dtype) -> int:
    return 4 // dtype.itemsize


def pack_weight_words(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (as nn.Linear stores it) in packed_linear's layout,
    ``[N / 16, K / E, 16, E]`` with E = 4 / element size (1 float32, 2 bf16 or f16): the
    32-bit words of 16 consecutive output columns at one step of K are one 64-byte
    vector. A new tensor; N must be a multiple of 16 and K of E."""
    _tensor("weight", weight)
    _float_dtype("weight", weight)
    _ndim("weight", weight, 2, "[out_features, in_features]")
    n, k = weight.shape
    e = _words_per_element(weight.dtype)
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
    _check_linear_input(input, "packed_weight", packed_weight, out)
    rows, in_features = input.shape
    for name, t in (("packed_weight", packed_weight), ("out", out)):
        _device(name, t, input.device)
        _same_dtype(name, t, input.dtype)
    e = _words_per_element(input.dtype)
    _ndim("packed_weight", packed_weight, 4, "[out_features / 16, in_features / E, 16, E]")
    if packed_weight.shape[1:] != (in_features // e, 16, e) or in_features % e:
        raise ValueError(
            f"packed_weight must be [out_features / 16, {in_features // e}, 16, {e}] "
            f"(pack_weight_words of a weight with {in_features} in_features), "
            f"got {tuple(packed_weight.shape)}"
        )
    _contiguous("packed_weight", packed_weight)
    out_features = packed_weight.shape[0] * 16
    _check_linear_output(out, bias, input, rows, out_features)
    _C.packed_linear(out, input, packed_weight, bias)


# ---------------------------------------------------------------------------
# Linear layers over GGUF-quantized weights.

# GGML type name -> (type id, weights per block, bytes per block): the block formats
# quant_linear and dequantize_rows read, as a GGUF file stores them.
QUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
_QUANT_BY_ID = {
    type_id: (name, block, nbytes) for name, (type_id, block, nbytes) in QUANT_TYPES.items()
}


def quant_row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one weight row of in_features values in GGML type qtype."""
    name, block, nbytes = _quant_type(qtype)
    if in_features % block:
        raise ValueError(
            f"in_features ({in_features}) must be a multiple of {name}'s block of {block}"
        )
    return in_features // block * nbytes


def _quant_type(qtype: object) -> tuple[str, int, int]:
    if isinstance(qtype, bool) or not isinstance(qtype, int) or qtype not in _QUANT_BY_ID:
        supported = ", ".join(f"{n}={t}" for n, (t, _, _) in QUANT_TYPES.items())
        raise ValueError(f"qtype must be a supported GGML type id ({supported}), got {qtype!r}")
    return _QUANT_BY_ID[qtype]


def _check_qweight(qweight: torch.Tensor, qtype: int, in_features: int, device) -> int:
    """qweight [N, row bytes] uint8 of type qtype for in_features values; returns N."""
    _tensor("qweight", qweight)
    _device("qweight", qweight, device)
    if qweight.dtype != torch.uint8:
        raise ValueError(f"qweight must be uint8 (the GGUF blocks' bytes), got {qweight.dtype}")
    _ndim("qweight", qweight, 2, "[out_features, row_bytes]")
    row_bytes = quant_row_bytes(qtype, in_features)
    if qweight.shape[1] != row_bytes:
        raise ValueError(
            f"qweight must be [out_features, {row_bytes}] ({_quant_type(qtype)[0]} rows of "
            f"{in_features} values), got {tuple(qweight.shape)}"
        )
    _contiguous("qweight", qweight)
    return qweight.shape[0]


def quant_linear(
    out: torch.Tensor,
    input: torch.Tensor,
    qweight: torch.Tensor,
    qtype: int,
    bias: torch.Tensor | None = None,
) -> None:
    """out = input @ W.T (+ bias) with W [N, K] kept quantized: ``qweight`` holds its N
    rows of GGUF blocks of GGML type ``qtype`` (``QUANT_TYPES``), uint8
    ``[N, quant_row_bytes(qtype, K)]``, exactly as a GGUF file stores the tensor.
    ``input [M, K]`` and ``out [M, N]`` float32/bf16/fp16, ``bias [N]``.

    On the CPU each input row is quantized to int8 in groups of 32 and multiplied with
    the weights' integers (VNNI or AVX2 integer dot products), scaled per group and
    accumulated in float32: the error against a float product is bounded by half a
    quantization step of the input per weight. Input rows and out rows may be strided
    (row views); their elements must be packed.
    """
    _check_linear_input(input, "qweight", qweight, out)
    rows, in_features = input.shape
    out_features = _check_qweight(qweight, qtype, in_features, input.device)
    _device("out", out, input.device)
    _same_dtype("out", out, input.dtype)
    _shape("out", out, (rows, out_features), "[rows, out_features]")
    _packed_rows("out", out)
    _check_linear_bias(bias, input, out_features)
    _C.quant_linear(out, input, qweight, qtype, bias)


def dequantize_rows(
    out: torch.Tensor, qweight: torch.Tensor, qtype: int, rows: torch.Tensor | None = None
) -> None:
    """out[i] = row rows[i] of the quantized weight, as floats (all rows in order when
    rows is None): ``out [R, K]`` float32/bf16/fp16, ``qweight`` as for quant_linear,
    ``rows [R]`` int64. An embedding lookup in a quantized token table."""
    _tensor("out", out)
    _supported_device("out", out)
    _float_dtype("out", out)
    _ndim("out", out, 2, "[rows, in_features]")
    _contiguous("out", out)
    num_rows = _check_qweight(qweight, qtype, out.shape[1], out.device)
    if rows is None:
        if out.shape[0] != num_rows:
            raise ValueError(
                f"out must have qweight's {num_rows} rows when rows is None, got {out.shape[0]}"
            )
    else:
        _tensor("rows", rows)
        _device("rows", rows, out.device)
        _index_dtype("rows", rows, torch.int64)
        _shape("rows", rows, (out.shape[0],), "[R] (one per row of out)")
        _contiguous("rows", rows)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
            raise ValueError(
                f"rows must lie in [0, {num_rows}), got {int(rows.min())}..{int(rows.max())}"
            )
    _C.dequantize_rows(out, qweight, qtype, rows)


# ---------------------------------------------------------------------------
# Contiguous KV layout: the virtual KV arena and its ops.

# The views of every live arena, by data pointer, so the ops below can refuse to read
# or write past a slot's committed tokens (the kernels cannot know what is committed).
_ARENA_VIEWS: dict[int, weakref.ref[KVArena]] = {}


def _forget_views(pointers: list[int], ref: weakref.ref) -> None:
    for pointer in pointers:
        if _ARENA_VIEWS.get(pointer) is ref:
            del _ARENA_VIEWS[pointer]


class KVArena:
    """A virtually contiguous KV cache: every slot's K/V reserved, memory mapped on demand.

    One reserved virtual range for keys and one for values hold ``max_num_seqs`` slots of
    ``max_model_len`` tokens in every layer; physical memory is mapped under a slot only
    by ``commit`` and given back by ``release``. Reserving far more than the machine's
    memory is fine: only committed tokens cost memory (``committed_bytes``).

    ``key_cache(layer)`` / ``value_cache(layer)`` are the views the contiguous ops read,
    in the layout of this module's docstring; they keep the reservation alive.

    Inside a slot, tiles of TOKEN_TILE tokens are outermost (then layers, then kv heads),
    so the memory under tokens ``[0, n)`` of a slot, in every layer, is one prefix of the
    slot's range: a commit is one mapping per reservation, rounded up to ``granularity``
    bytes (a 4 KiB page on the CPU, a 2 MiB granule on CUDA), and no page or granule is
    shared by two slots.

    Reading or writing a slot past its committed tokens is a caller bug: the checked ops
    below raise ValueError for it. Through ``torch.ops.pyllm`` directly it is harmless on
    the CPU: never-committed or released memory reads as zeros (and writes there are
    given back by the next ``release``).
    """

    def __init__(
        self,
        num_layers: int,
        max_num_seqs: int,
        max_model_len: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
            ("num_kv_heads", num_kv_heads),
        ):
            _positive_int(name, value)
        if max_model_len > 2**31 - 1:
            raise ValueError(f"max_model_len must fit int32, got {max_model_len}")
        _head_size(head_size)
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"dtype {dtype} is not supported; supported: float32, float16, bfloat16"
            )
        device = torch.device(device)
        if device.type == "cuda":
            if not BUILT_WITH_CUDA:
                raise ValueError(
                    f"device {device}: pyllm was built without CUDA kernels "
                    "(rebuild with PYLLM_TARGET=cuda)"
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise ValueError(f"device {device} is not supported; pyllm runs on cpu and cuda")
        self.num_layers, self.max_num_seqs, self.max_model_len = (
            num_layers,
            max_num_seqs,
            max_model_len,
        )
        self.num_kv_heads, self.head_size, self.dtype, self.device = (
            num_kv_heads,
            head_size,
            dtype,
            device,
        )
        self._arena = torch.classes.pyllm.KVArena(
            num_layers, max_num_seqs, max_model_len, num_kv_heads, head_size, dtype, device
        )
        self._key_caches = [self._arena.key_cache(layer) for layer in range(num_layers)]
        self._value_caches = [self._arena.value_cache(layer) for layer in range(num_layers)]
        # Committed tokens per slot, mirrored on the host for the ops' checks.
        self._committed = torch.zeros(max_num_seqs, dtype=torch.int64)
        ref = weakref.ref(self)
        pointers = [t.data_ptr() for t in (*self._key_caches, *self._value_caches)]
        for pointer in pointers:
            _ARENA_VIEWS[pointer] = ref
        weakref.finalize(self, _forget_views, pointers, ref)

    def _slot(self, slot: object) -> int:
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise TypeError(f"slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.max_num_seqs:
            raise ValueError(f"slot {slot} is outside [0, {self.max_num_seqs})")
        return slot

    def _layer(self, layer: object) -> int:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.num_layers})")
        return layer

    def key_cache(self, layer: int) -> torch.Tensor:
        """Layer's key view ``[max_num_seqs, num_kv_heads, num_tiles, head_size // x,
        TOKEN_TILE, x]``."""
        return self._key_caches[self._layer(layer)]

    def value_cache(self, layer: int) -> torch.Tensor:
        """Layer's value view ``[max_num_seqs, num_kv_heads, num_tiles, head_size,
        TOKEN_TILE]``."""
        return self._value_caches[self._layer(layer)]

    def commit(self, slot: int, num_tokens: int) -> int:
        """Maps memory under tokens ``[0, num_tokens)`` of the slot in every layer.

        Idempotent, never shrinks, and cheap when nothing new is needed (~10 us
        here); rounded up to whole pages/granules, so it may cover more tokens
        than asked: the return value, ``committed_tokens(slot)``, tells when the next
        call is due. Mapping costs what first-touching the memory costs (on this CPU
        about 1 GiB/s of page faults, so a 16-token tile of a 22-layer model, 704 KiB,
        takes ~0.6 ms); the Python thread that calls it lets others run meanwhile
        (measured), so an engine may commit ahead of need from a helper thread. Newly
        mapped memory holds zeros on the CPU and unspecified values on CUDA."""
        self._slot(slot)
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool):
            raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        if not 0 <= num_tokens <= self.max_model_len:
            raise ValueError(
                f"num_tokens {num_tokens} is outside [0, max_model_len = {self.max_model_len}]"
            )
        committed = int(self._arena.commit(slot, num_tokens))
        self._committed[slot] = committed
        return committed

    def release(self, slot: int, keep_tokens: int = 0) -> None:
        """Gives back the slot's memory past its first keep_tokens tokens (rounded up to
        whole pages/granules); 0, the default, gives back all of it (a finished or
        preempted sequence). Cost grows with the memory freed (on the CPU about 75 ms
        for 352 MiB): a new sequence may reuse a slot's committed memory instead, and
        keep_tokens trims a slot to a watermark."""
        self._slot(slot)
        if not isinstance(keep_tokens, int) or isinstance(keep_tokens, bool):
            raise TypeError(f"keep_tokens must be an int, got {type(keep_tokens).__name__}")
        if not 0 <= keep_tokens <= self.max_model_len:
            raise ValueError(
                f"keep_tokens {keep_tokens} is outside [0, max_model_len = {self.max_model_len}]"
            )
        self._arena.release(slot, keep_tokens)
        self._committed[slot] = int(self._arena.committed_tokens(slot))

    def committed_tokens(self, slot: int) -> int:
        """Tokens of the slot backed by memory in every layer (<= max_model_len)."""
        return int(self._arena.committed_tokens(self._slot(slot)))

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """Bytes (keys and values) that committing num_tokens tokens of one empty slot
        maps: whole tiles of every layer, rounded up to the granularity."""
        tiles = -(-num_tokens // TOKEN_TILE)
        element = self.dtype.itemsize
        tile_bytes = TOKEN_TILE * self.num_layers * self.num_kv_heads * self.head_size * element
        granularity = self.granularity
        return 2 * (-(-tiles * tile_bytes // granularity) * granularity)

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(key_cache, value_cache) of every layer."""
        return list(zip(self._key_caches, self._value_caches, strict=True))

    @property
    def committed_bytes(self) -> int:
        """Bytes of memory mapped under all slots, keys and values."""
        return int(self._arena.committed_bytes())

    @property
    def reserved_bytes(self) -> int:
        """Bytes of virtual address space reserved, keys and values."""
        return int(self._arena.reserved_bytes())

    @property
    def granularity(self) -> int:
        """Bytes per mapping unit: the page (CPU) or allocation granule (CUDA)."""
        return int(self._arena.granularity())

    def __repr__(self) -> str:
        return (
            f"KVArena(num_layers={self.num_layers}, max_num_seqs={self.max_num_seqs}, "
            f"max_model_len={self.max_model_len}, num_kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, dtype={self.dtype}, device={self.device}, "
            f"committed_bytes={self.committed_bytes}, reserved_bytes={self.reserved_bytes})"
        )


def _arena_of(key_cache: torch.Tensor) -> KVArena | None:
    """The live arena whose key view key_cache is, if any."""
    ref = _ARENA_VIEWS.get(key_cache.data_ptr())
    arena = ref() if ref is not None else None
    if arena is None or key_cache.stride() != arena._key_caches[0].stride():
        return None
    return arena


def _check_contiguous_kv_cache(
    key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int]:
    """Validates a contiguous-layout view pair; returns (max_num_seqs, num_kv_heads,
    num_tiles, head_size)."""
    _tensor("key_cache", key_cache)
    _tensor("value_cache", value_cache)
    _device("key_cache", key_cache, device)
    _device("value_cache", value_cache, device)
    _same_dtype("key_cache", key_cache, dtype)
    _same_dtype("value_cache", value_cache, dtype)
    _ndim(
        "key_cache",
        key_cache,
        6,
        "[max_num_seqs, num_kv_heads, num_tiles, head_size // x, TOKEN_TILE, x]",
    )
    _ndim(
        "value_cache",
        value_cache,
        5,
        "[max_num_seqs, num_kv_heads, num_tiles, head_size, TOKEN_TILE]",
    )
    num_slots, num_kv_heads, num_tiles, head_size, tile = value_cache.shape
    if tile != TOKEN_TILE:
        raise ValueError(f"value_cache's last dimension must be TOKEN_TILE = {TOKEN_TILE}")
    x = kv_cache_x(dtype)
    _shape(
        "key_cache",
        key_cache,
        (num_slots, num_kv_heads, num_tiles, head_size // x, TOKEN_TILE, x),
        f"(x = {x} for {dtype}, matching value_cache {tuple(value_cache.shape)})",
    )
    _head_size(head_size)
    if key_cache.stride()[3:] != (TOKEN_TILE * x, x, 1) or value_cache.stride()[3:] != (
        TOKEN_TILE,
        1,
    ):
        raise ValueError(
            "key_cache and value_cache must be dense inside each tile, got strides "
            f"{key_cache.stride()} and {value_cache.stride()}"
        )
    if key_cache.stride()[:3] != value_cache.stride()[:3] or min(key_cache.stride()[:3]) < 0:
        raise ValueError(
            "key_cache and value_cache must share their (slot, kv head, tile) strides, got "
            f"{key_cache.stride()} and {value_cache.stride()}"
        )
    return num_slots, num_kv_heads, num_tiles, head_size


def _check_committed(
    key_cache: torch.Tensor, slots: torch.Tensor, ends: torch.Tensor, what: str
) -> None:
    """Where key_cache is a KVArena view: every (slot, end) with slot >= 0 must have
    end <= the slot's committed tokens."""
    arena = _arena_of(key_cache)
    if arena is None or slots.numel() == 0:
        return
    slots, ends = slots.cpu().long(), ends.cpu().long()
    used = slots >= 0
    committed = arena._committed[slots.clamp(min=0)]
    bad = (used & (ends > committed)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"{what}[{i}] reaches token {int(ends[i])} of slot {int(slots[i])}, which has "
            f"{int(committed[i])} committed tokens (KVArena.commit the slot first)"
        )


def _check_seq_slots(
    seq_slots: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    num_slots: int,
    capacity: int,
    device: torch.device,
) -> None:
    _tensor("seq_slots", seq_slots)
    _tensor("seq_lens", seq_lens)
    _device("seq_slots", seq_slots, device)
    _device("seq_lens", seq_lens, device)
    _index_dtype("seq_slots", seq_slots, torch.int32)
    _index_dtype("seq_lens", seq_lens, torch.int32)
    _shape("seq_slots", seq_slots, (num_seqs,), "[num_seqs]")
    _shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs]")
    _contiguous("seq_slots", seq_slots)
    _contiguous("seq_lens", seq_lens)
    if num_seqs == 0:
        return
    lo, hi = int(seq_slots.min()), int(seq_slots.max())
    if lo < 0 or hi >= num_slots:
        raise ValueError(f"seq_slots must lie in [0, {num_slots}), got values in [{lo}, {hi}]")
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0 or hi > capacity:
        raise ValueError(
            f"seq_lens must lie in [0, {capacity}] (the slots' capacity), got values in "
            f"[{lo}, {hi}]"
        )


def _check_contiguous_attention(
    out, query, key_cache, value_cache, num_kv_heads, scale, seq_slots, seq_lens, num_seqs=None
) -> None:
    """Checks the arguments the contiguous decode and prefill share; num_seqs None
    means one sequence per query token (decode)."""
    num_tokens, _, head_size = _check_attention_io(out, query, num_kv_heads)
    num_seqs = num_tokens if num_seqs is None else num_seqs
    num_slots, cache_kv_heads, num_tiles, cache_head_size = _check_contiguous_kv_cache(
        key_cache, value_cache, query.dtype, query.device
    )
    if cache_kv_heads != num_kv_heads:
        raise ValueError(
            f"num_kv_heads is {num_kv_heads} but the cache holds {cache_kv_heads} kv heads"
        )
    if cache_head_size != head_size:
        raise ValueError(
            f"query head_size {head_size} does not match the cache's head_size {cache_head_size}"
        )
    _finite_float("scale", scale)
    _check_seq_slots(seq_slots, seq_lens, num_seqs, num_slots, num_tiles * TOKEN_TILE, query.device)
    _check_committed(key_cache, seq_slots, seq_lens, "seq_lens")


def write_kv_contiguous(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    token_slots: torch.Tensor,
    positions: torch.Tensor,
) -> None:
    """Writes each token's key/value into the contiguous cache at (slot, position).

    key, value: ``[num_tokens, num_kv_heads, head_size]``; key_cache/value_cache: one
    layer's views of the contiguous layout (``KVArena.key_cache(layer)``);
    token_slots: ``[num_tokens]`` int64, each token's sequence slot, -1 to skip the
    token (padding); positions: ``[num_tokens]`` int64, each token's position in its
    sequence (below the slots' capacity, and below the slot's committed tokens when the
    cache is a KVArena view).
    """
    _tensor("key", key)
    _tensor("value", value)
    _supported_device("key", key)
    _float_dtype("key", key)
    _ndim("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    _device("value", value, key.device)
    _same_dtype("value", value, key.dtype)
    _shape("value", value, key.shape, "(same as key)")
    _packed_rows("key", key)
    _packed_rows("value", value)
    num_slots, num_kv_heads, num_tiles, head_size = _check_contiguous_kv_cache(
        key_cache, value_cache, key.dtype, key.device
    )
    if tuple(key.shape[1:]) != (num_kv_heads, head_size):
        raise ValueError(
            f"key has {tuple(key.shape[1:])} [num_kv_heads, head_size] per token but the cache "
            f"holds ({num_kv_heads}, {head_size})"
        )
    num_tokens = key.shape[0]
    for name, t in (("token_slots", token_slots), ("positions", positions)):
        _tensor(name, t)
        _device(name, t, key.device)
        _index_dtype(name, t, torch.int64)
        _shape(name, t, (num_tokens,), "[num_tokens]")
        _contiguous(name, t)
    if num_tokens:
        lo, hi = int(token_slots.min()), int(token_slots.max())
        if lo < -1 or hi >= num_slots:
            raise ValueError(
                f"token_slots must lie in [-1, {num_slots}), got values in [{lo}, {hi}]"
            )
        written = positions[token_slots >= 0]
        capacity = num_tiles * TOKEN_TILE
        if written.numel() and (int(written.min()) < 0 or int(written.max()) >= capacity):
            raise ValueError(
                f"positions of written tokens must lie in [0, {capacity}) (the slots' "
                f"capacity), got values in [{int(written.min())}, {int(written.max())}]"
            )
        _check_committed(key_cache, token_slots, positions + 1, "positions")
    _C.write_kv_contiguous(key, value, key_cache, value_cache, token_slots, positions)


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
) -> None:
    """Decode attention over the contiguous cache: paged_attention_v1 with slots.

    out, query: ``[num_seqs, num_heads, head_size]``; key_cache/value_cache: one layer's
    contiguous views; seq_slots: ``[num_seqs]`` int32, each sequence's slot; seq_lens:
    ``[num_seqs]`` int32, cached tokens including this step's (at most the slot's
    committed tokens when the cache is a KVArena view); max_seq_len >= max(seq_lens).
    GQA/MQA when num_heads is a multiple of num_kv_heads.
    """
    _check_contiguous_attention(
        out, query, key_cache, value_cache, num_kv_heads, scale, seq_slots, seq_lens
    )
    _check_max_seq_len(max_seq_len, seq_lens)
    _C.contiguous_attention_decode(
        out, query, key_cache, value_cache, num_kv_heads, float(scale), seq_slots, seq_lens,
        max_seq_len,
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
) -> None:
    """Causal prefill over the contiguous cache: paged_attention_prefill with slots.

    out, query: ``[num_tokens, num_heads, head_size]``, the query tokens of all sequences
    back to back; query_start_loc: ``[num_seqs + 1]`` int32 offsets into them;
    seq_slots, seq_lens: ``[num_seqs]`` int32. Query token i of sequence s sits at
    position ``seq_lens[s] - q_len_s + i`` and attends to the cached keys up to its own
    (written first by write_kv_contiguous): prompts, later chunks of a chunked prefill.
    """
    num_tokens, _, _ = _check_attention_io(out, query, num_kv_heads)
    num_seqs = _query_start_loc(query_start_loc, query.device)
    _check_contiguous_attention(
        out, query, key_cache, value_cache, num_kv_heads, scale, seq_slots, seq_lens, num_seqs
    )
    _check_query_lens(query_start_loc, seq_lens, num_tokens, max_query_len)
    _C.contiguous_attention_prefill(
        out, query, key_cache, value_cache, num_kv_heads, float(scale), seq_slots, seq_lens,
        query_start_loc, max_query_len,
    )  # fmt: skip
