"""The fields chat and text completions share, and how they become SamplingParams.

Structured output (response_format, vLLM's structured_outputs and guided_* fields, and,
on chats, tool_choice "required" or a named function) becomes
SamplingParams.structured_output. vLLM's extension fields (top_k, min_p,
repetition_penalty, repeat_last_n, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens, include_stop_str_in_output) map onto the fields of the same name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pyllm.entrypoints.openai_protocol.base import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    StrictRequest,
)
from pyllm.entrypoints.openai_protocol.errors import RequestError
from pyllm.sampling.params import SamplingParams
from pyllm.sampling.structured import StructuredOutput

# What a ParamError's code says about a request that does not fit the context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class StreamOptions(StrictRequest):
    include_usage: bool = False


class JsonSchemaFormat(StrictRequest):
    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(StrictRequest):
    """vLLM's `structured_outputs` field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingRequest(StrictRequest):
    """The fields chat and text completions share, and their mapping to SamplingParams."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # `| None` with a default: null means the default (see StrictRequest).
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extension fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    # Lower runs first when requests wait for the engine (vLLM's meaning).
    priority: int | None = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output: OpenAI's response_format, or vLLM's fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def max_tokens_field(self) -> tuple[str, int | None]:
        """(the field that bounds the output, its value)."""
        return "max_tokens", self.max_tokens

    def _structured_sources(self) -> dict[str, dict[str, Any]]:
        """{request field: StructuredOutput fields} of each field that asks for one."""
        sources: dict[str, dict[str, Any]] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            sources["response_format"] = {"json_object": True}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise RequestError(
                    "response_format of type json_schema needs json_schema",
                    "response_format.json_schema",
                )
            schema = fmt.json_schema.json_schema
            sources["response_format"] = (
                {"json_object": True} if schema is None else {"json": schema}
            )
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(exclude_none=True)
            sources["structured_outputs"] = {k.rstrip("_"): v for k, v in given.items()}
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                sources[f"guided_{kind}"] = {kind: value}
        return sources

    def structured_field(self) -> str | None:
        """The request field that asks for structured output, if one does."""
        return next(iter(self._structured_sources()), None)

    def _structured_output(self) -> StructuredOutput | None:
        sources = self._structured_sources()
        if len(sources) > 1:
            names = ", ".join(sources)
            raise RequestError(f"give only one of {names}", list(sources)[1])
        if not sources:
            return None
        ((field, spec),) = sources.items()
        try:
            return StructuredOutput(**spec)
        except ValueError as error:
            raise RequestError(f"{field}: {error}", field) from None

    def _logprobs(self) -> int | None:
        raise NotImplementedError

    def _logprobs_field_name(self) -> str:
        return "logprobs"

    def _check_limits(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestError(f"stop may hold at most {MAX_STOP_STRINGS} strings", "stop")
        for stop in stops:
            if not stop or len(stop) > MAX_STOP_STRING_CHARS:
                raise RequestError(
                    f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters",
                    "stop",
                )
        if len(self.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
            raise RequestError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids", "stop_token_ids"
            )
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS_ENTRIES:
            raise RequestError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias"
            )
        if self.seed is not None and not -MAX_SEED - 1 <= self.seed <= MAX_SEED:
            raise RequestError(f"seed must fit in 64 bits, got {self.seed}", "seed")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")

    def _logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise RequestError(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
                ) from None
            bias[token_id] = value
        return bias

    def _sampling_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = dict(
            max_tokens=self.max_tokens_field()[1],
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            n=self.n,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self._logit_bias(),
            logprobs=self._logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            structured_output=self._structured_output(),
        )
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "repeat_last_n": self.repeat_last_n,
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        return fields

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams for this request; raises RequestError naming the field."""
        self._check_limits()
        fields = self._sampling_fields()
        try:
            return SamplingParams(**fields)
        except ValueError as error:
            raise self.request_error(error) from None

    def request_error(
        self, error: ValueError, prompt_field: str | None = None, prompt_fits: bool = True
    ) -> RequestError:
        """What a ValueError of SamplingParams or of the engine (a ParamError naming a
        SamplingParams field, or "prompt", and maybe a code) means for this request: the
        request field at fault, `prompt_field` where none is named, and the message in
        the request's own terms. A request too long for the context names the field that
        asked for too much: the output bound if the prompt fits alone (`prompt_fits`)."""
        message = str(error)
        name = getattr(error, "param", None)
        code = getattr(error, "code", None)
        param = self._field_of(name) or prompt_field
        if name and param and name != param and message.startswith(name):
            message = param + message[len(name) :]  # in the request's own terms
        if code == CONTEXT_LENGTH_EXCEEDED:
            max_tokens_name, max_tokens = self.max_tokens_field()
            param = max_tokens_name if prompt_fits and max_tokens is not None else prompt_field
        return RequestError(message, param, code=code)

    def _field_of(self, name: str | None) -> str | None:
        """The request field that a SamplingParams field comes from."""
        if name == "max_tokens":
            return self.max_tokens_field()[0]
        if name == "logprobs":
            return self._logprobs_field_name()
        if name is not None and name.startswith("structured_output"):
            return self.structured_field()
        return name if name in type(self).model_fields else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage
