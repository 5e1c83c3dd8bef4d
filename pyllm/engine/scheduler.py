"""Continuous batching: which sequences run this step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). The policy, in order:

1. Decodes: every running sequence with one pending token, oldest first, one token
   each, plus the tokens proposed for it (speculative decoding) where the budget and
   memory allow. They come first, so generation never waits behind a prompt.
2. Prompts share what is left: running prompts (chunked prefills, oldest first), then
   waiting sequences. While more than one prompt competes, a first pass gives each at
   most `long_prefill_token_threshold` tokens, and running prompts leave that many to
   the waiting ones, so long prompts' chunks never shut new arrivals out; a second
   pass hands what is still left to them in the same order. Alone, a prompt takes the
   whole budget.
3. Waiting sequences are taken by `priority` (lower first), then from the client group
   with the fewest running sequences (a group is one API request, or one generate
   call), then in arrival order: a request of many prompts (or a large n) cannot hold
   every slot while another client waits. A waiting group with fewer running
   sequences than the largest group by two or more may take a slot from it when the
   sequence cap is reached: the largest group's newest sequence is preempted.

When KV memory runs out, the lowest-priority, newest running sequence is preempted:
its memory is freed and it waits to be recomputed, ahead of newer arrivals of its
group. Nothing is dropped.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from pyllm.engine.config import EngineConfig
from pyllm.engine.kv_manager import KVCacheManager
from pyllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one step computes: (sequence, number of its pending tokens to compute)."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[tuple[Sequence, int]] = field(default_factory=list)
    num_preempted: int = 0
    num_prompt_chunks: int = 0  # prefills[:num_prompt_chunks] hold prompt tokens only

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    def all(self) -> list[tuple[Sequence, int]]:
        return self.prefills + self.decodes

    def add(self, seq: Sequence, num_new: int) -> None:
        """num_new of seq's pending tokens. One output token after the computed ones is
        a decode; anything else is a prefill chunk: a prompt's (even of one prompt
        token), which meets the prefill kernel however the prompt was chunked (the two
        kernels round differently), or output tokens with proposals to verify or
        computed again after preemption, whose rows attend as decodes do
        (AttentionMetadata.verify_seq_lens). Prompt chunks go before the other
        prefills, so that a step's prompt tokens are its first rows."""
        if num_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
            self.decodes.append((seq, num_new))
        elif seq.num_computed_tokens + num_new <= seq.num_prompt_tokens:
            self.prefills.insert(self.num_prompt_chunks, (seq, num_new))
            self.num_prompt_chunks += 1
        else:
            self.prefills.append((seq, num_new))


def _order(seq: Sequence) -> tuple[int, int]:
    return (seq.priority, seq.arrival)


class WaitingQueue:
    """Waiting sequences by client group, each group's in (priority, arrival) order."""

    def __init__(self) -> None:
        self._groups: dict[str, list[Sequence]] = {}

    def add(self, seq: Sequence) -> None:
        group = self._groups.setdefault(seq.group, [])
        bisect.insort(group, seq, key=_order)

    def remove(self, seq: Sequence) -> None:
        group = self._groups[seq.group]
        group.remove(seq)
        if not group:
            del self._groups[seq.group]

    def next(self, running: Counter) -> Sequence | None:
        """The sequence to admit next: priority, then the group with the fewest running
        sequences, then arrival."""
        heads = (group[0] for group in self._groups.values())
        return min(heads, key=lambda s: (s.priority, running[s.group], s.arrival), default=None)

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def __bool__(self) -> bool:
        return bool(self._groups)

    def __iter__(self) -> Iterator[Sequence]:
        return (s for g in self._groups.values() for s in g)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._groups.get(seq.group, ())


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens,
        max_num_seqs: int = EngineConfig.max_num_seqs,
        long_prefill_token_threshold: int | None = EngineConfig.long_prefill_token_threshold,
    ):
        """The limits as EngineConfig holds them (and checks them)."""
        if long_prefill_token_threshold is None:
            long_prefill_token_threshold = max(1, max_num_batched_tokens // 4)
        self.kv_manager = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # oldest first
        self.running_per_group: Counter[str] = Counter()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        grants: dict[int, int] = {}  # id(seq) -> tokens this step
        self._rebalance(batch)
        rebalanced = batch.num_preempted
        budget = self._schedule_decodes(batch, grants)
        prompts = [s for s in self.running if id(s) not in grants]
        # Waiting prompts join unless this step had to preempt for memory (then memory,
        # not compute, is the bottleneck).
        admit = batch.num_preempted == rebalanced
        competing = len(prompts) + (len(self.waiting) if admit else 0) > 1
        cap = self.long_prefill_token_threshold if competing else budget
        # While sequences wait, running prompts leave `cap` tokens of the first pass to
        # them: a new prompt starts within a step however many long ones are running.
        room = budget - cap if admit and self.waiting else budget
        for seq in prompts:
            if seq.status is SequenceStatus.RUNNING and room > 0:
                granted = self._grant(seq, min(cap, room), grants, batch, preempt=True)
                room -= granted
                budget -= granted
        admit = batch.num_preempted == rebalanced  # the first pass may have preempted
        while admit and budget > 0 and (seq := self._admit(min(cap, budget), grants)):
            prompts.append(seq)
            budget -= grants[id(seq)]
        for seq in prompts:  # the second pass: what the cap left over, if it fits
            if budget > 0 and seq.status is SequenceStatus.RUNNING:
                budget -= self._grant(seq, budget, grants, batch, preempt=False)
        for seq in prompts:
            if seq.status is SequenceStatus.RUNNING and grants.get(id(seq)):
                batch.add(seq, grants[id(seq)])
        return batch

    def _rebalance(self, batch: ScheduledBatch) -> None:
        """At the sequence cap, the next waiting sequence's group takes a slot from the
        group holding the most running sequences if that one holds two or more more:
        its newest sequence is preempted."""
        if len(self.running) < self.max_num_seqs:
            return
        seq = self.waiting.next(self.running_per_group)
        if seq is None:
            return
        largest, held = self.running_per_group.most_common(1)[0]
        if held >= self.running_per_group[seq.group] + 2:
            victim = max((s for s in self.running if s.group == largest), key=_order)
            self._preempt(victim)
            batch.num_preempted += 1

    def _schedule_decodes(self, batch: ScheduledBatch, grants: dict[int, int]) -> int:
        """Grants one token to every running decode (oldest first); returns the budget left."""
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is SequenceStatus.RUNNING and _is_decode(seq):
                n = self._decode_tokens(seq, budget)
                if self._grant(seq, n, grants, batch, preempt=True):
                    batch.add(seq, n)
                    budget -= n
        return budget

    def _decode_tokens(self, seq: Sequence, budget: int) -> int:
        """A decode's tokens this step: its pending one and the proposed tokens that fit
        the budget and free KV memory (proposals are dropped before anything is
        preempted for them)."""
        del seq.spec_token_ids[budget - 1 :]
        if seq.spec_token_ids and not self.kv_manager.can_append(seq, seq.num_scheduled_tokens):
            seq.spec_token_ids.clear()
        return seq.num_scheduled_tokens

    def _grant(self, seq: Sequence, most: int, grants, batch, preempt: bool) -> int:
        """Up to `most` more of seq's pending tokens this step, preempting sequences
        without a grant when memory is short (if preempt); returns how many."""
        have = grants.get(id(seq), 0)
        extra = min(seq.num_scheduled_tokens - have, most)
        if extra <= 0:
            return 0
        while not self.kv_manager.can_append(seq, have + extra):
            if not preempt:
                return 0
            victim = max((s for s in self.running if s is seq or id(s) not in grants), key=_order)
            self._preempt(victim)
            batch.num_preempted += 1
            if victim is seq:
                grants.pop(id(seq), None)
                return 0
        self.kv_manager.append_slots(seq, have + extra)
        grants[id(seq)] = have + extra
        return extra

    def _admit(self, most: int, grants: dict[int, int]) -> Sequence | None:
        """Starts the next waiting sequence with up to `most` tokens, or returns None
        when the sequence cap or free memory does not allow it."""
        seq = self.waiting.next(self.running_per_group)
        if seq is None or len(self.running) >= self.max_num_seqs:
            return None
        if not seq.block_table:
            self.kv_manager.match_prefix(seq)
        num_new = min(seq.num_scheduled_tokens, most)
        if not self.kv_manager.can_append(seq, num_new):
            # Give back the prefix blocks it took; it tries again next step.
            self.kv_manager.free(seq)
            return None
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.running_per_group[seq.group] += 1
        self.kv_manager.append_slots(seq, num_new)
        grants[id(seq)] = num_new
        return seq

    def _preempt(self, seq: Sequence) -> None:
        self._leave_running(seq)
        seq.spec_token_ids.clear()
        self.kv_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(seq)  # its arrival puts it ahead of newer ones of its group

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.running_per_group[seq.group] -= 1
        if not self.running_per_group[seq.group]:
            del self.running_per_group[seq.group]

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends seq (stop condition, length or abort) and frees its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self._leave_running(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_manager.free(seq)
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason


def _is_decode(seq: Sequence) -> bool:
    return seq.num_pending_tokens == 1 and seq.num_computed_tokens > 0
