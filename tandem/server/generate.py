"""From a validated request to a response: prompt, sampling, then one whole answer or an SSE stream.

A client that goes away is noticed in both modes and its request aborted at once, so its KV
blocks return to the pool instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.engine import Engine
from tandem.request import SamplingParams, TokenLogprobs
from tandem.server.errors import APIError, bad_request, error_body
from tandem.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tandem.server.responses import (
    DONE,
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    sse,
    usage,
)
from tandem.server.service import SHUTDOWN_ABORT_MESSAGE, GenerationService, RequestStream

Prompt = str | list[int]


# ---------------------------------------------------------------- prompts
def completion_prompts(body: CompletionRequest) -> list[Callable[[], Prompt]]:
    """One prompt, or a list of them (strings or token-id lists), as OpenAI accepts."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return [lambda p=p: p for p in prompt]
    return [lambda: prompt]


def chat_prompt(engine: Engine, messages: list[ChatMessage]) -> Callable[[], Prompt]:
    """The tokenizer's chat template, rendered on the tokenizer thread.

    The template writes any BOS itself, so the text is tokenized without special tokens.
    """
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "this model's tokenizer has no chat template, so /v1/chat/completions cannot build "
            "a prompt; use /v1/completions with a plain prompt",
            param="messages",
        )
    conversation = [m.as_template_message() for m in messages]

    def render() -> Prompt:
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja's TemplateError, raise_exception() in templates
            raise ValueError(f"the chat template refused these messages: {exc}") from None
        return tokenizer(text, add_special_tokens=False).input_ids

    return render


def sampling_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    try:
        return body.sampling_params()
    except ValueError as exc:  # SamplingParams' messages start with the field's name
        message = str(exc)
        match = re.match(r"(\w+) must", message)
        param = match.group(1) if match else None
        if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"
            message = param + message.removeprefix("max_tokens")
        raise bad_request(message, param=param) from None


# --------------------------------------------------------------- responses
async def respond(
    service: GenerationService,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prepares: list[Callable[[], Prompt]],
    model_name: str,
) -> JSONResponse | StreamingResponse:
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    params = sampling_params(body)
    chat = isinstance(body, ChatCompletionRequest)
    prefix, prompt_param = ("chatcmpl", "messages") if chat else ("cmpl", "prompt")
    stream = await service.submit(prepares, params, prefix, prompt_param)
    fmt_cls = ChatFormat if chat else CompletionFormat
    fmt = fmt_cls(stream.request_id, model_name, body.include_usage, params.logprobs)
    if body.stream:
        return SSEResponse(_events(stream, fmt), on_close=lambda: service.abort(stream))
    try:
        collected = await _collect_unless_disconnected(request, stream)
    finally:
        service.abort(stream)  # no-op once finished; frees the blocks if we were cancelled
    if collected is None:  # the client left; nobody reads this
        return JSONResponse(error_body(499, "client disconnected"), status_code=499)
    _raise_if_server_ended(stream)
    counts = usage(stream.num_prompt_tokens, stream.num_output_tokens)
    reasons = [stream.finish_reasons.get(i) or "stop" for i in range(stream.num_choices)]
    texts, logprobs = collected
    return JSONResponse(fmt.full(texts, reasons, counts, logprobs))


def _raise_if_server_ended(stream: RequestStream) -> None:
    if stream.error is not None:
        status = 503 if stream.error == SHUTDOWN_ABORT_MESSAGE else 500
        raise APIError(status, stream.error, code="aborted")


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
                yield sse(fmt.delta(text, index, logprobs[index]))
        for d in deltas:
            if d.finished:
                unfinished -= 1
                if stream.error is None:  # else the error below ends the stream
                    yield sse(fmt.closing(d.finish_reason or "stop", d.index))
    if stream.error is not None:  # ended by the server: say so in-stream, as OpenAI does
        status = 503 if stream.error == SHUTDOWN_ABORT_MESSAGE else 500
        yield sse(error_body(status, stream.error, code="aborted"))
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
