"""What one grammar may cost, and the compiled-grammar cache bounded in bytes.

A regex of 15 bytes such as `a{1000}{1001}` asks llguidance's lexer for a million
states: with its default limits the first mask alone takes a second and ~150 MB that
stay with the compiled grammar. LIMITS caps that work (llguidance's "fuel": the
expressions its lexer may build per step, its states, its parser items per step) so a
hostile grammar fails within ~0.1 s and ~20 MB, and GrammarCache holds compiled
grammars up to a byte budget, measured as the process's resident-memory growth while
each compiled (compiles run one at a time, so the growth is theirs).

Freed Rust memory goes back to glibc's heap, not to the system; `release_memory`
returns it (malloc_trim) after a grammar is refused or evicted, so the memory a
hostile grammar took does not stay counted against the machine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections import OrderedDict
from typing import Any

# llguidance's LLParserLimits, tighter than its defaults (1M initial / 200k step lexer
# fuel, 250k lexer states, 50k items per step, 500k grammar symbols). Every schema,
# regex and grammar in tests/ and benchmarks/ stays far below them.
LIMITS = {
    "initial_lexer_fuel": 100_000,  # building the lexer: ~0.1 s and ~20 MB at most
    "step_lexer_fuel": 100_000,  # per mask and token
    "max_lexer_states": 20_000,  # ~1-2 KB each
    "step_max_items": 5_000,  # Earley items per mask
    "max_items_in_row": 2_000,
    "max_grammar_size": 200_000,  # symbols in the grammar's productions
    "verbose_errors": False,  # an error is one line, without the parser's state
}
# Thread CPU time a compile may take (building, then PROBE_STEPS masks and tokens).
MAX_COMPILE_CPU_S = 1.0
PROBE_STEPS = 4
CACHE_BYTES = 256 * 2**20
CACHE_ENTRIES = 256
MIN_ENTRY_BYTES = 64 * 1024  # what an entry counts for at least (the RSS delta may be 0)

LIMITS_TEXT = (
    f"the server's grammar limits are {LIMITS['step_lexer_fuel']} lexer fuel per step, "
    f"{LIMITS['max_lexer_states']} lexer states, {LIMITS['step_max_items']} parser items "
    f"per step, {LIMITS['max_grammar_size']} grammar symbols and "
    f"{MAX_COMPILE_CPU_S:g} s of CPU to compile"
)


def parser_limits():
    import llguidance

    return llguidance.LLParserLimits(**LIMITS)


def over_limits(field: str, what: str, when: str = "") -> str:
    """The message of a grammar past the limits: `field`, what happened, the limits."""
    return f"{field}: the grammar is too complex{when} ({what}); {LIMITS_TEXT}"


class GrammarCache:
    """Compiled grammars by spec key, least recently used evicted first, within a byte
    budget and an entry count. Not thread-safe: the caller holds a lock."""

    def __init__(self, max_bytes: int = CACHE_BYTES, max_entries: int = CACHE_ENTRIES):
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str):
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: str, value, size: int) -> bool:
        """Caches value as `size` bytes (not at all if larger than the budget); True if
        others were evicted for it."""
        size = max(size, MIN_ENTRY_BYTES)
        if key in self._entries or size > self.max_bytes:
            return False
        evicted = False
        while self._entries and (
            self.bytes + size > self.max_bytes or len(self._entries) >= self.max_entries
        ):
            _, (_, freed) = self._entries.popitem(last=False)
            self.bytes -= freed
            evicted = True
        self._entries[key] = (value, size)
        self.bytes += size
        return evicted


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """The process's resident memory (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_malloc_trim()


def release_memory() -> None:
    """Gives the heap's free memory back to the system (glibc only; else nothing)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
