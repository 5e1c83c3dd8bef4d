"""The paged KV cache (vLLM's PagedAttention): a pool of blocks of block_size tokens,
each sequence's blocks listed in its block table.

A token's slot is block_table[position // block_size] * block_size + position %
block_size; reshape_and_cache writes it there, paged_attention_prefill runs prompt
tokens and paged_attention_v1/v2 decode tokens.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

import pyllm.ops as ops
from pyllm import _C  # the per-layer ops, bound directly (csrc/torch_bindings.cpp)
from pyllm.attention.backend import (
    MAIN_CACHE,
    AttentionBackend,
    CacheSpec,
    KVCache,
    KVPair,
    ScheduledSequence,
    kv_scales,
)
from pyllm.attention.metadata import AttentionMetadata, index_tensor
from pyllm.kv_cache import allocate_kv_cache, allocate_kv_scales, kv_token_bytes

# Decode attention switches from paged_attention_v1 (one pass per sequence and head)
# to v2 (partitions of ops.PARTITION_SIZE tokens, merged after) past this context
# length. Measured on 2 CPU cores with SmolLM2's 9/3 heads, 1-32 sequences,
# contexts 128-16384: v1 and v2 within noise of each other (v1 already spreads
# sequences x heads over the cores), so the CPU switches only for very long contexts.
V2_MIN_SEQ_LEN = 8192
# A GPU needs hundreds of (sequence, head) pairs in flight to fill its SMs; with fewer,
# splitting each sequence into partitions is what keeps it busy.
CUDA_V2_MAX_SEQ_HEADS = 512


@dataclass(slots=True)
class PagedMetadata(AttentionMetadata):
    """slot_mapping: slot = block_number * block_size + offset (-1 skips).
    prefill_block_tables [P, B] int32 and decode_block_tables [D, B'] int32: each
    sequence's blocks, padded (only the entries that cover cached tokens are read).
    groups: for a cache whose layers are in KV groups, the step as groups 1.. address
    it (their slot_mapping and block tables; the rest shared); this is group 0's."""

    prefill_block_tables: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    verify_block_tables: torch.Tensor | None = None  # [V, B]: each verify row's table
    groups: list[PagedMetadata] | None = None

    def group(self, g: int) -> PagedMetadata:
        return self.groups[g - 1] if g else self

    @property
    def backend(self) -> PagedBackend:
        return PAGED


def use_v2(meta: AttentionMetadata, num_heads: int, device: torch.device) -> bool:
    """Whether this step's decode attention (its verify rows' too) runs
    paged_attention_v2 (see V2_MIN_SEQ_LEN)."""
    if meta.max_decode_seq_len <= ops.PARTITION_SIZE:
        return False  # one partition: v2 would only add the merge
    if meta.max_decode_seq_len > V2_MIN_SEQ_LEN:
        return True
    few_pairs = _decode_rows(meta) * num_heads <= CUDA_V2_MAX_SEQ_HEADS
    return device.type == "cuda" and few_pairs


def _decode_rows(meta: AttentionMetadata) -> int:
    """Rows of the step's largest decode attention call: its decodes or its verify rows."""
    return max(meta.num_decode_tokens, meta.num_verify_tokens)


def _padded_block_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(tables), width)


def _token_slots(table: list[int], start: int, n: int, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(start, start + n)]


class PagedBackend(AttentionBackend):
    name = "paged"
    addressing = "blocks"
    metadata_cls = PagedMetadata

    # ---------------------------------------------------------- step metadata

    def build(self, prefills, decodes, block_size, device, num_groups=1) -> PagedMetadata:
        meta = super().build(prefills, decodes, block_size, device)
        if num_groups > 1:
            seqs = prefills + decodes
            meta.groups = [
                _group_metadata(meta, seqs, g, block_size, device) for g in range(num_groups - 1)
            ]
            self.add_verify_rows(meta)  # the groups' own tables
        return meta

    def address_verify_rows(self, meta: PagedMetadata, seqs: torch.Tensor) -> None:
        for part in (meta, *(meta.groups or ())):
            part.num_prompt_seqs, part.verify_seq_lens = meta.num_prompt_seqs, meta.verify_seq_lens
            part.max_decode_seq_len = meta.max_decode_seq_len
            part.verify_block_tables = part.prefill_block_tables.index_select(0, seqs)

    def token_slots(self, seq: ScheduledSequence, n: int, block_size: int) -> list[int]:
        return _token_slots(seq.block_table, seq.num_computed_tokens, n, block_size)

    def sequence_fields(self, prefills, decodes, device) -> dict:
        return {
            "prefill_block_tables": _padded_block_tables([s.block_table for s in prefills], device),
            "decode_block_tables": _padded_block_tables([s.block_table for s in decodes], device),
        }

    def cache_heads(self, kv_cache: KVPair) -> tuple[int, int]:
        # The ops check the caches' layout; the shape says what the step may address.
        value_cache = kv_cache[1]
        if value_cache.dim() != 4:
            raise ValueError(
                "value_cache must be 4-D [num_blocks, num_kv_heads, head_size, block_size], "
                f"got shape {tuple(value_cache.shape)}"
            )
        return value_cache.shape[1], value_cache.shape[2]

    def validate(self, meta: PagedMetadata, kv_cache: KVPair, device: torch.device) -> None:
        num_blocks, _, _, block_size = kv_cache[1].shape
        meta.check_tokens(device)
        T, P = meta.num_tokens, meta.num_prefill_tokens
        slots = meta.slot_mapping
        if T and (int(slots.min()) < -1 or int(slots.max()) >= num_blocks * block_size):
            raise ValueError(
                f"slot_mapping values must lie in [-1, {num_blocks * block_size}), got "
                f"{int(slots.min())}..{int(slots.max())}"
            )
        if P:
            _check_prefill(meta, num_blocks, block_size, device)
        if T - P:
            seq_lens = _check_tables(meta, "decode", T - P, num_blocks, block_size, device)
            if int(seq_lens.min()) < 1 or int(seq_lens.max()) > meta.max_decode_seq_len:
                raise ValueError(
                    f"decode_seq_lens must lie in [1, max_decode_seq_len="
                    f"{meta.max_decode_seq_len}], got {int(seq_lens.min())}..{int(seq_lens.max())}"
                )

    # -------------------------------------------------------------- attention

    def workspace(self, meta, num_heads, head_size, dtype, device):
        """The step's scratch for paged_attention_v2 (shared by all layers), or None for v1."""
        rows = _decode_rows(meta)
        if not rows or not use_v2(meta, num_heads, torch.device(device)):
            return None
        partitions = -(-meta.max_decode_seq_len // ops.PARTITION_SIZE)
        shape = (rows, num_heads, partitions)
        return (
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty((*shape, head_size), dtype=dtype, device=device),
        )

    def validate_cache(self, meta: PagedMetadata, cache: KVCache, device) -> None:
        """Each KV group's part against the cache (every layer's tensors are alike)."""
        num_groups = cache.num_groups
        if num_groups > 1 and len(meta.groups or ()) != num_groups - 1:
            raise ValueError(
                f"the cache has {num_groups} KV groups: the metadata needs groups for "
                f"{num_groups - 1} of them"
            )
        for g in range(num_groups):
            self.validate(meta.group(g), cache.layers[0], device)

    def forward(self, layer, out, q, k, v, positions, kv_cache, meta, workspace) -> None:
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        k_scale, v_scale = kv_scales(kv_cache)
        dtype = "auto" if k_scale is None else "int8"
        _C.reshape_and_cache(
            k, v, key_cache, value_cache, meta.slot_mapping, dtype, k_scale, v_scale
        )
        caches = (layer, key_cache, value_cache, k_scale, v_scale, meta.max_decode_seq_len)
        rows, tables, lens, starts = meta.prompt_part(meta.prefill_block_tables)
        if rows:
            _C.paged_attention_prefill(
                out[:rows], q[:rows], key_cache, value_cache, layer.num_kv_heads, layer.scale,
                tables, lens, starts, value_cache.shape[3], meta.max_query_len, None,
                layer.sliding_window, layer.sinks, k_scale, v_scale,
            )  # fmt: skip
        parts = meta.decode_parts(meta.verify_block_tables, meta.decode_block_tables)
        for first, last, tables, lens in parts:
            _decode(*caches, out[first:last], q[first:last], tables, lens, workspace)

    # ------------------------------------------------------------------ cache

    def block_bytes(self, spec: CacheSpec, block_size: int) -> int:
        """Bytes one block takes across all layers (keys and values, and an int8 cache's
        scales)."""
        token = kv_token_bytes(spec.head_size, spec.dtype, spec.kv_cache_dtype)
        return spec.num_layers * spec.num_kv_heads * block_size * token

    def cache_size(self, spec, budget_bytes, block_size, max_num_seqs) -> int:
        """The blocks budget_bytes holds."""
        per_block = self.block_bytes(spec, block_size)
        num_blocks = int(budget_bytes // per_block)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory of {budget_bytes / 2**30:.3f} GiB holds no block of "
                f"{per_block} bytes"
            )
        return num_blocks

    def group_cache_size(self, spec, budget_bytes, block_size, max_num_batched_tokens):
        """The blocks budget_bytes holds where the layers are in KV groups (kv_groups),
        each block one group's tokens; None where the model has no sliding-window layer.
        Raises ValueError where one step (a chunk of max_num_batched_tokens with its
        window in each window group, a block per global group) cannot fit."""
        windows = [w for w in spec.layer_windows if w]
        if not windows:
            return None
        _, positions, windowed = kv_groups(spec.layer_windows)
        per_block = self.block_bytes(spec, block_size) // spec.num_layers * (max(positions) + 1)
        count = int(budget_bytes // per_block)
        step = window_blocks(max(windows), max_num_batched_tokens, block_size)
        need = 1 + step * sum(windowed) + windowed.count(False)  # and the null block
        if count < need:
            raise ValueError(
                f"kv_cache_memory holds {count} KV blocks; one step of max_num_batched_tokens="
                f"{max_num_batched_tokens} with its window of {max(windows)} needs {need}"
            )
        return count

    def allocate(self, spec, count, block_size, cache_id=MAIN_CACHE, grouped=False) -> KVCache:
        """count blocks of block_size tokens in every layer (an int8 cache's scales
        alike); grouped: the layers in KV groups (kv_groups), layer i on block tensors
        positions[i], which every group shares."""

        def pair():
            kv = allocate_kv_cache(
                count, spec.num_kv_heads, spec.head_size, block_size, spec.cache_dtype, spec.device
            )
            if spec.kv_cache_dtype != "int8":
                return kv
            return (*kv, *allocate_kv_scales((count, spec.num_kv_heads, block_size), spec.device))

        if not grouped:
            return KVCache(self, [pair() for _ in range(spec.num_layers)], cache_id=cache_id)
        groups, positions, _ = kv_groups(spec.layer_windows)
        tensors = [pair() for _ in range(max(positions) + 1)]
        layers = [tensors[p] for p in positions]
        return KVCache(self, layers, cache_id=cache_id, layer_groups=groups)

    # ---------------------------------------------------- tensor-parallel step

    def pack(self, meta: PagedMetadata, cache: KVCache):
        """The block tables, flattened; their widths go in the header."""
        tables = [meta.prefill_block_tables, meta.decode_block_tables]
        sizes = (tables[0].shape[1], tables[1].shape[1])
        # Every group's tables are as wide as group 0's: one entry per block.
        for part in meta.groups or ():
            tables += [part.slot_mapping, part.prefill_block_tables, part.decode_block_tables]
        return sizes, [t.reshape(-1) for t in tables]

    def unpack(self, fields, sizes, take, cache) -> PagedMetadata:
        (nP,), (nD,) = fields["prefill_seq_lens"].shape, fields["decode_seq_lens"].shape
        prefill_width, decode_width = sizes
        meta = PagedMetadata(
            **fields,
            prefill_block_tables=take(nP * prefill_width).view(nP, prefill_width),
            decode_block_tables=take(nD * decode_width).view(nD, decode_width),
        )
        if cache.num_groups > 1:
            meta.groups = [
                dataclasses.replace(
                    meta,
                    slot_mapping=take(meta.num_tokens, torch.int64),
                    prefill_block_tables=take(nP * prefill_width).view(nP, prefill_width),
                    decode_block_tables=take(nD * decode_width).view(nD, decode_width),
                )
                for _ in range(cache.num_groups - 1)
            ]
        self.add_verify_rows(meta)
        return meta


def window_blocks(sliding_window: int, num_tokens: int, block_size: int) -> int:
    """Blocks a window layer holds for one sequence while num_tokens of it run in a
    step: theirs and the window before them, at any alignment."""
    return -(-(sliding_window - 1 + num_tokens) // block_size) + 1


def kv_groups(layer_windows: tuple[int, ...]):
    """The layers in KV groups of equal size, gcd(#global, #window layers): global
    groups first, then window groups, each layers in order. Returns (each layer's group,
    its position in the group, whether each group windows). Group g's layer at position
    p uses block tensors p: every group's blocks come from one pool."""
    full = [i for i, w in enumerate(layer_windows) if not w]
    window = [i for i, w in enumerate(layer_windows) if w]
    size = math.gcd(len(full), len(window))
    groups, positions, windowed = [0] * len(layer_windows), [0] * len(layer_windows), []
    for kind, layers in ((False, full), (True, window)):
        for start in range(0, len(layers), size):
            for p, i in enumerate(layers[start : start + size]):
                groups[i], positions[i] = len(windowed), p
            windowed.append(kind)
    return tuple(groups), tuple(positions), tuple(windowed)


def _group_metadata(meta: PagedMetadata, seqs, g: int, block_size: int, device) -> PagedMetadata:
    """meta's step in KV group g + 1: the same tokens and lengths, the sequences'
    group_block_tables[g] (prefill sequences first, as in meta)."""
    slots: list[int] = []
    num_prefills = meta.prefill_seq_lens.shape[0]
    tables = [seq.group_block_tables[g] for seq, _ in seqs]
    for (seq, n), table in zip(seqs, tables, strict=True):
        slots += _token_slots(table, seq.num_computed_tokens, n, block_size)
    return dataclasses.replace(
        meta,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        prefill_block_tables=_padded_block_tables(tables[:num_prefills], device),
        decode_block_tables=_padded_block_tables(tables[num_prefills:], device),
    )


def _decode(
    layer, key_cache, value_cache, k_scale, v_scale, max_len, out, q, tables, lens, workspace
) -> None:
    """Rows that each attend over their sequence up to lens[i] (decode tokens, verify
    rows): v1, or v2 where the step has a workspace."""
    block_size = value_cache.shape[3]
    if workspace is None:
        _C.paged_attention_v1(
            out, q, key_cache, value_cache, layer.num_kv_heads, layer.scale, tables, lens,
            block_size, max_len, None, layer.sliding_window, layer.sinks, k_scale, v_scale,
        )  # fmt: skip
        return
    exp_sums, max_logits, tmp_out = (w[: q.shape[0]] for w in workspace)
    _C.paged_attention_v2(
        out, exp_sums, max_logits, tmp_out, q, key_cache, value_cache,
        layer.num_kv_heads, layer.scale, tables, lens, block_size, max_len, None,
        layer.sliding_window, layer.sinks, k_scale, v_scale,
    )  # fmt: skip


def _check_prefill(meta: PagedMetadata, num_blocks: int, block_size: int, device) -> None:
    P = meta.num_prefill_tokens
    qsl = index_tensor(
        "prefill_query_start_loc", meta.prefill_query_start_loc, torch.int32, 1, device
    )
    num_seqs = qsl.shape[0] - 1
    seq_lens = _check_tables(meta, "prefill", num_seqs, num_blocks, block_size, device)
    q_lens = qsl[1:] - qsl[:-1]
    if num_seqs < 1 or int(qsl[0]) != 0 or int(qsl[-1]) != P or int(q_lens.min()) < 1:
        raise ValueError(
            f"prefill_query_start_loc must rise from 0 to num_prefill_tokens ({P}), "
            f"got {qsl.tolist()}"
        )
    if int(q_lens.max()) > meta.max_query_len or bool((q_lens > seq_lens).any()):
        raise ValueError(
            f"each prefill query length must be <= max_query_len ({meta.max_query_len}) "
            "and <= its prefill_seq_lens entry"
        )


def _check_tables(
    meta: PagedMetadata, part: str, num_seqs: int, num_blocks: int, block_size: int, device
) -> torch.Tensor:
    """part's seq_lens and block tables: one row per sequence, lengths within the table,
    block numbers within the cache; returns the seq_lens."""
    seq_lens = index_tensor(
        f"{part}_seq_lens", getattr(meta, f"{part}_seq_lens"), torch.int32, 1, device
    )
    tables = index_tensor(
        f"{part}_block_tables", getattr(meta, f"{part}_block_tables"), torch.int32, 2, device
    )
    if seq_lens.shape[0] != num_seqs or tables.shape[0] != num_seqs:
        raise ValueError(
            f"{part}_seq_lens {tuple(seq_lens.shape)} and {part}_block_tables "
            f"{tuple(tables.shape)} must have {num_seqs} rows (one per {part} sequence)"
        )
    if int(seq_lens.max()) > tables.shape[1] * block_size:
        raise ValueError(
            f"{part}_seq_lens reach {int(seq_lens.max())} but {part}_block_tables holds "
            f"{tables.shape[1]} blocks of {block_size} tokens"
        )
    # Only the table entries that cover cached tokens are read.
    used = torch.arange(tables.shape[1], device=device)[None, :] * block_size < seq_lens[:, None]
    entries = tables[used]
    if entries.numel() and (int(entries.min()) < 0 or int(entries.max()) >= num_blocks):
        raise ValueError(
            f"{part}_block_tables holds block numbers outside [0, {num_blocks}): "
            f"{int(entries.min())}..{int(entries.max())}"
        )
    return seq_lens


PAGED = PagedBackend()
