"""Turns a scheduled batch into the flat tensors the model takes, and runs it.

Tokens of all sequences go into one flat batch, no padding: prompt chunks (and decodes
verifying proposed tokens) first, then decode tokens, one per sequence. For each token
the runner computes its position; the cache's attention backend (pyllm.attention)
builds the step's metadata: where each token's key and value go and where each
sequence's cached tokens are. Logits are computed only where a token will be sampled:
the last token of each sequence whose pending tokens are all computed by this step
(for a decode carrying proposed tokens, the 1 + len(seq.spec_token_ids) rows that
verify them); and, for a sequence that asks for prompt logprobs (seq.prompt_logprobs
is not None), at each prompt position of its chunk whose next token is in the prompt
(every position but the last). Positions served from the prefix cache were never run:
the same step computes their logits apart, in a throwaway KV cache.

An embedding sequence (seq.pooling_params set) is never sampled: instead the runner
returns its chunk's part of the pooled hidden state (pooling.chunk_part; with `last`
pooling only the prompt's last chunk has one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyllm.attention.backend import SCRATCH_CACHE, KVCache
from pyllm.attention.paged import PAGED
from pyllm.engine.config import EngineConfig
from pyllm.engine.decode_graphs import DecodeGraphs
from pyllm.engine.pooling import chunk_part
from pyllm.engine.scheduler import ScheduledBatch
from pyllm.engine.sequence import Sequence
from pyllm.sampling.params import SamplingParams

# (sequence, first prompt position p0, float32 logits [positions, vocab] of positions
# p0, p0 + 1, ...): what a sequence's prompt logprobs are computed from.
PromptLogits = tuple[Sequence, int, torch.Tensor]
# (embedding sequence, first position p0 of its chunk, float32 [hidden]): the chunk's
# part of its pooled hidden state.
PooledPart = tuple[Sequence, int, torch.Tensor]


@dataclass
class _FlatBatch:
    """A step's tokens as flat lists, one entry per token."""

    input_ids: list[int]
    positions: list[int]
    logits_indices: list[int]
    sampled: list[Sequence]
    prompt_rows: list[tuple[Sequence, int, range]]
    pooled_rows: list[tuple[Sequence, int, range]]


def _flatten(batch: ScheduledBatch) -> _FlatBatch:
    """The scheduled tokens in batch.all() order, with their positions, and which of
    them are sampled or give prompt logits."""
    input_ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Sequence] = []
    prompt_rows: list[tuple[Sequence, int, range]] = []
    pooled_rows: list[tuple[Sequence, int, range]] = []
    for seq, n in batch.all():
        start = seq.num_computed_tokens
        if seq.pooling_params is not None:  # prefill only, pooled instead of sampled
            pooled_rows.append((seq, start, range(len(input_ids), len(input_ids) + n)))
            input_ids.extend(seq.step_token_ids(start, n))
            positions.extend(range(start, start + n))
            continue
        # Prompt positions before the last predict the prompt's own next token.
        last = min(start + n, seq.num_prompt_tokens - 1)
        if seq.prompt_logprobs is not None and start < last:
            prompt_rows.append((seq, start, range(len(input_ids), len(input_ids) + last - start)))
        input_ids.extend(seq.step_token_ids(start, n))
        positions.extend(range(start, start + n))
        if start + n == seq.num_tokens + len(seq.spec_token_ids):  # all pending computed
            # The last token's row, and one before it per proposed token: a draft is
            # verified at every position it proposes.
            first = len(input_ids) - 1 - len(seq.spec_token_ids)
            logits_indices.extend(range(first, len(input_ids)))
            sampled.append(seq)
    return _FlatBatch(input_ids, positions, logits_indices, sampled, prompt_rows, pooled_rows)


class ModelRunner:
    def __init__(
        self,
        model,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        pooling: str = EngineConfig.pooling,
        enforce_eager: bool = EngineConfig.enforce_eager,
    ):
        self.model = model
        self.pooling = pooling  # of embedding sequences' hidden states
        self.kv_cache = kv_cache  # its backend builds each step's metadata
        self.block_size = block_size
        self.device = device
        self.max_num_batched_tokens = max_num_batched_tokens  # chunk of a cached prompt pass
        self.graphs = None  # decode steps replayed from recorded kernel calls
        if not enforce_eager and DecodeGraphs.supports(model, device):
            self.graphs = DecodeGraphs(model, kv_cache, block_size)

    def prepare(self, batch: ScheduledBatch):
        """Returns (input_ids, positions, attn_metadata, logits_indices, sampled_seqs,
        prompt_rows, pooled_rows): logits_indices is None where every token is sampled
        (a step of decodes: no rows to pick); prompt_rows lists (seq, first position,
        flat token indices) of the prompt positions whose logits the sequence's prompt
        logprobs need; pooled_rows the same of embedding sequences' chunks."""
        flat = _flatten(batch)
        backend = self.kv_cache.backend
        metadata = backend.build(
            batch.prefills, batch.decodes, self.block_size, self.device, self.kv_cache.num_groups
        )
        device = self.device
        # The indices rise, so as many as the tokens are every token in order.
        every = len(flat.logits_indices) == len(flat.input_ids)
        return (
            torch.tensor(flat.input_ids, dtype=torch.int64, device=device),
            torch.tensor(flat.positions, dtype=torch.int64, device=device),
            metadata,
            None if every else torch.tensor(flat.logits_indices, dtype=torch.int64, device=device),
            flat.sampled,
            flat.prompt_rows,
            flat.pooled_rows,
        )

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, list[Sequence], list[PromptLogits], list[PooledPart]]:
        """Runs one step; returns float32 logits [rows, vocab] (one row per sampled
        sequence, 1 + len(seq.spec_token_ids) for one with proposals), those sequences,
        the prompt logits of the sequences asking for prompt logprobs (this step's chunk,
        and on a prompt's first step the positions the prefix cache served), and the
        embedding sequences' pooled parts."""
        logits, sampled, prompt_logits, pooled = self._forward(batch)
        for seq, _ in batch.prefills:
            cached = seq.num_cached_prompt_tokens
            if seq.prompt_logprobs is not None and cached and seq.prompt_logprobs[cached] is None:
                prompt_logits += self._prompt_logits_uncached(seq, cached)
        return logits, sampled, prompt_logits, pooled

    def _forward(self, batch: ScheduledBatch):
        input_ids, positions, metadata, logits_indices, sampled, prompt_rows, pooled_rows = (
            self.prepare(batch)
        )
        hidden = None
        if self.graphs is not None:  # steps without prompt tokens: decodes, verifications
            hidden = self.graphs.run(input_ids, positions, metadata)
        if hidden is None:
            # The metadata is built here from the scheduler's own state: skip re-validating.
            hidden = self.model(input_ids, positions, metadata, self.kv_cache, validate=False)
        prompt_logits = [
            (seq, start, self.model.compute_logits(hidden, torch.tensor(rows, device=self.device)))
            for seq, start, rows in prompt_rows
        ]
        pooled = self._pool(hidden, pooled_rows)
        if not sampled:
            return hidden.new_empty((0, 0), dtype=torch.float32), sampled, prompt_logits, pooled
        return self.model.compute_logits(hidden, logits_indices), sampled, prompt_logits, pooled

    def _pool(self, hidden: torch.Tensor, pooled_rows) -> list[PooledPart]:
        """Each embedding chunk's part; with `last` pooling only a prompt's last chunk."""
        parts = []
        for seq, start, rows in pooled_rows:
            if self.pooling == "last" and start + len(rows) < seq.num_prompt_tokens:
                continue
            parts.append((seq, start, chunk_part(hidden[rows.start : rows.stop], self.pooling)))
        return parts

    def _prompt_logits_uncached(self, owner: Sequence, num_positions: int) -> list[PromptLogits]:
        """Prompt logits of owner's positions [0, num_positions), computed in a throwaway
        KV cache: its first blocks came from the prefix cache (never recomputed, and
        shared, so they are not written again). Paged whatever the engine's layout: the
        throwaway sequence's blocks are simply the first ones."""
        bs = self.block_size
        chunk_size = self.max_num_batched_tokens
        tokens = list(owner.prompt_token_ids[: num_positions + 1])
        num_blocks = -(-len(tokens) // bs)
        cache = self.model.allocate_kv_cache(PAGED, num_blocks, bs, SCRATCH_CACHE)
        scratch = ModelRunner(self.model, cache, bs, self.device)
        seq = Sequence("prompt-logprobs", tokens, SamplingParams(max_tokens=1))
        seq.block_table = list(range(num_blocks))
        seq.prompt_logprobs = []
        chunks = []
        for start in range(0, num_positions, chunk_size):
            seq.num_computed_tokens = start
            n = min(chunk_size, num_positions - start)
            _, _, found, _ = scratch._forward(ScheduledBatch(prefills=[(seq, n)]))
            chunks += [(owner, first, logits) for _, first, logits in found]
        return chunks
