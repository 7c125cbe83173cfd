"""Ollama's API: POST /api/chat and /api/generate (streamed as newline-delimited JSON unless
`stream` is false), GET /api/tags, /api/ps and /api/version, POST /api/show; errors as
Ollama's `{"error": ...}`. The served model is listed under its name, and its LoRA adapters
under theirs (a request's `model` picks one); `NAME:latest`, as Ollama's clients write it, names
it too."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from tandem.server.frontend.errors import ErrorShapes
from tandem.server.frontend.respond import respond
from tandem.server.frontend.service import GenerationService, Prepared
from tandem.server.generation.prepare import Preparer
from tandem.server.generation.request import ChatJob
from tandem.server.ollama.encoder import ChatEncoder, RawGenerateEncoder, now, ollama_error
from tandem.server.ollama.protocol import ChatRequest, GenerateRequest, ShowRequest

PREFIX = "/api"
# The Ollama API version this server's answers follow (clients check it for features).
OLLAMA_VERSION = "0.13.0"


def model_name(name: str) -> str:
    """Ollama's `NAME:latest` is NAME."""
    return name.removesuffix(":latest")


def _loads_only(raw: bytes) -> bool:
    """A generate request with no prompt: Ollama's clients send it to load a model, and the
    model is loaded already."""
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and isinstance(body.get("model"), str)
        and not body.get("prompt")
        and not body.get("system")
    )


def prepare_chat(preparer: Preparer, raw: bytes, bulk: bool) -> Prepared:
    body = preparer.parse(ChatRequest, raw, bulk, ChatRequest.endpoint)
    adapter = preparer.check_model(model_name(body.model))
    request_id = f"ollama-{uuid.uuid4().hex}"
    request, tools = preparer.chat(body.job(), request_id, adapter)
    encoder = ChatEncoder(body.model, plan=tools)
    return Prepared(request_id, [request], encoder, body.stream, "messages")


def prepare_generate(preparer: Preparer, raw: bytes, bulk: bool) -> Prepared:
    body = preparer.parse(GenerateRequest, raw, bulk, GenerateRequest.endpoint)
    adapter = preparer.check_model(model_name(body.model))
    request_id = f"ollama-{uuid.uuid4().hex}"
    job = body.job()
    if isinstance(job, ChatJob):
        request, tools = preparer.chat(job, request_id, adapter)
        encoder = ChatEncoder(body.model, plan=tools, generate=True)
        return Prepared(request_id, [request], encoder, body.stream, "prompt")
    requests = preparer.completion(job, request_id, adapter)
    return Prepared(request_id, requests, RawGenerateEncoder(body.model), body.stream, "prompt")


def routes(service: GenerationService, preparer: Preparer, shapes: ErrorShapes) -> APIRouter:
    shapes.add(PREFIX + "/", ollama_error)
    router = APIRouter()
    model = preparer.model
    modified = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
    path = model.model_path
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    details = {
        "parent_model": "",
        "format": "gguf" if path.suffix == ".gguf" else "safetensors",
        "family": model.model_type,
        "families": [model.model_type],
        "parameter_size": "",
        "quantization_level": "",
    }
    card = {
        "name": preparer.model_name,
        "model": preparer.model_name,
        "modified_at": modified,
        "size": size,
        "digest": "",
        "details": details,
    }

    @router.post(PREFIX + "/chat")
    async def chat(request: Request) -> Response:
        return await respond(service, request, partial(prepare_chat, preparer))

    @router.post(PREFIX + "/generate")
    async def generate(request: Request) -> Response:
        raw = await request.body()  # kept by the request: `respond` reads it again
        if len(raw) < 4096 and _loads_only(raw):
            name = json.loads(raw)["model"]
            await preparer.check_model_async(model_name(name))
            return JSONResponse({"model": name, "created_at": now(),
                                 "response": "", "done": True, "done_reason": "load"})  # fmt: skip
        return await respond(service, request, partial(prepare_generate, preparer))

    @router.get(PREFIX + "/tags")
    async def tags() -> dict[str, Any]:
        adapters = [
            {**card, "name": a.name, "model": a.name,
             "details": {**details, "parent_model": preparer.model_name}}
            for a in await service.adapters.list()
        ]  # fmt: skip
        return {"models": [card, *adapters]}

    @router.get(PREFIX + "/ps")
    async def ps() -> dict[str, Any]:
        running = {**card, "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                   "context_length": model.max_model_len}  # fmt: skip
        return {"models": [running]}

    @router.get(PREFIX + "/version")
    async def version() -> dict[str, str]:
        return {"version": OLLAMA_VERSION}

    @router.post(PREFIX + "/show")
    async def show(request: Request) -> dict[str, Any]:
        body = preparer.parse(ShowRequest, await request.body(), False, PREFIX + "/show")
        await preparer.check_model_async(model_name(body.model_name))
        template = getattr(model.tokenizer, "chat_template", None) or ""
        capabilities = ["completion"] + (["tools"] if "tools" in template else [])
        return {
            "modelfile": f"FROM {path}\n",
            "parameters": "",
            "template": template,
            "details": details,
            "model_info": {
                "general.architecture": model.model_type,
                f"{model.model_type}.context_length": model.max_model_len,
            },
            "capabilities": capabilities,
            "modified_at": modified,
        }

    return router
