"""From a request to a response: admission and preparation (`service.submit`), then one whole
answer or an SSE stream.

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
from tandem.server.errors import APIError, error_body
from tandem.server.prepare import Prepared
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.responses import (
    DONE,
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    sse,
    usage,
)
from tandem.server.service import GenerationService, RequestStream


async def respond(
    service: GenerationService,
    request: Request,
    prepare: Callable[[bytes, bool], Prepared],
    model_name: str,
) -> JSONResponse | StreamingResponse:
    """Read the body, have `prepare` turn it into an engine request off the event loop, respond."""
    # Read whole (it is within --max-request-bytes) even if it is to be refused: closing a
    # connection with unread data resets it, and the client might not see the answer.
    raw = await request.body()
    bulk = service.intake.is_bulk(raw)
    stream, prepared = await service.submit(bulk, partial(prepare, raw, bulk))
    del raw  # a large body is not kept alive for the length of the generation
    body = prepared.body
    fmt: ResponseFormat
    if isinstance(body, ChatCompletionRequest):
        fmt = ChatFormat(
            stream.request_id,
            model_name,
            body.include_usage,
            prepared.logprobs,
            tools=prepared.tools,
        )
    else:
        fmt = CompletionFormat(stream.request_id, model_name, body.include_usage, prepared.logprobs)
    if body.stream:
        return SSEResponse(_events(stream, fmt), on_close=lambda: service.abort(stream))
    try:
        collected = await _collect_unless_disconnected(request, stream)
    finally:
        service.abort(stream)  # no-op once finished; frees the blocks if we were cancelled
    if collected is None:  # the client left; nobody reads this
        return JSONResponse(error_body(499, "client disconnected"), status_code=499)
    if stream.error is not None:
        raise APIError(stream.error_status, stream.error, code="aborted")
    counts = usage(stream.num_prompt_tokens, stream.num_output_tokens)
    reasons = [stream.finish_reasons.get(i) or "stop" for i in range(stream.num_choices)]
    texts, logprobs = collected
    return JSONResponse(fmt.full(texts, reasons, counts, logprobs))


async def _collect(stream: RequestStream) -> tuple[list[str], list[list[TokenLogprobs]]]:
    """Every choice's whole text, and the logprobs of its tokens (empty unless asked for), by
    choice index."""
    parts: list[list[str]] = [[] for _ in range(stream.num_choices)]
    logprobs: list[list[TokenLogprobs]] = [[] for _ in range(stream.num_choices)]
    unfinished = stream.num_choices
    while unfinished:
        for delta in await stream.next_deltas():
            parts[delta.index].append(delta.text)
            logprobs[delta.index] += delta.logprobs or []
            unfinished -= delta.finished
    return ["".join(p) for p in parts], logprobs


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_disconnected(
    request: Request, stream: RequestStream
) -> tuple[list[str], list[list[TokenLogprobs]]] | None:
    """Every choice's whole text and logprobs, or None if the client disconnected first."""
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


async def _events(stream: RequestStream, fmt: ResponseFormat) -> AsyncIterator[bytes]:
    """One chunk per choice with new text, a closing chunk per choice as it finishes."""
    for index in range(stream.num_choices):
        for chunk in fmt.opening(index):
            yield sse(chunk)
    unfinished = stream.num_choices
    while unfinished:
        deltas = await stream.next_deltas()
        texts: dict[int, str] = {}
        logprobs: dict[int, list[TokenLogprobs]] = {}
        for d in deltas:
            texts[d.index] = texts.get(d.index, "") + d.text
            logprobs.setdefault(d.index, []).extend(d.logprobs or [])
        for index, text in texts.items():
            if text or logprobs[index]:
                chunk = fmt.delta(text, index, logprobs[index])
                if chunk is not None:  # None: a tool-call parser holds the text back
                    yield sse(chunk)
        for d in deltas:
            if d.finished:
                unfinished -= 1
                if stream.error is None:  # else the error below ends the stream
                    yield sse(fmt.closing(d.finish_reason or "stop", d.index))
    if stream.error is not None:  # ended by the server: say so in-stream, as OpenAI does
        yield sse(error_body(stream.error_status, stream.error, code="aborted"))
    elif fmt.include_usage:
        yield sse(fmt.usage_chunk(usage(stream.num_prompt_tokens, stream.num_output_tokens)))
    yield DONE


class SSEResponse(StreamingResponse):
    """A text/event-stream whose `on_close` runs however the response ends, a disconnect included."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
