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

    def _chunk(self, choice: dict[str, Any], index: int = 0) -> dict[str, Any]:
        body = {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, "logprobs": None, **choice}],
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def opening(self, index: int = 0) -> list[dict[str, Any]]:
        return []

    def delta(self, text: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"text": text, "finish_reason": None}, index)

    def closing(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"text": "", "finish_reason": finish_reason}, index)

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk({}), "choices": [], "usage": counts}

    def full(
        self, texts: list[str], finish_reasons: list[str], counts: dict[str, int]
    ) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                for i, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True))
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

    def _chunk(
        self, delta: dict[str, Any], finish_reason: str | None, index: int = 0
    ) -> dict[str, Any]:
        body = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def opening(self, index: int = 0) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None, index)]

    def delta(self, text: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"content": text}, None, index)

    def closing(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({}, finish_reason, index)

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk({}, None), "choices": [], "usage": counts}

    def full(
        self, texts: list[str], finish_reasons: list[str], counts: dict[str, int]
    ) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": reason,
                }
                for i, (text, reason) in enumerate(zip(texts, finish_reasons, strict=True))
            ],
            "usage": counts,
        }


ResponseFormat = CompletionFormat | ChatFormat
