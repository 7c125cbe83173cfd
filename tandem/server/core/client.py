"""A front end's connection to the engine cores: requests out, step outputs in, faults noticed.

One DEALER socket per core (a data-parallel server has several). `connect` does the handshake
before the event loop starts; afterwards every socket is read on the event loop, and what is
submitted or aborted during one turn of the loop goes out as one `Inbox` per core.

A core that dies is noticed at once (a pidfd becomes readable); one that hangs, when it has
work from this front end and has sent nothing for `engine_timeout_s`. Either way `on_failure`
runs once, on the event loop. New requests go to the core with the fewest of this front end's
sequences in flight (ties: the fewest running and waiting by its latest stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from tandem.request import Request
from tandem.server.core import wire

logger = logging.getLogger("tandem.server")

WATCHDOG_INTERVAL_S = 0.5


class CoreUnavailable(RuntimeError):
    """A core failed to start, or died before it was ready."""


@dataclass(frozen=True)
class CoreEndpoint:
    address: str
    pid: int


@dataclass
class _Core:
    index: int
    endpoint: CoreEndpoint
    sock: zmq.Socket  # the asyncio view of `owner` once started
    pidfd: int | None
    ready: wire.Ready | None = None
    stats: wire.CoreStats | None = None
    in_flight: int = 0  # this front end's sequences on it
    last_heard: float = 0.0
    pending: wire.Inbox = field(default_factory=wire.Inbox)
    timelines: deque[asyncio.Future] = field(default_factory=deque)  # queries awaiting answers
    lora_queries: dict[int, asyncio.Future] = field(default_factory=dict)  # by query number
    owner: zmq.Socket | None = None  # the socket itself: a shadow does not keep it open


class CoreClient:
    def __init__(
        self, endpoints: list[CoreEndpoint], frontend_index: int = 0, engine_timeout_s: float = 60.0
    ):
        if not endpoints:
            raise ValueError("a front end needs at least one engine core")
        self.engine_timeout_s = engine_timeout_s
        self._frontend_index = frontend_index
        self._context = zmq.Context()
        self._cores = [
            _Core(i, endpoint, self._socket(endpoint, frontend_index), _pidfd(endpoint.pid))
            for i, endpoint in enumerate(endpoints)
        ]
        self.on_outputs: Callable[[list[wire.TokenDelta]], None] | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.failed: str | None = None
        self._home: dict[str, _Core] = {}  # request id -> its core
        self._samples_left: dict[str, int] = {}  # request id -> samples the core still runs
        self._flush_scheduled = False
        self._turn = 0
        self._query = 0  # the latest LoRA query's number
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    def _socket(self, endpoint: CoreEndpoint, frontend_index: int) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"frontend-{frontend_index}-{os.getpid()}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint.address)
        return sock

    # ------------------------------------------------------------ lifecycle
    def connect(self, timeout_s: float = 600.0) -> wire.Ready:
        """Handshake with every core (blocking, before the event loop runs); returns the first
        core's `Ready` (replicas serve one model). Raises CoreUnavailable."""
        for core in self._cores:
            core.sock.send(wire.encode(wire.Hello(frontend=self._frontend_index)))
        deadline = time.monotonic() + timeout_s
        for core in self._cores:
            while core.ready is None:
                if time.monotonic() > deadline:
                    raise CoreUnavailable(
                        f"engine core {core.index} was not ready in {timeout_s} s"
                    )
                if core.sock.poll(100):
                    message = wire.core_decoder.decode(core.sock.recv())
                    if isinstance(message, wire.CoreFailed):
                        raise CoreUnavailable(message.message)
                    if isinstance(message, wire.Ready):
                        core.ready = message
                elif not _alive(core):
                    note = wire.read_failure_note(core.endpoint.address)
                    raise CoreUnavailable(note or f"engine core {core.index} exited while starting")
        return self._cores[0].ready

    def start(self) -> None:
        """On the event loop: read every core, watch every core's process."""
        self._aloop = loop = asyncio.get_running_loop()
        for core in self._cores:
            core.owner = core.sock
            core.sock = zmq.asyncio.Socket.shadow(core.owner.underlying)
            core.last_heard = time.monotonic()
            self._tasks.append(loop.create_task(self._read(core)))
            if core.pidfd is not None:
                loop.add_reader(core.pidfd, self._core_exited, core)
        self._tasks.append(loop.create_task(self._watchdog()))

    def close(self) -> None:
        """Stop reading (the cores' processes belong to whoever started them)."""
        for task in self._tasks:
            task.cancel()
        for core in self._cores:
            for future in core.lora_queries.values():
                with contextlib.suppress(RuntimeError):  # its loop may be closed already
                    future.cancel()
            core.lora_queries.clear()
            if core.pidfd is not None:
                if self._aloop is not None and not self._aloop.is_closed():
                    self._aloop.remove_reader(core.pidfd)
                os.close(core.pidfd)
                core.pidfd = None
            (core.owner or core.sock).close(linger=0)
        self._context.term()

    @property
    def readies(self) -> list[wire.Ready]:
        return [core.ready for core in self._cores if core.ready is not None]

    @property
    def stats(self) -> list[wire.CoreStats | None]:
        """Each core's state after its latest step (None before it has sent any)."""
        return [core.stats for core in self._cores]

    @property
    def pids(self) -> list[int]:
        return [core.endpoint.pid for core in self._cores]

    # ------------------------------------------------------------- requests
    def submit(self, request: Request) -> None:
        """Queue a request for the least busy core (sent at the end of this loop turn)."""
        n = len(self._cores)
        self._turn += 1  # ties go round the cores, so sequential requests spread too
        core = min((self._cores[(self._turn + i) % n] for i in range(n)), key=_load)
        if core.in_flight == 0:
            core.last_heard = time.monotonic()  # the hang timer starts with work
        core.in_flight += request.params.n
        self._home[request.request_id] = core
        self._samples_left[request.request_id] = request.params.n
        lora = request.lora.lora_name if request.lora is not None else None
        core.pending.adds.append(
            wire.NewRequest(request.request_id, request.prompt_token_ids, request.params, lora)
        )
        self._schedule_flush()

    def abort(self, request_id: str, index: int | None = None) -> None:
        core = self._home.get(request_id)
        if core is not None:
            core.pending.aborts.append(wire.Abort(request_id, index))
            self._schedule_flush()

    async def timelines(self, after: list[int], timeout_s: float) -> list[wire.Timeline | None]:
        """Each core's steps retired after `after[i]` (-1: its latest seconds' worth); None for
        a core that has not answered within `timeout_s` (it answers between steps)."""
        assert self._aloop is not None, "start() first"
        futures = []
        for core, last in zip(self._cores, after, strict=True):
            future = self._aloop.create_future()
            core.timelines.append(future)
            core.sock.send(wire.encode(wire.TimelineQuery(last)))
            futures.append(future)
        await asyncio.wait(futures, timeout=timeout_s)
        return [f.result() if f.done() and not f.cancelled() else None for f in futures]

    async def ask_lora(
        self,
        make: Callable[[int], wire.LoraLoad | wire.LoraUnload | wire.LoraList],
        cores: list[int] | None = None,
    ) -> list[wire.LoraAnswer]:
        """Send `make(query)` to each core (every one by default) and wait for every answer (a
        load's comes once the core's loader thread is done). Raises CoreUnavailable if a core
        fails first."""
        assert self._aloop is not None, "start() first"
        if self.failed is not None:
            raise CoreUnavailable(self.failed)
        futures = []
        for i in range(len(self._cores)) if cores is None else cores:
            core = self._cores[i]
            self._query += 1
            future = self._aloop.create_future()
            core.lora_queries[self._query] = future
            core.sock.send(wire.encode(make(self._query)))
            futures.append(future)
        return list(await asyncio.gather(*futures))

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled and self._aloop is not None:
            self._flush_scheduled = True
            self._aloop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.failed is not None:
            return
        for core in self._cores:
            if core.pending.adds or core.pending.aborts:
                core.sock.send(wire.encode(core.pending))  # DEALER queues: never blocks here
                core.pending = wire.Inbox()

    # -------------------------------------------------------------- outputs
    async def _read(self, core: _Core) -> None:
        try:
            while True:
                message = wire.core_decoder.decode(await core.sock.recv())
                core.last_heard = time.monotonic()
                if isinstance(message, wire.StepOutputs):
                    core.stats = message.stats
                    self._finished(core, message.deltas)
                    if self.on_outputs is not None:
                        self.on_outputs(message.deltas)
                elif isinstance(message, wire.Timeline):
                    future = core.timelines.popleft()  # answers come in the order asked
                    if not future.done():  # else cancelled: its reader went away
                        future.set_result(message)
                elif isinstance(message, wire.LoraAnswer):
                    future = core.lora_queries.pop(message.query, None)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif isinstance(message, wire.CoreFailed):
                    self._fail(f"engine core {core.index} failed: {message.message}")
        except (asyncio.CancelledError, zmq.ContextTerminated, zmq.ZMQError):
            pass

    def _finished(self, core: _Core, deltas: list[wire.TokenDelta]) -> None:
        """Count finished samples: a request is forgotten once the core has ended all of them."""
        for delta in deltas:
            if delta.finished:
                core.in_flight -= 1
                left = self._samples_left[delta.request_id] - 1
                if left:
                    self._samples_left[delta.request_id] = left
                else:
                    del self._samples_left[delta.request_id], self._home[delta.request_id]

    # --------------------------------------------------------------- faults
    def _core_exited(self, core: _Core) -> None:
        assert self._aloop is not None and core.pidfd is not None
        self._aloop.remove_reader(core.pidfd)
        self._fail(f"engine core {core.index} (pid {core.endpoint.pid}) exited")

    async def _watchdog(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while self.failed is None:
                await asyncio.sleep(WATCHDOG_INTERVAL_S)
                now = time.monotonic()
                for core in self._cores:
                    silent = now - core.last_heard
                    if core.in_flight > 0 and silent > self.engine_timeout_s:
                        self._fail(
                            f"engine core {core.index} has sent nothing for {silent:.0f} s "
                            f"with requests in flight (--engine-timeout {self.engine_timeout_s:g})"
                        )
                        break

    def _fail(self, message: str) -> None:
        if self.failed is not None:
            return
        logger.error("%s", message)
        self.failed = message
        for core in self._cores:  # nobody waits for an answer that will not come
            for future in core.lora_queries.values():
                if not future.done():
                    future.set_exception(CoreUnavailable(message))
                    future.exception()  # retrieved: a caller gone meanwhile leaves no warning
            core.lora_queries.clear()
        if self.on_failure is not None:
            self.on_failure(message)


def _load(core: _Core) -> tuple[int, int]:
    stats = core.stats
    return core.in_flight, (stats.num_running + stats.num_waiting) if stats else 0


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux); None where unsupported."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _alive(core: _Core) -> bool:
    if core.pidfd is not None:
        return not select.select([core.pidfd], [], [], 0)[0]
    try:
        os.kill(core.endpoint.pid, 0)
    except ProcessLookupError:
        return False
    return True
