"""The event-loop side of the engine: admission, one stream per request, and graceful shutdown.

Everything here runs on the asyncio event loop except tokenization (and chat-template rendering),
which runs on one worker thread so a long prompt never stalls other connections. Outputs come
from the engine loop thread once per step, as a single `call_soon_threadsafe(_deliver, deltas)`.

Admission: at most `max_num_seqs + max_waiting` sequences are in flight (accepted, not finished;
an HTTP request asks for one per prompt and sample). The engine runs up to `max_num_seqs` at once,
so the excess is the waiting queue, counted here on the event loop where it is exact (the engine's
own counters lag behind its inbox). Beyond it, 503 with Retry-After. An accepted request is never
dropped: it runs to completion (or until its client disconnects, or the shutdown grace period
runs out).

One HTTP request becomes one engine request per prompt, each with `n` samples; its choices are
numbered prompt-major, `prompt_index * n + sample_index`, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tandem.engine import Engine
from tandem.request import SamplingParams
from tandem.server.errors import APIError, bad_request, unavailable
from tandem.server.loop import Delta, EngineLoop
from tandem.server.metrics import ServerMetrics

logger = logging.getLogger("tandem.server")

SHUTDOWN_ABORT_MESSAGE = "the server is shutting down: the request was aborted"


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
    finished: bool = False  # every choice has finished
    error: str | None = None  # set when the server, not the client, ended it early
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
    def __init__(self, engine: Engine, max_waiting: int = 256, retry_after_s: int = 1):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.capacity = engine.config.max_num_seqs + max_waiting
        self.retry_after_s = retry_after_s
        self.accepting = False
        self._streams: dict[str, RequestStream] = {}  # engine request id -> its HTTP request
        self._unfinished: dict[str, int] = {}  # engine request id -> samples still running
        self._admitting = 0  # sequences accepted, still being tokenized
        self._idle = asyncio.Event()
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._tokenizer_pool: ThreadPoolExecutor | None = None
        self.loop = EngineLoop(engine, self._from_engine_thread, self._crash_from_engine_thread)
        self.metrics = ServerMetrics(
            engine, lambda: self.num_in_flight, lambda: self.loop.device_idle_fraction
        )

    # ----------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Called on the event loop (the app's lifespan): binds the bridge to it."""
        self._aloop = asyncio.get_running_loop()
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-tokenize")
        self.loop.start()
        self._idle.set()
        self.accepting = True

    @property
    def ready(self) -> bool:
        return self.accepting and self.loop.alive

    def unready_reason(self) -> str:
        if self._aloop is None:
            return "the server is starting"
        if self.loop.crashed is not None or (self.accepting and not self.loop.alive):
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
                stream.error = SHUTDOWN_ABORT_MESSAGE
                self.engine.abort(engine_id)
            if not await self._wait_idle(abort_wait_s):
                self._fail_all(SHUTDOWN_ABORT_MESSAGE)  # the loop is stuck: release the clients

    def close(self) -> None:
        """Stop the loop thread and the tokenizer worker (after `shutdown`); idempotent."""
        self.accepting = False
        self.loop.stop()
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

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
        self,
        prepares: Sequence[Callable[[], str | list[int]]],
        params: SamplingParams,
        prefix: str,
        prompt_param: str,
    ) -> RequestStream:
        """Admit, tokenize (off the event loop) and queue one HTTP request: one engine request
        per prompt, each with `params.n` samples. All are admitted and queued, or none.

        Each of `prepares` builds a prompt on the tokenizer thread; a ValueError from it or from
        the engine's validation becomes a 400 naming `prompt_param`.
        """
        num_seqs = len(prepares) * params.n
        self._check_admission(num_seqs, "n" if params.n > 1 else prompt_param)
        self._admitting += num_seqs
        try:
            request_id = f"{prefix}-{uuid.uuid4().hex}"
            engine_ids = (
                [request_id]
                if len(prepares) == 1
                else [f"{request_id}-{i}" for i in range(len(prepares))]
            )
            arrival = time.perf_counter()

            def build():
                requests = []
                for i, (engine_id, prepare) in enumerate(zip(engine_ids, prepares, strict=True)):
                    try:
                        requests.append(self.engine.make_request(prepare(), params, engine_id))
                    except ValueError as exc:
                        raise ValueError(
                            f"prompt {i}: {exc}" if len(prepares) > 1 else exc
                        ) from None
                return requests

            assert self._aloop is not None and self._tokenizer_pool is not None
            try:
                requests = await self._aloop.run_in_executor(self._tokenizer_pool, build)
            except ValueError as exc:  # the engine's validation: the prompt, or its length
                message = str(exc)
                param = "max_tokens" if "plus max_tokens" in message else prompt_param
                if "logit_bias" in message:  # a token id outside the vocabulary
                    param = "logit_bias"
                raise bad_request(message, param=param) from None
            if not self.ready:  # shutdown began while the prompt was being tokenized
                raise self._refuse(self.unready_reason())
            stream = RequestStream(
                request_id,
                engine_ids,
                params.n,
                [request.num_prompt_tokens for request in requests],
                arrival,
            )
            for request in requests:
                self._streams[request.request_id] = stream
                self._unfinished[request.request_id] = params.n
                self.engine.submit(request)
        finally:
            self._admitting -= num_seqs
            if not self._streams and not self._admitting:
                self._idle.set()
        self.metrics.prompt_tokens.inc(stream.num_prompt_tokens)
        return stream

    def abort(self, stream: RequestStream) -> None:
        """The client went away: free the request's KV blocks now (the engine ends it as "abort")."""
        if not stream.finished:
            stream.client_gone = True
            for engine_id in stream.engine_ids:
                self.engine.abort(engine_id)

    def _check_admission(self, num_seqs: int = 1, param: str = "n") -> None:
        if not self.ready:
            raise self._refuse(self.unready_reason())
        if num_seqs > self.capacity:
            raise bad_request(
                f"this request asks for {num_seqs} sequences (prompts x n); the server holds at "
                f"most {self.capacity} at once",
                param=param,
            )
        if self.num_in_flight + num_seqs > self.capacity:
            raise self._refuse(
                f"the server is at capacity ({self.num_in_flight} sequences in flight, "
                f"{self.capacity - self.engine.config.max_num_seqs} may wait); retry later"
            )

    def _refuse(self, message: str) -> APIError:
        self.metrics.rejected.inc()
        return unavailable(message, self.retry_after_s)

    # ------------------------------------------------ engine -> event loop
    def _from_engine_thread(self, deltas: list[Delta]) -> None:
        self._call_in_event_loop(self._deliver, deltas)

    def _crash_from_engine_thread(self, exc: BaseException) -> None:
        self._call_in_event_loop(self._fail_all, f"the engine failed: {type(exc).__name__}: {exc}")

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
            engine_id = delta.request_id
            stream = self._streams.get(engine_id)
            if stream is None:
                continue
            choice = stream.choice(engine_id, delta.index)
            if choice in stream.finish_reasons:
                continue  # already failed by _fail_all
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
                if delta.error:
                    stream.error = delta.error
                self._unfinished[engine_id] -= 1
                if not self._unfinished[engine_id]:
                    del self._unfinished[engine_id], self._streams[engine_id]
                stream.finished = len(stream.finish_reasons) == stream.num_choices
                metrics.finished.labels(finish_reason=delta.finish_reason or "error").inc()
            stream.queue.put_nowait(dataclasses.replace(delta, index=choice))
        if not self._streams and not self._admitting:
            self._idle.set()

    def _fail_all(self, message: str) -> None:
        """End every open stream with an error (engine crash, or a loop stuck at shutdown)."""
        failed = []
        for engine_id, stream in self._streams.items():
            first = stream.choice(engine_id, 0)
            for sample in range(stream.n):
                if first + sample not in stream.finish_reasons:
                    tokens = stream.output_tokens.get(first + sample, 0)
                    failed.append(Delta(engine_id, "", 0, tokens, True, "abort", message, sample))
        self._deliver(failed)
