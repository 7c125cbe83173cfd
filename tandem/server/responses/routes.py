"""OpenAI's Responses API: POST /v1/responses (streamed or not), GET and DELETE
/v1/responses/{id} (Codex, the OpenAI Agents SDK, the `openai` SDK's `responses`)."""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response

from tandem.server.frontend.errors import APIError
from tandem.server.frontend.respond import respond
from tandem.server.frontend.service import GenerationService, Prepared
from tandem.server.generation.prepare import Preparer
from tandem.server.responses.encoder import ResponsesEncoder
from tandem.server.responses.protocol import ENDPOINT, ResponsesRequest
from tandem.server.responses.store import ResponseStore


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"no stored response has the id {response_id!r} (never stored, deleted or evicted)",
        param=param,
        code="not_found",
    )


def prepare_response(preparer: Preparer, store: ResponseStore, raw: bytes, bulk: bool) -> Prepared:
    body = preparer.parse(ResponsesRequest, raw, bulk, ENDPOINT)
    adapter = preparer.check_model(body.model)
    history = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        history = previous.conversation
    job, ignored = body.job(history)
    response_id = f"resp_{uuid.uuid4().hex}"
    request, tools = preparer.chat(job, response_id, adapter)
    name = preparer.served_name(adapter)
    encoder = ResponsesEncoder(response_id, name, body, history, store, plan=tools)
    return Prepared(response_id, [request], encoder, body.stream, "input", ignored)


def routes(service: GenerationService, preparer: Preparer, store: ResponseStore) -> APIRouter:
    router = APIRouter()

    @router.post(ENDPOINT)
    async def create(request: Request) -> Response:
        return await respond(service, request, partial(prepare_response, preparer, store))

    @router.get(ENDPOINT + "/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.body

    @router.delete(ENDPOINT + "/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return router
