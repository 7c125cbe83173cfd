"""Decode-step thread timings kept on disk: a model started again on the same machine, with the
same step shapes, plans its compute threads from the timings of its first start instead of
timing again (dozens of full decode steps: seconds of start-up on a real model).

A timing is kept only when it settled (every candidate had runs with its cores: `cpu_threads`),
so that a start that shared the machine with something else does not decide later ones. The
key names everything the timed step depends on; anything else, and the timings are taken anew.
Delete the folder (`$TANDEM_CACHE_DIR/thread-timings`) to time again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from tandem.config import usable_cores
from tandem.execution.fast_path import ExecutionPlan
from tandem.execution.thread_plan import DecodeTimings
from tandem.models.llama import LlamaModel
from tandem.ops.cpu_kernels import cache_root, cpu_flags, cpu_name

FORMAT = 1  # what a kept timing measures: bump when the timed step or the rounds change
ENVIRONMENT = ("MKL_ENABLE_INSTRUCTIONS", "TANDEM_CPU_ISA", "OMP_WAIT_POLICY")  # change speed


def timings_key(
    model: LlamaModel, plan: ExecutionPlan, batch: int, contexts: tuple[int, ...], kv_dtype
) -> dict:
    """What the timings of `model`'s decode steps at `batch` requests of `contexts` depend on:
    the machine (its CPU, the cores this process may use), the software (torch, the kernels'
    build) and the step (the model's shape and weight formats, the execution path, the KV
    cache's dtype)."""
    kernels = plan.kernels.path.name if plan.kernels and plan.kernels.path else None
    return {
        "format": FORMAT,
        "cpu": [cpu_name(), cpu_flags()],
        "cores": usable_cores(),
        "environment": {name: os.environ.get(name) for name in ENVIRONMENT},
        "torch": torch.__version__,
        "kernels": kernels,
        "execution": [plan.ops, plan.packed_gemm],
        "model": [type(model).__name__, repr(model.spec)],
        "weights": [plan.weight_formats, plan.weight_bytes],
        "step": [batch, list(contexts), str(kv_dtype)],
    }


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "thread-timings" / f"{digest}.json"


def load(key: dict) -> list[DecodeTimings] | None:
    """The timings kept under `key`, or None (none kept, or unreadable: time again)."""
    path = cache_path(key)
    try:
        kept = json.loads(path.read_text())
        if kept["key"] != json.loads(json.dumps(key)):  # a digest's collision
            return None
        return [
            DecodeTimings(t["positions"], {int(n): float(ms) for n, ms in t["ms"].items()})
            for t in kept["timings"]
        ]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def store(key: dict, timings: list[DecodeTimings]) -> None:
    """Keep `timings` under `key` (written whole, then renamed: a reader never sees half)."""
    path = cache_path(key)
    kept = {"key": key, "timings": [{"positions": t.positions, "ms": t.ms} for t in timings]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(kept, sort_keys=True, indent=1))
        os.replace(partial, path)
    except OSError:
        pass  # a read-only cache: the next start times again
