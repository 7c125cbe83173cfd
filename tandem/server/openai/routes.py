"""OpenAI's API of 2023 and vLLM's extras: /v1/completions, /v1/chat/completions, /v1/models,
/tokenize and /detokenize, and (only where runtime updates are allowed) vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter. Each generation route parses its body,
translates it into Tandem's own form and answers through its encoder (`formats.py`). A request's
`model` names the served model or one of its LoRA adapters, which /v1/models lists after it."""

from __future__ import annotations

import logging
import time
import uuid
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from tandem.server.frontend.errors import bad_request
from tandem.server.frontend.respond import respond
from tandem.server.frontend.service import GenerationService, Prepared
from tandem.server.generation.prepare import Preparer, render_chat
from tandem.server.openai.formats import ChatFormat, CompletionFormat
from tandem.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)

logger = logging.getLogger("tandem.server")


def prepare_completion(preparer: Preparer, raw: bytes, bulk: bool) -> Prepared:
    body = preparer.parse(CompletionRequest, raw, bulk, "/v1/completions")
    adapter = preparer.check_model(body.model)
    body.check()
    request_id = f"cmpl-{uuid.uuid4().hex}"
    requests = preparer.completion(body.job(), request_id, adapter)
    logprobs = requests[0].params.logprobs
    name = preparer.served_name(adapter)
    encoder = CompletionFormat(
        request_id,
        name,
        body.include_usage,
        logprobs,
        tokens_as_ids=body.return_tokens_as_token_ids,
    )
    return Prepared(request_id, requests, encoder, body.stream, "prompt")


def prepare_chat(preparer: Preparer, raw: bytes, bulk: bool) -> Prepared:
    body = preparer.parse(ChatCompletionRequest, raw, bulk, "/v1/chat/completions")
    adapter = preparer.check_model(body.model)
    body.check()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    request, tools = preparer.chat(body.job(), request_id, adapter)
    logprobs = request.params.logprobs
    name = preparer.served_name(adapter)
    encoder = ChatFormat(request_id, name, body.include_usage, logprobs, tools=tools)
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


def routes(
    service: GenerationService, preparer: Preparer, runtime_lora_updating: bool = False
) -> APIRouter:
    """`runtime_lora_updating`: mount vLLM's load and unload endpoints (else they are 404s)."""
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
        """The served model, then its LoRA adapters as vLLM lists them (asked of the cores)."""
        base = preparer.model_name
        card = {
            "id": base,
            "object": "model",
            "created": created,
            "owned_by": "tandem",
            "root": str(preparer.model.model_path),
            "parent": None,
            "max_model_len": preparer.model.max_model_len,
        }
        cards = [card]
        for adapter in await service.adapters.list():
            named = adapter.base_model_name
            parent = named if named in preparer.accepted_names else base
            cards.append({**card, "id": adapter.name, "root": adapter.path, "parent": parent})
        return {"object": "list", "data": cards}

    @router.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        return await service.compute(await request.body(), partial(tokenize, preparer))

    @router.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        return await service.compute(await request.body(), partial(detokenize, preparer))

    if runtime_lora_updating:
        add_lora_routes(router, service, preparer)
    return router


def add_lora_routes(router: APIRouter, service: GenerationService, preparer: Preparer) -> None:
    """vLLM's runtime endpoints. A load is read on every engine core's loader thread (the cores
    keep stepping) and answered once all are done; success is vLLM's plain-text line."""

    def parse(body_type: type, path: str, raw: bytes, bulk: bool) -> Any:
        return preparer.parse(body_type, raw, bulk, path)

    @router.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Response:
        work = partial(parse, LoadLoRAAdapterRequest, "/v1/load_lora_adapter")
        body: LoadLoRAAdapterRequest = await service.compute(await request.body(), work)
        name = body.lora_name
        if name in preparer.accepted_names:
            raise bad_request(
                f"{name!r} names the served model: an adapter needs a name of its own",
                param="lora_name",
            )
        await service.adapters.load(name, body.lora_path)
        logger.info("loaded LoRA adapter %r from %s", name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Response:
        work = partial(parse, UnloadLoRAAdapterRequest, "/v1/unload_lora_adapter")
        body: UnloadLoRAAdapterRequest = await service.compute(await request.body(), work)
        await service.adapters.unload(body.lora_name, body.lora_int_id)
        name = body.lora_name or f"#{body.lora_int_id}"
        logger.info("unloaded LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
