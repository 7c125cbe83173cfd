"""Response bodies and stream chunks, in the two shapes OpenAI clients parse.

Plain dicts and `json.dumps` rather than pydantic models: a stream serialises one chunk per token
per request, and this is the cheapest way to do it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class CompletionFormat:
    """/v1/completions: `text` in each choice."""

    request_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        body = {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "logprobs": None, **choice}],
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta(self, text: str) -> dict[str, Any]:
        return self._chunk({"text": text, "finish_reason": None})

    def closing(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({"text": "", "finish_reason": finish_reason})

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk({}), "choices": [], "usage": counts}

    def full(self, text: str, finish_reason: str, counts: dict[str, int]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            ],
            "usage": counts,
        }


@dataclass
class ChatFormat:
    """/v1/chat/completions: a `delta` per chunk (the role first), a `message` when whole."""

    request_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        body = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def delta(self, text: str) -> dict[str, Any]:
        return self._chunk({"content": text}, None)

    def closing(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk({}, finish_reason)

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk({}, None), "choices": [], "usage": counts}

    def full(self, text: str, finish_reason: str, counts: dict[str, int]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": counts,
        }


ResponseFormat = CompletionFormat | ChatFormat
