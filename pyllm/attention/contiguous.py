"""The contiguous KV cache (pyllm.kv_cache.KVArena): each sequence owns one arena slot
of max_model_len tokens, virtually contiguous, with memory mapped under it as it grows.

A sequence is addressed by its slot and a token by its position in it, so there are no
block tables: write_kv_contiguous writes the step's keys and values, and
contiguous_attention_prefill / _decode run prompt and decode tokens (the decode op
splits long contexts by itself, so no step needs a workspace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyllm import _C  # the per-layer ops, bound directly (csrc/torch_bindings.cpp)
from pyllm.attention.backend import (
    MAIN_CACHE,
    AttentionBackend,
    KVCache,
    KVPair,
    ScheduledSequence,
    kv_scales,
)
from pyllm.attention.metadata import AttentionMetadata, index_tensor
from pyllm.kv_cache import KVArena


@dataclass(slots=True)
class ContiguousMetadata(AttentionMetadata):
    """slot_mapping: each token's sequence slot (-1 skips; the token's position in the
    slot is its position). prefill_seq_slots [P] / decode_seq_slots [D] int32: each
    sequence's slot."""

    prefill_seq_slots: torch.Tensor | None = None
    decode_seq_slots: torch.Tensor | None = None
    verify_seq_slots: torch.Tensor | None = None  # [V]: each verify row's slot

    @property
    def backend(self) -> ContiguousBackend:
        return CONTIGUOUS


def _seq_slots(seqs: list[ScheduledSequence], device: torch.device) -> torch.Tensor:
    return torch.tensor([s.kv_slot for s in seqs], dtype=torch.int32, device=device)


class ContiguousBackend(AttentionBackend):
    name = "contiguous"
    addressing = "slots"
    metadata_cls = ContiguousMetadata

    # ---------------------------------------------------------- step metadata

    def token_slots(self, seq: ScheduledSequence, n: int, block_size: int) -> list[int]:
        return [seq.kv_slot] * n

    def sequence_fields(self, prefills, decodes, device) -> dict:
        return {
            "prefill_seq_slots": _seq_slots(prefills, device),
            "decode_seq_slots": _seq_slots(decodes, device),
        }

    def address_verify_rows(self, meta: ContiguousMetadata, seqs: torch.Tensor) -> None:
        meta.verify_seq_slots = meta.prefill_seq_slots.index_select(0, seqs)

    def cache_heads(self, kv_cache: KVPair) -> tuple[int, int]:
        # Arena views: [slots, kv_heads, tiles, ...]; the op wrappers check the rest.
        key_cache, value_cache = kv_cache[:2]
        return key_cache.shape[1], value_cache.shape[3]

    def validate(self, meta: ContiguousMetadata, kv_cache: KVPair, device) -> None:
        """Slots in [0, num_slots) (-1 skips a token), sequence lengths within a slot's
        capacity."""
        key_cache = kv_cache[0]
        num_slots, slot_capacity = key_cache.shape[0], key_cache.shape[2] * key_cache.shape[4]
        meta.check_tokens(device)
        T, P = meta.num_tokens, meta.num_prefill_tokens
        slots = meta.slot_mapping
        if T and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
            raise ValueError(f"slot_mapping (token slots) must lie in [-1, {num_slots})")
        for part, count in (("prefill", P and meta.prefill_query_start_loc.shape[0] - 1),
                            ("decode", T - P)):  # fmt: skip
            if count:
                _check_part(meta, part, count, num_slots, slot_capacity, device)

    # -------------------------------------------------------------- attention

    def forward(self, layer, out, q, k, v, positions, kv_cache, meta, workspace) -> None:
        key_cache, value_cache = kv_cache[:2]
        k_scale, v_scale = kv_scales(kv_cache)
        _C.write_kv_contiguous(
            k, v, key_cache, value_cache, meta.slot_mapping, positions, k_scale, v_scale
        )
        rows, slots, lens, starts = meta.prompt_part(meta.prefill_seq_slots)
        if rows:
            _C.contiguous_attention_prefill(
                out[:rows], q[:rows], key_cache, value_cache, layer.num_kv_heads, layer.scale,
                slots, lens, starts, meta.max_query_len, layer.sliding_window, layer.sinks,
                k_scale, v_scale,
            )  # fmt: skip
        parts = meta.decode_parts(meta.verify_seq_slots, meta.decode_seq_slots)
        for first, last, slots, lens in parts:
            _C.contiguous_attention_decode(
                out[first:last], q[first:last], key_cache, value_cache, layer.num_kv_heads,
                layer.scale, slots, lens, meta.max_decode_seq_len, layer.sliding_window,
                layer.sinks, k_scale, v_scale,
            )  # fmt: skip

    # ------------------------------------------------------------------ cache

    def cache_size(self, spec, budget_bytes, block_size, max_num_seqs) -> int:
        """One slot per sequence: virtual room for max_num_seqs x max_model_len tokens,
        of which only budget_bytes are ever committed at once (the engine's
        SlotManager keeps to that)."""
        return max_num_seqs

    def allocate(self, spec, count, block_size, cache_id=MAIN_CACHE, grouped=False) -> KVCache:
        """An arena of count slots of max_model_len tokens; nothing is committed until a
        slot is (block_size: unused, the arena's tiles are fixed). Sliding-window layers
        keep every token here too: grouped must be False."""
        if grouped:
            raise ValueError("the contiguous KV cache has no KV groups (grouped False)")
        arena = KVArena(
            spec.num_layers, count, spec.max_model_len, spec.num_kv_heads, spec.head_size,
            spec.cache_dtype, spec.device,
        )  # fmt: skip
        return KVCache(self, arena.kv_caches, memory=arena, cache_id=cache_id)

    # ---------------------------------------------------- tensor-parallel step

    def pack(self, meta: ContiguousMetadata, cache: KVCache):
        """The sequences' slots, and the arena's committed tokens per slot (the ranks'
        arenas map the same memory); their count goes in the header."""
        committed = cache.memory.committed_tokens_per_slot
        device = meta.slot_mapping.device
        pieces = [meta.prefill_seq_slots, meta.decode_seq_slots, committed.to(device)]
        return (committed.shape[0], 0), pieces

    def unpack(self, fields, sizes, take, cache) -> ContiguousMetadata:
        (nP,), (nD,) = fields["prefill_seq_lens"].shape, fields["decode_seq_lens"].shape
        meta = ContiguousMetadata(**fields, prefill_seq_slots=take(nP), decode_seq_slots=take(nD))
        sync_arena(cache.memory, take(sizes[0], torch.int64).cpu())
        self.add_verify_rows(meta)
        return meta


def sync_arena(arena: KVArena, committed: torch.Tensor) -> None:
    """Maps and unmaps this rank's arena slots as rank 0's are (same geometry, so the
    same committed token counts)."""
    own = arena.committed_tokens_per_slot
    for slot in (committed != own).nonzero().flatten().tolist():
        tokens = int(committed[slot])
        if tokens > own[slot]:
            arena.commit(slot, tokens)
        else:
            arena.release(slot, tokens)


def _check_part(meta, part: str, count: int, num_slots: int, capacity: int, device) -> None:
    slots = index_tensor(f"{part}_seq_slots", getattr(meta, f"{part}_seq_slots"),
                         torch.int32, 1, device)  # fmt: skip
    lens = index_tensor(f"{part}_seq_lens", getattr(meta, f"{part}_seq_lens"),
                        torch.int32, 1, device)  # fmt: skip
    if slots.shape[0] != count or lens.shape[0] != count:
        raise ValueError(f"{part}_seq_slots and {part}_seq_lens need {count} entries")
    if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
        raise ValueError(f"{part}_seq_slots must lie in [0, {num_slots})")
    if int(lens.min()) < 1 or int(lens.max()) > capacity:
        raise ValueError(f"{part}_seq_lens must lie in [1, {capacity}]")


CONTIGUOUS = ContiguousBackend()
