"""What rank 0 sends the other ranks: a fixed header (one int64 tensor) naming the call,
then, where the call has data, one flat int64 tensor with all of it. A step is sent as
tensors only (token ids, positions, the fields every KV layout has, then what the
cache's attention backend packs: block tables, or sequence slots and the arena's
committed tokens), never as Python objects per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyllm.attention.backend import MAIN_CACHE, KVCache
from pyllm.attention.metadata import AttentionMetadata

HEADER_SIZE = 16
# Commands (header[0]).
NOOP, FORWARD, LOGITS, ALLOC_CACHE, STOP = range(5)


@dataclass
class Header:
    command: int
    cache: int = MAIN_CACHE  # FORWARD, ALLOC_CACHE: which cache (KVCache.cache_id)
    num_tokens: int = 0
    num_prefill_tokens: int = 0
    num_prefills: int = 0
    num_decodes: int = 0
    max_query_len: int = 0
    max_decode_seq_len: int = 0
    num_prompt_tokens: int = 0  # FORWARD: the step's prompt tokens (AttentionMetadata's)
    layout_a: int = 0  # FORWARD: the two sizes the backend packs (AttentionBackend.pack)
    layout_b: int = 0
    backend: int = 0  # ALLOC_CACHE: the backend's number (pyllm.attention.registry)
    a: int = 0  # ALLOC_CACHE: blocks or slots; LOGITS: rows (-1: all)
    b: int = 0  # ALLOC_CACHE: block_size
    c: int = 0  # ALLOC_CACHE: 1 where the layers are in KV groups (allocate's grouped)
    payload: int = 0  # int64 values that follow

    def tensor(self) -> torch.Tensor:
        values = list(vars(self).values())
        return torch.tensor(values + [0] * (HEADER_SIZE - len(values)), dtype=torch.int64)

    @classmethod
    def of(cls, t: torch.Tensor) -> Header:
        return cls(*t.tolist()[: len(cls.__dataclass_fields__)])


def encode_step(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, cache: KVCache
) -> tuple[Header, torch.Tensor]:
    """The header and payload of a FORWARD over cache."""
    sizes, layout = meta.backend.pack(meta, cache)
    pieces = [input_ids, positions, meta.slot_mapping, meta.prefill_query_start_loc,
              meta.prefill_seq_lens, meta.decode_seq_lens, *layout]  # fmt: skip
    payload = torch.cat([p.to(torch.int64) for p in pieces])
    header = Header(
        FORWARD, cache.cache_id, meta.num_tokens, meta.num_prefill_tokens,
        meta.prefill_seq_lens.shape[0], meta.decode_seq_lens.shape[0], meta.max_query_len,
        meta.max_decode_seq_len, meta.num_prompt_tokens, *sizes, payload=payload.shape[0],
    )  # fmt: skip
    return header, payload


def decode_step(
    h: Header, payload: torch.Tensor, cache: KVCache
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) of a FORWARD over this rank's cache: the tensors
    rank 0's model runner built, with their dtypes and shapes."""
    at = 0

    def take(n: int, dtype=torch.int32) -> torch.Tensor:
        nonlocal at
        at += n
        return payload[at - n : at].to(dtype)

    T, nP, nD = h.num_tokens, h.num_prefills, h.num_decodes
    input_ids, positions, slot_mapping = (take(T, torch.int64) for _ in range(3))
    fields = {
        "slot_mapping": slot_mapping,
        "num_prefill_tokens": h.num_prefill_tokens,
        "prefill_query_start_loc": take(nP + 1),
        "prefill_seq_lens": take(nP),
        "max_query_len": h.max_query_len,
        "decode_seq_lens": take(nD),
        "max_decode_seq_len": h.max_decode_seq_len,
        "num_prompt_tokens": h.num_prompt_tokens,
    }
    meta = cache.backend.unpack(fields, (h.layout_a, h.layout_b), take, cache)
    return input_ids, positions, meta
