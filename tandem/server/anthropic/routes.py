"""Anthropic's Messages API: POST /v1/messages (streamed or not) and
/v1/messages/count_tokens, answered and refused in Anthropic's shapes (Claude Code, the
`anthropic` SDK). Clients add `?beta=true` and `anthropic-beta` headers; neither changes
anything here."""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response

from tandem.server.anthropic.messages import MessagesEncoder, anthropic_error
from tandem.server.anthropic.protocol import ENDPOINT, CountTokensRequest, MessagesRequest
from tandem.server.frontend.errors import ErrorShapes
from tandem.server.frontend.respond import respond
from tandem.server.frontend.service import GenerationService, Prepared
from tandem.server.generation.prepare import Preparer

PREFIX = "/v1/messages"


def prepare_message(preparer: Preparer, raw: bytes, bulk: bool) -> Prepared:
    body = preparer.parse(MessagesRequest, raw, bulk, ENDPOINT)
    adapter = preparer.check_model(body.model)
    job, ignored = body.job(body.sampling(), body.constraint())
    message_id = f"msg_{uuid.uuid4().hex}"
    request, tools = preparer.chat(job, message_id, adapter)
    encoder = MessagesEncoder(message_id, preparer.served_name(adapter), plan=tools)
    return Prepared(message_id, [request], encoder, body.stream, "messages", ignored)


def count_tokens(preparer: Preparer, raw: bytes, bulk: bool) -> dict[str, Any]:
    """The `input_tokens` a message with this conversation reports: the same template, tools
    and tokenization as `prepare_message`."""
    body = preparer.parse(CountTokensRequest, raw, bulk, f"{ENDPOINT}/count_tokens")
    preparer.check_model(body.model)
    job, _ = body.job()
    return {"input_tokens": len(preparer.chat_tokens(job, preparer.tool_plan(job)))}


def routes(service: GenerationService, preparer: Preparer, shapes: ErrorShapes) -> APIRouter:
    shapes.add(PREFIX, anthropic_error)
    router = APIRouter()

    @router.post(PREFIX)
    async def messages(request: Request) -> Response:
        return await respond(service, request, partial(prepare_message, preparer))

    @router.post(f"{PREFIX}/count_tokens")
    async def count(request: Request) -> dict[str, Any]:
        return await service.compute(await request.body(), partial(count_tokens, preparer))

    return router
