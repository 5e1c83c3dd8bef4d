"""The responses kept for `previous_response_id`: each one's conversation as chat
messages, the least recently used dropped first, bounded in count and in bytes. Used
from the event loop only."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from pyllm.entrypoints.openai_protocol import RequestError

MAX_RESPONSES = 256
MAX_BYTES = 64 << 20  # the messages' JSON, all responses together


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(
                f"max_responses and max_bytes must be at least 1, got {max_responses}, {max_bytes}"
            )
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def messages(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation up to and including the response; a 404 if it is not kept."""
        kept = self._kept.get(response_id)
        if kept is None:
            raise RequestError(
                f"previous response {response_id!r} not found (responses are kept in "
                f"memory, the latest {self.max_responses}, with store: true)",
                "previous_response_id",
                status_code=404,
                code="previous_response_not_found",
            )
        self._kept.move_to_end(response_id)
        return kept[0]

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        """Keeps the conversation; one larger than the whole budget is not kept."""
        size = len(json.dumps(messages, ensure_ascii=False).encode())
        if size > self.max_bytes:
            return
        self._kept[response_id] = (messages, size)
        self.bytes += size
        while len(self._kept) > self.max_responses or self.bytes > self.max_bytes:
            _, (_, dropped) = self._kept.popitem(last=False)
            self.bytes -= dropped
