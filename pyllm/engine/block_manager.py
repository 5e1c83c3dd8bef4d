"""KV cache blocks: who holds which, and which full blocks can be shared by prefix.

Every block is either held (ref_count > 0, in some sequences' block tables) or free.
A free block may still hold a cached prefix: its hash stays in `cached_blocks` until
the block is handed out again, least recently freed first. A freed block that holds no
cached prefix is handed out before those, and before blocks never used: its memory is
already committed, where a never-used block faults its pages in when first written (on
2 cores, 30 layers' 4 KiB faults made a 512-token prompt's reshape_and_cache 41 ms
instead of 4). So "free" counts blocks that can be allocated, cached or not, and after
every request has ended all blocks are free.

A full block's hash covers its tokens and, through the previous block's hash, every
token before it: two sequences share a block only if their whole prefix up to and
including that block is the same. It is a blake2b digest, not Python's hash(): the same
in every process, so it also names the block's file in the prefix cache on disk
(`disk`, a BlockStore), which a prefix missing from memory is read back from.
"""

from __future__ import annotations

import copy
import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyllm.engine.sequence import Sequence
from pyllm.sampling.params import ParamError

if TYPE_CHECKING:
    from pyllm.engine.block_store import BlockStore


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and its KV computed
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class Blocks:
    """A pool's Block objects by id, each made on first use. A pool of 43,690 blocks (Gemma 3
    270M's default) made at once took a load 0.11 s: the objects' allocation set off a full
    garbage collection of every object the imports had made."""

    __slots__ = ("_made", "_size")

    def __init__(self, size: int):
        self._made: dict[int, Block] = {}
        self._size = size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, block_id: int) -> Block:
        block = self._made.get(block_id)
        if block is None:
            if not 0 <= block_id < self._size:
                raise IndexError(f"block id {block_id} out of range for {self._size} blocks")
            block = self._made[block_id] = Block(block_id)
        return block

    def __iter__(self):
        return (self[i] for i in range(self._size))


def chain_hash(previous: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    digest = hashlib.blake2b(previous or b"", digest_size=16)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        block_bytes: int = 0,
        table: str | int = "block_table",
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        # Where seq keeps this manager's block table: a Sequence field, or an index into
        # seq.group_block_tables (a KV group sharing another manager's blocks).
        self.table = table
        self.salt = b""  # appended to prefix hashes: groups sharing blocks key them apart
        self.block_size = block_size
        self.block_bytes = block_bytes  # KV memory of one block, all layers of this pool
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = Blocks(num_blocks)
        # Allocation takes from the front: blocks holding no prefix (most recently
        # freed first), never-used ones, then cached prefixes in the order they were
        # freed, so a cached prefix survives as long as possible (LRU eviction).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # hash -> block_id
        self.disk: BlockStore | None = None  # the prefix cache on disk, if any
        # Per sequence: how many of its blocks are hashed (registered in the cache), and
        # the last one's hash (its block may have left a sliding window's table since).
        self._num_hashed: dict[int, tuple[int, bytes | None]] = {}
        self.prefix_cache_queries = 0  # prompt tokens admitted with caching on
        self.prefix_cache_hits = 0  # of those, tokens served from the cache
        # Per sequence matched but not yet admitted: (prompt tokens, cache hits). A prompt
        # counts once, on its first append_slots; one given back before does not.
        self._uncounted: dict[int, tuple[int, int]] = {}

    def group_view(self, group: int) -> BlockManager:
        """KV group `group` (>= 1) over this manager's blocks: one allocator and one LRU of
        free blocks, its own tables (seq.group_block_tables[group - 1]) and prefix keys."""
        view = copy.copy(self)  # shares blocks, free_blocks and cached_blocks
        view.table, view.salt = group - 1, group.to_bytes(4, "little")
        view._num_hashed, view._uncounted = {}, {}
        view.prefix_cache_queries = view.prefix_cache_hits = 0
        return view

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def describe(self) -> str:
        tokens = self.num_blocks * self.block_size
        return (
            f"kv_cache=paged block_size={self.block_size} kv_blocks={self.num_blocks} "
            f"({tokens} tokens, {self.committed_bytes() / 2**30:.2f} GiB)"
        )

    def usage(self) -> float:
        """Share of the blocks in use (0 to 1)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def committed_bytes(self) -> int:
        """The whole cache: it is reserved at start (its pages are committed as blocks
        are first written)."""
        return self.num_blocks * self.block_bytes

    def block_counts(self) -> tuple[int, int]:
        return self.num_free_blocks, self.num_blocks

    def check_fits(self, num_tokens: int) -> None:
        """Raises ValueError if one sequence of num_tokens could never be held."""
        blocks = -(-num_tokens // self.block_size)
        if blocks > self.num_blocks:
            raise ParamError(
                f"prompt + max_tokens needs {blocks} KV blocks but the cache has only "
                f"{self.num_blocks}; raise kv_cache_memory",
                "prompt",
            )

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the cache can hold `num_new_tokens` more of seq's tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(self.block_table(seq)))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grows seq's block table to cover `num_new_tokens` more tokens."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free_blocks} free")
        table = self.block_table(seq)
        for _ in range(needed):
            table.append(self._take_free_block())
        counted = self._uncounted.pop(id(seq), None)
        if counted is not None:
            self.prefix_cache_queries += counted[0]
            self.prefix_cache_hits += counted[1]

    def block_table(self, seq: Sequence) -> list[int]:
        if isinstance(self.table, int):
            return seq.group_block_tables[self.table]
        return getattr(seq, self.table)

    def _set_block_table(self, seq: Sequence, table: list[int]) -> None:
        if isinstance(self.table, int):
            seq.group_block_tables[self.table] = table
        else:
            setattr(seq, self.table, table)

    def holds(self, h: bytes, chunk: tuple[int, ...]) -> bool:
        """Whether a block of these tokens is cached under h (in memory)."""
        block_id = self.cached_blocks.get(h + self.salt)
        return block_id is not None and self.blocks[block_id].token_ids == chunk

    def match_prefix(self, seq: Sequence) -> None:
        """On a sequence's first schedule: reuse cached blocks of its prompt's prefix.

        Only full blocks are shared, and at least one prompt token is always left to
        compute, since the model needs the last token's logits. A sequence that needs
        every token's hidden state (not seq.reuse_prefix) computes them all.
        """
        table = self.block_table(seq)
        assert not table and seq.num_computed_tokens == 0
        self._num_hashed[id(seq)] = (0, None)
        if not self.enable_prefix_caching or not seq.reuse_prefix:
            return
        previous = None
        for h, chunk in prefix_hashes(seq.token_ids, self.block_size):
            block_id = self._hold_cached(h, chunk)
            if block_id is None:
                break
            table.append(block_id)
            previous = h
        num_hit = len(table)
        self._num_hashed[id(seq)] = (num_hit, previous)
        seq.num_computed_tokens = num_hit * self.block_size
        seq.num_cached_prompt_tokens = seq.num_computed_tokens
        self._uncounted[id(seq)] = (seq.num_tokens, seq.num_computed_tokens)

    def _hold_cached(self, h: bytes, chunk: tuple[int, ...]) -> int | None:
        """The block cached under h, held once more; read from disk into a free block
        if not in memory; None where neither has it."""
        block_id = self.cached_blocks.get(h + self.salt)
        if block_id is None:
            return self._read_from_disk(h, chunk)
        block = self.blocks[block_id]
        if block.token_ids != chunk:
            return None
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1
        return block_id

    def _read_from_disk(self, h: bytes, chunk: tuple[int, ...]) -> int | None:
        if self.disk is None or not self.free_blocks or not self.disk.contains(h):
            return None
        block_id = self._take_free_block()
        if not self.disk.load(h, block_id):
            self._give_back(self.blocks[block_id])
            return None
        block = self.blocks[block_id]
        block.hash, block.token_ids = h, chunk
        self.cached_blocks[h] = block_id
        return block_id

    def register_computed_blocks(self, seq: Sequence) -> None:
        """After a step: make seq's newly filled blocks findable by later prompts."""
        if not self.enable_prefix_caching:
            return
        done, previous = self._num_hashed.get(id(seq), (0, None))
        full = seq.num_computed_tokens // self.block_size
        table = self.block_table(seq)
        for i in range(done, full):
            block = self.blocks[table[i]]
            chunk = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(previous, chunk)
            key = h + self.salt
            if block.hash is None and key not in self.cached_blocks:
                block.hash, block.token_ids = key, chunk
                self.cached_blocks[key] = block.block_id
                if self.disk is not None:
                    self.disk.save(h, block.block_id)
            previous = h
        if full > done:
            self._num_hashed[id(seq)] = (full, previous)

    def trim(self, seq: Sequence) -> None:
        """Frees seq's blocks past its computed tokens (those only rejected proposals
        reached). Never hashed, never shared: they go to the front of the free list and
        are taken before any cached prefix is evicted. The last kept block may hold
        rejected KV past the computed tokens; it is not full, so not hashed, and those
        positions are written again before it fills."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        table = self.block_table(seq)
        for block_id in reversed(table[keep:]):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, f"block {block_id} is shared"
            self._give_back(block)
        del table[keep:]

    def _give_back(self, block: Block) -> None:
        """Frees a block that holds nothing worth keeping: it is the next one taken."""
        block.ref_count = 0
        self.free_blocks[block.block_id] = None
        self.free_blocks.move_to_end(block.block_id, last=False)

    def free(self, seq: Sequence) -> None:
        """Releases seq's blocks (finished, aborted or preempted)."""
        # Tail blocks first: they are the least likely to be shared, so they should
        # be evicted before the prefix blocks they follow.
        for block_id in reversed(self.block_table(seq)):
            self._release(block_id)
        self._set_block_table(seq, [])
        seq.num_computed_tokens = 0
        self._num_hashed.pop(id(seq), None)
        self._uncounted.pop(id(seq), None)

    def _release(self, block_id: int) -> None:
        """One holder less; a block nobody holds is free, keeping its cached prefix, or
        is the next one taken where it holds none."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.hash is None:
                self._give_back(block)
            else:
                self.free_blocks[block_id] = None

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the cached prefix it held
            if self.cached_blocks.get(block.hash) == block_id:
                del self.cached_blocks[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id


def prefix_hashes(token_ids: list[int], block_size: int):
    """(hash, tokens) of each full block a prompt may take from the prefix cache: at
    least one token is left to compute, since the model needs the last token's logits."""
    previous = None
    for i in range((len(token_ids) - 1) // block_size):
        chunk = tuple(token_ids[i * block_size : (i + 1) * block_size])
        previous = chain_hash(previous, chunk)
        yield previous, chunk
