"""Turns a scheduled batch into the flat tensors the model takes, and runs it.

Tokens of all sequences go into one flat batch, no padding: prompt chunks first, then
decode tokens, one per sequence. For each token the runner computes its position and
its KV slot (block_table[position // block_size] * block_size + position % block_size;
with the contiguous cache, the sequence's arena slot, the position being the offset).
Logits are computed only where a token will be sampled: the last token of each
sequence whose pending tokens are all computed by this step; and, for a sequence that
asks for prompt logprobs (seq.prompt_logprobs is not None), at each prompt position of
its chunk whose next token is in the prompt (every position but the last). Positions
served from the prefix cache were never run: the same step computes their logits apart,
in a throwaway KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyllm.engine.config import EngineConfig
from pyllm.engine.scheduler import ScheduledBatch
from pyllm.engine.sequence import Sequence
from pyllm.model.layers import AttentionMetadata
from pyllm.sampling.params import SamplingParams


def _padded_block_tables(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    width = max((len(s.block_table) for s in seqs), default=0)
    rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int32, device=device).view(len(seqs), width)


def _seq_slots(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    return torch.tensor([s.kv_slot for s in seqs], dtype=torch.int32, device=device)


# (sequence, first prompt position p0, float32 logits [positions, vocab] of positions
# p0, p0 + 1, ...): what a sequence's prompt logprobs are computed from.
PromptLogits = tuple[Sequence, int, torch.Tensor]


@dataclass
class _FlatBatch:
    """A step's tokens as flat lists, one entry per token (query_start_loc: per sequence,
    where its tokens start, plus the end)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    logits_indices: list[int]
    sampled: list[Sequence]
    prompt_rows: list[tuple[Sequence, int, range]]


def _flatten(batch: ScheduledBatch, bs: int, contiguous: bool) -> _FlatBatch:
    """The scheduled tokens in batch.all() order, with their positions, KV slots, and
    which of them are sampled or give prompt logits."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_start_loc = [0]
    logits_indices: list[int] = []
    sampled: list[Sequence] = []
    prompt_rows: list[tuple[Sequence, int, range]] = []
    for seq, n in batch.all():
        start = seq.num_computed_tokens
        # Prompt positions before the last predict the prompt's own next token.
        last = min(start + n, seq.num_prompt_tokens - 1)
        if seq.prompt_logprobs is not None and start < last:
            prompt_rows.append((seq, start, range(len(input_ids), len(input_ids) + last - start)))
        table = seq.block_table
        input_ids.extend(seq.token_ids[start : start + n])
        span = range(start, start + n)
        positions.extend(span)
        if contiguous:
            slot_mapping.extend([seq.kv_slot] * n)
        else:
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in span)
        query_start_loc.append(query_start_loc[-1] + n)
        if start + n == seq.num_tokens:  # everything pending is computed: sample
            logits_indices.append(len(input_ids) - 1)
            sampled.append(seq)
    return _FlatBatch(
        input_ids, positions, slot_mapping, query_start_loc, logits_indices, sampled, prompt_rows
    )


class ModelRunner:
    def __init__(
        self,
        model,
        kv_caches,
        block_size: int,
        device: torch.device,
        contiguous: bool = False,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.contiguous = contiguous  # kv_caches are views of a KVArena (SlotManager)
        self.max_num_batched_tokens = max_num_batched_tokens  # chunk of a cached prompt pass

    def prepare(self, batch: ScheduledBatch):
        """Returns (input_ids, positions, attn_metadata, logits_indices, sampled_seqs,
        prompt_rows): prompt_rows lists (seq, first position, flat token indices) of the
        prompt positions whose logits the sequence's prompt logprobs need."""
        flat = _flatten(batch, self.block_size, self.contiguous)
        metadata = self._attention_metadata(batch, flat.slot_mapping, flat.query_start_loc)
        device = self.device
        return (
            torch.tensor(flat.input_ids, dtype=torch.int64, device=device),
            torch.tensor(flat.positions, dtype=torch.int64, device=device),
            metadata,
            torch.tensor(flat.logits_indices, dtype=torch.int64, device=device),
            flat.sampled,
            flat.prompt_rows,
        )

    def _attention_metadata(
        self, batch: ScheduledBatch, slot_mapping: list[int], query_start_loc: list[int]
    ) -> AttentionMetadata:
        device = self.device
        prefill_seqs = [s for s, _ in batch.prefills]
        decode_seqs = [s for s, _ in batch.decodes]
        num_prefills = len(prefill_seqs)
        prefill_lens = [s.num_computed_tokens + n for s, n in batch.prefills]
        decode_lens = [s.num_computed_tokens + 1 for s in decode_seqs]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            num_prefill_tokens=query_start_loc[num_prefills],
            prefill_query_start_loc=torch.tensor(
                query_start_loc[: num_prefills + 1], dtype=torch.int32, device=device
            ),
            prefill_seq_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=device),
            prefill_block_tables=_padded_block_tables(prefill_seqs, device),
            max_query_len=max((n for _, n in batch.prefills), default=0),
            decode_seq_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
            decode_block_tables=_padded_block_tables(decode_seqs, device),
            max_decode_seq_len=max(decode_lens, default=0),
        )
        if self.contiguous:
            metadata.contiguous = True
            metadata.prefill_seq_slots = _seq_slots(prefill_seqs, device)
            metadata.decode_seq_slots = _seq_slots(decode_seqs, device)
        return metadata

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence], list[PromptLogits]]:
        """Runs one step; returns float32 logits [len(sampled), vocab], those sequences, and
        the prompt logits of the sequences asking for prompt logprobs: this step's chunk,
        and on a prompt's first step the positions the prefix cache served."""
        logits, sampled, prompt_logits = self._forward(batch)
        for seq, _ in batch.prefills:
            cached = seq.num_cached_prompt_tokens
            if seq.prompt_logprobs is not None and cached and seq.prompt_logprobs[cached] is None:
                prompt_logits += self._prompt_logits_uncached(seq, cached)
        return logits, sampled, prompt_logits

    def _forward(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, list[Sequence], list[PromptLogits]]:
        input_ids, positions, metadata, logits_indices, sampled, prompt_rows = self.prepare(batch)
        # The metadata is built here from the scheduler's own state: skip re-validating it.
        hidden = self.model(input_ids, positions, metadata, self.kv_caches, validate=False)
        prompt_logits = [
            (seq, start, self.model.compute_logits(hidden, torch.tensor(rows, device=self.device)))
            for seq, start, rows in prompt_rows
        ]
        if not sampled:
            return hidden.new_empty((0, 0), dtype=torch.float32), sampled, prompt_logits
        return self.model.compute_logits(hidden, logits_indices), sampled, prompt_logits

    def _prompt_logits_uncached(self, owner: Sequence, num_positions: int) -> list[PromptLogits]:
        """Prompt logits of owner's positions [0, num_positions), computed in a throwaway
        KV cache: its first blocks came from the prefix cache (never recomputed, and
        shared, so they are not written again)."""
        bs = self.block_size
        chunk_size = self.max_num_batched_tokens
        tokens = list(owner.prompt_token_ids[: num_positions + 1])
        num_blocks = -(-len(tokens) // bs)
        scratch = ModelRunner(
            self.model, self.model.allocate_kv_caches(num_blocks, bs), bs, self.device
        )
        seq = Sequence("prompt-logprobs", tokens, SamplingParams(max_tokens=1))
        seq.block_table = list(range(num_blocks))
        seq.prompt_logprobs = []
        chunks = []
        for start in range(0, num_positions, chunk_size):
            seq.num_computed_tokens = start
            n = min(chunk_size, num_positions - start)
            _, _, found = scratch._forward(ScheduledBatch(prefills=[(seq, n)]))
            chunks += [(owner, first, logits) for _, first, logits in found]
        return chunks
