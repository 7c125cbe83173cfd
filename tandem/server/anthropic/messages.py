"""The Messages API's answers: a message of content blocks, or its event stream.

A stream is `message_start` (with the prompt's `input_tokens`) and a `ping`, then per block
`content_block_start`, its `content_block_delta`s (`thinking_delta` for a reasoning model's
thinking, which comes first, `text_delta`, or `input_json_delta` for a tool call's arguments)
and `content_block_stop`, then `message_delta` (the stop reason and the usage) and
`message_stop`; an engine failure mid-stream ends it with an `error` event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.request import TokenLogprobs
from tandem.server.frontend.encoding import sse
from tandem.server.frontend.errors import APIError
from tandem.server.frontend.service import RequestStream
from tandem.server.generation.output import Block, BlockEncoder, BlockEvent

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(error: APIError) -> dict[str, Any]:
    """The Messages API's error body."""
    kind = ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def stop_reason(finish_reason: str, stop_string: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer that ended with `finish_reason`."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def content_block(block: Block) -> dict[str, Any]:
    """A whole block as a message's content holds it (a thinking block's signature is empty:
    the server signs nothing, and drops thinking blocks sent back)."""
    if block.kind == "thinking":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    try:
        arguments = json.loads(block.text) if block.text else {}
    except ValueError:  # cut off by max_tokens: the stop reason says so
        arguments = {}
    return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name,
            "input": arguments}  # fmt: skip


@dataclass
class MessagesEncoder(BlockEncoder):
    message_id: str
    model: str
    media_type: str = "text/event-stream"

    def message(
        self, content: list[dict[str, Any]], stream: RequestStream, reason: str | None
    ) -> dict[str, Any]:
        stop, sequence = (None, None)
        if reason is not None:
            stop, sequence = stop_reason(reason, stream.stop_strings.get(0))
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": sequence,
            "usage": _usage(stream),
        }

    def opening(self, stream: RequestStream) -> list[bytes]:
        start = {"type": "message_start", "message": self.message([], stream, None)}
        opening = [sse(start, "message_start"), sse({"type": "ping"}, "ping")]
        return opening + self.encode(self.output.opening())

    def ending(self, stream: RequestStream) -> list[bytes]:
        if stream.error is not None:
            error = anthropic_error(APIError(stream.error_status, stream.error))
            return [sse(error, "error")]
        stop, sequence = stop_reason(self.finish_reason, stream.stop_strings.get(0))
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": sequence},
            "usage": _usage(stream),
        }
        return [sse(delta, "message_delta"), sse({"type": "message_stop"}, "message_stop")]

    def whole(
        self,
        stream: RequestStream,
        texts: list[str],
        logprobs: list[list[TokenLogprobs]],
        thinking: list[str],
    ) -> dict[str, Any]:
        blocks = self.whole_blocks(stream, texts[0], thinking[0])
        return self.message([content_block(b) for b in blocks], stream, self.finish_reason)

    def encode(self, events: list[BlockEvent]) -> list[bytes]:
        out = []
        for event in events:
            block = event.block
            if event.kind == "open":
                # Empty: a call's input follows as input_json_delta, a text as its deltas.
                start = content_block(Block(block.kind, call_id=block.call_id, name=block.name))
                payload = {"type": "content_block_start", "index": event.index,
                           "content_block": start}  # fmt: skip
                out.append(sse(payload, "content_block_start"))
            elif event.kind == "append":
                delta = {
                    "thinking": {"type": "thinking_delta", "thinking": event.text},
                    "text": {"type": "text_delta", "text": event.text},
                    "call": {"type": "input_json_delta", "partial_json": event.text},
                }[block.kind]
                payload = {"type": "content_block_delta", "index": event.index, "delta": delta}
                out.append(sse(payload, "content_block_delta"))
            else:
                payload = {"type": "content_block_stop", "index": event.index}
                out.append(sse(payload, "content_block_stop"))
        return out


def _usage(stream: RequestStream) -> dict[str, int]:
    return {"input_tokens": stream.num_prompt_tokens, "output_tokens": stream.num_output_tokens}
