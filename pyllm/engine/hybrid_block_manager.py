"""The paged cache's bookkeeping for a model with sliding-window layers: two groups of
layers, each with its own block pool and block table per sequence.

The global layers (`full`, seq.block_table) keep every token, as BlockManager always
does. The window layers (`window`, seq.window_block_table) keep only what a later
query can still see: the query at position p sees keys (p - window, p], so once a
sequence has computed c tokens, table entries wholly before c - window + 1 point to
NULL_BLOCK, a reserved block of zeros that nothing writes, and their blocks go back
to the window pool. The kernels never read a block wholly before a query's window;
the null block keeps the table's entries valid block numbers all the same.

Both tables have one entry per block of the sequence, so a token's block index is the
same in both. A prompt chunk of n tokens needs its window's blocks plus its own while
it runs: at most ceil((window - 1 + n) / block_size) + 1 window blocks. A model whose
every layer has a window has no global pool (`full` None): the window pool is its one
pool, and its table seq.block_table.

Prefix caching: window blocks keep their hashes while free (least recently freed
evicted first, as in BlockManager). A prefix hit of h blocks needs, in the window
pool, the blocks of the window before position h * block_size; where some were
evicted the hit is shortened to the longest one whose window is all there.
"""

from __future__ import annotations

from pyllm.engine.block_manager import BlockManager, prefix_hashes
from pyllm.engine.sequence import Sequence

NULL_BLOCK = 0  # window pool block 0: zeros, never handed out


class HybridBlockManager:
    def __init__(self, full: BlockManager | None, window: BlockManager, sliding_window: int):
        """full None: every layer has a window (Mistral-style); the one pool is the
        window pool, and its table is seq.block_table."""
        if full is not None:
            assert window.table == "window_block_table" and window.block_size == full.block_size
        self.full, self.window = full, window
        self.pools = [p for p in (full, window) if p is not None]
        self.sliding_window = sliding_window
        self.block_size = window.block_size
        del window.free_blocks[NULL_BLOCK]
        window.blocks[NULL_BLOCK].ref_count = 1  # held for good
        self._num_released: dict[int, int] = {}  # per sequence: leading entries nulled

    # --------------------------------------------------------------- reporting

    @property
    def prefix_cache_queries(self) -> int:
        return self.pools[0].prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.pools[0].prefix_cache_hits

    @property
    def num_window_blocks(self) -> int:
        """Window blocks that can be handed out (the null block excluded)."""
        return self.window.num_blocks - 1

    def describe(self) -> str:
        bs, full = self.block_size, self.full
        size = f"{self.committed_bytes() / 2**30:.2f} GiB"
        window = (
            f"kv_blocks={self.num_window_blocks} ({self.num_window_blocks * bs} tokens "
            f"of window {self.sliding_window}"
        )
        if full is None:
            return f"kv_cache=paged block_size={bs} window {window}, every layer), {size}"
        return (
            f"kv_cache=paged block_size={bs} kv_blocks={full.num_blocks} "
            f"({full.num_blocks * bs} tokens) + window {window}), {size}"
        )

    def usage(self) -> float:
        """The fuller pool's share in use: either running out stops admission."""
        window_used = 1.0 - self.window.num_free_blocks / self.num_window_blocks
        return max(window_used, self.full.usage() if self.full else 0.0)

    def committed_bytes(self) -> int:
        return sum(p.committed_bytes() for p in self.pools)

    def block_counts(self) -> tuple[int, int]:
        """(free, total) over the pools (the null block left out)."""
        free = sum(p.num_free_blocks for p in self.pools)
        return free, sum(p.num_blocks for p in self.pools) - 1

    def check_fits(self, num_tokens: int) -> None:
        # The window pool holds a step's chunk and its window whatever the length
        # (checked when it is sized); the global pool holds every token.
        if self.full is not None:
            self.full.check_fits(num_tokens)

    # ---------------------------------------------------------------- blocks

    def first_needed(self, num_computed: int) -> int:
        """The first block the query at position num_computed (the next one) can see."""
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return all(p.can_append(seq, num_new_tokens) for p in self.pools)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        for pool in self.pools:
            pool.append_slots(seq, num_new_tokens)

    def match_prefix(self, seq: Sequence) -> None:
        """The global group's hit (every full prompt block where there is none),
        shortened to where the window group still holds the blocks of the window
        before it."""
        window, bs = self.window, self.block_size
        # A sequence that needs every token's hidden state (mean pooling) reuses nothing.
        blocks = list(prefix_hashes(seq.token_ids, bs)) if seq.reuse_prefix else []
        if self.full is not None:
            self.full.match_prefix(seq)
            blocks = blocks[: len(seq.block_table)]
        hit = len(blocks)
        cached = [window.cached_blocks.get(h) is not None for h, _ in blocks]
        while hit and not all(cached[self.first_needed(hit * bs) : hit]):
            hit -= 1
        if self.full is not None and hit < len(seq.block_table):
            self.full.drop_hits(seq, hit)
        start = self.first_needed(hit * bs)
        table = window.block_table(seq)
        assert not table
        table.extend([NULL_BLOCK] * start)
        for h, chunk in blocks[start:hit]:
            block_id = window._hold_cached(h, chunk)
            assert block_id is not None, "a window block's tokens differ from its hash's"
            table.append(block_id)
        window._num_hashed[id(seq)] = (hit, blocks[hit - 1][0] if hit else None)
        self._num_released[id(seq)] = start
        if self.full is None:
            seq.num_computed_tokens = seq.num_cached_prompt_tokens = hit * bs
            if window.enable_prefix_caching:
                window._uncounted[id(seq)] = (seq.num_tokens, hit * bs)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """After a step: offers the new full blocks of both groups to later prompts,
        then gives back the window blocks no later query of seq can see."""
        for pool in self.pools:
            pool.register_computed_blocks(seq)
        table = self.window.block_table(seq)
        released = self._num_released.get(id(seq), 0)
        first = self.first_needed(seq.num_computed_tokens)
        for i in range(released, first):
            self.window._release(table[i])
            table[i] = NULL_BLOCK
        self._num_released[id(seq)] = max(released, first)

    def trim(self, seq: Sequence) -> None:
        # Only blocks past the computed tokens go: never before the window.
        for pool in self.pools:
            pool.trim(seq)

    def free(self, seq: Sequence) -> None:
        table = self.window.block_table(seq)
        table[:] = [b for b in table if b != NULL_BLOCK]
        for pool in reversed(self.pools):
            pool.free(seq)
        self._num_released.pop(id(seq), None)
