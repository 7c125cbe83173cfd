"""OpenAI-compatible HTTP serving: `serve(config)` for the CLI, `create_app(engine)` to embed.

Module map: protocol (request bodies), errors (OpenAI error shape), guards (API key and body size,
as ASGI middleware), token_bound (a provable lower bound on a prompt's tokens), prepare (body ->
engine request, off the event loop), intake (the thread pools preparation runs in), json_count (a
helper process that counts a large body's JSON values off the GIL), loop (the engine thread),
service (admission, per-request streams, shutdown, engine failure), generate (responses and SSE),
metrics (Prometheus), app (routes), serve (uvicorn with a graceful drain).
"""

from tandem.server.app import create_app
from tandem.server.serve import serve

__all__ = ["create_app", "serve"]
