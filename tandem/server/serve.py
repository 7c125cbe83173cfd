"""`serve()`: start the engine cores and the front ends, drain gracefully, never half-serve.

Processes: one engine core per data-parallel replica (`core.py`), and `api_server_count` front
ends (HTTP, validation, tokenization, detokenization, streaming) sharing one listening socket,
which this process binds first (so a port in use fails at once, before any model loads). With
one front end, this process is it; with several, this process only supervises.

Signals: the first SIGINT/SIGTERM starts a drain: the server keeps answering, with 503 +
Retry-After to new requests and /health (so a load balancer moves away), in-flight requests get
`grace_period` seconds to finish, the rest are aborted, and only then does it exit (0). A
second signal aborts everything at once. Front-end and core processes ignore SIGINT/SIGTERM
(a terminal's Ctrl-C reaches the whole group): the supervisor relays the drain with
`DRAIN_SIGNAL`, and stops cores once no front end is left.

Faults: a core that dies, hangs or fails a step makes every front end answer its requests with
an error at once, /health 503, and exit 1; a front end that dies makes the supervisor end the
others (aborting their requests). `serve` then raises `EngineFailure` (the CLI exits 1). Every
child dies with its parent, so none outlives even a SIGKILLed server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

import uvicorn

from tandem.config import EngineConfig, usable_cores
from tandem.models.catalog import resolve_model
from tandem.models.generation_defaults import read_generation_defaults
from tandem.models.loader import read_config
from tandem.server import wire
from tandem.server.app import create_app
from tandem.server.core import CoreOptions, die_with_parent, spawn_core, stop_core
from tandem.server.core_client import CoreClient, CoreEndpoint, CoreUnavailable
from tandem.server.guards import DEFAULT_MAX_REQUEST_BYTES
from tandem.server.metrics import MULTIPROCESS_ENV
from tandem.server.served_model import ServedModel
from tandem.server.service import GenerationService

logger = logging.getLogger("tandem.server")

API_KEY_ENV = "TANDEM_API_KEY"
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


class EngineFailure(RuntimeError):
    """An engine core or a front end failed while serving; raised after clients were answered."""


@dataclass
class FrontendOptions:
    """Everything a front end needs (picklable: it crosses into a spawned process)."""

    cores: list[CoreEndpoint]
    model: str | None  # the configured name, accepted as an alias
    index: int = 0
    max_waiting: int = 256
    max_running: int | None = None
    grace_period: float = 10.0
    api_key: str | None = None
    protect_metrics: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    engine_timeout_s: float = 60.0
    supervised: bool = False  # a child of the supervisor (drains on DRAIN_SIGNAL)
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


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting: int = 256,
    grace_period: float = 10.0,
    api_key: str | None = None,
    protect_metrics: bool = False,
    max_request_bytes: int | None = None,
    api_server_count: int = 1,
    data_parallel_size: int = 1,
    engine_timeout_s: float = 60.0,
    trace: str | None = None,
) -> None:
    """Serve `config`'s model over the OpenAI-compatible API until SIGINT/SIGTERM.

    `api_key` defaults to $TANDEM_API_KEY; without either, the API is open. `max_request_bytes`
    defaults to 16 MiB. `engine_timeout_s`: a core with requests in flight that sends nothing for
    this long is taken as hung. `trace`: each core writes a Chrome trace of its steps there on
    exit (`PATH`, or `PATH.N.json` per replica). Raises `EngineFailure` if a core or a front end
    fails.
    """
    if api_server_count < 1 or data_parallel_size < 1:
        raise ValueError("api_server_count and data_parallel_size must be >= 1")
    if engine_timeout_s <= 0:
        raise ValueError("engine_timeout_s must be > 0")
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if protect_metrics and not api_key:
        raise ValueError("protect_metrics needs an API key (--api-key or $TANDEM_API_KEY)")
    if config.model is not None:  # a wrong path fails here in a second, before any process
        path = read_config(resolve_model(config.model))[0]
        read_generation_defaults(path, config.generation_config)
    draft = config.speculative_config.model if config.speculative_config else None
    if draft is not None:  # the draft model's path too
        try:
            read_config(resolve_model(draft))
        except ValueError as exc:
            raise ValueError(f"speculative_config.model: {exc}") from None
    replicas = replica_options(config, data_parallel_size)
    listener = listening_socket(host, port)
    workdir = tempfile.mkdtemp(prefix="tandem-serve-")
    cores: list[multiprocessing.Process] = []
    failure: str | None = "the server did not start"
    try:
        for i, options in enumerate(replicas):
            options.address = f"ipc://{workdir}/core-{i}"
            if trace:
                options.trace_path = trace if len(replicas) == 1 else f"{trace}.{i}.json"
            cores.append(spawn_core(options))
            where = f"CPU cores {options.cpu_set}" if options.cpu_set else "every CPU core"
            logger.info("engine core %d: pid %d, %s", i, cores[-1].pid, where)
        frontend = FrontendOptions(
            cores=[CoreEndpoint(o.address, p.pid) for o, p in zip(replicas, cores, strict=True)],
            model=config.model,
            max_waiting=max_waiting,
            grace_period=grace_period,
            api_key=api_key,
            protect_metrics=protect_metrics,
            max_request_bytes=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
            engine_timeout_s=engine_timeout_s,
            parent_pid=os.getpid(),
        )
        if api_server_count == 1:
            failure = run_frontend(frontend, listener)
        else:
            failure = supervise(frontend, listener, api_server_count, config.max_num_seqs, workdir)
        if failure is not None:  # a core that failed to start says why better than its front end
            notes = (wire.read_failure_note(o.address) for o in replicas)
            failure = next((note for note in notes if note), failure)
    finally:
        listener.close()
        for process in cores:  # after a failure a core may be hung: no long wait for it
            stop_core(process, timeout=10.0 if failure is None else 1.0)
        shutil.rmtree(workdir, ignore_errors=True)
    if failure is not None:
        raise EngineFailure(failure)


def replica_options(config: EngineConfig, data_parallel_size: int) -> list[CoreOptions]:
    """One core per replica. On the CPU each gets its own slice of the cores (and as many
    compute threads, unless --cpu-threads says otherwise); on CUDA its own devices."""
    if data_parallel_size == 1:
        return [CoreOptions(config, address="", parent_pid=os.getpid())]
    if config.torch_device.type == "cuda":
        raise ValueError(
            "data_parallel_size > 1 on CUDA: run one server per device for now "
            "(data-parallel replicas are split over CPU cores)"
        )
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < data_parallel_size:
        raise ValueError(
            f"data_parallel_size {data_parallel_size} needs at least as many CPU cores; "
            f"this process may use {usable_cores()}"
        )
    share = len(cores) // data_parallel_size
    options = []
    for i in range(data_parallel_size):
        cpu_set = cores[i * share : (i + 1) * share]
        replica = dataclasses.replace(config, cpu_threads=config.cpu_threads or len(cpu_set))
        options.append(CoreOptions(replica, "", i, cpu_set, os.getpid()))
    return options


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound, not yet listening: connections are refused until a front end is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def run_frontend(options: FrontendOptions, listener: socket.socket) -> str | None:
    """Connect to the cores, serve until drained or failed; the failure, or None."""
    client = CoreClient(options.cores, options.index, options.engine_timeout_s)
    try:
        ready = client.connect()
    except CoreUnavailable as exc:
        logger.error("%s", exc)
        client.close()
        return str(exc)
    model = ServedModel(ready, options.model)
    app = create_app(
        client,
        model,
        max_waiting=options.max_waiting,
        grace_period=options.grace_period,
        api_key=options.api_key,
        protect_metrics=options.protect_metrics,
        max_request_bytes=options.max_request_bytes,
        max_running=options.max_running,
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
