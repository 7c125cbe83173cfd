"""Which CPU thread count computes a step, decided per step from its shape.

A step that prefills runs on every core; a decode step's count depends on the K/V positions it
reads: at short contexts its GEMMs decide (and a core left free keeps the asynchronous host off
the compute team's cores), at long ones its attention does. `cpu_threads.py` times the counts
at start-up and makes the plan; `ModelRunner` applies it on the stream, step by step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

PREFILL_TOKENS_FOR_ALL_THREADS = 64  # GEMMs this tall run faster on every core


@dataclass(frozen=True)
class DecodeTimings:
    """The fastest decode-step time (ms) of each candidate thread count, at a step that reads
    `positions` K/V positions (its requests' contexts summed)."""

    positions: int
    ms: dict[int, float]


@dataclass(frozen=True)
class ThreadPlan:
    """`prefill` threads for a step of at least `PREFILL_TOKENS_FOR_ALL_THREADS` prefill tokens;
    else `decode[i]` threads, where `bounds[i]` is the last bound the step's K/V positions reach
    (`bounds[0]` is 0: every step reaches it)."""

    bounds: tuple[int, ...]
    decode: tuple[int, ...]
    prefill: int

    def __post_init__(self) -> None:
        if not self.bounds or self.bounds[0] != 0 or list(self.bounds) != sorted(self.bounds):
            raise ValueError(f"bounds must rise from 0, got {self.bounds}")
        if len(self.decode) != len(self.bounds):
            raise ValueError("one decode count per bound")

    @classmethod
    def fixed(cls, decode: int, prefill: int) -> ThreadPlan:
        """The same decode count at every context."""
        return cls((0,), (decode,), prefill)

    def threads(self, prefill_tokens: int, kv_positions: int) -> int:
        """The count for a step of `prefill_tokens` prefill tokens whose rows read
        `kv_positions` K/V positions in all (each row its context)."""
        if prefill_tokens >= PREFILL_TOKENS_FOR_ALL_THREADS:
            return self.prefill
        return self.decode[bisect.bisect_right(self.bounds, kv_positions) - 1]

    def describe(self) -> str:
        """e.g. "1 below 40000, 2 from 40000 K/V positions a step"; "2" for one count."""
        if len(self.bounds) == 1:
            return str(self.decode[0])
        parts = [f"{self.decode[0]} below {self.bounds[1]}"]
        later = zip(self.bounds[1:], self.decode[1:], strict=True)
        parts += [f"{n} from {bound}" for bound, n in later]
        return ", ".join(parts) + " K/V positions a step"
