"""From a request to a response, for every API: admission and preparation (`service.submit`),
then one whole answer or a stream, both written by the request's `Encoder`.

A client that goes away is noticed in both modes and its request aborted at once, so its KV
blocks return to the pool instead of generating for nobody. That includes a client whose own
timeout closed the connection while the request was waiting for its first token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.request import TokenLogprobs
from tandem.server.frontend.errors import APIError
from tandem.server.frontend.service import Encoder, GenerationService, Prepared, RequestStream

CLIENT_GONE = 499  # nginx's status for a client that closed the connection first


async def respond(
    service: GenerationService, request: Request, prepare: Callable[[bytes, bool], Prepared]
) -> JSONResponse | StreamingResponse:
    """Read the body, have `prepare` turn it into engine requests off the event loop, respond."""
    # Read whole (it is within --max-request-bytes) even if it is to be refused: closing a
    # connection with unread data resets it, and the client might not see the answer.
    raw = await request.body()
    bulk = service.intake.is_bulk(raw)
    stream, prepared = await service.submit(bulk, partial(prepare, raw, bulk))
    del raw  # a large body is not kept alive for the length of the generation
    encoder = prepared.encoder
    headers = warning_headers(prepared.warnings)
    if prepared.stream:
        return EventStream(
            _events(stream, encoder),
            encoder.media_type,
            headers,
            on_close=lambda: service.abort(stream),
        )
    try:
        collected = await _collect_unless_disconnected(request, stream)
    finally:
        service.abort(stream)  # no-op once finished; frees the blocks if we were cancelled
    if collected is None:  # the client left; nobody reads this
        raise APIError(CLIENT_GONE, "client disconnected")
    if stream.error is not None:
        raise APIError(stream.error_status, stream.error, code=stream.error_code)
    texts, logprobs, thinking = collected
    return JSONResponse(encoder.whole(stream, texts, logprobs, thinking), headers=headers)


def warning_headers(warnings: list[str]) -> dict[str, str]:
    """RFC 7234's Warning header, code 299 ("miscellaneous persistent warning"), one per note
    joined by commas; none without notes."""
    if not warnings:
        return {}
    quoted = ", ".join('299 tandem "' + w.replace('"', "'") + '"' for w in warnings)
    return {"Warning": quoted.encode("ascii", "replace").decode()}


Collected = tuple[list[str], list[list[TokenLogprobs]], list[str]]


async def _collect(stream: RequestStream) -> Collected:
    """Every choice's whole text, the logprobs of its tokens (empty unless asked for) and its
    thinking, by choice index."""
    parts: list[list[str]] = [[] for _ in range(stream.num_choices)]
    thinking: list[list[str]] = [[] for _ in range(stream.num_choices)]
    logprobs: list[list[TokenLogprobs]] = [[] for _ in range(stream.num_choices)]
    unfinished = stream.num_choices
    while unfinished:
        for delta in await stream.next_deltas():
            parts[delta.index].append(delta.text)
            thinking[delta.index].append(delta.thinking)
            logprobs[delta.index] += delta.logprobs or []
            unfinished -= delta.finished
    return ["".join(p) for p in parts], logprobs, ["".join(t) for t in thinking]


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_disconnected(request: Request, stream: RequestStream) -> Collected | None:
    """Every choice's whole text, logprobs and thinking, or None if the client disconnected
    first."""
    collect = asyncio.ensure_future(_collect(stream))
    disconnect = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({collect, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, disconnect):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    return collect.result() if collect.done() and not collect.cancelled() else None


async def _events(stream: RequestStream, encoder: Encoder) -> AsyncIterator[bytes]:
    """The encoder's opening, then per step each choice's new thinking and text and the
    closing of each choice that ended, then its ending. A choice's text of several queued steps
    goes out as one delta (a slow client gets fewer, larger chunks); its thinking always first:
    the thinking precedes the answer."""
    for chunk in encoder.opening(stream):
        yield chunk
    unfinished = stream.num_choices
    while unfinished:
        deltas = await stream.next_deltas()
        texts: dict[int, str] = {}
        thinking: dict[int, str] = {}
        logprobs: dict[int, list[TokenLogprobs]] = {}
        for d in deltas:
            texts[d.index] = texts.get(d.index, "") + d.text
            thinking[d.index] = thinking.get(d.index, "") + d.thinking
            logprobs.setdefault(d.index, []).extend(d.logprobs or [])
        for index, text in texts.items():
            if thinking[index]:
                for chunk in encoder.thinking(index, thinking[index]):
                    yield chunk
            if text or logprobs[index]:
                for chunk in encoder.delta(index, text, logprobs[index]):
                    yield chunk
        for d in deltas:
            if d.finished:
                unfinished -= 1
                if stream.error is None:  # else the ending says what cut the stream short
                    for chunk in encoder.closing(d.index, d.finish_reason or "stop"):
                        yield chunk
    for chunk in encoder.ending(stream):
        yield chunk


class EventStream(StreamingResponse):
    """A streamed answer whose `on_close` runs however the response ends, a disconnect included."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        media_type: str,
        headers: dict[str, str],
        on_close: Callable[[], None],
    ):
        super().__init__(
            content,
            media_type=media_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
