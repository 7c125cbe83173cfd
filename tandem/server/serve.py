"""`serve()`: build the engine, run the app under uvicorn, drain gracefully on SIGINT/SIGTERM.

uvicorn on its own would stop listening at once on a signal (new clients see connection refused)
and wait for open requests without bound. Here the first signal starts a drain instead: the
server keeps answering, with 503 + Retry-After to new requests and /health (so a load balancer
moves away), in-flight requests get `grace_period` seconds to finish, the rest are aborted, and
only then does uvicorn exit. A second signal aborts everything at once.

If the engine fails, every request has already been answered with an error (`service.py`); the
server then exits at once and `serve` raises `EngineFailure`, so the process exits non-zero and
a supervisor restarts it, rather than leaving a live socket in front of a dead engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from types import FrameType

import uvicorn

from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.server.app import create_app
from tandem.server.guards import DEFAULT_MAX_REQUEST_BYTES
from tandem.server.service import GenerationService

logger = logging.getLogger("tandem.server")

API_KEY_ENV = "TANDEM_API_KEY"


class EngineFailure(RuntimeError):
    """The engine loop died while serving; raised by `serve` after every client was answered."""


# An idle connection stays open longer than clients keep idle connections pooled (httpx and the
# openai client 5 s, aiohttp 15 s): at equal timeouts a client reuses a connection just as the
# server closes it, and its request fails with a read error.
KEEP_ALIVE_S = 30


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: GenerationService, grace_period: float):
        super().__init__(config)
        self.service = service
        self.grace_period = grace_period
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._tasks: set[asyncio.Task] = set()
        self.engine_error: BaseException | None = None
        service.on_failure = self._engine_failed

    def _engine_failed(self, exc: BaseException) -> None:
        """On the event loop, after the service has answered every request: stop serving.
        uvicorn closes the listening socket, lets the open responses finish, then returns."""
        logger.error("the engine failed; exiting after answering open requests")
        self.engine_error = exc
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the signal handler. Not recorded in _captured_signals, which uvicorn would
        re-raise after shutdown: a drained server exits with status 0."""
        if self._loop is None or not self.started:
            self.should_exit = True  # still starting: nothing to drain
            return
        grace = 0.0 if self._draining else self.grace_period
        if self._draining:
            logger.warning("second signal: aborting every request now")
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain, grace)

    def _start_drain(self, grace: float) -> None:
        task = asyncio.ensure_future(self._drain(grace))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, grace: float) -> None:
        try:
            await self.service.shutdown(grace)
        finally:
            self.should_exit = True


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting: int = 256,
    grace_period: float = 10.0,
    api_key: str | None = None,
    protect_metrics: bool = False,
    max_request_bytes: int | None = None,
) -> None:
    """Serve `config`'s model over the OpenAI-compatible API until SIGINT/SIGTERM.

    `api_key` defaults to $TANDEM_API_KEY; without either, the API is open.
    `max_request_bytes` defaults to 16 MiB. Raises `EngineFailure` if the engine dies (after
    answering every request).
    """
    if max_request_bytes is None:
        max_request_bytes = DEFAULT_MAX_REQUEST_BYTES
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV) or None
    if protect_metrics and not api_key:
        raise ValueError("protect_metrics needs an API key (--api-key or $TANDEM_API_KEY)")
    engine = Engine(config)
    app = create_app(
        engine,
        max_waiting=max_waiting,
        grace_period=grace_period,
        api_key=api_key,
        protect_metrics=protect_metrics,
        max_request_bytes=max_request_bytes,
    )
    service: GenerationService = app.state.service
    logger.info(
        "serving %r (max_model_len %d, %d KV blocks, %d running + %d waiting requests; "
        "API key %s; bodies up to %d bytes)",
        app.state.model_name,
        engine.max_model_len,
        engine.num_kv_blocks,
        config.max_num_seqs,
        max_waiting,
        "required" + (" (and for /metrics)" if protect_metrics else "") if api_key else "off",
        max_request_bytes,
    )
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        access_log=False,  # a log line per request costs more than a tiny model's step
        timeout_graceful_shutdown=5,  # after the drain: only connections left to close
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = GracefulServer(uv_config, service, grace_period)
    try:
        server.run()
    finally:
        service.close(wait=True)
        # After a failure the engine's state is suspect: free the device, retire nothing.
        engine.close(retire=server.engine_error is None)
    if server.engine_error is not None:
        error = server.engine_error
        raise EngineFailure(f"the engine failed: {type(error).__name__}: {error}") from error
