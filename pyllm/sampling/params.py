"""SamplingParams: what one request asks of the sampler and of the stop checks.

Field names and meanings follow the OpenAI API and vLLM, so a request body maps onto
this class field by field. Every value is validated here, once, and a bad one raises
ParamError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyllm.sampling.errors import ParamError

if TYPE_CHECKING:
    from pyllm.sampling.structured import StructuredOutput

MAX_TOP_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    # How many tokens, and when to stop.
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False

    # The distribution: temperature 0 (below sampling.batch.GREEDY_TEMPERATURE) is greedy.
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0

    # Penalties. repeat_last_n: the window of most recent tokens repetition_penalty
    # looks at (0 = the whole context, as in llama.cpp).
    repetition_penalty: float = 1.0
    repeat_last_n: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    seed: int | None = None
    n: int = 1
    # Samples drawn; the n with the highest log-probability per token are returned
    # (OpenAI's best_of). None: n.
    best_of: int | None = None

    # Log-probabilities: of the chosen token (logprobs=0) plus the top k (logprobs=k).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    # Constrained decoding: a JSON schema, regex, choice or grammar (structured.py); a
    # dict is read as StructuredOutput's fields.
    structured_output: StructuredOutput | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()

    @property
    def num_samples(self) -> int:
        """Sequences the engine runs for this request: best_of, else n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def ranks_samples(self) -> bool:
        """More samples are drawn than returned, so each one's log-probability is needed."""
        return self.num_samples > self.n

    def validate(self) -> None:
        """Raises ParamError on the first bad value, the fields checked in class order."""
        self._validate_stopping()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_samples()
        self._validate_structured()

    def _validate_structured(self) -> None:
        from pyllm.sampling.structured import StructuredOutput

        spec = self.structured_output
        if spec is None:
            return
        if isinstance(spec, dict):
            try:
                spec = self.structured_output = StructuredOutput(**spec)
            except TypeError as error:  # an unknown key
                raise ParamError(f"structured_output: {error}", "structured_output") from None
        if not isinstance(spec, StructuredOutput):
            raise ParamError(
                f"structured_output must be a StructuredOutput or dict, got {type(spec).__name__}",
                "structured_output",
            )
        # Both would forbid the end-of-sequence token where the grammar needs it.
        if self.ignore_eos or self.min_tokens:
            name = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise ParamError(f"{name} cannot be combined with structured_output", name)

    def _validate_stopping(self) -> None:
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1)
        _integer("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                "min_tokens",
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ParamError("stop must be a list of non-empty strings", "stop")
        for token_id in self.stop_token_ids:
            _integer("stop_token_ids", token_id, 0)

    def _validate_distribution(self) -> None:
        if _number("temperature", self.temperature) < 0:
            raise ParamError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        _integer("top_k", self.top_k, -1)
        top_p = _number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0.0 <= _number("min_p", self.min_p) <= 1.0:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")

    def _validate_penalties(self) -> None:
        if _number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ParamError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        _integer("repeat_last_n", self.repeat_last_n, 0)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _number(name, getattr(self, name)) <= 2.0:
                raise ParamError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        for token_id, bias in self.logit_bias.items():
            _integer("logit_bias key", token_id, 0, "logit_bias")
            if not -100.0 <= _number("logit_bias value", bias, "logit_bias") <= 100.0:
                raise ParamError(
                    f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias"
                )

    def _validate_samples(self) -> None:
        """seed, n, best_of and the logprobs counts."""
        if self.seed is not None:
            _integer("seed", self.seed)
        _integer("n", self.n, 1)
        if self.best_of is not None:
            _integer("best_of", self.best_of, 1)
            if self.best_of < self.n:
                raise ParamError(f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _integer(name, value, 0)
                if value > MAX_TOP_LOGPROBS:
                    raise ParamError(f"{name} must be <= {MAX_TOP_LOGPROBS}, got {value}", name)


def _integer(name: str, value: object, low: int | None = None, param: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(f"{name} must be an integer, got {value!r}", param or name)
    if low is not None and value < low:
        raise ParamError(f"{name} must be >= {low}, got {value}", param or name)


def _number(name: str, value: object, param: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(f"{name} must be a number, got {value!r}", param or name)
    if value != value or value in (float("inf"), float("-inf")):
        raise ParamError(f"{name} must be finite, got {value}", param or name)
    return float(value)
