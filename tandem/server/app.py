"""The FastAPI app of one front end: every API's routes, the lifespan, error handlers, guards.

`create_app` takes a `CoreClient` already connected to the engine cores and the `ServedModel`
their handshake described; the app reads the cores while its lifespan runs. It does not own the
cores' processes: whoever started them stops them after the app has shut down.

Each API is a package with its own routes and error shape (`openai`, `anthropic`, `ollama`); this
module mounts them side by side over one `GenerationService` and one `Preparer`, so adding an API
touches no other API's file. Generation routes take the raw body: it is parsed and translated in
an intake lane, off the event loop (`generation/prepare.py`), after the guards
(`frontend/guards.py`) have checked the API key and the body's size.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from tandem.models.catalog import PACKAGED_MODELS
from tandem.server.anthropic import routes as anthropic_routes
from tandem.server.core.client import CoreClient
from tandem.server.frontend.errors import ErrorShapes, error_body, install_error_handlers
from tandem.server.frontend.guards import DEFAULT_MAX_REQUEST_BYTES, APIKeyGuard, BodyLimit
from tandem.server.frontend.metrics import CONTENT_TYPE
from tandem.server.frontend.served_model import ServedModel
from tandem.server.frontend.service import GenerationService
from tandem.server.frontend.token_bound import prompt_bound
from tandem.server.generation.prepare import Preparer
from tandem.server.ollama import routes as ollama_routes
from tandem.server.openai import routes as openai_routes
from tandem.server.responses import routes as responses_routes
from tandem.server.responses.store import ResponseStore
from tandem.server.web import routes as web_routes

# Paths that need the API key, when one is set: every API's, vLLM's token utilities and the
# pages' data.
# The pages themselves are open: they ask for the key where the data they read needs it.
GUARDED_PREFIXES = ("/v1", "/api", "/tokenize", "/detokenize", "/chat/settings", "/dashboard/data")

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


def model_names(model: ServedModel, served_names: str | list[str] | None) -> tuple[str, list[str]]:
    """The name clients should use (the first served name, else a short name as given, else
    the model folder's or file's name) and every alias accepted."""
    if isinstance(served_names, str):
        served_names = [served_names]
    path = Path(model.model_path)
    short = model.configured_name if model.configured_name in PACKAGED_MODELS else None
    name = (served_names or [None])[0] or short or path.name
    aliases = [name, *(served_names or []), path.name, str(path), str(path.resolve())]
    if model.configured_name:
        aliases.append(model.configured_name)
    return name, list(dict.fromkeys(aliases))


def create_app(
    client: CoreClient,
    model: ServedModel,
    *,
    served_model_name: str | list[str] | None = None,
    max_waiting: int = 256,
    grace_period: float = 10.0,
    api_key: str | None = None,
    protect_metrics: bool = False,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_running: int | None = None,
    response_store: ResponseStore | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """The app in front of `client`'s engine cores: every API's routes.

    `served_model_name`: the names clients may use for the model (the first is reported).
    `grace_period` bounds the lifespan shutdown: in-flight requests get that long to finish,
    then are aborted. (`serve` drains on SIGTERM before that, while still answering 503s.)
    With `api_key`, every API request (and /metrics if `protect_metrics`) needs it, as
    `Authorization: Bearer <api_key>` or `x-api-key`. Bodies over `max_request_bytes` get 413.
    `max_running`: this front end's share of the cores' running sequences (`GenerationService`).
    `response_store`: where stored Responses API answers are kept (default bounds otherwise).
    `allow_runtime_lora_updating`: mount vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
    (`core.lora.runtime_updating_allowed` reads the flag and the environment).
    """
    if protect_metrics and not api_key:
        raise ValueError("protect_metrics needs an api_key")
    service = GenerationService(client, model, max_waiting=max_waiting, max_running=max_running)
    name, accepted_names = model_names(model, served_model_name)
    bound, why_not = prompt_bound(model.tokenizer)
    if bound is not None:
        logger.info("over-long prompts are refused before tokenizing (%s)", bound.describe())
    else:
        logger.info("over-long prompts are refused after tokenizing: no exact bound (%s)", why_not)
    preparer = Preparer(
        model,
        name,
        accepted_names,
        bound,
        service.intake.counter,
        max_seqs=service.capacity,
        adapters=service.adapters,
    )
    for adapter in service.adapters.list_known():
        if adapter.name in accepted_names:
            logger.warning("LoRA adapter %r has a name of the served model's, which it keeps: "
                           "requests cannot reach the adapter", adapter.name)  # fmt: skip
    if allow_runtime_lora_updating:
        logger.warning("LoRA adapters may be loaded and unloaded at runtime "
                       "(/v1/load_lora_adapter, /v1/unload_lora_adapter): for development only")  # fmt: skip

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
    shapes = ErrorShapes()
    install_error_handlers(app, shapes)
    # The last one added runs first: the key is checked before the body is read at all.
    app.add_middleware(BodyLimit, shapes=shapes, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(
            APIKeyGuard,
            api_key=api_key,
            shapes=shapes,
            prefixes=GUARDED_PREFIXES,
            protect_metrics=protect_metrics,
        )
    app.include_router(openai_routes.routes(service, preparer, allow_runtime_lora_updating))
    app.include_router(anthropic_routes.routes(service, preparer, shapes))
    store = ResponseStore() if response_store is None else response_store
    app.include_router(responses_routes.routes(service, preparer, store))
    app.include_router(ollama_routes.routes(service, preparer, shapes))
    app.include_router(web_routes.routes(service, name))

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
