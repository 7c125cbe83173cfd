"""Every failure leaves the server as a JSON body in its API's shape, with a meaningful status.

400: the request is wrong (including malformed JSON and wrong types, which FastAPI would call 422),
401: missing or wrong API key, 404: unknown model or route, 413: body over --max-request-bytes,
500: the engine failed mid-request, 503: not ready, shutting down, full or failed (Retry-After).

Code anywhere raises one `APIError`; which body it becomes is decided by the request's path
(`ErrorShapes`: each API registers its prefixes), so the guards, FastAPI's own errors and a
route's refusals all answer a client in the shape its SDK parses. OpenAI's is the default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tandem.server")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ErrorShape = Callable[[APIError], dict[str, Any]]


def openai_error(error: APIError) -> dict[str, Any]:
    return error_body(error.status, error.message, error.param, error.code)


class ErrorShapes:
    """Each API's error body by path prefix (the longest that matches); OpenAI's elsewhere."""

    def __init__(self) -> None:
        self._shapes: list[tuple[str, ErrorShape]] = []

    def add(self, prefix: str, shape: ErrorShape) -> None:
        self._shapes.append((prefix, shape))
        self._shapes.sort(key=lambda item: -len(item[0]))

    def body(self, error: APIError, path: str) -> dict[str, Any]:
        shape = next((s for p, s in self._shapes if path.startswith(p)), openai_error)
        return shape(error)

    def response(self, error: APIError, path: str) -> JSONResponse:
        return JSONResponse(
            self.body(error, path), status_code=error.status, headers=error.headers or None
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, code="service_unavailable", retry_after=retry_after)


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"; type tags of unions are dropped."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in str(part) or part in {"str", "int", "float", "bool", "list", "dict"}:
            continue  # union member tags such as "list[int]"
        else:
            path += f".{part}" if path else str(part)
    return path or None


def _describe(error: dict[str, Any]) -> tuple[str | None, str]:
    param = _param_path(tuple(error.get("loc", ())))
    kind, msg = error.get("type", ""), str(error.get("msg", "invalid value"))
    if kind == "json_invalid":
        detail = error.get("ctx", {}).get("error", "")
        return None, f"request body is not valid JSON{': ' + detail if detail else ''}"
    if kind == "extra_forbidden":
        return param, f"unsupported parameter: {param}"
    if kind == "missing":
        return param, f"missing required parameter: {param}"
    msg = msg.removeprefix("Value error, ")
    if param is None:
        return None, f"request body: {msg}"
    if msg.startswith("not supported"):
        return param, f"unsupported parameter: {param} is {msg}"
    return param, f"{param}: {msg}"


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 naming the first offending parameter; every problem is listed in the message."""
    described = [_describe(e) for e in errors] or [(None, "invalid request")]
    seen: list[str] = []
    for _, msg in described:
        if msg not in seen:
            seen.append(msg)
    param = described[0][0]
    code = "unsupported_parameter" if seen[0].startswith("unsupported") else "invalid_value"
    return APIError(400, "; ".join(seen), param=param, code=code)


def install_error_handlers(app: FastAPI, shapes: ErrorShapes) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return shapes.response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return shapes.response(validation_error(list(exc.errors())), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return shapes.response(APIError(exc.status_code, str(exc.detail)), request.url.path)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        error = APIError(500, f"internal server error: {type(exc).__name__}")
        return shapes.response(error, request.url.path)
