"""The engine's public figures: a snapshot of its state and counters, and the recent step and
request records, which readers take in windows (by mark) without clearing anything."""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

from tandem.config import EngineConfig
from tandem.metrics import RequestTiming, RunSummary, SpeculativeStats, StepRecord, summarize
from tandem.models.spec import LlamaSpec
from tandem.ops.kv_quant import INT8_BLOCK, row_width
from tandem.scheduling.scheduler import CacheStats, ScheduledBatch, Scheduler

HISTORY_LENGTH = 100_000  # step and request records kept: bounded, so a server can run for days


@dataclass(frozen=True)
class EngineStats:
    """Plain numbers, read at one moment: cheap, and safe to hand to any thread."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int  # free blocks still holding a cached prefix (reusable until evicted)
    num_preemptions: int
    prefix_cache: CacheStats  # admissions and cache hits since the engine started
    speculative: SpeculativeStats  # drafts since the engine started (zeros without speculation)

    @classmethod
    def of(cls, scheduler: Scheduler, speculative: SpeculativeStats) -> EngineStats:
        blocks = scheduler.blocks
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_blocks_total=blocks.size,
            kv_blocks_used=blocks.num_used,
            kv_blocks_cached=blocks.num_free_cached,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache=dataclasses.replace(scheduler.stats),
            speculative=dataclasses.replace(speculative),
        )


@dataclass(frozen=True)
class HistoryMark:
    """A point in the history: records appended after it form a window."""

    steps: int
    requests: int


class StepHistory:
    """The last HISTORY_LENGTH step records and finished requests' timings.

    Appended by the loop's thread; read a window from that thread (or while the loop is idle)."""

    def __init__(self, length: int = HISTORY_LENGTH):
        self._steps: deque[StepRecord] = deque(maxlen=length)
        self._requests: deque[RequestTiming] = deque(maxlen=length)
        self._num_steps = 0  # ever appended
        self._num_requests = 0

    def keep(self, steps: int, requests: int) -> None:
        """Keep at most this many records from now on (the latest ones): a server that reads
        only a recent window need not hold a long history in memory."""
        self._steps = deque(self._steps, maxlen=steps)
        self._requests = deque(self._requests, maxlen=requests)

    def add_step(self, record: StepRecord) -> None:
        self._steps.append(record)
        self._num_steps += 1

    def add_request(self, timing: RequestTiming) -> None:
        self._requests.append(timing)
        self._num_requests += 1

    def latest(self) -> StepRecord | None:
        """The last step retired (a caller may add its own spans to it)."""
        return self._steps[-1] if self._steps else None

    def mark(self) -> HistoryMark:
        return HistoryMark(self._num_steps, self._num_requests)

    def steps(self, since: HistoryMark | None = None) -> list[StepRecord]:
        """The step records kept, those after `since` if given, oldest first."""
        return _tail(self._steps, self._num_steps - since.steps if since else len(self._steps))

    def requests(self, since: HistoryMark | None = None) -> list[RequestTiming]:
        n = self._num_requests - since.requests if since else len(self._requests)
        return _tail(self._requests, n)

    def summary(self, since: HistoryMark | None = None) -> RunSummary:
        """Device idle, throughput and latencies over the window (or everything kept).

        Consecutive windows tile the device's timeline: one starts where the step before it
        left the device (or with its first step's scheduling, after a pause)."""
        steps = self.steps(since)
        before = self._num_steps - len(steps)  # steps appended before the window
        kept_before = len(self._steps) - len(steps)
        after = (
            self._steps[kept_before - 1] if since is not None and before and kept_before else None
        )
        return summarize(steps, self.requests(since), after)


def _tail(records: deque, n: int) -> list:
    n = min(n, len(records))
    return list(records)[len(records) - n :] if n else []


def describe_kv_cache(config: EngineConfig, spec: LlamaSpec) -> tuple[dict[int | None, int], str]:
    """Bytes of K and V one cached position holds in the layers of each window, and the cache's
    kind in words, e.g. "float32, 2048 bytes a token" or "int8 codes, float32 scales per block
    of 32, 576 bytes a token"."""
    storage = config.kv_storage_dtype
    by_window = spec.kv_bytes_by_window(row_width(spec.head_dim, storage) * storage.itemsize)
    kind = str(config.torch_dtype).removeprefix("torch.")
    if config.kv_cache_dtype != "auto":
        int8 = config.kv_cache_dtype == "int8"
        scales = f"per block of {INT8_BLOCK}" if int8 else "per token and KV head"
        kind = f"{config.kv_cache_dtype} codes, float32 scales {scales}"
    return by_window, f"{kind}, {sum(by_window.values())} bytes a token"


def kv_bytes_read(bytes_by_window: dict[int | None, int], batch: ScheduledBatch) -> int:
    """Bytes of K and V a step's attention reads at least: each request's positions up to its
    last new one, within each layer's window (`LlamaSpec.kv_bytes_by_window`)."""
    ends = [item.start + item.num_tokens for item in batch.items]
    total = 0
    for window, per_position in bytes_by_window.items():
        positions = sum(ends) if window is None else sum(min(end, window) for end in ends)
        total += per_position * positions
    return total
