"""A front end: HTTP, validation, tokenization, detokenization and streaming for the engine
cores `serve.py` started, served by uvicorn with a graceful drain; and the supervisor of several
front ends sharing one listening socket. Signals and faults: `serve.py`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

import uvicorn

from tandem.execution.lifetime import die_with_parent
from tandem.server.app import create_app
from tandem.server.core.client import CoreClient, CoreEndpoint, CoreUnavailable
from tandem.server.frontend.guards import DEFAULT_MAX_REQUEST_BYTES
from tandem.server.frontend.metrics import MULTIPROCESS_ENV
from tandem.server.frontend.served_model import ServedModel, load_tokenizer
from tandem.server.frontend.service import GenerationService

logger = logging.getLogger("tandem.server")

DRAIN_SIGNAL = signal.SIGUSR1  # supervisor -> front end: drain (a second one: abort now)
# supervisor -> front end: abort every request now. Not a second DRAIN_SIGNAL: two signals of
# one kind sent at once may arrive as one (and Python runs its handler once per arrival).
ABORT_SIGNAL = signal.SIGUSR2

# An idle connection stays open longer than clients keep idle connections pooled (httpx and the
# openai client 5 s, aiohttp 15 s): at equal timeouts a client reuses a connection just as the
# server closes it, and its request fails with a read error.
KEEP_ALIVE_S = 30
# A drained front end stops accepting this long before it exits: time enough for a connection it
# accepted a moment earlier to deliver its request (answered 503, not reset).
ACCEPTED_LINGER_S = 0.2


@dataclass
class FrontendOptions:
    """Everything a front end needs (picklable: it crosses into a spawned process)."""

    cores: list[CoreEndpoint]
    model: str | None  # the configured name, accepted as an alias
    served_model_name: list[str] | None
    model_path: str  # the checkpoint the cores load, as `serve` resolved it (the tokenizer's)
    index: int = 0
    max_waiting: int = 256
    max_running: int | None = None
    grace_period: float = 10.0
    api_key: str | None = None
    protect_metrics: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    engine_timeout_s: float = 60.0
    supervised: bool = False  # a child of the supervisor (drains on DRAIN_SIGNAL)
    allow_runtime_lora_updating: bool = False  # vLLM's load and unload endpoints mounted
    parent_pid: int = 0


class GracefulServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        service: GenerationService,
        grace_period: float,
        drain_signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
        abort_signals: tuple[int, ...] = (),
    ):
        super().__init__(config)
        self.service = service
        self.grace_period = grace_period
        self.drain_signals = drain_signals
        self.abort_signals = abort_signals
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._tasks: set[asyncio.Task] = set()
        self.engine_error: str | None = None
        service.on_failure = self._engine_failed

    def _engine_failed(self, message: str) -> None:
        """On the event loop, after the service has answered every request: stop serving.
        uvicorn closes the listening socket, lets the open responses finish, then returns."""
        logger.error("exiting after answering open requests: %s", message)
        self.engine_error = message
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, for `drain_signals`; not recorded in _captured_signals, which uvicorn
        would re-raise after shutdown: a drained server exits with status 0."""
        before = {sig: signal.signal(sig, self.handle_exit) for sig in self.drain_signals}
        before |= {sig: signal.signal(sig, self.handle_abort) for sig in self.abort_signals}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the signal handler."""
        if self._loop is None or not self.started:
            self.should_exit = True  # still starting: nothing to drain
            return
        grace = 0.0 if self._draining else self.grace_period
        if self._draining:
            logger.warning("second signal: aborting every request now")
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain, grace)

    def handle_abort(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the signal handler: abort every request now (a drain with no grace)."""
        if self._loop is None or not self.started:
            self.should_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain, 0.0)

    def _start_drain(self, grace: float) -> None:
        task = asyncio.ensure_future(self._drain(grace))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, grace: float) -> None:
        try:
            await self.service.shutdown(grace)
        finally:
            await self._stop_accepting()
            self.should_exit = True

    async def _stop_accepting(self) -> None:
        """Close this process's listening socket, then wait ACCEPTED_LINGER_S: uvicorn's shutdown
        closes every connection whose request has not arrived, so a client that connected just
        before would see a reset instead of its 503. Other front ends keep accepting."""
        for server in self.servers:
            server.close()
        await asyncio.sleep(ACCEPTED_LINGER_S)


def run_frontend(options: FrontendOptions, listener: socket.socket) -> str | None:
    """Connect to the cores, serve until drained or failed; the failure, or None."""
    client = CoreClient(options.cores, options.index, options.engine_timeout_s)
    tokenizer = load_tokenizer(options.model_path)  # while the cores load
    try:
        ready = client.connect()
    except CoreUnavailable as exc:
        logger.error("%s", exc)
        client.close()
        return str(exc)
    model = ServedModel(ready, tokenizer, options.model)
    app = create_app(
        client,
        model,
        served_model_name=options.served_model_name,
        max_waiting=options.max_waiting,
        grace_period=options.grace_period,
        api_key=options.api_key,
        protect_metrics=options.protect_metrics,
        max_request_bytes=options.max_request_bytes,
        max_running=options.max_running,
        allow_runtime_lora_updating=options.allow_runtime_lora_updating,
    )
    service: GenerationService = app.state.service
    if options.index == 0:
        for r in client.readies:
            logger.info("engine core %d: %s", r.engine_index, r.execution)
        logger.info(client.readies[0].sampling_defaults_note)
        logger.info(
            "serving %r (max_model_len %d, %d KV blocks per core, %d running + %d waiting "
            "requests per front end; API key %s; bodies up to %d bytes)",
            app.state.model_name,
            model.max_model_len,
            model.num_kv_blocks,
            service.max_running,
            options.max_waiting,
            "required" + (" (and for /metrics)" if options.protect_metrics else "")
            if options.api_key
            else "off",
            options.max_request_bytes,
        )
        if service.adapters.enabled:
            held = [f"{a.name} ({a.path})" for a in service.adapters.list_known()]
            logger.info("LoRA adapters, by the name a request's model gives: %s",
                        ", ".join(held) or "none yet")  # fmt: skip
        host, port = listener.getsockname()[:2]
        host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        host = f"[{host}]" if ":" in host else host
        logger.info("chat page: http://%s:%d/  the engines, live: http://%s:%d/dashboard",
                    host, port, host, port)  # fmt: skip
    uv_config = uvicorn.Config(
        app,
        access_log=False,  # a log line per request costs more than a tiny model's step
        timeout_graceful_shutdown=5,  # after the drain: only connections left to close
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    signals = (DRAIN_SIGNAL,) if options.supervised else (signal.SIGINT, signal.SIGTERM)
    aborts = (ABORT_SIGNAL,) if options.supervised else ()
    server = GracefulServer(uv_config, service, options.grace_period, signals, aborts)
    try:
        server.run(sockets=[listener])
    finally:
        service.close(wait=True)
    return server.engine_error


def _frontend_process(options: FrontendOptions, listener: socket.socket) -> None:
    die_with_parent(options.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(DRAIN_SIGNAL, _exit_while_starting)  # uvicorn's handler replaces it
    signal.signal(ABORT_SIGNAL, _exit_while_starting)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    failure = run_frontend(options, listener)
    raise SystemExit(0 if failure is None else 1)


def _exit_while_starting(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)  # nothing accepted yet: nothing to drain


def supervise(
    options: FrontendOptions,
    listener: socket.socket,
    count: int,
    max_num_seqs: int,
    workdir: str,
) -> str | None:
    """Run `count` front ends until all have exited; the first failure, or None."""
    metrics_dir = os.path.join(workdir, "metrics")
    os.makedirs(metrics_dir)
    os.environ[MULTIPROCESS_ENV] = metrics_dir  # read by the front ends' prometheus_client
    running = max_num_seqs * len(options.cores)
    context = multiprocessing.get_context("spawn")
    frontends = []
    for i in range(count):
        child = dataclasses.replace(
            options, index=i, supervised=True, max_running=math.ceil(running / count)
        )
        process = context.Process(
            target=_frontend_process, args=(child, listener), name=f"tandem-api-{i}"
        )
        process.start()
        frontends.append(process)
        logger.info("front end %d: pid %d", i, process.pid)
    del os.environ[MULTIPROCESS_ENV]

    def relay(sig: int, frame: FrameType | None) -> None:
        for process in frontends:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, DRAIN_SIGNAL)

    before = {sig: signal.signal(sig, relay) for sig in (signal.SIGINT, signal.SIGTERM)}
    failure = None
    try:
        alive = {p.sentinel: p for p in frontends}
        while alive:
            for sentinel in multiprocessing.connection.wait(list(alive)):
                process = alive.pop(sentinel)
                process.join()
                if process.exitcode != 0 and failure is None:
                    failure = f"front end {process.name} exited with status {process.exitcode}"
                    logger.error("%s: stopping the others", failure)
                    for other in alive.values():  # drain with no grace: abort, answer, exit
                        os.kill(other.pid, ABORT_SIGNAL)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for process in frontends:
            if process.is_alive():
                process.kill()
            process.join()
    return failure
