"""`serve()`: build the engine, run the app under uvicorn, drain gracefully on SIGINT/SIGTERM.

uvicorn on its own would stop listening at once on a signal (new clients see connection refused)
and wait for open requests without bound. Here the first signal starts a drain instead: the
server keeps answering, with 503 + Retry-After to new requests and /health (so a load balancer
moves away), in-flight requests get `grace_period` seconds to finish, the rest are aborted, and
only then does uvicorn exit. A second signal aborts everything at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.server.app import create_app
from tandem.server.service import GenerationService

logger = logging.getLogger("tandem.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: GenerationService, grace_period: float):
        super().__init__(config)
        self.service = service
        self.grace_period = grace_period
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._tasks: set[asyncio.Task] = set()

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
) -> None:
    """Serve `config`'s model over the OpenAI-compatible API until SIGINT/SIGTERM."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    engine = Engine(config)
    app = create_app(engine, max_waiting=max_waiting, grace_period=grace_period)
    service: GenerationService = app.state.service
    logger.info(
        "serving %r (max_model_len %d, %d KV blocks, %d running + %d waiting requests)",
        app.state.model_name,
        engine.max_model_len,
        engine.num_kv_blocks,
        config.max_num_seqs,
        max_waiting,
    )
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port,
        access_log=False,  # a log line per request costs more than a tiny model's step
        timeout_graceful_shutdown=5,  # after the drain: only connections left to close
    )
    try:
        GracefulServer(uv_config, service, grace_period).run()
    finally:
        service.close()
        engine.close()
