"""What rank 0 sends the other ranks: a fixed header (one int64 tensor) naming the call,
then, where the call has data, one flat int64 tensor with all of it. A step is sent as
tensors only (token ids, positions, slot mapping, block tables or sequence slots),
never as Python objects per sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyllm.model.layers import AttentionMetadata

HEADER_SIZE = 16
# Commands (header[0]).
NOOP, FORWARD, LOGITS, ALLOC_CACHE, ALLOC_ARENA, STOP = range(6)
MAIN_CACHE, SCRATCH_CACHE = 0, 1  # header[1] of FORWARD and ALLOC_CACHE


@dataclass
class Header:
    command: int
    cache: int = MAIN_CACHE
    num_tokens: int = 0
    num_prefill_tokens: int = 0
    num_prefills: int = 0
    num_decodes: int = 0
    prefill_width: int = 0  # block table columns
    decode_width: int = 0
    max_query_len: int = 0
    max_decode_seq_len: int = 0
    contiguous: int = 0
    num_slots: int = 0  # committed tokens per arena slot follow (contiguous)
    a: int = 0  # ALLOC_CACHE: num_blocks; ALLOC_ARENA: max_num_seqs; LOGITS: rows (-1: all)
    b: int = 0  # ALLOC_CACHE: block_size
    payload: int = 0  # int64 values that follow

    def tensor(self) -> torch.Tensor:
        values = list(vars(self).values())
        return torch.tensor(values + [0] * (HEADER_SIZE - len(values)), dtype=torch.int64)

    @classmethod
    def of(cls, t: torch.Tensor) -> Header:
        return cls(*t.tolist()[: len(cls.__dataclass_fields__)])


def encode_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    meta: AttentionMetadata,
    cache: int,
    committed: torch.Tensor | None,
) -> tuple[Header, torch.Tensor]:
    """The header and payload of a FORWARD: committed holds the contiguous arena's
    committed tokens per slot (the ranks' arenas map the same memory)."""
    num_prefills = meta.prefill_seq_lens.shape[0]
    num_decodes = meta.decode_seq_lens.shape[0]
    pieces = [input_ids, positions, meta.slot_mapping, meta.prefill_query_start_loc,
              meta.prefill_seq_lens, meta.decode_seq_lens]  # fmt: skip
    widths = (0, 0)
    if meta.contiguous:
        pieces += [meta.prefill_seq_slots, meta.decode_seq_slots, committed.to(input_ids.device)]
    else:
        widths = (meta.prefill_block_tables.shape[1], meta.decode_block_tables.shape[1])
        pieces += [meta.prefill_block_tables.reshape(-1), meta.decode_block_tables.reshape(-1)]
    payload = torch.cat([p.to(torch.int64) for p in pieces])
    header = Header(
        FORWARD, cache, meta.num_tokens, meta.num_prefill_tokens, num_prefills, num_decodes,
        *widths, meta.max_query_len, meta.max_decode_seq_len, int(meta.contiguous),
        0 if committed is None else committed.shape[0], payload=payload.shape[0],
    )  # fmt: skip
    return header, payload


def decode_step(
    h: Header, payload: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]:
    """(input_ids, positions, metadata, committed tokens per slot or None) of a FORWARD:
    the tensors rank 0's model runner built, with their dtypes and shapes."""
    at = 0

    def take(n: int, dtype=torch.int32) -> torch.Tensor:
        nonlocal at
        at += n
        return payload[at - n : at].to(dtype)

    T, nP, nD = h.num_tokens, h.num_prefills, h.num_decodes
    input_ids, positions, slot_mapping = (take(T, torch.int64) for _ in range(3))
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_prefill_tokens=h.num_prefill_tokens,
        prefill_query_start_loc=take(nP + 1),
        prefill_seq_lens=take(nP),
        max_query_len=h.max_query_len,
        decode_seq_lens=take(nD),
        max_decode_seq_len=h.max_decode_seq_len,
        contiguous=bool(h.contiguous),
    )
    committed = None
    if meta.contiguous:
        meta.prefill_seq_slots, meta.decode_seq_slots = take(nP), take(nD)
        committed = take(h.num_slots, torch.int64).cpu()
    else:
        meta.prefill_block_tables = take(nP * h.prefill_width).view(nP, h.prefill_width)
        meta.decode_block_tables = take(nD * h.decode_width).view(nD, h.decode_width)
    return input_ids, positions, meta, committed
