"""The FastAPI app of one front end: routes, lifespan, error handlers, guards.

`create_app` takes a `CoreClient` already connected to the engine cores and the `ServedModel`
their handshake described; the app reads the cores while its lifespan runs. It does not own the
cores' processes: whoever started them stops them after the app has shut down.
Generation routes take the raw body: it is parsed and validated in an intake lane, off the event
loop (`prepare.py`), after the guards (`guards.py`) have checked the API key and the body's size.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from tandem.models.catalog import PACKAGED_MODELS
from tandem.server.core_client import CoreClient
from tandem.server.errors import error_body, install_error_handlers
from tandem.server.generate import respond
from tandem.server.guards import DEFAULT_MAX_REQUEST_BYTES, APIKeyGuard, BodyLimit
from tandem.server.metrics import CONTENT_TYPE
from tandem.server.prepare import Preparer
from tandem.server.served_model import ServedModel
from tandem.server.service import GenerationService
from tandem.server.token_bound import prompt_bound

logger = logging.getLogger("tandem.server")


@contextmanager
def frozen_startup_heap() -> Iterator[None]:
    """While the server runs, the garbage collector's full passes skip what start-up built.

    The modules and the tokenizer are hundreds of thousands of tracked objects, and a full
    collection walks them all holding the GIL (a stall of a tenth of a second or more), while
    every request waits. They live as long as the server, so
    they are frozen (as vLLM does after start-up) and later objects are collected as before.
    Unfrozen on exit, so that a process embedding the app gets them back (the freeze is
    process-wide: one app per process).
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def model_names(model: ServedModel, served_name: str | None) -> tuple[str, list[str]]:
    """The name clients should use (a short name as given, else the model folder's or file's
    name) and every alias accepted."""
    path = Path(model.model_path)
    short = model.configured_name if model.configured_name in PACKAGED_MODELS else None
    name = served_name or short or path.name
    aliases = [name, path.name, str(path), str(path.resolve())]
    if model.configured_name:
        aliases.append(model.configured_name)
    return name, list(dict.fromkeys(aliases))


def create_app(
    client: CoreClient,
    model: ServedModel,
    *,
    served_model_name: str | None = None,
    max_waiting: int = 256,
    grace_period: float = 10.0,
    api_key: str | None = None,
    protect_metrics: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_running: int | None = None,
) -> FastAPI:
    """An OpenAI-compatible app in front of `client`'s engine cores.

    `grace_period` bounds the lifespan shutdown: in-flight requests get that long to finish,
    then are aborted. (`serve` drains on SIGTERM before that, while still answering 503s.)
    With `api_key`, every /v1 request (and /metrics if `protect_metrics`) needs
    `Authorization: Bearer <api_key>`. Bodies over `max_request_bytes` get 413. `max_running`:
    this front end's share of the cores' running sequences (`GenerationService`).
    """
    if protect_metrics and not api_key:
        raise ValueError("protect_metrics needs an api_key")
    service = GenerationService(client, model, max_waiting=max_waiting, max_running=max_running)
    name, accepted_names = model_names(model, served_model_name)
    created = int(time.time())
    bound, why_not = prompt_bound(model.tokenizer)
    if bound is not None:
        logger.info("over-long prompts are refused before tokenizing (%s)", bound.describe())
    else:
        logger.info("over-long prompts are refused after tokenizing: no exact bound (%s)", why_not)
    preparer = Preparer(
        model, name, accepted_names, bound, service.intake.counter, max_seqs=service.capacity
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        with frozen_startup_heap():
            try:
                yield
            finally:
                await service.shutdown(grace_period)
                service.close()

    app = FastAPI(title="Tandem", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    app.state.preparer = preparer
    app.state.model_name = name
    install_error_handlers(app)
    # The last one added runs first: the key is checked before the body is read at all.
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyGuard, api_key=api_key, protect_metrics=protect_metrics)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await respond(service, request, preparer.completion, name)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await respond(service, request, preparer.chat, name)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
            "root": str(model.model_path),
            "max_model_len": model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if service.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            error_body(503, service.unready_reason(), code="service_unavailable"),
            status_code=503,
            headers={"Retry-After": str(service.retry_after_s)},
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    return app
