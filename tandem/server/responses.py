"""Response bodies and stream chunks, in the two shapes OpenAI clients parse.

Plain dicts and `json.dumps` rather than pydantic models: a stream serialises one chunk per token
per request, and this is the cheapest way to do it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.request import Logprob, TokenLogprobs

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


def _logprob(value: float) -> float:
    """JSON has no -inf: clamp, as vLLM does."""
    return max(value, -9999.0)


def _top(entry: TokenLogprobs, k: int) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.rank)[:k]


@dataclass
class CompletionFormat:
    """/v1/completions: `text` in each choice."""

    request_id: str
    model: str
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    # Per choice: where its next token's text starts (a stream spans many chunks).
    _text_offsets: dict[int, int] = field(default_factory=dict)

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

    def _logprobs(self, entries: list[TokenLogprobs], index: int) -> dict[str, Any] | None:
        """OpenAI's legacy shape: the sampled tokens, their logprobs, and per token a dict of
        the top alternatives (with the sampled token: up to logprobs + 1 entries)."""
        if self.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        offsets = out["text_offset"] = []
        offset = self._text_offsets.get(index, 0)
        for entry in entries:
            token, sampled = next(iter(entry.items()))
            text = sampled.decoded_token or ""
            out["tokens"].append(_token_label(token, sampled))
            out["token_logprobs"].append(_logprob(sampled.logprob))
            out["top_logprobs"].append(
                {_token_label(t, lp): _logprob(lp.logprob) for t, lp in entry.items()}
            )
            offsets.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return out

    def opening(self, index: int = 0) -> list[dict[str, Any]]:
        return []

    def delta(
        self, text: str, index: int = 0, logprobs: list[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        choice = {"text": text, "logprobs": self._logprobs(logprobs or [], index)}
        return self._chunk({**choice, "finish_reason": None}, index)

    def closing(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"text": "", "finish_reason": finish_reason}, index)

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk({}), "choices": [], "usage": counts}

    def full(
        self,
        texts: list[str],
        finish_reasons: list[str],
        counts: dict[str, int],
        logprobs: list[list[TokenLogprobs]] | None = None,
    ) -> dict[str, Any]:
        """One choice per text; `logprobs`, when given, holds each choice's tokens' logprobs."""
        logprobs = logprobs or [[] for _ in texts]
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "text": text,
                    "logprobs": self._logprobs(entries, i),
                    "finish_reason": reason,
                }
                for i, (text, reason, entries) in enumerate(
                    zip(texts, finish_reasons, logprobs, strict=True)
                )
            ],
            "usage": counts,
        }


@dataclass
class ChatFormat:
    """/v1/chat/completions: a `delta` per chunk (the role first), a `message` when whole."""

    request_id: str
    model: str
    include_usage: bool = False
    logprobs: int | None = None  # top_logprobs per token; None: no logprobs
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(
        self,
        delta: dict[str, Any],
        finish_reason: str | None,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = {
            "id": self.request_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                }
            ],
        }
        if self.include_usage:
            body["usage"] = None
        return body

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        """`content`: per token, its text, logprob and UTF-8 bytes, and the top_logprobs."""
        if self.logprobs is None:
            return None
        content = []
        for entry in entries:
            sampled = next(iter(entry.values()))
            content.append(
                {
                    **_chat_token(sampled),
                    "top_logprobs": [_chat_token(lp) for lp in _top(entry, self.logprobs)],
                }
            )
        return {"content": content}

    def opening(self, index: int = 0) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None, index)]

    def delta(
        self, text: str, index: int = 0, logprobs: list[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        return self._chunk({"content": text}, None, index, self._logprobs(logprobs or []))

    def closing(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({}, finish_reason, index)

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk({}, None), "choices": [], "usage": counts}

    def full(
        self,
        texts: list[str],
        finish_reasons: list[str],
        counts: dict[str, int],
        logprobs: list[list[TokenLogprobs]] | None = None,
    ) -> dict[str, Any]:
        """One choice per text; `logprobs`, when given, holds each choice's tokens' logprobs."""
        logprobs = logprobs or [[] for _ in texts]
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": self._logprobs(entries),
                    "finish_reason": reason,
                }
                for i, (text, reason, entries) in enumerate(
                    zip(texts, finish_reasons, logprobs, strict=True)
                )
            ],
            "usage": counts,
        }


def _token_label(token: int, lp: Logprob) -> str:
    """The token's text; a model without a tokenizer has none, so its id (vLLM's label)."""
    return f"token_id:{token}" if lp.decoded_token is None else lp.decoded_token


def _chat_token(lp: Logprob) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": _logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}


ResponseFormat = CompletionFormat | ChatFormat
