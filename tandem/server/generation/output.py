"""One answer's text as the newer APIs give it: a list of blocks, a reasoning model's thinking
first, then text and tool calls in the order the model wrote them (Anthropic's content blocks,
the Responses API's output items, Ollama's message, thinking and tool calls).

`ChatOutput` reads the text through the request's tool-call parser (`tools.py`) and says, piece
by piece, which block opens, what is appended to it and when it closes; an API's encoder turns
those events into its own stream. A whole answer is the same reader fed the whole text at once
(`whole`), so a stream and a plain response always hold the same blocks. `BlockEncoder` is
what the encoders of those APIs share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.request import TokenLogprobs
from tandem.server.frontend.service import RequestStream
from tandem.server.generation.tools import ToolCallParser, ToolPlan, tool_finish_reason


@dataclass
class Block:
    kind: Literal["thinking", "text", "call"]
    text: str = ""  # the thinking, the text, or the call's arguments (JSON text)
    call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class BlockEvent:
    """`open`: `block` starts (a call with its id and name); `append`: `text` is added to it;
    `close`: it is complete. `index` is the block's place in the answer."""

    kind: Literal["open", "append", "close"]
    index: int
    block: Block
    text: str = ""


@dataclass
class ChatOutput:
    plan: ToolPlan | None = None
    blocks: list[Block] = field(default_factory=list)
    _parser: ToolCallParser | None = None
    _open: int | None = None  # the block text or arguments go to
    _calls: dict[int, int] = field(default_factory=dict)  # parser's call index -> block

    def __post_init__(self) -> None:
        self._parser = self.plan.parser() if self.plan is not None else None

    @property
    def called(self) -> bool:
        return self._parser is not None and self._parser.called

    def think(self, text: str) -> list[BlockEvent]:
        """Thinking text: its own block, before the answer's (the thinking precedes it)."""
        if not text:
            return []
        events: list[BlockEvent] = []
        index = self._open
        if index is None or self.blocks[index].kind != "thinking":
            index = self._start(Block("thinking"), events)
        self.blocks[index].text += text
        events.append(BlockEvent("append", index, self.blocks[index], text))
        return events

    def opening(self) -> list[BlockEvent]:
        """A named function's call opens the answer before any text."""
        return self._events(self._parser.opening() if self._parser else [])

    def feed(self, text: str) -> list[BlockEvent]:
        if self._parser is None:
            return self._events([text] if text else [])
        return self._events(self._parser.feed(text).pieces)

    def finish(self, finish_reason: str) -> tuple[list[BlockEvent], str]:
        """The last events (what the parser held back, the open block's close) and the finish
        reason: "tool_calls" for an answer that ended by itself after calling tools."""
        events = self._events(self._parser.finish(finish_reason).pieces if self._parser else [])
        if self._open is not None:
            events.append(BlockEvent("close", self._open, self.blocks[self._open]))
            self._open = None
        return events, tool_finish_reason(finish_reason, self.called)

    def whole(self, text: str, finish_reason: str, thinking: str = "") -> tuple[list[Block], str]:
        """Every block of a whole answer (the thinking first), and its finish reason."""
        self.think(thinking)
        self.opening()
        self.feed(text)
        _, reason = self.finish(finish_reason)
        return self.blocks, reason

    def _events(self, pieces: list[str | dict[str, Any]]) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for piece in pieces:
            if isinstance(piece, str):
                index = self._open if self._open is not None else -1
                if index < 0 or self.blocks[index].kind != "text":  # after thinking too
                    index = self._start(Block("text"), events)
            elif "id" in piece:  # a call's first entry: its id, name and first arguments
                function = piece["function"]
                call = Block("call", call_id=piece["id"], name=function["name"])
                index = self._calls[piece["index"]] = self._start(call, events)
                piece = function["arguments"]
            else:
                index = self._calls[piece["index"]]
                piece = piece["function"]["arguments"]
            if piece:
                self.blocks[index].text += piece
                events.append(BlockEvent("append", index, self.blocks[index], piece))
        return events

    def _start(self, block: Block, events: list[BlockEvent]) -> int:
        if self._open is not None:
            events.append(BlockEvent("close", self._open, self.blocks[self._open]))
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        events.append(BlockEvent("open", self._open, block))
        return self._open


@dataclass(kw_only=True)
class BlockEncoder:
    """What the encoders of the block APIs share: the answer's text read by a `ChatOutput`,
    step by step, each step's block events written by the API (`encode`)."""

    plan: ToolPlan | None = None
    finish_reason: str = "stop"  # the answer's, once it has ended ("tool_calls" after calls)
    output: ChatOutput = field(init=False)

    def __post_init__(self) -> None:
        self.output = ChatOutput(self.plan)

    def thinking(self, index: int, text: str) -> list[bytes]:
        return self.encode(self.output.think(text))

    def delta(self, index: int, text: str, logprobs: list[TokenLogprobs]) -> list[bytes]:
        return self.encode(self.output.feed(text))

    def closing(self, index: int, finish_reason: str) -> list[bytes]:
        events, self.finish_reason = self.output.finish(finish_reason)
        return self.encode(events)

    def whole_blocks(self, stream: RequestStream, text: str, thinking: str) -> list[Block]:
        """A whole answer's blocks (read afresh: a stream's reader is not shared)."""
        blocks, self.finish_reason = ChatOutput(self.plan).whole(
            text, stream.finish_reasons[0] or "stop", thinking
        )
        return blocks

    def encode(self, events: list[BlockEvent]) -> list[bytes]:
        raise NotImplementedError
