"""Tandem: an LLM inference engine whose host prepares step N+1 while the device computes step N."""

import os

# Before torch's first allocation: large CPU buffers in huge pages (see tandem/ops/huge_pages.py).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# ruff: noqa: E402

from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.llm import LLM
from tandem.request import (
    CompletionOutput,
    RequestOutput,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "LLM",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
__version__ = "0.1.0"
