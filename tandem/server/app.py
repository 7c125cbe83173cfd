"""The FastAPI app: routes, lifespan (start and stop the engine loop), error handlers.

`create_app` does not own the engine: whoever built it closes it after the app has shut down.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from tandem.engine import Engine
from tandem.server.errors import APIError, error_body, install_error_handlers
from tandem.server.generate import chat_prompt, completion_prompts, respond
from tandem.server.metrics import CONTENT_TYPE
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.service import GenerationService


def model_names(engine: Engine, served_name: str | None) -> tuple[str, list[str]]:
    """The name clients should use (the model folder's name) and every alias accepted."""
    path = Path(engine.model_path)
    name = served_name or path.name
    aliases = [name, path.name, str(path), str(path.resolve())]
    if engine.config.model:
        aliases.append(engine.config.model)
    return name, list(dict.fromkeys(aliases))


def create_app(
    engine: Engine,
    *,
    served_model_name: str | None = None,
    max_waiting: int = 256,
    grace_period: float = 10.0,
) -> FastAPI:
    """An OpenAI-compatible app around `engine`. Its loop thread runs while the app's lifespan does.

    `grace_period` bounds the lifespan shutdown: in-flight requests get that long to finish,
    then are aborted. (`serve` drains on SIGTERM before that, while still answering 503s.)
    """
    service = GenerationService(engine, max_waiting=max_waiting)
    name, accepted_names = model_names(engine, served_model_name)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            await service.shutdown(grace_period)
            service.close()

    app = FastAPI(title="Tandem", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    app.state.model_name = name
    install_error_handlers(app)

    def check_model(model: str) -> None:
        if model not in accepted_names:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {name!r}",
                param="model",
                code="model_not_found",
            )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await respond(service, request, body, completion_prompts(body), name)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prepare = chat_prompt(engine, body.messages)
        return await respond(service, request, body, [prepare], name)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
            "root": str(engine.model_path),
            "max_model_len": engine.max_model_len,
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
