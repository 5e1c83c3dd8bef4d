"""AttentionBackend: everything a KV-cache layout decides, in one object per layout.

A backend builds and checks a step's metadata, writes the step's keys and values and
runs prefill and decode attention over them, allocates its cache, and packs its
metadata for the tensor-parallel step protocol. The model, the model runner and the
protocol call these methods and never ask which layout they hold.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from pyllm.attention.metadata import AttentionMetadata, verify_rows

# One layer's (key_cache, value_cache), then (k_scale, v_scale) for an int8 cache.
KVPair = tuple[torch.Tensor, ...]
# Which of its caller's caches a KVCache is: tensor-parallel ranks keep theirs by it.
MAIN_CACHE, SCRATCH_CACHE = 0, 1


class ScheduledSequence(Protocol):
    """What a backend reads of a scheduled sequence (pyllm.engine.sequence.Sequence)."""

    num_computed_tokens: int
    num_prompt_tokens: int
    block_table: list[int]
    group_block_tables: list[list[int]]
    kv_slot: int | None


class AttentionLayer(Protocol):
    """What a backend reads of the attention layer it runs (pyllm.model.layers.Attention)."""

    num_kv_heads: int
    scale: float
    sliding_window: int  # 0: none
    sinks: torch.Tensor | None  # float32 [num_heads]: a logit per head with no value


@dataclass(frozen=True)
class CacheSpec:
    """One rank's cache geometry, as the model needs it."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (0: none); () all 0
    kv_cache_dtype: str = "auto"  # or "int8" (pyllm.kv_cache.KV_CACHE_DTYPES)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The cache tensors' element type."""
        return torch.int8 if self.kv_cache_dtype == "int8" else self.dtype


@dataclass
class KVCache:
    """One allocated cache: every layer's (key_cache, value_cache) in its backend's
    layout, what holds their memory where the backend tracks it (the contiguous
    layout's KVArena), and which of its caller's caches it is. layer_groups: each
    layer's KV group, where layers share block tensors by group (the metadata's
    `group(g)` addresses group g's blocks); () where every layer is in one group."""

    backend: AttentionBackend
    layers: list[KVPair]
    memory: Any = None
    cache_id: int = MAIN_CACHE
    layer_groups: tuple[int, ...] = ()

    @property
    def num_groups(self) -> int:
        return max(self.layer_groups, default=0) + 1


def kv_scales(kv_cache: KVPair) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One layer's (k_scale, v_scale): an int8 cache's, else (None, None)."""
    return (kv_cache[2], kv_cache[3]) if len(kv_cache) == 4 else (None, None)


class AttentionBackend(ABC):
    name: ClassVar[str]  # the engine's kv_cache option
    metadata_cls: ClassVar[type[AttentionMetadata]]
    # How sequences are addressed, which picks the engine's KV bookkeeping: "blocks"
    # (block tables) or "slots" (one slot per sequence).
    addressing: ClassVar[str]

    # ---------------------------------------------------------- step metadata

    def build(
        self,
        prefills: list[tuple[ScheduledSequence, int]],
        decodes: list[tuple[ScheduledSequence, int]],
        block_size: int,
        device: torch.device,
        num_groups: int = 1,
    ) -> AttentionMetadata:
        """The metadata of a step of (sequence, tokens) prefill chunks, then decodes
        (num_groups: the cache's KV groups)."""
        slot_mapping = []
        for seq, n in prefills + decodes:
            slot_mapping.extend(self.token_slots(seq, n, block_size))
        fields = _step_fields(prefills, decodes, slot_mapping, device)
        layout = self.sequence_fields([s for s, _ in prefills], [s for s, _ in decodes], device)
        meta = self.metadata_cls(**fields, **layout)
        self.add_verify_rows(meta)
        return meta

    def add_verify_rows(self, meta: AttentionMetadata) -> None:
        """meta's verify rows (metadata.verify_rows) and their addressing in this layout."""
        seqs = verify_rows(meta)
        if seqs is not None:
            self.address_verify_rows(meta, seqs)

    @abstractmethod
    def address_verify_rows(self, meta: AttentionMetadata, seqs: torch.Tensor) -> None:
        """Sets this layout's addressing of each verify row: that of its prefill
        sequence seqs[i]."""

    @abstractmethod
    def token_slots(self, seq: ScheduledSequence, n: int, block_size: int) -> list[int]:
        """slot_mapping's entries for seq's next n tokens."""

    @abstractmethod
    def sequence_fields(
        self,
        prefills: list[ScheduledSequence],
        decodes: list[ScheduledSequence],
        device: torch.device,
    ) -> dict:
        """The metadata fields that say where each sequence's cached tokens are."""

    @abstractmethod
    def cache_heads(self, kv_cache: KVPair) -> tuple[int, int]:
        """(num_kv_heads, head_size) of one layer's cache; ValueError if the shape is not
        this layout's."""

    @abstractmethod
    def validate(self, meta: AttentionMetadata, kv_cache: KVPair, device: torch.device) -> None:
        """Checks meta's shapes, dtypes and index ranges against one layer's cache (every
        layer's is alike); raises ValueError naming the field."""

    def validate_cache(self, meta: AttentionMetadata, cache: KVCache, device) -> None:
        """validate against the cache's layers (a layout with layer_groups checks each
        group's part)."""
        self.validate(meta, cache.layers[0], device)

    # -------------------------------------------------------------- attention

    def workspace(
        self, meta: AttentionMetadata, num_heads: int, head_size: int, dtype, device
    ) -> Any:
        """Scratch memory the step's layers share (None: none needed)."""
        return None

    @abstractmethod
    def forward(
        self,
        layer: AttentionLayer,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVPair,
        meta: AttentionMetadata,
        workspace: Any,
    ) -> None:
        """Writes the step's keys and values into kv_cache, then out [T, Hq, D] =
        attention of q [T, Hq, D] over every cached token of its sequence (k, v:
        [T, Hkv, D]); prefill tokens causally, decode tokens over the whole sequence."""

    # ------------------------------------------------------------------ cache

    @abstractmethod
    def cache_size(
        self, spec: CacheSpec, budget_bytes: int, block_size: int, max_num_seqs: int
    ) -> int:
        """allocate's count for a cache of budget_bytes (or, for a cache that commits
        memory as it goes, of room for max_num_seqs sequences)."""

    def group_cache_size(
        self, spec: CacheSpec, budget_bytes: int, block_size: int, max_num_batched_tokens: int
    ) -> int | None:
        """allocate's count with grouped=True, where this layout groups layers so that
        sliding-window layers free blocks behind the window; None: every layer alike."""
        return None

    @abstractmethod
    def allocate(
        self,
        spec: CacheSpec,
        count: int,
        block_size: int,
        cache_id: int = MAIN_CACHE,
        grouped: bool = False,
    ) -> KVCache:
        """A cache of count units: blocks of block_size tokens, or sequence slots;
        grouped (a layout that supports it): the layers in KV groups that share one
        pool of blocks (pyllm.attention.paged.kv_groups)."""

    # ---------------------------------------------------- tensor-parallel step

    @abstractmethod
    def pack(
        self, meta: AttentionMetadata, cache: KVCache
    ) -> tuple[tuple[int, int], list[torch.Tensor]]:
        """What rank 0 sends beyond the fields every layout has: two sizes for the
        header and integer tensors for the payload."""

    @abstractmethod
    def unpack(
        self,
        fields: dict,
        sizes: tuple[int, int],
        take: Callable[..., torch.Tensor],
        cache: KVCache,
    ) -> AttentionMetadata:
        """The metadata pack sent (fields: every layout's; take(n, dtype) reads the
        payload's next n values); brings this rank's cache to rank 0's state first."""


def _step_fields(
    prefills: list[tuple[ScheduledSequence, int]],
    decodes: list[tuple[ScheduledSequence, int]],
    slot_mapping: list[int],
    device: torch.device,
) -> dict:
    """AttentionMetadata's fields for a step of prefill chunks then decode tokens."""
    prefill_lens = [s.num_computed_tokens + n for s, n in prefills]
    decode_lens = [s.num_computed_tokens + 1 for s, _ in decodes]
    query_start_loc = list(itertools.accumulate((n for _, n in prefills), initial=0))
    prompt_chunks = itertools.takewhile(
        lambda chunk: chunk[0].num_computed_tokens + chunk[1] <= chunk[0].num_prompt_tokens,
        prefills,
    )

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return {
        "slot_mapping": torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        "num_prefill_tokens": query_start_loc[-1],
        "num_prompt_tokens": sum(n for _, n in prompt_chunks),
        "prefill_query_start_loc": int32(query_start_loc),
        "prefill_seq_lens": int32(prefill_lens),
        "max_query_len": max((n for _, n in prefills), default=0),
        "decode_seq_lens": int32(decode_lens),
        "max_decode_seq_len": max(decode_lens, default=0),
    }
