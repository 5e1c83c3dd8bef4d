"""Draft model proposals: a small model sharing the target's vocabulary runs in the
engine's process, over its own KV cache, and proposes each speculating sequence's
next tokens greedily (argmax: a point-mass proposal, so verification stays exact).

Each step, for the sequences that speculate, batched across them:

1. catch up: the draft computes the sequence's tokens it has not seen (the whole
   sequence at first, afterwards the tokens emitted since its last step: the accepted
   run and the token after it), in chunks of at most max_num_batched_tokens per
   forward; the argmax after the last one is the first proposal;
2. one decode forward per further proposed position, for every sequence that still
   wants one (k forwards in all when nothing is chunked);
3. roll back, at the next step: the draft keeps the KV of the proposals the target
   accepted and returns to the longest prefix its tokens share with the sequence's, so
   a rejected proposal's KV is never attended to (it is written over), and an accepted
   one is not computed twice.

A draft holds its KV only for the sequences speculating this step: a sequence that
does not speculate, finishes, is aborted or is preempted has it freed (and catches up
from its first token if it speculates again).
"""

from __future__ import annotations

from pyllm.engine.kv_manager import KVCacheManager
from pyllm.engine.model_runner import ModelRunner
from pyllm.engine.scheduler import ScheduledBatch
from pyllm.engine.sequence import Sequence

# (the draft's view of a sequence, the token it proposes next)
Proposed = tuple[Sequence, int]


class DraftProposer:
    """The Speculator's proposer for method "draft_model" (built by load_draft)."""

    def __init__(self, runner: ModelRunner, kv_manager: KVCacheManager, name: str) -> None:
        self.runner = runner  # the draft model over its own KV cache
        self.kv_manager = kv_manager
        self.name = name  # the draft's file or folder name, for the log
        # Per speculating sequence (by its arrival): the draft's view of it. Its
        # num_computed_tokens and block_table / kv_slot address the draft's cache.
        self.states: dict[int, Sequence] = {}
        self.committed: dict[int, int] = {}  # by arrival: its tokens when last proposed to

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        """Per sequence, up to its length of proposed tokens ([] when the draft's cache
        has no room for it this step)."""
        keep = {seq.arrival for seq in seqs}
        for arrival in [a for a in self.states if a not in keep]:
            self._free(arrival)
        wanted = {}
        for seq, k in zip(seqs, lengths, strict=True):
            if self._reserve(seq, k):
                wanted[seq.arrival] = k
        proposals = self._generate([self.states[a] for a in wanted], wanted)
        return [proposals.get(seq.arrival, []) for seq in seqs]

    def forget(self, seq: Sequence) -> None:
        """Frees the draft's KV of seq (finished or aborted)."""
        self._free(seq.arrival)

    def _reserve(self, seq: Sequence, k: int) -> bool:
        """Brings the draft's view of seq up to its tokens and makes room in the draft's
        cache for them and k - 1 proposals; False (the view freed) if there is none."""
        draft = self.states.get(seq.arrival)
        if draft is None:
            params = seq.sampling_params
            draft = Sequence(seq.request_id, seq.prompt_token_ids, params, arrival=seq.arrival)
            self.states[seq.arrival] = draft
        else:
            self._roll_back(draft, seq)
        draft.token_ids = list(seq.token_ids)
        self.committed[seq.arrival] = seq.num_tokens
        need = draft.num_pending_tokens + k - 1
        if not self.kv_manager.can_append(draft, need):
            self._free(seq.arrival)
            return False
        self.kv_manager.append_slots(draft, need)
        return True

    def _generate(self, drafts: list[Sequence], wanted: dict[int, int]) -> dict[int, list[int]]:
        """The drafts' proposals by arrival: catch up, then one decode per position."""
        out: dict[int, list[int]] = {d.arrival: [] for d in drafts}
        found = self._catch_up(drafts)
        while found:
            for draft, token in found:
                out[draft.arrival].append(token)
                draft.token_ids.append(token)
            more = [(d, 1) for d, _ in found if len(out[d.arrival]) < wanted[d.arrival]]
            found = self._forward(more)
        return out

    def _catch_up(self, drafts: list[Sequence]) -> list[Proposed]:
        """Computes each draft's pending tokens, at most max_num_batched_tokens per
        forward; returns each draft with the argmax after its last token."""
        found: list[Proposed] = []
        pending = list(drafts)
        while pending:
            budget = self.runner.max_num_batched_tokens
            chunk = []
            for draft in pending:
                n = min(draft.num_pending_tokens, budget)
                if n == 0:
                    break
                chunk.append((draft, n))
                budget -= n
            found += self._forward(chunk)
            pending = [d for d in pending if d.num_pending_tokens]
        return found

    def _forward(self, chunk: list[tuple[Sequence, int]]) -> list[Proposed]:
        """One draft forward over (draft, tokens) pairs; the argmax after each draft
        whose pending tokens are then all computed."""
        if not chunk:
            return []
        batch = ScheduledBatch()
        for draft, n in chunk:
            batch.add(draft, n)
        logits, sampled, _, _ = self.runner.run(batch)
        for draft, n in batch.all():
            draft.num_computed_tokens += n
        if not sampled:  # only chunks of longer catch-ups ran
            return []
        return list(zip(sampled, logits.argmax(dim=-1).tolist(), strict=True))

    def _roll_back(self, draft: Sequence, seq: Sequence) -> None:
        """Back to the tokens the draft's view shares with seq: the KV of the proposals
        seq accepted stays, that of the first rejected one and after it is dropped."""
        computed, tokens = draft.num_computed_tokens, seq.token_ids
        # The view held seq's tokens up to its last proposals, which followed them.
        shared = min(computed, self.committed[seq.arrival])
        while shared < min(computed, len(tokens)) and draft.token_ids[shared] == tokens[shared]:
            shared += 1
        draft.num_computed_tokens = shared
        self.kv_manager.trim(draft)

    def _free(self, arrival: int) -> None:
        self.committed.pop(arrival, None)
        draft = self.states.pop(arrival, None)
        if draft is not None:
            self.kv_manager.free(draft)
