"""OpenAI-compatible HTTP serving: `serve(config)` for the CLI, `create_app(engine)` to embed.

Module map: protocol (request bodies), errors (OpenAI error shape), loop (the engine thread),
service (admission, per-request streams, shutdown), generate (responses and SSE), metrics
(Prometheus), app (routes), serve (uvicorn with a graceful drain).
"""

from tandem.server.app import create_app
from tandem.server.serve import serve

__all__ = ["create_app", "serve"]
