"""ParamError: a bad request parameter, named. Its own module so that params.py and
structured.py, which validate each other's parts, both import it."""

from __future__ import annotations


class ParamError(ValueError):
    """A bad value of one SamplingParams field (or "prompt"), named by `param`, so that a
    caller can point at it without reading the message; `code` is the OpenAI error code
    where the field alone does not say what is wrong ("grammar_too_complex",
    "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
