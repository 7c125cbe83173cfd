"""The encoders of /v1/completions and /v1/chat/completions: response bodies and stream
chunks in the two shapes OpenAI clients parse, for any number of choices."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tandem.metrics import SpeculativeStats
from tandem.request import Logprob, TokenLogprobs
from tandem.server.frontend.encoding import sse
from tandem.server.frontend.errors import error_body
from tandem.server.frontend.service import RequestStream
from tandem.server.generation.tools import (
    Parsed,
    ToolCallParser,
    ToolPlan,
    assemble,
    tool_finish_reason,
)

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def usage(stream: RequestStream) -> dict[str, Any]:
    """OpenAI's token counts; with speculative decoding, how the request's drafts fared too
    (summed over its choices)."""
    prompt_tokens, completion_tokens = stream.num_prompt_tokens, stream.num_output_tokens
    counts: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if stream.speculative:
        spec = SpeculativeStats(*map(sum, zip(*stream.speculative.values(), strict=True)))
        counts["speculative_decoding"] = {
            "draft_tokens": spec.drafted_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "verifications": spec.num_verified,
            "mean_accepted_length": round(spec.mean_accepted_length, 3),
        }
    return counts


def _logprob(value: float) -> float:
    """JSON has no -inf: clamp, as vLLM does."""
    return max(value, -9999.0)


def _top(entry: TokenLogprobs, k: int) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.rank)[:k]


class _Encoder:
    """The Encoder protocol over a format's chunks (`opening_chunks`, `delta_chunk`,
    `closing_chunk`, `usage_chunk`, `full`): SSE framing, the usage chunk, [DONE]."""

    media_type = MEDIA_TYPE
    include_usage: bool

    def opening(self, stream: RequestStream) -> list[bytes]:
        return [sse(c) for i in range(stream.num_choices) for c in self.opening_chunks(i)]

    def thinking(self, index: int, text: str) -> list[bytes]:
        chunk = self.thinking_chunk(text, index)
        return [] if chunk is None else [sse(chunk)]

    def thinking_chunk(self, text: str, index: int) -> dict[str, Any] | None:
        return None  # completions are not read for thinking: their text is the model's own

    def delta(self, index: int, text: str, logprobs: list[TokenLogprobs]) -> list[bytes]:
        chunk = self.delta_chunk(text, index, logprobs)
        return [] if chunk is None else [sse(chunk)]

    def closing(self, index: int, finish_reason: str) -> list[bytes]:
        return [sse(self.closing_chunk(finish_reason, index))]

    def ending(self, stream: RequestStream) -> list[bytes]:
        """The error that cut the stream short (in-stream, as OpenAI does), or the usage if
        asked for; then [DONE]."""
        if stream.error is not None:
            return [sse(error_body(stream.error_status, stream.error, code="aborted")), DONE]
        if self.include_usage:
            counts = usage(stream)
            return [sse(self.usage_chunk(counts)), DONE]
        return [DONE]

    def whole(
        self,
        stream: RequestStream,
        texts: list[str],
        logprobs: list[list[TokenLogprobs]],
        thinking: list[str],
    ) -> dict[str, Any]:
        counts = usage(stream)
        reasons = [stream.finish_reasons.get(i) or "stop" for i in range(stream.num_choices)]
        return self.full(texts, reasons, counts, logprobs, thinking)


@dataclass
class CompletionFormat(_Encoder):
    """/v1/completions: `text` in each choice."""

    request_id: str
    model: str
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's extra)
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
            label = _token_id_label if self.tokens_as_ids else _token_label
            out["tokens"].append(label(token, sampled))
            out["token_logprobs"].append(_logprob(sampled.logprob))
            out["top_logprobs"].append(
                {label(t, lp): _logprob(lp.logprob) for t, lp in entry.items()}
            )
            offsets.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return out

    def opening_chunks(self, index: int = 0) -> list[dict[str, Any]]:
        return []

    def delta_chunk(
        self, text: str, index: int = 0, logprobs: list[TokenLogprobs] | None = None
    ) -> dict[str, Any]:
        choice = {"text": text, "logprobs": self._logprobs(logprobs or [], index)}
        return self._chunk({**choice, "finish_reason": None}, index)

    def closing_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk({"text": "", "finish_reason": finish_reason}, index)

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk({}), "choices": [], "usage": counts}

    def full(
        self,
        texts: list[str],
        finish_reasons: list[str],
        counts: dict[str, int],
        logprobs: list[list[TokenLogprobs]] | None = None,
        thinking: list[str] | None = None,
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
class ChatFormat(_Encoder):
    """/v1/chat/completions: a `delta` per chunk (the role first), a `message` when whole.

    With `tools` (a plan whose output is read for calls), each choice's text goes through its
    own tool-call parser (`tool_calls.py`): a chunk may then carry `tool_calls`, hold text back
    (no chunk), or carry text and calls flushed at the close."""

    request_id: str
    model: str
    include_usage: bool = False
    logprobs: int | None = None  # top_logprobs per token; None: no logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    tools: ToolPlan | None = None
    _parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # per streamed choice

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

    def opening_chunks(self, index: int = 0) -> list[dict[str, Any]]:
        if self.tools is not None:
            parser = self._parsers[index] = self.tools.parser()
            calls = parser.opening()
            if calls:  # a named function: its call opens the stream, its arguments follow
                delta = {"role": "assistant", "content": None, "tool_calls": calls}
                return [self._chunk(delta, None, index)]
        return [self._chunk({"role": "assistant", "content": ""}, None, index)]

    def delta_chunk(
        self, text: str, index: int = 0, logprobs: list[TokenLogprobs] | None = None
    ) -> dict[str, Any] | None:
        """The chunk for a choice's new text; None when a tool-call parser holds it all back
        and there are no logprobs to send."""
        if self.tools is None:
            return self._chunk({"content": text}, None, index, self._logprobs(logprobs or []))
        parsed = self._parsers[index].feed(text)
        if not (parsed.content or parsed.calls or logprobs):
            return None
        return self._chunk(_parsed_delta(parsed), None, index, self._logprobs(logprobs or []))

    def closing_chunk(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        """The last chunk of a choice; with tools, it carries what the parser held back."""
        if self.tools is None:
            return self._chunk({}, finish_reason, index)
        parser = self._parsers.pop(index)
        parsed = parser.finish(finish_reason)
        reason = tool_finish_reason(finish_reason, parser.called)
        delta = _parsed_delta(parsed) if parsed.content or parsed.calls else {}
        return self._chunk(delta, reason, index)

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk({}, None), "choices": [], "usage": counts}

    def thinking_chunk(self, text: str, index: int) -> dict[str, Any]:
        """Thinking as DeepSeek's API and llama.cpp send it (`reasoning_content`) and as vLLM
        does (`reasoning`): clients read one or the other."""
        return self._chunk({"reasoning_content": text, "reasoning": text}, None, index)

    def full(
        self,
        texts: list[str],
        finish_reasons: list[str],
        counts: dict[str, int],
        logprobs: list[list[TokenLogprobs]] | None = None,
        thinking: list[str] | None = None,
    ) -> dict[str, Any]:
        """One choice per text; `logprobs`, when given, holds each choice's tokens' logprobs,
        `thinking` a reasoning model's thinking."""
        logprobs = logprobs or [[] for _ in texts]
        thinking = thinking or ["" for _ in texts]
        choices = []
        for i, (text, reason, entries, thought) in enumerate(
            zip(texts, finish_reasons, logprobs, thinking, strict=True)
        ):
            message, reason = self._message(text, reason)
            if thought:
                message["reasoning_content"] = message["reasoning"] = thought
            choice = {"index": i, "message": message, "logprobs": self._logprobs(entries)}
            choices.append({**choice, "finish_reason": reason})
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": counts,
        }

    def _message(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish reason: the streaming parser, fed all at once."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        parser = self.tools.parser()
        opening = parser.opening()
        parsed = parser.feed(text) + parser.finish(finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
        if opening or parsed.calls:
            message["tool_calls"] = assemble(opening + parsed.calls)
        return message, tool_finish_reason(finish_reason, parser.called)


def _parsed_delta(parsed: Parsed) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": parsed.content} if parsed.content else {}
    if parsed.calls:
        delta["tool_calls"] = parsed.calls
    return delta or {"content": ""}


def _token_label(token: int, lp: Logprob) -> str:
    """The token's text; a model without a tokenizer has none, so its id (vLLM's label)."""
    return f"token_id:{token}" if lp.decoded_token is None else lp.decoded_token


def _token_id_label(token: int, lp: Logprob) -> str:
    return f"token_id:{token}"


def _chat_token(lp: Logprob) -> dict[str, Any]:
    text = lp.decoded_token or ""
    return {"token": text, "logprob": _logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}
