"""Ollama's answers: newline-delimited JSON chunks (Ollama streams by default) or one object.

A chat chunk carries `message.content` (a reasoning model's thinking first, in
`message.thinking`); a tool call goes out whole, in `message.tool_calls` with its arguments as
an object, once it is complete. A generate chunk carries `response` (and `thinking`). The
last chunk says `done`, the `done_reason` ("stop", "length") and the counts and durations
(nanoseconds: the prompt's evaluation until the first token, the generation after it); an
engine failure ends the stream with an `error` line.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from tandem.request import TokenLogprobs
from tandem.server.frontend.encoding import ndjson
from tandem.server.frontend.errors import APIError
from tandem.server.frontend.service import RequestStream
from tandem.server.generation.output import Block, BlockEncoder, BlockEvent

MEDIA_TYPE = "application/x-ndjson"


def ollama_error(error: APIError) -> dict[str, Any]:
    return {"error": error.message}


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def tool_call(block: Block) -> dict[str, Any]:
    try:
        arguments = json.loads(block.text) if block.text else {}
    except ValueError:  # cut off by the output limit: done_reason says so
        arguments = {}
    return {"function": {"name": block.name, "arguments": arguments}}


def chunk(model: str, **fields: Any) -> bytes:
    return ndjson({"model": model, "created_at": now(), **fields, "done": False})


def last(model: str, stream: RequestStream, finish_reason: str, **fields: Any) -> dict[str, Any]:
    """The closing chunk (or whole answer): how it ended, counts and durations."""
    end = time.perf_counter()
    first = stream.first_token_time or end
    ns = 1_000_000_000
    return {
        "model": model,
        "created_at": now(),
        **fields,
        "done": True,
        "done_reason": "length" if finish_reason == "length" else "stop",
        "total_duration": int((end - stream.arrival) * ns),
        "load_duration": 0,
        "prompt_eval_count": stream.num_prompt_tokens,
        "prompt_eval_duration": int((first - stream.arrival) * ns),
        "eval_count": stream.num_output_tokens,
        "eval_duration": int((end - first) * ns),
    }


def ending(model: str, stream: RequestStream, finish_reason: str, **empty: Any) -> list[bytes]:
    """An engine failure's error line, or the closing chunk (its text field `empty`)."""
    if stream.error is not None:
        return [ndjson({"error": stream.error})]
    return [ndjson(last(model, stream, finish_reason, **empty))]


@dataclass
class ChatEncoder(BlockEncoder):
    """/api/chat, and /api/generate of a chat-template prompt when `generate` is set."""

    model: str
    generate: bool = False
    media_type: str = MEDIA_TYPE

    def opening(self, stream: RequestStream) -> list[bytes]:
        return self.encode(self.output.opening())

    def ending(self, stream: RequestStream) -> list[bytes]:
        empty = {"response": ""} if self.generate else {"message": _message("")}
        return ending(self.model, stream, self.finish_reason, **empty)

    def whole(
        self,
        stream: RequestStream,
        texts: list[str],
        logprobs: list[list[TokenLogprobs]],
        thinking: list[str],
    ) -> dict[str, Any]:
        blocks = self.whole_blocks(stream, texts[0], thinking[0])
        text = "".join(b.text for b in blocks if b.kind == "text")
        thought = "".join(b.text for b in blocks if b.kind == "thinking")
        if self.generate:
            fields = {"response": text, **({"thinking": thought} if thought else {})}
            return last(self.model, stream, self.finish_reason, **fields)
        calls = [tool_call(b) for b in blocks if b.kind == "call"]
        message = _message(text, calls, thought)
        return last(self.model, stream, self.finish_reason, message=message)

    def encode(self, events: list[BlockEvent]) -> list[bytes]:
        out = []
        for event in events:
            kind = event.block.kind
            if event.kind == "append" and kind in ("text", "thinking"):
                text, thought = (event.text, "") if kind == "text" else ("", event.text)
                if self.generate:
                    fields = {"response": text, **({"thinking": thought} if thought else {})}
                    out.append(chunk(self.model, **fields))
                else:
                    out.append(chunk(self.model, message=_message(text, thinking=thought)))
            elif event.kind == "close" and kind == "call" and not self.generate:
                out.append(chunk(self.model, message=_message("", [tool_call(event.block)])))
        return out


@dataclass
class RawGenerateEncoder:
    """/api/generate with `raw`: the prompt as it is, the text as it comes."""

    model: str
    media_type: str = MEDIA_TYPE
    finish_reason: str = "stop"

    def opening(self, stream: RequestStream) -> list[bytes]:
        return []

    def thinking(self, index: int, text: str) -> list[bytes]:
        return []  # a raw prompt's text is not read for thinking

    def delta(self, index: int, text: str, logprobs: list[TokenLogprobs]) -> list[bytes]:
        return [chunk(self.model, response=text)]

    def closing(self, index: int, finish_reason: str) -> list[bytes]:
        self.finish_reason = finish_reason
        return []

    def ending(self, stream: RequestStream) -> list[bytes]:
        return ending(self.model, stream, self.finish_reason, response="")

    def whole(
        self,
        stream: RequestStream,
        texts: list[str],
        logprobs: list[list[TokenLogprobs]],
        thinking: list[str],
    ) -> dict[str, Any]:
        reason = stream.finish_reasons[0] or "stop"
        return last(self.model, stream, reason, response=texts[0])


def _message(
    text: str, calls: list[dict[str, Any]] | None = None, thinking: str = ""
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return message
