"""RequestError, the body every error is sent in, and what pydantic's errors mean as one."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable

from pydantic import ValidationError


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


@contextlib.contextmanager
def fields_renamed(rename: Callable[[str | None], str | None]):
    """RequestErrors raised inside, about a chat request another API's request became,
    name that request's fields: rename maps a chat field to its name there."""
    try:
        yield
    except RequestError as error:
        param = rename(error.param)
        message = error.message
        if error.param and param != error.param and message.startswith(error.param):
            message = param + message[len(error.param) :]
        raise RequestError(message, param, error.status_code, error.code, error.type) from None


def error_body(message: str, type: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|[\[\]-]")


def param_of_location(loc: tuple) -> str | None:
    """'messages[0].role' from pydantic's ('messages', 0, 'role'); union tags dropped."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif _TYPE_TAG.search(part):
            break  # the name of a union member, not a field
        else:
            param += f".{part}" if param else part
    return param or None


def invalid_body(error: ValidationError) -> RequestError:
    """The first thing pydantic found wrong with a request body, naming its field."""
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {first['msg']}")
    param = param_of_location(first["loc"])
    message = first["msg"]
    if first["type"] != "missing":
        message += f" (got {repr(first.get('input'))[:80]})"
    return RequestError(f"{param}: {message}" if param else message, param)
