"""KVCacheManager: what the scheduler and the engine ask of the KV cache's bookkeeping.

Three implementations: BlockManager (the paged cache: block tables, prefix caching),
HybridBlockManager (the same with the layers in KV groups sharing one pool, so
sliding-window layers give back the blocks behind their window) and
SlotManager (the contiguous cache: one arena slot per sequence, no prefix caching).
Scheduling and preemption only go through these methods, so they are the same in both
modes. `allocate_kv_cache` builds a cache and its manager (the engine's, and a draft
model's for speculative decoding).
"""

from __future__ import annotations

from typing import Protocol

from pyllm.attention.backend import KVCache
from pyllm.attention.paged import kv_groups
from pyllm.attention.registry import get_backend
from pyllm.engine.block_manager import BlockManager
from pyllm.engine.hybrid_block_manager import HybridBlockManager
from pyllm.engine.sequence import Sequence
from pyllm.engine.slot_manager import SlotManager


class KVCacheManager(Protocol):
    # Prompt tokens admitted with prefix caching on, and of those, the tokens served from
    # the cache (both stay 0 without it). The manager counts them itself.
    prefix_cache_queries: int
    prefix_cache_hits: int

    def describe(self) -> str:
        """The cache's layout and size, for the engine's start-up log line."""
        ...

    def usage(self) -> float:
        """Share of the cache in use (0 to 1)."""
        ...

    def committed_bytes(self) -> int:
        """Physical KV memory held now."""
        ...

    def block_counts(self) -> tuple[int, int] | None:
        """(free, total) blocks, or None where the cache is not made of blocks."""
        ...

    def check_fits(self, num_tokens: int) -> None:
        """Raises ParamError if one sequence of num_tokens could never be held."""
        ...

    def match_prefix(self, seq: Sequence) -> None:
        """On a sequence's first schedule: reuse what the cache already holds of its
        prompt (seq.num_computed_tokens moves past it)."""
        ...

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool: ...

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Makes room for num_new_tokens more of seq's tokens (can_append must hold)."""
        ...

    def register_computed_blocks(self, seq: Sequence) -> None:
        """After a step: offers seq's newly computed tokens to later prompts."""
        ...

    def trim(self, seq: Sequence) -> None:
        """Releases what seq holds past its computed tokens: the room of rejected
        proposed tokens (speculative decoding), whose KV is garbage."""
        ...

    def free(self, seq: Sequence) -> None:
        """Releases seq's memory (finished, aborted or preempted)."""
        ...


def allocate_kv_cache(
    model,
    layout: str,
    budget: int,
    block_size: int,
    max_num_seqs: int,
    prefix_caching: bool,
    max_num_batched_tokens: int = 0,
) -> tuple[KVCache, KVCacheManager]:
    """model's KV cache in `layout` (an attention backend's name) within budget bytes,
    and the manager that hands out its memory: blocks, or one slot per sequence (at
    most max_num_seqs). max_num_batched_tokens > 0 (the paged layout): sliding-window
    layers hold only their window, in KV groups sharing one pool (HybridBlockManager)."""
    backend = get_backend(layout)
    if max_num_batched_tokens:
        count = backend.group_cache_size(model.cache_spec, budget, block_size,
                                         max_num_batched_tokens)  # fmt: skip
        if count is not None:
            return _grouped_cache(
                model, backend, count, block_size, prefix_caching, max_num_batched_tokens
            )
    count = backend.cache_size(model.cache_spec, budget, block_size, max_num_seqs)
    cache = model.allocate_kv_cache(backend, count, block_size)
    if backend.addressing == "slots":
        # Virtual room for count sequences; only `budget` bytes of it are ever
        # committed at once (SlotManager keeps to that).
        return cache, SlotManager(cache.memory, budget)
    block_bytes = sum(t.nbytes for layer in cache.layers for t in layer) // count
    return cache, BlockManager(count, block_size, prefix_caching, block_bytes=block_bytes)


def _grouped_cache(model, backend, count, block_size, prefix_caching, max_num_batched_tokens):
    """Sliding-window layers: every KV group's blocks from one pool of count blocks."""
    windows = model.cache_spec.layer_windows
    cache = model.allocate_kv_cache(backend, count, block_size, grouped=True)
    _, positions, windowed = kv_groups(windows)
    # Layers share tensors: count each once (an int8 cache's scales too).
    tensors = {layer[0].data_ptr(): sum(t.nbytes for t in layer) for layer in cache.layers}
    pool = BlockManager(count, block_size, prefix_caching,
                        block_bytes=sum(tensors.values()) // count)  # fmt: skip
    manager = HybridBlockManager(
        pool, windowed, max(windows), max_num_batched_tokens, max(positions) + 1
    )
    return cache, manager
