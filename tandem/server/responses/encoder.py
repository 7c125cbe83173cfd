"""The Responses API's answers: a response object of output items, or its event stream.

A stream is `response.created` and `response.in_progress`, then per output item
`response.output_item.added`, its deltas (`response.reasoning_text.delta` for a reasoning
model's thinking, which comes first; `response.content_part.added` and
`response.output_text.delta` for a message; `response.function_call_arguments.delta` for a
function call), their `.done` events and `response.output_item.done`, then
`response.completed` (or `response.incomplete` when max_output_tokens cut the answer; or
`response.failed` when the engine failed). Every event carries its `sequence_number`.
A stored response (`store`) is kept once it is complete, streamed or not.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.request import TokenLogprobs
from tandem.server.frontend.encoding import sse
from tandem.server.frontend.service import RequestStream
from tandem.server.generation.output import Block, BlockEncoder, BlockEvent
from tandem.server.generation.request import Message, ToolCall
from tandem.server.responses.protocol import ResponsesRequest
from tandem.server.responses.store import ResponseStore


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesEncoder(BlockEncoder):
    response_id: str
    model: str
    body: ResponsesRequest
    history: list[Message]  # the conversation before this answer, without instructions
    store: ResponseStore
    media_type: str = "text/event-stream"
    created_at: int = field(default_factory=lambda: int(time.time()))
    _items: dict[int, dict[str, Any]] = field(default_factory=dict)  # block -> its item
    _sequence: int = 0

    # ------------------------------------------------------------ stream
    def opening(self, stream: RequestStream) -> list[bytes]:
        started = self._response("in_progress", [], None)
        out = [self._event("response.created", response=started)]
        out.append(self._event("response.in_progress", response=started))
        return out + self.encode(self.output.opening())

    def ending(self, stream: RequestStream) -> list[bytes]:
        output = [self._items[i] for i in sorted(self._items)]
        if stream.error is not None:
            error = {"code": "server_error", "message": stream.error}
            failed = self._response("failed", output, stream, error=error)
            return [self._event("response.failed", response=failed)]
        response = self._finished(output, self.output.blocks, stream)
        return [self._event(f"response.{response['status']}", response=response)]

    # ------------------------------------------------------------- whole
    def whole(
        self,
        stream: RequestStream,
        texts: list[str],
        logprobs: list[list[TokenLogprobs]],
        thinking: list[str],
    ) -> dict[str, Any]:
        blocks = self.whole_blocks(stream, texts[0], thinking[0])
        output = [
            _item(block, _item_id(ITEM_PREFIXES[block.kind]), self._status(i, len(blocks)))
            for i, block in enumerate(blocks)
        ]
        return self._finished(output, blocks, stream)

    # ----------------------------------------------------------- helpers
    def _status(self, index: int, count: int) -> str:
        """A closed item's status, of `count`: the last is incomplete when max_output_tokens
        cut it."""
        cut = self.finish_reason == "length" and index == count - 1
        return "incomplete" if cut else "completed"

    def _finished(
        self, output: list[dict[str, Any]], blocks: list[Block], stream: RequestStream
    ) -> dict[str, Any]:
        """The complete response, stored if asked."""
        incomplete = self.finish_reason == "length"
        response = self._response("incomplete" if incomplete else "completed", output, stream)
        if self.body.store:
            self.store.put(response, [*self.history, *self.body.messages(), _answer(blocks)])
        return response

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        stream: RequestStream | None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format else None
        usage = None
        if stream is not None:
            usage = {
                "input_tokens": stream.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": stream.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": stream.num_prompt_tokens + stream.num_output_tokens,
            }
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {
                "format": fmt.model_dump(by_alias=True, exclude_none=True)
                if fmt is not None
                else {"type": "text"}
            },  # fmt: skip
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(payload, kind)

    def encode(self, events: list[BlockEvent]) -> list[bytes]:
        out = []
        for event in events:
            at, block = event.index, event.block
            if event.kind == "open":
                item = self._items[at] = _item(block, _item_id(ITEM_PREFIXES[block.kind]))
                out.append(self._event("response.output_item.added", output_index=at, item=item))
                if block.kind == "text":
                    out.append(self._part_event("added", at, _text_part("")))
            elif event.kind == "append":
                where = {"item_id": self._items[at]["id"], "output_index": at}
                if block.kind == "call":
                    kind = "response.function_call_arguments.delta"
                    out.append(self._event(kind, **where, delta=event.text))
                else:
                    kind = f"response.{TEXT_EVENTS[block.kind]}.delta"
                    extra = {"logprobs": []} if block.kind == "text" else {}
                    out.append(self._event(kind, **where, content_index=0, delta=event.text,
                                           **extra))  # fmt: skip
            else:
                out += self._done(at, block)
        return out

    def _done(self, at: int, block: Block) -> list[bytes]:
        """A closed item's events: its text's or arguments' `.done`, then the item's."""
        item_id = self._items[at]["id"]
        done = self._items[at] = _item(block, item_id, self._status(at, len(self.output.blocks)))
        where = {"item_id": item_id, "output_index": at}
        if block.kind == "call":
            kind = "response.function_call_arguments.done"
            out = [self._event(kind, **where, name=block.name, arguments=block.text)]
        else:
            kind = f"response.{TEXT_EVENTS[block.kind]}.done"
            extra = {"logprobs": []} if block.kind == "text" else {}
            out = [self._event(kind, **where, content_index=0, text=block.text, **extra)]
            if block.kind == "text":
                out.append(self._part_event("done", at, done["content"][0]))
        out.append(self._event("response.output_item.done", output_index=at, item=done))
        return out

    def _part_event(self, what: str, at: int, part: dict[str, Any]) -> bytes:
        kind = f"response.content_part.{what}"
        return self._event(kind, item_id=self._items[at]["id"], output_index=at, content_index=0,
                           part=part)  # fmt: skip


ITEM_PREFIXES = {"thinking": "rs", "text": "msg", "call": "fc"}
TEXT_EVENTS = {"thinking": "reasoning_text", "text": "output_text"}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item(block: Block, item_id: str, status: str = "in_progress") -> dict[str, Any]:
    """An output item as it stands; an item still open has no content yet."""
    final = status != "in_progress"
    if block.kind == "call":
        return {"type": "function_call", "id": item_id, "call_id": block.call_id,
                "name": block.name, "arguments": block.text if final else "", "status": status}  # fmt: skip
    if block.kind == "thinking":
        content = [{"type": "reasoning_text", "text": block.text}] if final else []
        return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
                "status": status}  # fmt: skip
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(block.text)] if final else []}  # fmt: skip


def _answer(blocks: list[Block]) -> Message:
    """The answer as the assistant turn a later request continues from."""
    text = "".join(b.text for b in blocks if b.kind == "text")
    calls = tuple(ToolCall(b.call_id, b.name, b.text) for b in blocks if b.kind == "call")
    return Message("assistant", text, calls)
