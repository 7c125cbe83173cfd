"""The event-loop side of the engine: admission, one stream per request, and graceful shutdown.

Everything here runs on the asyncio event loop except request preparation (parsing, the chat
template, tokenization), which runs in the intake lanes (`intake.py`) so that no request, however
large, stalls other connections. Outputs come from the engine loop thread once per step, as a
single `call_soon_threadsafe(_deliver, deltas)`.

Admission: at most `max_num_seqs + max_waiting` requests are in flight (accepted, not finished).
The engine runs up to `max_num_seqs` at once, so the excess is the waiting queue, counted here on
the event loop where it is exact (the engine's own counters lag behind its inbox). Beyond it, 503
with Retry-After. An accepted request is never dropped: it runs to completion (or until its client
disconnects, or the shutdown grace period runs out, or the engine fails).

If the engine loop thread dies, every request in flight or being prepared is answered at once
(503 if it had produced nothing yet, 500 otherwise; streams end with an error event), /health
says 503, and `on_failure` tells the owner (`serve` exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine import Engine
from tandem.server.errors import APIError, unavailable
from tandem.server.intake import IntakeLanes
from tandem.server.loop import Delta, EngineLoop
from tandem.server.metrics import ServerMetrics
from tandem.server.prepare import Prepared

logger = logging.getLogger("tandem.server")

SHUTDOWN_ABORT_MESSAGE = "the server is shutting down: the request was aborted"


@dataclass
class RequestStream:
    """One accepted request as its HTTP handler sees it: deltas queued in engine order."""

    request_id: str
    num_prompt_tokens: int
    arrival: float
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    num_output_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # set when the server, not the client, ended it early
    error_status: int = 500  # the HTTP status that `error` stands for
    client_gone: bool = False
    last_token_time: float | None = None

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
        engine: Engine,
        max_waiting: int = 256,
        retry_after_s: int = 1,
        intake: IntakeLanes | None = None,
    ):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.capacity = engine.config.max_num_seqs + max_waiting
        self.retry_after_s = retry_after_s
        self.accepting = False
        self.intake = intake or IntakeLanes()
        self.on_failure: Callable[[BaseException], None] | None = None  # called on the event loop
        self._streams: dict[str, RequestStream] = {}
        self._admitting = 0  # accepted, still being prepared
        self._idle = asyncio.Event()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._failed: asyncio.Future[None] | None = None  # done once the engine has failed
        self.loop = EngineLoop(engine, self._from_engine_thread, self._crash_from_engine_thread)
        self.metrics = ServerMetrics(
            engine, lambda: self.num_in_flight, lambda: self.loop.device_idle_fraction
        )

    # ----------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Called on the event loop (the app's lifespan): binds the bridge to it."""
        self._aloop = asyncio.get_running_loop()
        self._failed = self._aloop.create_future()
        self.intake.start()
        self.loop.start()
        self._idle.set()
        self.accepting = True

    @property
    def ready(self) -> bool:
        return self.accepting and self.loop.alive

    @property
    def failed(self) -> bool:
        return self.loop.crashed is not None

    def unready_reason(self) -> str:
        if self._aloop is None:
            return "the server is starting"
        if self.loop.crashed is not None or (self.accepting and not self.loop.alive):
            return "the engine is not running"
        return "the server is shutting down"

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + self._admitting

    async def shutdown(self, grace_period: float, abort_wait_s: float = 5.0) -> None:
        """Refuse new requests, give in-flight ones `grace_period` seconds, abort the rest."""
        if self.accepting:
            logger.info("shutting down: %d request(s) in flight", self.num_in_flight)
        self.accepting = False
        if not await self._wait_idle(grace_period):
            logger.warning("grace period over: aborting %d request(s)", len(self._streams))
            for stream in list(self._streams.values()):
                stream.error, stream.error_status = SHUTDOWN_ABORT_MESSAGE, 503
                self.engine.abort(stream.request_id)
            if not await self._wait_idle(abort_wait_s):
                self._fail_all(SHUTDOWN_ABORT_MESSAGE)  # the loop is stuck: release the clients

    def close(self, wait: bool = False) -> None:
        """Stop the loop thread and the intake workers (after `shutdown`); idempotent. With
        `wait`, also wait for preparations still running (off the event loop only)."""
        self.accepting = False
        self.loop.stop()
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
        """Admit, prepare (in an intake lane: parse, tokenize, validate) and queue one request.

        `bulk` picks the lane (`intake.is_bulk`); `prepare` raises APIError for a bad request.
        If the engine fails meanwhile, the request gets 503 at once.
        """
        self._check_admission()
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
            if not self.ready:  # shutdown began (or the engine failed) during preparation
                raise self._refuse(self.unready_reason())
            request = prepared.request
            stream = RequestStream(request.request_id, request.num_prompt_tokens, arrival)
            self._streams[request.request_id] = stream
            self.engine.submit(request)
        finally:
            self._admitting -= 1
            if not self._streams and not self._admitting:
                self._idle.set()
        self.metrics.prompt_tokens.inc(stream.num_prompt_tokens)
        return stream, prepared

    def abort(self, stream: RequestStream) -> None:
        """The client went away: free the request's KV blocks now (the engine ends it as "abort")."""
        if not stream.finished:
            stream.client_gone = True
            self.engine.abort(stream.request_id)

    def _check_admission(self) -> None:
        if not self.ready:
            raise self._refuse(self.unready_reason())
        if self.num_in_flight >= self.capacity:
            raise self._refuse(
                f"the server is at capacity ({self.num_in_flight} requests in flight, "
                f"{self.capacity - self.engine.config.max_num_seqs} may wait); retry later"
            )

    def _refuse(self, message: str) -> APIError:
        self.metrics.rejected.inc()
        return unavailable(message, self.retry_after_s)

    # ------------------------------------------------ engine -> event loop
    def _from_engine_thread(self, deltas: list[Delta]) -> None:
        self._call_in_event_loop(self._deliver, deltas)

    def _crash_from_engine_thread(self, exc: BaseException) -> None:
        self._call_in_event_loop(self._engine_failed, exc)

    def _call_in_event_loop(self, fn: Callable, arg: object) -> None:
        try:
            if self._aloop is not None:
                self._aloop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the event loop has closed: nobody is left to tell
            pass

    def _deliver(self, deltas: list[Delta]) -> None:
        now = time.perf_counter()
        metrics = self.metrics
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.num_new_tokens:
                metrics.generation_tokens.inc(delta.num_new_tokens)
                if stream.last_token_time is None:
                    metrics.ttft.observe(now - stream.arrival)
                else:
                    metrics.itl.observe(now - stream.last_token_time)
                stream.last_token_time = now
            stream.num_output_tokens = delta.num_output_tokens
            if delta.finished:
                stream.finished = True
                stream.finish_reason = delta.finish_reason
                if delta.error and stream.error is None:
                    stream.error = delta.error
                del self._streams[delta.request_id]
                metrics.finished.labels(finish_reason=delta.finish_reason or "error").inc()
            stream.queue.put_nowait(delta)
        if not self._streams and not self._admitting:
            self._idle.set()

    def _engine_failed(self, exc: BaseException) -> None:
        """The loop thread died: answer everyone now, then tell the owner."""
        self.accepting = False
        message = f"the engine failed: {type(exc).__name__}: {exc}"
        for stream in self._streams.values():
            # Nothing generated yet: the request can be retried elsewhere as it is.
            stream.error_status = 503 if stream.num_output_tokens == 0 else 500
        self._fail_all(message)
        assert self._failed is not None
        if not self._failed.done():
            self._failed.set_result(None)  # requests still being prepared get 503 now
        if self.on_failure is not None:
            self.on_failure(exc)

    def _fail_all(self, message: str) -> None:
        """End every open stream with an error (engine failure, or a loop stuck at shutdown)."""
        for stream in self._streams.values():
            stream.error = message
        failed = [
            Delta(rid, "", 0, s.num_output_tokens, True, "abort", message)
            for rid, s in self._streams.items()
        ]
        self._deliver(failed)
