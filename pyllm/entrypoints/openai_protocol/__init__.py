"""The OpenAI API's request and response bodies, as pydantic models, by area:

    base.py        strict request and response models, a request's limits
    errors.py      RequestError, error_body, what pydantic's errors name
    messages.py    a chat's messages and tools
    sampling.py    the fields chat and text completions share -> SamplingParams
    chat.py        /v1/chat/completions       completion.py   /v1/completions
    responses.py   usage, models, errors, status
    tokenize.py    vLLM's /tokenize and /detokenize
    embedding.py   /v1/embeddings

Requests are parsed strictly (a string is not an integer, a float is not an integer, a
boolean is not a number), so a wrong type is a 400 naming the field rather than a silent
coercion; a null for a field OpenAI marks nullable means its default. Unknown fields are
ignored, as OpenAI-compatible servers commonly do, except those that would change the
meaning of the request and cannot be honoured (suffix): those are refused.
"""

from pyllm.entrypoints.openai_protocol.base import now, random_id
from pyllm.entrypoints.openai_protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from pyllm.entrypoints.openai_protocol.completion import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
)
from pyllm.entrypoints.openai_protocol.embedding import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    encode_embedding,
)
from pyllm.entrypoints.openai_protocol.errors import RequestError, error_body, invalid_body
from pyllm.entrypoints.openai_protocol.responses import (
    ErrorResponse,
    HealthStatus,
    ModelCard,
    ModelList,
    UsageInfo,
    VersionResponse,
)
from pyllm.entrypoints.openai_protocol.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = [
    "AssistantMessage", "ChatChoice", "ChatChunkChoice",
    "ChatCompletionChunk", "ChatCompletionRequest", "ChatCompletionResponse", "ChatLogprobs",
    "ChatTokenLogprob", "CompletionChoice", "CompletionLogprobs", "CompletionRequest",
    "CompletionResponse", "DeltaFunctionCall", "DeltaMessage", "DeltaToolCall", "DetokenizeRequest",
    "DetokenizeResponse", "Embedding", "EmbeddingRequest", "EmbeddingResponse",
    "EmbeddingUsage", "ErrorResponse", "FunctionCall", "HealthStatus", "ModelCard",
    "ModelList", "PromptLogprob", "RequestError", "TokenizeRequest", "TokenizeResponse",
    "ToolCall", "TopLogprob", "UsageInfo", "VersionResponse", "encode_embedding", "error_body",
    "invalid_body", "now", "random_id",
]  # fmt: skip
