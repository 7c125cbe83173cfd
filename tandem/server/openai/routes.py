"""OpenAI's API of 2023 and vLLM's extras: /v1/completions, /v1/chat/completions, /v1/models,
/tokenize and /detokenize. Each generation route parses its body, translates it into Tandem's
own form and answers through its encoder (`formats.py`)."""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response

from tandem.server.frontend.respond import respond
from tandem.server.frontend.service import GenerationService, Prepared
from tandem.server.generation.prepare import Preparer, render_chat
from tandem.server.openai.formats import ChatFormat, CompletionFormat
from tandem.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


def prepare_completion(preparer: Preparer, raw: bytes, bulk: bool) -> Prepared:
    body = preparer.parse(CompletionRequest, raw, bulk, "/v1/completions")
    preparer.check_model(body.model)
    body.check()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    requests = preparer.completion(body.job(), request_id)
    logprobs = requests[0].params.logprobs
    encoder = CompletionFormat(request_id, preparer.model_name, body.include_usage, logprobs)
    return Prepared(request_id, requests, encoder, body.stream, "prompt")


def prepare_chat(preparer: Preparer, raw: bytes, bulk: bool) -> Prepared:
    body = preparer.parse(ChatCompletionRequest, raw, bulk, "/v1/chat/completions")
    preparer.check_model(body.model)
    body.check()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    request, tools = preparer.chat(body.job(), request_id)
    logprobs = request.params.logprobs
    encoder = ChatFormat(request_id, preparer.model_name, body.include_usage, logprobs, tools=tools)
    return Prepared(request_id, [request], encoder, body.stream, "messages")


def tokenize(preparer: Preparer, raw: bytes, bulk: bool) -> dict[str, Any]:
    """vLLM's /tokenize: a prompt, or messages through the chat template."""
    body = preparer.parse(TokenizeRequest, raw, bulk, "/tokenize")
    if body.model is not None:
        preparer.check_model(body.model)
    model = preparer.model
    if body.messages is not None:
        job = body.chat_job()
        text = render_chat(model, job.messages, body.tools, job)
        ids = model.tokenizer(text, add_special_tokens=body.add_special_tokens is True).input_ids
    else:
        ids = body.token_ids(model)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}
    out["token_strs"] = [model.token_text(t) for t in ids] if body.return_token_strs else None
    return out


def detokenize(preparer: Preparer, raw: bytes, bulk: bool) -> dict[str, Any]:
    """vLLM's /detokenize: token ids back to text."""
    body = preparer.parse(DetokenizeRequest, raw, bulk, "/detokenize")
    if body.model is not None:
        preparer.check_model(body.model)
    return {"prompt": body.text(preparer.model)}


def routes(service: GenerationService, preparer: Preparer) -> APIRouter:
    router = APIRouter()
    created = int(time.time())

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await respond(service, request, partial(prepare_completion, preparer))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await respond(service, request, partial(prepare_chat, preparer))

    @router.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": preparer.model_name,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
            "root": str(preparer.model.model_path),
            "max_model_len": preparer.model.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        return await service.compute(await request.body(), partial(tokenize, preparer))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        return await service.compute(await request.body(), partial(detokenize, preparer))

    return router
