"""Structured output: a sequence's tokens constrained to a JSON schema, any JSON object, a
regex, one of a few strings, or a grammar (Lark or GBNF), through llguidance.

    spec = StructuredOutput(json={"type": "object", ...})   # in SamplingParams
    grammars = GrammarCompiler(tokenizer, vocab_size)        # one per engine
    grammars.compile(spec)     # once per spec (cached); ParamError if it is invalid
    matcher = grammars.matcher(spec)                         # one per sequence
    mask_logits(logits, rows, matchers, eos_ids)             # each step, in the sampler

Each step the sampler asks every constrained sequence's matcher which tokens may come
next (one bit per token, filled in parallel by llguidance's threads) and masks the
others out of the logits in one tensor operation; the engine then advances the matcher
with the sampled token. End-of-sequence tokens are allowed only where the grammar may
end.

llguidance rather than xgrammar: it installs as one 3 MB wheel with no dependencies
(xgrammar pulls transformers and triton), and its masks are cheap enough: ~30 us per
sequence and step for a nested JSON schema over SmolLM2's 49k-token vocabulary, against
a decode step of tens of milliseconds.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from pyllm import ops
from pyllm.sampling.errors import ParamError

# A spec larger than this is refused before compiling: real schemas are a few KiB, and
# the compile time of a hostile one grows with its size.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
_CACHE_SIZE = 256  # compiled specs kept


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
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as error:
                    raise ParamError(f"json: not a JSON schema: {error}", self.param) from None
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

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    @property
    def param(self) -> str:
        return f"structured_output.{self.kind}"

    @property
    def key(self) -> str:
        """The spec as one string: what compiled grammars are cached by."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))

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
    server compiles in worker threads while the engine thread takes matchers."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def compile(self, spec: StructuredOutput):
        """The compiled (pristine) matcher of `spec`; ParamError naming the field if the
        spec is invalid or beyond the parser's limits."""
        with self._lock:
            compiled = self._compiled.get(spec.key)
            if compiled is not None:
                self._compiled.move_to_end(spec.key)
                return compiled
        llguidance = _import_llguidance(spec)
        tokenizer = self._llguidance_tokenizer()
        try:
            grammar = spec.llguidance_grammar()
        except Exception as error:  # llguidance's parse errors have no common type
            raise ParamError(f"{spec.param}: {_first_line(str(error))}", spec.param) from None
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        # The first mask too: a grammar that overflows the parser's limits mostly does so
        # at once, and is then a client error rather than a failure mid-generation.
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        for m in (matcher, probe):
            if m.is_error():
                raise ParamError(f"{spec.param}: {_first_line(m.get_error())}", spec.param)
        with self._lock:
            self._compiled[spec.key] = matcher
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

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
    kernel (ops.apply_token_bitmask). A matcher in error (a grammar past the parser's
    limits mid-way) allows only end-of-sequence."""
    global _executor
    import llguidance
    import llguidance.torch as llg_torch

    if _executor is None:
        _executor = llguidance.LLExecutor()
    vocab = logits.shape[1]
    bitmask = llg_torch.allocate_token_bitmask(len(matchers), vocab)
    llg_torch.fill_next_token_bitmask_par(
        _executor, [(m, i) for i, m in enumerate(matchers)], bitmask
    )
    for i, m in enumerate(matchers):
        if m.is_error():
            bitmask[i] = 0
            for t in eos_ids:
                bitmask[i, t // 32] |= _BITS[t % 32]
    device = logits.device
    rows_tensor = torch.tensor(rows, dtype=torch.int64, device=device)
    ops.apply_token_bitmask(logits, bitmask.to(device), rows_tensor)


# Bit b of a mask word: 1 << b as int32 (bit 31 is the sign bit; & works all the same).
_BITS = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32)


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
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:4])[:500] if lines else "invalid"
