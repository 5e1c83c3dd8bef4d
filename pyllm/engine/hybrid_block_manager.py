"""The paged cache's bookkeeping for a model with sliding-window layers: the layers in
KV groups of equal size (pyllm.attention.paged.kv_groups) that take their blocks from
one pool.

Each group has its own block table per sequence (group 0's is seq.block_table, the
others' seq.group_block_tables) and its own BlockManager view of the one pool: one
allocator, one LRU of free blocks, prefix hashes keyed by group. A global group keeps
every token, as BlockManager always does. A window group keeps only what a later query
can still see: the query at position p sees keys (p - window, p], so once a sequence
has computed c tokens, table entries wholly before c - window + 1 point to NULL_BLOCK,
a reserved block of zeros that nothing writes, and their blocks go back to the pool,
where any group may take them. The kernels never read a block wholly before a query's
window; the null block keeps the table's entries valid block numbers all the same.

Every table has one entry per block of the sequence, so a token's block index is the
same in all. A prompt chunk of n tokens needs, in each window group, its window's
blocks plus its own while it runs: at most ceil((window - 1 + n) / block_size) + 1.
A model whose every layer has a window has one group, a window group.

Prefix caching: blocks keep their hashes while free (least recently freed evicted
first, as in BlockManager). A prefix hit of h blocks needs them in every global group
and, in every window group, the blocks of the window before position h * block_size;
where some were evicted the hit is shortened to the longest one whose window is all
there.
"""

from __future__ import annotations

from pyllm.attention.paged import window_blocks
from pyllm.engine.block_manager import BlockManager, prefix_hashes
from pyllm.engine.sequence import Sequence
from pyllm.sampling.params import ParamError

NULL_BLOCK = 0  # pool block 0: zeros, never handed out


class HybridBlockManager:
    def __init__(
        self, pool: BlockManager, windowed: tuple[bool, ...], sliding_window: int,
        max_num_batched_tokens: int, group_layers: int = 1,
    ):  # fmt: skip
        """pool: group 0's manager, whose blocks every group shares; windowed: whether
        each group windows; group_layers: layers per group (for describe)."""
        self.pool = pool
        self.groups = [pool] + [pool.group_view(g) for g in range(1, len(windowed))]
        self.full = [m for m, w in zip(self.groups, windowed, strict=True) if not w]
        self.window = [m for m, w in zip(self.groups, windowed, strict=True) if w]
        self.sliding_window = sliding_window
        self.block_size = pool.block_size
        self.group_layers = group_layers
        # The most window blocks one sequence holds in a group during a step.
        self.step_window_blocks = window_blocks(
            sliding_window, max_num_batched_tokens, self.block_size
        )
        del pool.free_blocks[NULL_BLOCK]
        pool.blocks[NULL_BLOCK].ref_count = 1  # held for good
        self._num_released: dict[int, int] = {}  # per sequence: leading entries nulled

    # --------------------------------------------------------------- reporting

    @property
    def prefix_cache_queries(self) -> int:
        return self.pool.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.pool.prefix_cache_hits

    @property
    def num_blocks(self) -> int:
        """Blocks that can be handed out (the null block excluded)."""
        return self.pool.num_blocks - 1

    def describe(self) -> str:
        n, bs = self.num_blocks, self.block_size
        return (
            f"kv_cache=paged block_size={bs} kv_blocks={n} ({n * bs} tokens of "
            f"{self.group_layers} layers) shared by {len(self.full)} global and "
            f"{len(self.window)} window-{self.sliding_window} KV groups, "
            f"{self.committed_bytes() / 2**30:.2f} GiB"
        )

    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def committed_bytes(self) -> int:
        return self.pool.committed_bytes()

    def block_counts(self) -> tuple[int, int]:
        return self.pool.num_free_blocks, self.num_blocks

    def check_fits(self, num_tokens: int) -> None:
        """One sequence alone: every token in each global group, at most a step's chunk
        and its window in each window group."""
        blocks = -(-num_tokens // self.block_size)
        window = min(blocks, self.step_window_blocks)
        need = blocks * len(self.full) + window * len(self.window)
        if need > self.num_blocks:
            raise ParamError(
                f"prompt + max_tokens needs {need} KV blocks over the cache's KV groups but "
                f"the cache has only {self.num_blocks}; raise kv_cache_memory",
                "prompt",
            )

    # ---------------------------------------------------------------- blocks

    def first_needed(self, num_computed: int) -> int:
        """The first block the query at position num_computed (the next one) can see."""
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = sum(m.blocks_needed(seq, num_new_tokens) for m in self.groups)
        return need <= self.pool.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        if not self.can_append(seq, num_new_tokens):
            raise RuntimeError(f"out of KV blocks: {self.pool.num_free_blocks} free")
        for m in self.groups:
            m.append_slots(seq, num_new_tokens)

    def match_prefix(self, seq: Sequence) -> None:
        """The prompt's full blocks cached in every global group, shortened to where
        every window group still holds the blocks of the window before it."""
        bs = self.block_size
        seq.group_block_tables = [[] for _ in self.groups[1:]]
        caching = self.pool.enable_prefix_caching
        # A sequence that needs every token's hidden state (mean pooling) reuses nothing.
        blocks = list(prefix_hashes(seq.token_ids, bs)) if caching and seq.reuse_prefix else []
        hit = 0
        while hit < len(blocks) and all(m.holds(*blocks[hit]) for m in self.full):
            hit += 1
        cached = [all(m.holds(h, chunk) for m in self.window) for h, chunk in blocks[:hit]]
        while hit and not all(cached[self.first_needed(hit * bs) : hit]):
            hit -= 1
        start = self.first_needed(hit * bs)
        last = blocks[hit - 1][0] if hit else None
        for m in self.groups:
            table = m.block_table(seq)
            assert not table
            first = start if m in self.window else 0
            table.extend([NULL_BLOCK] * first)
            for h, chunk in blocks[first:hit]:
                block_id = m._hold_cached(h, chunk)
                assert block_id is not None, "a block's tokens differ from its hash's"
                table.append(block_id)
            m._num_hashed[id(seq)] = (hit, last)
        self._num_released[id(seq)] = start
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = hit * bs
        if caching:
            self.pool._uncounted[id(seq)] = (seq.num_tokens, hit * bs)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """After a step: offers every group's new full blocks to later prompts, then
        gives back the window groups' blocks no later query of seq can see."""
        for m in self.groups:
            m.register_computed_blocks(seq)
        released = self._num_released.get(id(seq), 0)
        first = self.first_needed(seq.num_computed_tokens)
        for m in self.window:
            table = m.block_table(seq)
            for i in range(released, first):
                m._release(table[i])
                table[i] = NULL_BLOCK
        self._num_released[id(seq)] = max(released, first)

    def trim(self, seq: Sequence) -> None:
        # Only blocks past the computed tokens go: never before the window.
        for m in self.groups:
            m.trim(seq)

    def free(self, seq: Sequence) -> None:
        # Window blocks first: freed earlier, they are evicted before the global ones.
        if len(seq.group_block_tables) < len(self.groups) - 1:
            seq.group_block_tables = [[] for _ in self.groups[1:]]
        for m in self.window:
            table = m.block_table(seq)
            table[:] = [b for b in table if b != NULL_BLOCK]
        for m in self.window + self.full:
            m.free(seq)
        self._num_released.pop(id(seq), None)
