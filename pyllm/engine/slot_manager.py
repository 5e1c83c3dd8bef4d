"""The contiguous KV cache's bookkeeping: one arena slot per running sequence.

With `kv_cache="contiguous"` every layer's keys and values live in a virtual KV arena
(pyllm.ops.KVArena): each sequence slot has room for max_model_len tokens in virtual
memory, and physical memory is mapped under a slot only as its sequence grows. So
there are no block tables: a sequence is addressed by its slot number, and this class
only hands out slots and decides how much of each to commit, within the engine's KV
memory budget (the same budget that sizes the paged cache).

It implements KVCacheManager as BlockManager does, so scheduling and preemption are
the same in both modes. Prefix caching is not offered: a slot belongs to one sequence,
and sharing a prefix would mean copying it.
"""

from __future__ import annotations

from pyllm.engine.sequence import Sequence
from pyllm.sampling.params import ParamError

# Slots are committed this many tokens ahead of need, so mapping memory happens once
# every COMMIT_AHEAD decode steps of a sequence, not on every step.
COMMIT_AHEAD = 64


class SlotManager:
    def __init__(self, arena, budget_bytes: int):
        self.arena = arena
        self.budget_bytes = budget_bytes
        self.max_model_len = arena.max_model_len
        # Lowest slot first: keeps the live part of the arena compact.
        self.free_slots = list(range(arena.max_num_seqs - 1, -1, -1))
        self.prefix_cache_queries = 0  # never counted: no prefix cache in this mode
        self.prefix_cache_hits = 0

    @property
    def num_slots(self) -> int:
        return self.arena.max_num_seqs

    def describe(self) -> str:
        return (
            f"kv_cache=contiguous slots={self.num_slots} (virtual "
            f"{self.arena.reserved_bytes / 2**30:.2f} GiB, committed at most "
            f"{self.budget_bytes / 2**30:.2f} GiB)"
        )

    def committed_bytes(self) -> int:
        return self.arena.committed_bytes

    def block_counts(self) -> None:
        return None  # slots, not blocks

    def usage(self) -> float:
        """Share of the memory budget committed (0 to 1)."""
        return min(1.0, self.committed_bytes() / self.budget_bytes)

    def check_fits(self, num_tokens: int) -> None:
        """Raises ValueError if one sequence of num_tokens could never be held."""
        need = self.arena.bytes_for_tokens(num_tokens)
        if need > self.budget_bytes:
            raise ParamError(
                f"prompt + max_tokens ({num_tokens} tokens) needs {need / 2**20:.1f} MiB of "
                f"KV memory but the budget is {self.budget_bytes / 2**20:.1f} MiB; raise "
                "kv_cache_memory",
                "prompt",
            )

    def _target(self, seq: Sequence, num_new_tokens: int) -> int:
        """Tokens to have committed so seq can take num_new_tokens more (with lookahead)."""
        needed = seq.num_computed_tokens + num_new_tokens
        return min(self.max_model_len, needed + COMMIT_AHEAD)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        if seq.kv_slot is None and not self.free_slots:
            return False
        needed = seq.num_computed_tokens + num_new_tokens
        if seq.kv_slot is not None and self.arena.committed_tokens(seq.kv_slot) >= needed:
            return True
        have = 0 if seq.kv_slot is None else self.arena.committed_tokens(seq.kv_slot)
        extra = self.arena.bytes_for_tokens(needed) - self.arena.bytes_for_tokens(have)
        return self.committed_bytes() + extra <= self.budget_bytes

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Gives seq a slot if it has none and commits memory for its new tokens: with
        lookahead when the budget allows, else exactly what can_append checked."""
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError(f"out of KV memory for {num_new_tokens} more tokens")
        if seq.kv_slot is None:
            seq.kv_slot = self.free_slots.pop()
        slot = seq.kv_slot
        needed = seq.num_computed_tokens + num_new_tokens
        have = self.arena.committed_tokens(slot)
        if have >= needed:
            return
        target = self._target(seq, num_new_tokens)
        extra = self.arena.bytes_for_tokens(target) - self.arena.bytes_for_tokens(have)
        if self.committed_bytes() + extra > self.budget_bytes:
            target = needed
        self.arena.commit(slot, target)

    def free(self, seq: Sequence) -> None:
        """Gives seq's slot and its memory back (finish, abort or preemption); a
        preempted sequence recomputes everything when it is scheduled again."""
        seq.num_computed_tokens = 0
        if seq.kv_slot is None:
            return
        self.arena.release(seq.kv_slot)
        self.free_slots.append(seq.kv_slot)
        seq.kv_slot = None

    def trim(self, seq: Sequence) -> None:
        """Nothing to give back: the slot's committed memory stays for the tokens to
        come (as COMMIT_AHEAD's), and seq.num_computed_tokens is the committed length."""

    # Prefix caching is a paged-cache feature: nothing to match or register here.
    def match_prefix(self, seq: Sequence) -> None:
        pass

    def register_computed_blocks(self, seq: Sequence) -> None:
        pass
