"""The OpenAI API's request and response bodies, as pydantic models.

Requests are parsed strictly (a string is not an integer, a float is not an integer, a
boolean is not a number), so a wrong type is a 400 naming the field rather than a silent
coercion; a null for a field OpenAI marks nullable means its default. Unknown fields are
ignored, as OpenAI-compatible servers commonly do, except those that would change the
meaning of the request and cannot be honoured (suffix): those are refused.

Structured output (response_format, vLLM's structured_outputs and guided_* fields, and
tool_choice "required" or a named function) becomes SamplingParams.structured_output.

Each request model turns itself into engine `SamplingParams` with `to_sampling_params`;
vLLM's extension fields (top_k, min_p, repetition_penalty, repeat_last_n, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, include_stop_str_in_output) map onto the
fields of the same name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import uuid
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from pyllm.sampling.json_depth import loads_bounded
from pyllm.sampling.params import SamplingParams
from pyllm.sampling.structured import StructuredOutput

# Limits a single request may not exceed, so that no client can make the engine's
# per-token work (stop-string scans, logit bias) arbitrarily expensive for everyone.
MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_SEED = 2**63 - 1
# The default limit on a request's sequences: prompts x n (or best_of, if larger).
MAX_SEQS_PER_REQUEST = 256


class RequestError(ValueError):
    """A client mistake: becomes a 4xx response in OpenAI's error shape."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.code = code
        self.type = type


def error_body(message: str, type: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Clients that serialize every field send null for those they leave unset; OpenAI's
        # spec marks them nullable, meaning the default.
        if not isinstance(data, dict):
            return data
        defaulted = _nullable_with_default(cls)
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


@functools.cache
def _nullable_with_default(model: type[BaseModel]) -> frozenset[str]:
    """The fields typed `X | None` whose default is not None: null there means the default."""
    return frozenset(
        name
        for name, field in model.model_fields.items()
        if field.default is not None and type(None) in get_args(field.annotation)
    )


# -------------------------------------------------------------------- requests


class StreamOptions(_Strict):
    include_usage: bool = False


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    # OpenAI's is a JSON string; an object is taken too (HF templates want one).
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Strict):
    """A call an assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's convention: call arguments as
        a dict, not OpenAI's JSON string)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


def _template_call(call: MessageToolCall) -> dict[str, Any]:
    """The call as templates read it: OpenAI's nesting, and name and arguments at the
    top too (some templates read call.name, others call.function.name)."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON (or too deep): the string itself
            arguments = loads_bounded(arguments)
    function = {"name": call.function.name, "arguments": arguments}
    template_call = {"type": call.type, "function": function, **function}
    if call.id is not None:
        template_call["id"] = call.id
    return template_call


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs` field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _SamplingRequest(_Strict):
    """The fields chat and text completions share, and their mapping to SamplingParams."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    # `| None` with a default: null means the default (see _Strict).
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

    def _max_tokens_field(self) -> tuple[str, int | None]:
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

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams for this request; raises RequestError naming the field."""
        self._check_limits()
        max_tokens_name, max_tokens = self._max_tokens_field()
        fields: dict[str, Any] = dict(
            max_tokens=max_tokens,
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
        try:
            return SamplingParams(**fields)
        except ValueError as error:
            message = str(error)
            name = getattr(error, "param", None)  # a ParamError names its field
            param = self._param_of(name, max_tokens_name)
            if param is not None and name != param and message.startswith(name):
                message = param + message[len(name) :]  # say it in the request's own terms
            raise RequestError(message, param) from None

    def _param_of(self, name: str | None, max_tokens_name: str) -> str | None:
        """The request field that a SamplingParams field (a ParamError's param) comes from."""
        if name == "max_tokens":
            return max_tokens_name
        if name == "logprobs":
            return self._logprobs_field_name()
        if name is not None and name.startswith("structured_output"):
            return self.structured_field()
        return name if name in type(self).model_fields else None

    def _logprobs_field_name(self) -> str:
        return "logprobs"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    def _max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def _logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def _logprobs_field_name(self) -> str:
        return "top_logprobs"

    def check(self) -> None:
        if not self.messages:
            raise RequestError("messages must hold at least one message", "messages")
        for i, message in enumerate(self.messages):
            if message.content is None and message.role != "assistant":
                raise RequestError(f"messages[{i}].content is required", f"messages[{i}].content")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise RequestError("tool_choice needs tools", "tool_choice")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise RequestError("tools must have distinct function names", "tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in names:
                raise RequestError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, which is "
                    "not in tools",
                    "tool_choice",
                )

    @property
    def tool_mode(self) -> str:
        """'none' (no tools, or tool_choice none), 'auto' (the model may call one, in
        its own format), 'required' (a list of calls) or 'named' (that function's
        arguments)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template receives them (none with tool_choice none)."""
        if self.tool_mode == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def _structured_sources(self) -> dict[str, dict[str, Any]]:
        sources = super()._structured_sources()
        mode = self.tool_mode
        if mode == "named":
            function = self._function(self.tool_choice.function.name)
            sources["tool_choice"] = {"json": function.parameters or {"type": "object"}}
        elif mode == "required":
            calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.function.name},
                        "arguments": tool.function.parameters or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for tool in self.tools
            ]}}  # fmt: skip
            if self.parallel_tool_calls is False:
                calls["maxItems"] = 1
            sources["tool_choice"] = {"json": calls}
        return sources

    def _function(self, name: str) -> FunctionDefinition:
        return next(t.function for t in self.tools if t.function.name == name)

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]


class CompletionRequest(_SamplingRequest):
    # A string, a list of strings, one prompt's token ids, or a list of those.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's extension: the top k logprobs of every prompt token, in choices[].prompt_logprobs.
    prompt_logprobs: int | None = None

    def _logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echo_logprobs(self) -> bool:
        """echo with logprobs: the prompt tokens' logprobs come first in choices[].logprobs."""
        return self.echo and self.logprobs is not None

    def to_sampling_params(self) -> SamplingParams:
        params = super().to_sampling_params()
        if self.best_of is not None:
            try:
                params = dataclasses.replace(params, best_of=self.best_of)
            except ValueError as error:
                raise RequestError(str(error), "best_of") from None
        # The engine computes the prompt's logprobs once, for the larger of the two asks.
        asked = [k for k in (self.prompt_logprobs, self.echo_logprobs and self.logprobs) if k]
        if self.prompt_logprobs is None and not self.echo_logprobs:
            return params
        try:
            return dataclasses.replace(params, prompt_logprobs=max(asked, default=0))
        except ValueError as error:
            raise RequestError(str(error), "prompt_logprobs") from None

    def check(self) -> None:
        if self.suffix:
            raise RequestError("suffix is not supported by this server", "suffix")
        if self.best_of is not None and not 1 <= self.best_of <= MAX_N:
            raise RequestError(f"best_of must be in [1, {MAX_N}], got {self.best_of}", "best_of")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            # As OpenAI: the best samples are known only when all have finished.
            raise RequestError("best_of larger than n cannot be streamed", "best_of")
        if self.stream and (self.echo_logprobs or self.prompt_logprobs is not None):
            raise RequestError(
                "prompt logprobs (echo with logprobs, or prompt_logprobs) need stream: false",
                "prompt_logprobs" if self.prompt_logprobs is not None else "echo",
            )
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("prompt must not be an empty list", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the batch: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)


# ------------------------------------------------------------------- responses


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    # None for the first prompt token under echo (nothing precedes it).
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's Logprob: rank is 1 for the most likely token; None for a prompt token
    outside the top k (its rank is not computed)."""

    logprob: float
    rank: int | None
    decoded_token: str


class FunctionCall(_Response):
    name: str
    arguments: str  # a JSON object


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    """A whole call in one stream chunk (OpenAI may split arguments over several)."""

    index: int


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    # A reasoning model's thinking apart from its answer (vLLM's field; gpt-oss's analysis).
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler):
        body = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if body.get(key) is None:
                body.pop(key, None)
        return body


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        # OpenAI sends only what a delta carries: {"role": ...} first, then {"content": ...}.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    # vLLM's extension, when asked: per prompt token, {token id: logprob} of the prompt
    # token and the top k; None for the first.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pyllm"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    """The body of every 4xx and 5xx, as error_body builds it."""

    error: ErrorInfo


class HealthStatus(_Response):
    status: str


# ---------------------------------------------- vLLM's /tokenize, /detokenize, /version


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool | None = True  # messages only
    # Default: BOS and the like for a prompt; none for messages (the template writes them).
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of prompt and messages", "prompt")
        if self.messages is not None:
            chat = ChatCompletionRequest(messages=self.messages)
            chat.check()

    def template_messages(self) -> list[dict[str, str]]:
        return ChatCompletionRequest(messages=self.messages).template_messages()


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
