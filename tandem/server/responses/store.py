"""Stored responses (`store: true`, the API's default): what `GET /v1/responses/{id}` returns,
and the conversation a later request continues with `previous_response_id`.

Kept in the front end's memory under two bounds, the oldest evicted first: at most
`max_count` responses and `max_bytes` of them (each counted as its response body's JSON plus
its conversation's text). A response bigger than the whole byte bound is not kept. An evicted,
deleted or never-stored id is unknown: 404. With several front ends (`--api-server-count`),
each keeps the responses it answered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tandem.server.frontend.encoding import encode_json
from tandem.server.generation.request import Message

DEFAULT_MAX_COUNT = 1024
DEFAULT_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as a GET returns it
    conversation: list[Message]  # input and output, without the instructions
    size: int


class ResponseStore:
    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_count < 1 or max_bytes < 1:
            raise ValueError("max_count and max_bytes must be >= 1")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # intake workers read, the event loop writes

    def __len__(self) -> int:
        return len(self._items)

    def put(self, body: dict[str, Any], conversation: list[Message]) -> None:
        size = len(encode_json(body)) + sum(
            len(m.content) + sum(len(c.arguments) for c in m.tool_calls) for m in conversation
        )
        if size > self.max_bytes:
            return
        with self._lock:
            self._discard(body["id"])
            self._items[body["id"]] = StoredResponse(body, conversation, size)
            self.num_bytes += size
            while len(self._items) > self.max_count or self.num_bytes > self.max_bytes:
                self._discard(next(iter(self._items)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._discard(response_id)

    def _discard(self, response_id: str) -> bool:
        item = self._items.pop(response_id, None)
        if item is not None:
            self.num_bytes -= item.size
        return item is not None
