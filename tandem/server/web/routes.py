"""The pages and the dashboard's data.

The pages are plain files (`static/`): they talk to the server through its public endpoints
(chat completions, models) and `/dashboard/data`, which this module answers. The data is read
only when a page asks (about once a second while one is open): each engine core's steps since
the page's latest, answered between steps, and the figures /metrics renders at that moment, so
nothing is spent on a dashboard nobody looks at.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from fastapi import APIRouter, Response
from fastapi.responses import FileResponse

from tandem.models.generation_defaults import CHAT_SAMPLING_SOURCE, chat_sampling
from tandem.server.frontend.errors import bad_request
from tandem.server.frontend.service import GenerationService

STATIC = Path(__file__).parent / "static"
PAGES = {"/": "chat.html", "/dashboard": "dashboard.html"}
TIMELINE_WAIT_S = 2.0  # a core answers between steps; one busy longer is shown without steps
# Server-wide figures, read as /metrics renders them (every front end's, summed).
SERVER_SAMPLES = {
    "tandem_requests_in_flight",
    "tandem_generation_tokens_total",
    "tandem_prompt_tokens_total",
    "tandem_requests_rejected_total",
    "tandem_time_to_first_token_seconds_sum",
    "tandem_time_to_first_token_seconds_count",
    "tandem_inter_token_latency_seconds_sum",
    "tandem_inter_token_latency_seconds_count",
}


def routes(service: GenerationService, model_name: str) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    files = {path.name for path in STATIC.iterdir() if path.is_file()}

    def page(name: str):
        async def serve_page() -> FileResponse:
            return FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})

        return serve_page

    for path, name in PAGES.items():
        router.add_api_route(path, page(name), methods=["GET", "HEAD"])

    @router.get("/static/{name}")
    async def static_file(name: str) -> FileResponse:
        if name not in files:  # only the files shipped: no path reaches outside the folder
            raise bad_request(f"no such file: {name}")
        return FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})

    @router.get("/chat/settings")
    async def chat_settings() -> dict:
        """What the chat page starts from: the model, its context, and the sampling a chat
        gets (the model's defaults where it sets any, else llama.cpp's, as `tandem chat`)."""
        model = service.model
        sampling, own = chat_sampling(model.sampling_defaults)
        return {
            "model": model_name,
            "max_model_len": model.max_model_len,
            "max_tokens": model.sampling_defaults.get("max_tokens"),  # the server's cap, if any
            "sampling": sampling,
            "sampling_source": "the model's defaults" if own else CHAT_SAMPLING_SOURCE,
            "reasoning": model.reasoning is not None,
        }

    @router.get("/dashboard/data")
    async def dashboard_data(after: str = "") -> Response:
        """Every engine's state and its steps retired after `after` (a step id per engine,
        comma-separated; none: each engine's latest seconds), and the server's figures."""
        client = service.client
        count = len(client.stats)
        try:
            last = [int(x) for x in after.split(",")] if after else [-1] * count
        except ValueError:
            raise bad_request(
                f"after must be step ids separated by commas, got {after!r}"
            ) from None
        if len(last) != count:
            raise bad_request(f"after must name {count} step ids, one per engine, got {after!r}")
        timelines = await client.timelines(last, TIMELINE_WAIT_S)
        engines = []
        for i, (ready, stats, timeline) in enumerate(
            zip(client.readies, client.stats, timelines, strict=True)
        ):
            engines.append({
                "engine": i,
                "execution": ready.execution,
                "stats": msgspec.structs.asdict(stats) if stats is not None else None,
                "timeline": timeline,  # None: the core was busy for longer than the wait
            })  # fmt: skip
        body = {
            "model": model_name,
            "max_model_len": service.model.max_model_len,
            "engines": engines,
            "server": service.metrics.samples(SERVER_SAMPLES),
        }
        return Response(msgspec.json.encode(body), media_type="application/json")

    return router
