"""Request bodies as clients send them: fields the server does not know are accepted, never
refused, and each one's name is logged once.

Agent clients send what their own vendor's API takes (Claude Code: `context_management`,
`output_config`, `cache_control` on content blocks; Codex: `prompt_cache_key`,
`client_metadata`), and grow new fields every release; refusing them would break every client
with every release. A parameter the server knows but cannot honour is another matter: it is
declared, and a value other than its neutral one is refused by name (`only`).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from pydantic import AfterValidator, BaseModel, ConfigDict

logger = logging.getLogger("tandem.server")

# Names are remembered to be logged once; past this many (a client inventing names), no more.
MAX_REPORTED = 512
_reported: set[tuple[str, str]] = set()
_lock = threading.Lock()


class Body(BaseModel):
    """A request body, or a part of one: unknown fields kept aside (`model_extra`), types not
    coerced (a string is not a number)."""

    model_config = ConfigDict(extra="allow", strict=True)


def only(*neutral: Any) -> AfterValidator:
    """Accept a known but unsupported parameter only at a value that changes nothing."""

    def check(value: Any) -> Any:
        if value not in neutral and not (isinstance(value, (list, dict)) and not value):
            shown = " or ".join(json.dumps(v) for v in neutral)
            raise ValueError(f"not supported by this server (only {shown} is accepted)")
        return value

    return AfterValidator(check)


def ignored_fields(body: BaseModel, path: str = "") -> list[str]:
    """The dotted names of every unknown field in `body` and the models within it (list
    positions are left out, so a field of every message is one name)."""
    names = [f"{path}{name}" for name in body.model_extra or {}]
    for name in type(body).model_fields:
        names += _ignored_in(getattr(body, name), f"{path}{name}.")
    return names


def _ignored_in(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return ignored_fields(value, path)
    if isinstance(value, (list, tuple)):
        found: list[str] = []
        for item in value:
            found += [n for n in _ignored_in(item, path) if n not in found]
        return found
    return []


def report_ignored(endpoint: str, body: BaseModel) -> None:
    """Log each unknown field's name the first time `endpoint` sees it."""
    log_ignored(endpoint, ignored_fields(body))


def log_ignored(endpoint: str, names: list[str]) -> None:
    """Log each of `names` the first time `endpoint` sees it."""
    for name in names:
        key = (endpoint, name)
        if key in _reported:
            continue
        with _lock:
            if key in _reported or len(_reported) > MAX_REPORTED:
                continue
            _reported.add(key)
            if len(_reported) > MAX_REPORTED:
                logger.info("%d unknown field names logged: no more will be", MAX_REPORTED)
                continue
        logger.info("%s: ignoring the field %r, which this server does not use", endpoint, name)
