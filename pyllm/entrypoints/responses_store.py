"""The responses kept for `previous_response_id` and GET /v1/responses/{id}: each
one's conversation as chat messages and its response object as JSON, the least
recently used dropped first, bounded in count and in bytes. Used from the event loop
only."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pyllm.entrypoints.openai_protocol import RequestError

MAX_RESPONSES = 256
MAX_BYTES = 64 << 20  # the messages' and responses' JSON, all responses together


@dataclass
class _Kept:
    messages: list[dict[str, Any]]
    response: str  # the response object's JSON, as create returned it
    size: int


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(
                f"max_responses and max_bytes must be at least 1, got {max_responses}, {max_bytes}"
            )
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[str, _Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def messages(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation up to and including the response; a 404 if it is not kept."""
        return self._get(response_id, "previous_response_id", "previous response").messages

    def response(self, response_id: str) -> str:
        """The response object's JSON; a 404 if it is not kept."""
        return self._get(response_id, "response_id", "response").response

    def delete(self, response_id: str) -> None:
        """Forgets the response; a 404 if it is not kept."""
        kept = self._get(response_id, "response_id", "response")
        del self._kept[response_id]
        self.bytes -= kept.size

    def put(self, response_id: str, messages: list[dict[str, Any]], response: str = "") -> None:
        """Keeps the conversation and the response; one larger than the whole budget is
        not kept."""
        size = len(json.dumps(messages, ensure_ascii=False).encode()) + len(response.encode())
        if size > self.max_bytes:
            return
        if response_id in self._kept:
            self.bytes -= self._kept.pop(response_id).size
        self._kept[response_id] = _Kept(messages, response, size)
        self.bytes += size
        while len(self._kept) > self.max_responses or self.bytes > self.max_bytes:
            _, dropped = self._kept.popitem(last=False)
            self.bytes -= dropped.size

    def _get(self, response_id: str, param: str, what: str) -> _Kept:
        kept = self._kept.get(response_id)
        if kept is None:
            raise RequestError(
                f"{what} {response_id!r} not found (responses are kept in memory, the "
                f"latest {self.max_responses}, with store: true)",
                param,
                status_code=404,
                code=f"{what.replace(' ', '_')}_not_found",
            )
        self._kept.move_to_end(response_id)
        return kept
