"""The front end's request side: admission, one stream per request, text, graceful shutdown;
and what an API hands it: a `Prepared` request with the `Encoder` that answers it.

Everything here runs on the asyncio event loop except request preparation (parsing, the chat
template, tokenization), which runs in the intake lanes (`intake.py`) so that no request, however
large, stalls other connections. Requests go to the engine core through a `CoreClient`; its step
outputs come back once per step as token ids, which are detokenized here, per choice (stop
strings too: a choice that meets one ends here, and its sample is aborted in the core).

Admission: at most `max_num_seqs + max_waiting` sequences are in flight (accepted, not finished;
an HTTP request asks for one per prompt and sample), counted here on the event loop where it is
exact. Beyond it, 503 with Retry-After. A request holds one sequence while it is prepared (its
prompts and `n` are known only once it is parsed), then all of its own. An accepted request is
never dropped: it runs to completion (or until its client disconnects, or the shutdown grace
period runs out, or the engine fails).

One HTTP request becomes one engine request per prompt, each with `n` samples; its choices are
numbered prompt-major, `prompt_index * n + sample_index`, as OpenAI does.

If an engine core fails (it dies, hangs or reports a failed step), every request in flight or
being prepared is answered at once (503 if it had produced nothing yet, 500 otherwise; every
choice of a stream ends, then an error event ends the stream), /health says 503, and
`on_failure` tells the owner (`serve` exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

from tandem.request import Request, TokenLogprobs
from tandem.server.core import wire
from tandem.server.core.client import CoreClient
from tandem.server.frontend.adapters import Adapters
from tandem.server.frontend.errors import APIError, bad_request, unavailable
from tandem.server.frontend.intake import IntakeLanes
from tandem.server.frontend.metrics import ServerMetrics
from tandem.server.frontend.served_model import ChoiceText, ServedModel

logger = logging.getLogger("tandem.server")
T = TypeVar("T")

SHUTDOWN_ABORT_MESSAGE = "the server is shutting down: the request was aborted"


class Encoder(Protocol):
    """One request's answer in its API's format, streamed or whole.

    A stream is `opening`, then for each step the `thinking` (a reasoning model's, before the
    answer) and the `delta` of every choice with new text, and the `closing` of every choice
    that ended, then `ending` (usage, the end marker, or the error that cut the stream short:
    `stream.error`). A whole answer is `whole` over every choice's text and thinking. Each
    streaming method returns framed bytes, ready to send.
    """

    media_type: str  # of a stream

    def opening(self, stream: RequestStream) -> list[bytes]: ...

    def thinking(self, index: int, text: str) -> list[bytes]: ...

    def delta(self, index: int, text: str, logprobs: list[TokenLogprobs]) -> list[bytes]: ...

    def closing(self, index: int, finish_reason: str) -> list[bytes]: ...

    def ending(self, stream: RequestStream) -> list[bytes]: ...

    def whole(
        self,
        stream: RequestStream,
        texts: list[str],
        logprobs: list[list[TokenLogprobs]],
        thinking: list[str],
    ) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Prepared:
    """An HTTP request ready for the engine, whatever its API: one engine request per prompt,
    each with `n` samples, and the encoder that answers it in the API's format."""

    request_id: str  # the response's id
    requests: list[Request]
    encoder: Encoder
    stream: bool
    prompt_param: str = "prompt"  # names the prompts when there are too many sequences
    # What the server ignored that the client should know (a tool it cannot run): each
    # becomes a Warning header of the response.
    warnings: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return self.requests[0].params.n

    @property
    def num_seqs(self) -> int:
        """Sequences it asks the engine for: prompts x n."""
        return len(self.requests) * self.n

    @property
    def seqs_param(self) -> str:
        """The parameter to name when it asks for too many sequences."""
        return "n" if self.n > 1 else self.prompt_param


@dataclass(frozen=True)
class Delta:
    """What one step means to one choice of a client's request: new text and tokens, and how it
    ended."""

    request_id: str  # the engine request's id
    text: str
    num_new_tokens: int
    num_output_tokens: int  # cumulative
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0  # the choice
    logprobs: list[TokenLogprobs] | None = None  # of the new tokens, when asked for
    thinking: str = ""  # new thinking text (a reasoning model's chat request)


@dataclass
class RequestStream:
    """One accepted HTTP request as its handler sees it: deltas queued in engine order, each
    carrying its choice's index."""

    request_id: str  # the response's id
    engine_ids: list[str]  # one engine request per prompt
    n: int  # samples per prompt
    prompt_tokens: list[int]  # per prompt
    arrival: float
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    output_tokens: dict[int, int] = field(default_factory=dict)  # choice -> tokens so far
    finish_reasons: dict[int, str | None] = field(default_factory=dict)  # finished choices
    texts: dict[int, ChoiceText] = field(default_factory=dict)  # choice -> its text so far
    stop_strings: dict[int, str] = field(default_factory=dict)  # choice -> the one that ended it
    # choice -> its speculative decoding (draft tokens, accepted ones, verifying steps)
    speculative: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    finished: bool = False  # every choice has finished
    error: str | None = None  # set when the server, not the client, ended it early
    error_status: int = 500  # the HTTP status that `error` stands for
    error_code: str = "aborted"  # and its code in the error body
    client_gone: bool = False
    first_token_time: float | None = None
    last_token_time: dict[int, float] = field(default_factory=dict)  # per choice
    prompt_index: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_index = {engine_id: i for i, engine_id in enumerate(self.engine_ids)}

    @property
    def num_choices(self) -> int:
        return len(self.engine_ids) * self.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_tokens.values())

    def choice(self, engine_id: str, sample: int) -> int:
        return self.prompt_index[engine_id] * self.n + sample

    async def next_deltas(self) -> list[Delta]:
        """Wait for at least one delta, then take every one already queued (a slow client
        gets fewer, larger chunks instead of an ever-growing backlog)."""
        deltas = [await self.queue.get()]
        while not self.queue.empty():
            deltas.append(self.queue.get_nowait())
        return deltas


class GenerationService:
    def __init__(
        self,
        client: CoreClient,
        model: ServedModel,
        max_waiting: int = 256,
        retry_after_s: int = 1,
        intake: IntakeLanes | None = None,
        max_running: int | None = None,
    ):
        """`max_running`: the sequences this front end may have running (default: every core's
        `max_num_seqs`; a server with several front ends gives each a share)."""
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.client = client
        self.model = model
        self.max_running = max_running or model.max_num_seqs * len(client.pids)
        self.capacity = self.max_running + max_waiting
        self.retry_after_s = retry_after_s
        self.accepting = False
        self.intake = intake or IntakeLanes()
        self.on_failure: Callable[[str], None] | None = None  # called on the event loop
        self._streams: dict[str, RequestStream] = {}  # engine request id -> its HTTP request
        self._unfinished: dict[str, int] = {}  # engine request id -> samples still running
        self._admitting = 0  # sequences accepted, still being prepared (one per request)
        self._idle = asyncio.Event()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._failed: asyncio.Future[None] | None = None  # done once the engine has failed
        self.metrics = ServerMetrics(client)
        enable_lora = bool(client.readies) and client.readies[0].enable_lora
        self.adapters = Adapters(client, enable_lora, client.engine_timeout_s)

    # ----------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Called on the event loop (the app's lifespan): binds the bridge to it."""
        self._aloop = asyncio.get_running_loop()
        self._failed = self._aloop.create_future()
        self.intake.start()
        self.adapters.start()
        self.client.on_outputs = self._deliver
        self.client.on_failure = self._engine_failed
        self.client.start()
        self._idle.set()
        self.accepting = True

    @property
    def ready(self) -> bool:
        return self.accepting and self.client.failed is None

    @property
    def failed(self) -> bool:
        return self.client.failed is not None

    def unready_reason(self) -> str:
        if self._aloop is None:
            return "the server is starting"
        if self.client.failed is not None:
            return "the engine is not running"
        return "the server is shutting down"

    @property
    def num_in_flight(self) -> int:
        """Sequences (prompts x samples) accepted and not finished."""
        return sum(self._unfinished.values()) + self._admitting

    async def shutdown(self, grace_period: float, abort_wait_s: float = 5.0) -> None:
        """Refuse new requests, give in-flight ones `grace_period` seconds, abort the rest."""
        if self.accepting:
            logger.info("shutting down: %d request(s) in flight", self.num_in_flight)
        self.accepting = False
        if not await self._wait_idle(grace_period):
            logger.warning("grace period over: aborting %d request(s)", len(self._streams))
            for engine_id, stream in list(self._streams.items()):
                stream.error, stream.error_status = SHUTDOWN_ABORT_MESSAGE, 503
                self.client.abort(engine_id)
            if not await self._wait_idle(abort_wait_s):
                self._fail_all(SHUTDOWN_ABORT_MESSAGE)  # the loop is stuck: release the clients

    def close(self, wait: bool = False) -> None:
        """Stop reading the cores and the intake workers (after `shutdown`). With `wait`, also
        wait for preparations still running (off the event loop only)."""
        self.accepting = False
        self.adapters.close()
        self.client.close()
        self.intake.close(wait)

    async def _wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight; False if `timeout` seconds pass first."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while self._streams or self._admitting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._idle.clear()  # set again by the delivery that empties the table
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), remaining)
        return True

    # ------------------------------------------------------------ requests
    async def submit(
        self, bulk: bool, prepare: Callable[[], Prepared]
    ) -> tuple[RequestStream, Prepared]:
        """Admit, prepare (in an intake lane: parse, tokenize, validate) and queue one HTTP
        request: one engine request per prompt, each with `n` samples. All are queued, or none.

        `bulk` picks the lane (`intake.is_bulk`); `prepare` raises APIError for a bad request.
        If the engine fails meanwhile, the request gets 503 at once.
        """
        self._check_admission(1)  # its size is known once it is parsed
        if bulk and self.intake.bulk_full:
            raise self._refuse(
                f"{self.intake.max_bulk} large requests are already being prepared; retry later"
            )
        self._admitting += 1
        try:
            arrival = time.perf_counter()
            job = self.intake.run(bulk, prepare)
            assert self._failed is not None
            await asyncio.wait({job, self._failed}, return_when=asyncio.FIRST_COMPLETED)
            if not job.done():  # the engine failed while the request was being prepared
                raise self._refuse(self.unready_reason())
            prepared = job.result()
            # Shutdown may have begun (or the engine failed) during preparation, and other
            # requests may have filled the server: admit all of its sequences, or none.
            self._check_admission(prepared.num_seqs, prepared.seqs_param, reserved=1)
            requests = prepared.requests
            stream = RequestStream(
                prepared.request_id,
                [request.request_id for request in requests],
                prepared.n,
                [request.num_prompt_tokens for request in requests],
                arrival,
            )
            for request in requests:
                self._streams[request.request_id] = stream
                self._unfinished[request.request_id] = prepared.n
                first = stream.choice(request.request_id, 0)
                for sample in range(prepared.n):
                    stream.texts[first + sample] = self.model.choice_text(request)
                self.client.submit(request)
        finally:
            self._admitting -= 1
            self._after_delivery()
        self.metrics.prompt_tokens.inc(stream.num_prompt_tokens)
        return stream, prepared

    async def compute(self, raw: bytes, work: Callable[[bytes, bool], T]) -> T:
        """`work(raw, bulk)` in an intake lane, off the event loop, for a request that generates
        nothing (a token count): it takes no sequence, but a large body waits in the bulk lane
        like any other."""
        bulk = self.intake.is_bulk(raw)
        if bulk and self.intake.bulk_full:
            raise self._refuse(
                f"{self.intake.max_bulk} large requests are already being prepared; retry later"
            )
        return await self.intake.run(bulk, partial(work, raw, bulk))

    def abort(self, stream: RequestStream) -> None:
        """The client went away: free the request's KV blocks now (the engine ends it as "abort")."""
        if not stream.finished:
            stream.client_gone = True
            for engine_id in stream.engine_ids:
                self.client.abort(engine_id)

    def _check_admission(self, num_seqs: int, param: str = "n", reserved: int = 0) -> None:
        """`reserved`: sequences this request already holds in `num_in_flight`."""
        if not self.ready:
            raise self._refuse(self.unready_reason())
        if num_seqs > self.capacity:  # the preparer refuses these first; kept for other callers
            raise bad_request(
                f"this request asks for {num_seqs} sequences (prompts x n); the server holds at "
                f"most {self.capacity} at once",
                param=param,
            )
        in_flight = self.num_in_flight - reserved
        if in_flight + num_seqs > self.capacity:
            raise self._refuse(
                f"the server is at capacity ({in_flight} sequences in flight, "
                f"{self.capacity - self.max_running} may wait); retry later"
            )

    def _refuse(self, message: str) -> APIError:
        self.metrics.rejected.inc()
        return unavailable(message, self.retry_after_s)

    # ---------------------------------------------------- cores -> streams
    def _deliver(self, deltas: list[wire.TokenDelta]) -> None:
        """One core's step: each sample's new tokens become its choice's text."""
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            choice = stream.choice(delta.request_id, delta.index)
            if choice in stream.finish_reasons:
                continue  # ended here already (a stop string, or _fail_all)
            text = stream.texts[choice]
            tokens = delta.token_ids
            stopped = False
            for k, token in enumerate(tokens):
                if text.add(token):
                    stopped, tokens = True, tokens[: k + 1]
                    break
            finished = delta.finished or stopped
            if stopped:
                stream.stop_strings[choice] = text.matched_stop
                if not delta.finished:
                    self.client.abort(delta.request_id, delta.index)  # free its blocks now
            if delta.error_status == 404 and stream.error is None:  # its adapter has gone
                stream.error_status, stream.error_code = 404, "model_not_found"
                self.adapters.forget()  # the cores are asked again next time
            logprobs = delta.logprobs
            if delta.speculative is not None:
                stream.speculative[choice] = delta.speculative
            self._route(
                stream,
                Delta(
                    delta.request_id,
                    text.delta(finished),
                    len(tokens),
                    text.num_tokens,
                    finished,
                    "stop" if stopped else delta.finish_reason,
                    delta.error,
                    choice,
                    None if logprobs is None else self.model.logprobs(logprobs[: len(tokens)]),
                    text.thinking_delta(finished),
                ),
            )
        self._after_delivery()

    def _route(self, stream: RequestStream, delta: Delta) -> None:
        """Count it, then queue it for the stream's handler (`delta.index` is the choice)."""
        now = time.perf_counter()
        metrics = self.metrics
        engine_id, choice = delta.request_id, delta.index
        if delta.num_new_tokens:
            metrics.generation_tokens.inc(delta.num_new_tokens)
            if stream.first_token_time is None:
                stream.first_token_time = now
                metrics.ttft.observe(now - stream.arrival)
            if choice in stream.last_token_time:
                metrics.itl.observe(now - stream.last_token_time[choice])
            stream.last_token_time[choice] = now
        stream.output_tokens[choice] = delta.num_output_tokens
        if delta.finished:
            stream.finish_reasons[choice] = delta.finish_reason
            del stream.texts[choice]
            if delta.error and stream.error is None:
                stream.error = delta.error
            self._unfinished[engine_id] -= 1
            if not self._unfinished[engine_id]:
                del self._unfinished[engine_id], self._streams[engine_id]
            stream.finished = len(stream.finish_reasons) == stream.num_choices
            metrics.finished.labels(finish_reason=delta.finish_reason or "error").inc()
        stream.queue.put_nowait(delta)

    def _after_delivery(self) -> None:
        self.metrics.in_flight.set(self.num_in_flight)
        if not self._streams and not self._admitting:
            self._idle.set()

    def _engine_failed(self, reason: str) -> None:
        """A core failed: answer everyone now, then tell the owner."""
        self.accepting = False
        message = f"the engine failed: {reason}"
        for stream in self._streams.values():
            # Nothing generated yet: the request can be retried elsewhere as it is.
            stream.error_status = 503 if stream.num_output_tokens == 0 else 500
        self._fail_all(message)
        assert self._failed is not None
        if not self._failed.done():
            self._failed.set_result(None)  # requests still being prepared get 503 now
        if self.on_failure is not None:
            self.on_failure(message)

    def _fail_all(self, message: str) -> None:
        """End every unfinished choice of every open stream with an error (engine failure, or a
        loop stuck at shutdown)."""
        for engine_id, stream in list(self._streams.items()):
            stream.error = message
            first = stream.choice(engine_id, 0)
            for choice in range(first, first + stream.n):
                if choice not in stream.finish_reasons:
                    tokens = stream.output_tokens.get(choice, 0)
                    self._route(
                        stream, Delta(engine_id, "", 0, tokens, True, "abort", message, choice)
                    )
        self._after_delivery()
