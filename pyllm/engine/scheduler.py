"""Continuous batching: which sequences run this step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). Running sequences go first, oldest first: a decode costs one token,
an unfinished prompt its next chunk. What is left of the budget goes to waiting
prompts, first come first served, so a long prompt is prefilled over several steps
while the others keep decoding. When KV memory runs out, the newest running sequence
is preempted: its blocks are freed and it waits to be recomputed, ahead of newer
arrivals. Nothing is dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pyllm.engine.kv_manager import KVCacheManager
from pyllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one step computes: (sequence, number of its pending tokens to compute)."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[tuple[Sequence, int]] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    def all(self) -> list[tuple[Sequence, int]]:
        return self.prefills + self.decodes


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 256,
    ):
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.kv_manager = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        # Running sequences first, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_pending_tokens, budget)
            while not self.kv_manager.can_append(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing newer is left to run
            self.kv_manager.append_slots(seq, num_new)
            self._add_to_batch(batch, seq, num_new)
            budget -= num_new
            i += 1

        # Then waiting prompts, first come first served, unless this step had to
        # preempt (then memory is the bottleneck, not compute).
        while (
            self.waiting
            and budget > 0
            and batch.num_preempted == 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if not seq.block_table:
                self.kv_manager.match_prefix(seq)
            num_new = min(seq.num_pending_tokens, budget)
            if not self.kv_manager.can_append(seq, num_new):
                # Give back the prefix blocks it took; it tries again next step.
                self.kv_manager.free(seq)
                break
            self.waiting.popleft()
            self.kv_manager.append_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, num_new)
            budget -= num_new
        return batch

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, seq: Sequence, num_new: int) -> None:
        # One pending token after some computed ones is a decode; anything else
        # (a prompt, a chunk, a recomputation) runs through the prefill kernel.
        if num_new == 1 and seq.num_computed_tokens > 0:
            batch.decodes.append((seq, num_new))
        else:
            batch.prefills.append((seq, num_new))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Ahead of newer arrivals, behind older preempted ones.
        position = 0
        while position < len(self.waiting) and self.waiting[position].arrival < seq.arrival:
            position += 1
        self.waiting.insert(position, seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends seq (stop condition, length or abort) and frees its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
