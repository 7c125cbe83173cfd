"""Tandem: an LLM inference engine whose host prepares step N+1 while the device computes step N."""

import os
from importlib import import_module
from typing import TYPE_CHECKING

# ruff: noqa: F401 - the TYPE_CHECKING imports below are for type checkers and editors only

# Before torch's first allocation: large CPU buffers in huge pages (see tandem/ops/huge_pages.py).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

if TYPE_CHECKING:
    from tandem.config import EngineConfig
    from tandem.engine.engine import Engine
    from tandem.llm import LLM
    from tandem.lora import LoRARequest
    from tandem.request import (
        CompletionOutput,
        RequestOutput,
        SamplingParams,
        StructuredOutputsParams,
    )

# The public names, imported on first use: a process that needs only part of the package (the
# command line's parser, a server's front end) does not pay for the engine, torch and all.
_PUBLIC = {
    "LLM": "tandem.llm",
    "LoRARequest": "tandem.lora",
    "CompletionOutput": "tandem.request",
    "Engine": "tandem.engine.engine",
    "EngineConfig": "tandem.config",
    "RequestOutput": "tandem.request",
    "SamplingParams": "tandem.request",
    "StructuredOutputsParams": "tandem.request",
}
__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    return getattr(import_module(_PUBLIC[name]), name)
