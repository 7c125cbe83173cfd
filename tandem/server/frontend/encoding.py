"""The two framings streams use (server-sent events, newline-delimited JSON).

Payloads are plain dicts encoded by msgspec rather than pydantic models or `json.dumps`: a
stream serialises one chunk per step per request, and msgspec does one in a tenth of json's time.
"""

from __future__ import annotations

from typing import Any

import msgspec

encode_json = msgspec.json.Encoder().encode  # compact UTF-8, as json.dumps with separators


def sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    """One server-sent event; `event` names it (Anthropic's and the Responses API's streams)."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + encode_json(payload) + b"\n\n"


def ndjson(payload: dict[str, Any]) -> bytes:
    """One line of a newline-delimited JSON stream (Ollama's)."""
    return encode_json(payload) + b"\n"
