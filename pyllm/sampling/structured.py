"""Structured output: a sequence's tokens constrained to a JSON schema, any JSON object, a
regex, one of a few strings, or a grammar (Lark or GBNF), through llguidance.

    spec = StructuredOutput(json={"type": "object", ...})   # in SamplingParams
    grammars = GrammarCompiler(tokenizer, vocab_size)        # one per engine
    grammars.compile(spec)     # once per spec (cached); ParamError if it is invalid
    matcher = grammars.matcher(spec)                         # one per sequence
    mask_logits(logits, rows, matchers, eos_ids)             # each step, in the sampler
    mask_draft_logits(logits, starts, matchers, drafts, eos_ids)  # speculative rows

Each step the sampler asks every constrained sequence's matcher which tokens may come
next (one bit per token, filled in parallel by llguidance's threads) and masks the
others out of the logits in one tensor operation; the engine then advances the matcher
with the sampled token. End-of-sequence tokens are allowed only where the grammar may
end.

llguidance rather than xgrammar: it installs as one 3 MB wheel with no dependencies
(xgrammar pulls transformers and triton), and its masks are cheap enough: ~30 us per
sequence and step for a nested JSON schema over SmolLM2's 49k-token vocabulary, against
a decode step of tens of milliseconds.

What one grammar may cost (llguidance's limits, the compile's CPU time) and the cache's
byte budget are in grammar_budget.py. A grammar past the limits at compile time is a
ParamError; one that goes past them while decoding ends its sequence with
finish_reason "error" (the engine reads `matcher_error`).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pyllm import ops
from pyllm.sampling import grammar_budget as budget
from pyllm.sampling.errors import ParamError
from pyllm.sampling.json_depth import MAX_JSON_DEPTH, json_text_depth, loads_bounded

# A spec larger than this is refused before compiling: real schemas are a few KiB, and
# the compile time of a hostile one grows with its size.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024


@dataclass(slots=True)
class StructuredOutput:
    """Exactly one of: `json` (a JSON schema, dict or string), `json_object` (any JSON
    object), `regex`, `choice` (the output is one of these strings), `grammar` (Lark,
    or llama.cpp's GBNF)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    _key: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ParamError(
                f"structured_output needs exactly one of {', '.join(_KINDS)}, got "
                f"{', '.join(given) or 'none'}",
                "structured_output",
            )
        self._check_types()
        if len(self.key) > MAX_SPEC_CHARS:
            raise ParamError(
                f"structured_output.{self.kind} is {len(self.key)} characters long; the "
                f"limit is {MAX_SPEC_CHARS}",
                self.param,
            )

    def _check_types(self) -> None:
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            value = self._parsed_json(value)
            if not isinstance(value, dict | bool):
                raise ParamError("json must be a JSON schema (an object)", self.param)
        elif kind == "json_object":
            if value is not True:
                raise ParamError("json_object must be true", self.param)
        elif kind == "choice":
            if not isinstance(value, list | tuple) or not value:
                raise ParamError("choice must be a non-empty list of strings", self.param)
            if len(value) > MAX_CHOICES or not all(isinstance(c, str) and c for c in value):
                raise ParamError(f"choice must be 1 to {MAX_CHOICES} non-empty strings", self.param)
            self.choice = list(value)
        elif not isinstance(value, str) or not value:
            raise ParamError(f"{kind} must be a non-empty string", self.param)

    def _parsed_json(self, value: Any) -> Any:
        """The schema as an object, its nesting bounded either way it came."""
        try:
            if isinstance(value, str):
                return loads_bounded(value)
            text = json.dumps(value)  # RecursionError: deeper than Python's stack allows
        except (ValueError, TypeError, RecursionError) as error:
            raise ParamError(f"json: not a JSON schema: {error}", self.param) from None
        depth = json_text_depth(text)
        if depth > MAX_JSON_DEPTH:
            raise ParamError(
                f"json: the schema nests {depth} levels deep; the limit is {MAX_JSON_DEPTH}",
                self.param,
            )
        return value

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    @property
    def param(self) -> str:
        return f"structured_output.{self.kind}"

    @property
    def key(self) -> str:
        """The spec as one string: what compiled grammars are cached by."""
        if self._key is None:
            value: Any = getattr(self, self.kind)
            if self.kind == "json" and isinstance(value, str):
                value = json.loads(value)  # its depth was checked in __post_init__
            compact = json.dumps(value, sort_keys=True, separators=(",", ":"))
            self._key = self.kind + ":" + compact
        return self._key

    def llguidance_grammar(self) -> str:
        """The spec in llguidance's grammar format."""
        import llguidance

        kind, value = self.kind, getattr(self, self.kind)
        if kind in ("json", "json_object"):
            schema = value if isinstance(value, str) else json.dumps(value)
            if kind == "json_object":
                schema = '{"type": "object"}'
            # JSON on one line, as OpenAI's models write it: free whitespace lets a small
            # model spend its tokens on indentation and newlines.
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            # Lark string literals take JSON's escapes.
            lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        from llguidance.gbnf_to_lark import any_to_lark  # GBNF to Lark; Lark as it is

        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(value))


_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GrammarCompiler:
    """Compiles specs against one tokenizer and hands out matchers. Thread-safe: the
    server compiles in worker threads while the engine thread takes matchers.

    Compiles run one at a time: the process's memory growth meanwhile is the grammar's
    size in the cache, and a burst of hostile grammars costs one grammar's memory at a
    time."""

    def __init__(self, tokenizer, vocab_size: int, cache_bytes: int = budget.CACHE_BYTES):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()  # the cache and the tokenizer
        self._compile_lock = threading.Lock()
        self._ll_tokenizer = None
        self._token_lengths: torch.Tensor | None = None  # bytes per token, for the probe
        self.cache = budget.GrammarCache(cache_bytes)

    def compile(self, spec: StructuredOutput):
        """The compiled (pristine) matcher of `spec`; ParamError naming the field if the
        spec is invalid or beyond the limits (grammar_budget.py)."""
        with self._lock:
            compiled = self.cache.get(spec.key)
        if compiled is not None:
            return compiled
        llguidance = _import_llguidance(spec)
        tokenizer = self._llguidance_tokenizer()
        try:
            grammar = spec.llguidance_grammar()
        except Exception as error:  # llguidance's parse errors have no common type
            raise ParamError(f"{spec.param}: {_first_line(str(error))}", spec.param) from None
        with self._compile_lock:
            with self._lock:
                compiled = self.cache.get(spec.key)  # compiled meanwhile by another thread
            if compiled is not None:
                return compiled
            before = budget.resident_bytes()
            matcher, problem = self._build(llguidance, tokenizer, grammar)
            if problem is not None:
                matcher = None
                budget.release_memory()  # what the refused grammar took
                raise _refusal(spec, problem)
            size = budget.resident_bytes() - before
            with self._lock:
                evicted = self.cache.put(spec.key, matcher, size)
            if evicted:
                budget.release_memory()
        return matcher

    def _build(self, llguidance, tokenizer, grammar: str):
        """(matcher, None), or (None, why it failed). The first PROBE_STEPS masks are
        computed too, each followed by the longest token it allows: a grammar past the
        limits mostly is so at once, and is then a client error rather than a failure
        mid-generation. Returns rather than raises, so that nothing (a traceback's
        frames) keeps a refused matcher's memory alive."""
        start = time.thread_time()
        matcher = llguidance.LLMatcher(
            tokenizer, grammar, log_level=0, limits=budget.parser_limits()
        )
        if matcher.is_error():
            return None, matcher.get_error()
        probe = matcher.deep_copy()
        mask = _allocate_bitmask(1, self.vocab_size)
        for _ in range(budget.PROBE_STEPS):
            probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            token = None if probe.is_error() else self._longest_allowed(mask)
            if token is not None:
                probe.consume_token(token)
            if probe.is_error():
                return None, probe.get_error()
            spent = time.thread_time() - start
            if spent > budget.MAX_COMPILE_CPU_S:
                return None, f"compiling took {spent:.1f} s of CPU"
            if token is None:
                break
        return matcher, None

    def _longest_allowed(self, mask: torch.Tensor) -> int | None:
        """The allowed token with the most bytes, end-of-sequence aside (None if none)."""
        if self._token_lengths is None:
            self._token_lengths = _token_lengths(self._ll_tokenizer, self.vocab_size)
            self._token_lengths[sorted(self._tokenizer.eos_token_ids)] = 0
        bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten()[: self.vocab_size].bool()
        lengths = torch.where(allowed, self._token_lengths, 0)
        token = int(lengths.argmax())
        return token if lengths[token] > 0 else None

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher for one sequence (a copy of the compiled one)."""
        return self.compile(spec).deep_copy()

    def _llguidance_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                from pyllm.model.tokenizer.export import hf_tokenizer_json

                try:
                    document = hf_tokenizer_json(self._tokenizer)
                except ValueError as error:
                    raise ParamError(
                        f"structured output is not available for this tokenizer: {error}",
                        "structured_output",
                    ) from None
                self._ll_tokenizer = llguidance.LLTokenizer(
                    document,
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids),
                )
            return self._ll_tokenizer


_executor = None  # llguidance's thread pool for filling masks, made on first use


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list, eos_ids) -> None:
    """Sets logits[rows[i], t] = -inf for every token t that matchers[i] does not allow
    next: the masks are filled in parallel, then applied to all rows at once by one
    kernel (ops.apply_token_bitmask). A matcher in error (a grammar past the limits
    mid-way) allows only end-of-sequence; the engine then ends that sequence with
    finish_reason "error" (matcher_error)."""
    bitmask = _allocate_bitmask(len(matchers), logits.shape[1])
    _fill_masks(bitmask, list(enumerate(matchers)), eos_ids)
    _apply_masks(logits, rows, bitmask)


def mask_draft_logits(
    logits: torch.Tensor, starts: list[int], matchers: list, drafts: list[list[int]], eos_ids
) -> None:
    """Speculative decoding's masks: row starts[j] + i of logits gets the mask of
    matchers[j] after it consumed drafts[j][:i] (each draft allowed by its grammar:
    allowed_prefix). llguidance walks each matcher through its draft and back, the
    sequences in parallel."""
    rows = [
        start + i
        for start, draft in zip(starts, drafts, strict=True)
        for i in range(len(draft) + 1)
    ]
    bitmask = _allocate_bitmask(len(rows), logits.shape[1])
    local = list(itertools.accumulate((len(d) + 1 for d in drafts), initial=0))
    walks = [(m, first, draft) for m, first, draft in zip(matchers, local, drafts, strict=False)]
    _shared_executor().unsafe_compute_mask_ptr_with_draft_token(
        walks, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
    )
    _only_eos_where_error(bitmask, [(first, m) for m, first, _ in walks], eos_ids)
    _apply_masks(logits, rows, bitmask)


def allowed_prefix(matcher, draft: list[int]) -> list[int]:
    """The longest prefix of draft the grammar accepts from where matcher stands."""
    if not draft or matcher.is_error() or matcher.is_stopped():
        return []
    return draft[: matcher.validate_tokens(draft)]


def _fill_masks(bitmask: torch.Tensor, targets: list[tuple[int, object]], eos_ids) -> None:
    """Fills bitmask[row] with matcher's next-token mask for each (row, matcher)."""
    pairs = [(m, row) for row, m in targets]
    _shared_executor().unsafe_compute_mask_ptr(
        pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
    )
    _only_eos_where_error(bitmask, targets, eos_ids)


def _shared_executor():
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def _only_eos_where_error(bitmask: torch.Tensor, targets, eos_ids) -> None:
    for row, m in targets:
        if m.is_error():
            bitmask[row] = 0
            for t in eos_ids:
                bitmask[row, t // 32] |= _BITS[t % 32]


def _apply_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    device = logits.device
    rows_tensor = torch.tensor(rows, dtype=torch.int64, device=device)
    ops.apply_token_bitmask(logits, bitmask.to(device), rows_tensor)


def _allocate_bitmask(rows: int, vocab: int) -> torch.Tensor:
    # llguidance's own llguidance.torch helpers would import torch.compile's machinery
    # (~7 s and ~100 MB at the first constrained request) for a kernel never used here.
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


# Bit b of a mask word: 1 << b as int32 (bit 31 is the sign bit; & works all the same).
_BITS = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)


def matcher_error(matcher) -> str | None:
    """Why a sequence's matcher failed mid-generation (past the limits), or None."""
    if matcher is None or not matcher.is_error():
        return None
    return budget.over_limits("structured_output", _first_line(matcher.get_error()),
                              " for this output")  # fmt: skip


def _refusal(spec: StructuredOutput, problem: str) -> ParamError:
    problem = _first_line(problem)
    if not _is_limit(problem):
        return ParamError(f"{spec.param}: {problem}", spec.param)
    return ParamError(budget.over_limits(spec.param, problem), spec.param, "grammar_too_complex")


def _is_limit(problem: str) -> bool:
    lowered = problem.lower()
    return any(s in lowered for s in ("too many", "limit", "max is", "fuel", "of cpu", "too big"))


def _token_lengths(ll_tokenizer, vocab_size: int) -> torch.Tensor:
    lengths = [len(ll_tokenizer.decode_bytes([t])) for t in range(vocab_size)]
    return torch.tensor(lengths, dtype=torch.int32)


def _import_llguidance(spec: StructuredOutput):
    try:
        import llguidance
    except ImportError:
        raise ParamError(
            "structured output needs the llguidance package: pip install llguidance",
            spec.param,
        ) from None
    return llguidance


def _first_line(message: str) -> str:
    """llguidance's error, on one line (it may point at the spot over several)."""
    message = message.replace("<non-verbose/>", "")  # the mark of LIMITS' verbose_errors
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:4])[:500] if lines else "invalid"
