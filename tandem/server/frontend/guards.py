"""Checks that run before a request reaches a route: the API key, then the body's size.

Both are plain ASGI middleware, so they answer before FastAPI reads the body: a client without
the key, or with a body over the limit, costs the server a header check, not a parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.server.frontend.errors import APIError, ErrorShapes

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
# After refusing a request, the rest of its body is read and dropped for at most this long and
# this much, so that the client sees the answer instead of a connection reset.
LINGER_S = 2.0
LINGER_BYTES = 64 * 1024 * 1024


async def refuse(
    receive: Receive,
    send: Send,
    error: APIError,
    shapes: ErrorShapes,
    path: str,
    headers: dict[str, str] | None = None,
) -> None:
    """Answer with an error before the body was read, then close the connection cleanly.

    Closing a socket with unread data in it resets the connection, and the reset can destroy
    the answer before the client reads it (a client blocked writing its body sees only the
    reset). So the answer goes out first, then the rest of the body is discarded for a bounded
    time and amount (a "lingering close"), and only then does the response end and the
    connection close.
    """
    body = json.dumps(shapes.body(error, path)).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"connection", b"close"),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body, "more_body": True})
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(_discard_body(receive), LINGER_S)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _discard_body(receive: Receive) -> None:
    discarded = 0
    while discarded <= LINGER_BYTES:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        discarded += len(message.get("body", b""))


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class APIKeyGuard:
    """Every request under one of `prefixes` (and /metrics if `protect_metrics`) must carry the
    key: `Authorization: Bearer <key>` (OpenAI's clients, Claude Code's auth token) or
    `x-api-key: <key>` (Anthropic's SDK).

    The comparison is of SHA-256 digests with `hmac.compare_digest`, so its time depends on
    neither the key's content nor its length.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        shapes: ErrorShapes,
        prefixes: tuple[str, ...] = ("/v1",),
        protect_metrics: bool = False,
    ):
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()
        self._shapes = shapes
        self._prefixes = prefixes
        self._protect_metrics = protect_metrics

    def _guarded(self, path: str) -> bool:
        under = any(path == p or path.startswith(p + "/") for p in self._prefixes)
        return under or (self._protect_metrics and path == "/metrics")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._guarded(scope["path"]):
            return await self.app(scope, receive, send)
        keys = _presented_keys(scope)
        if not keys:
            message = (
                "missing API key: send it in the Authorization header as 'Bearer <key>' or in "
                "the x-api-key header (the client's api_key)"
            )
            return await self._refuse(scope, receive, send, message)
        digests = [hashlib.sha256(key).digest() for key in keys]
        if not any(hmac.compare_digest(digest, self._digest) for digest in digests):
            return await self._refuse(scope, receive, send, "incorrect API key provided")
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, message: str) -> None:
        error = APIError(401, message, code="invalid_api_key")
        headers = {"www-authenticate": "Bearer"}
        await refuse(receive, send, error, self._shapes, scope["path"], headers)


def _presented_keys(scope: Scope) -> list[bytes]:
    """The keys a request presents: a bearer token, an x-api-key, or both."""
    keys = []
    scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        keys.append(token.strip())
    x_api_key = (_header(scope, b"x-api-key") or b"").strip()
    if x_api_key:
        keys.append(x_api_key)
    return keys


class BodyLimit:
    """Bodies over `max_bytes` get 413 without being read whole.

    A declared Content-Length over the limit is refused before a byte of the body is read; a
    chunked body is read up to the limit, then refused. Either way the rest of the body is
    never stored, and the connection is closed after a bounded lingering read (`refuse`).
    """

    def __init__(
        self, app: ASGIApp, shapes: ErrorShapes, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    ):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self._shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None:
            # The server enforces that the body matches Content-Length; only its value matters.
            if length.isdigit() and int(length) > self.max_bytes:
                return await self._refuse(scope, receive, send, f"{int(length)} bytes")
            return await self.app(scope, receive, send)
        if _header(scope, b"transfer-encoding") is None:
            return await self.app(scope, receive, send)  # no body at all
        # Chunked: read it here, up to the limit, and hand it on as one message.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the app see that
                return await self.app(scope, _replay([message], receive), send)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, f"more than {self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = (
            f"the request body is {size}; this server accepts at most {self.max_bytes} "
            "bytes (--max-request-bytes)"
        )
        error = APIError(413, message, code="request_too_large")
        await refuse(receive, send, error, self._shapes, scope["path"])


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that returns `messages` first, then whatever the connection sends."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
