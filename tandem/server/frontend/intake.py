"""Where request preparation runs: two bounded thread pools, chosen by the body.

Preparing a request (JSON parsing, the chat template, tokenization) costs time in proportion to
its body, so it never runs on the event loop nor on the engine's loop thread. Small bodies, nearly
every request, go to a `fast` lane of a few workers; bodies over `bulk_threshold` bytes, or that
may hold more than `CHEAP_VALUES` JSON values, go to a one-worker `bulk` lane that holds at most
`max_bulk` of them (running or queued); beyond that they are refused with 503. So a flood of huge
prompts waits behind itself, never in front of a small request, and cannot grow a queue without
bound either. Tokenizers release the GIL, so the lanes run in parallel with the event loop and
the engine; JSON parsers do not, so bulk bodies are first counted in a helper process
(`json_count.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tandem.server.frontend.json_count import JSONCounter

T = TypeVar("T")

BULK_THRESHOLD = 64 * 1024
# A small body with more commas than this may hold that many JSON values, which pydantic would
# parse while holding the GIL for tens of milliseconds: it goes to the bulk lane.
CHEAP_VALUES = 8192


class IntakeLanes:
    def __init__(
        self,
        fast_workers: int = 2,
        max_bulk: int = 4,
        bulk_threshold: int = BULK_THRESHOLD,
    ):
        if fast_workers < 1 or max_bulk < 1:
            raise ValueError("fast_workers and max_bulk must be >= 1")
        self.fast_workers = fast_workers
        self.max_bulk = max_bulk
        self.bulk_threshold = bulk_threshold
        self.bulk_pending = 0  # read and written on the event loop only
        self.counter = JSONCounter()
        self._fast: ThreadPoolExecutor | None = None
        self._bulk: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._fast = ThreadPoolExecutor(self.fast_workers, thread_name_prefix="tandem-intake")
        self._bulk = ThreadPoolExecutor(1, thread_name_prefix="tandem-intake-bulk")

    def is_bulk(self, raw: bytes) -> bool:
        """Cheap on the event loop: the comma count only runs on bodies under the threshold."""
        return len(raw) > self.bulk_threshold or raw.count(b",") > CHEAP_VALUES

    @property
    def bulk_full(self) -> bool:
        return self.bulk_pending >= self.max_bulk

    def run(self, bulk: bool, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` in the fast or the bulk lane (on the event loop; the caller checks
        `bulk_full` first)."""
        assert self._fast is not None and self._bulk is not None, "start() first"
        loop = asyncio.get_running_loop()
        if not bulk:
            future = loop.run_in_executor(self._fast, fn)
        else:
            self.bulk_pending += 1
            future = loop.run_in_executor(self._bulk, fn)
            future.add_done_callback(self._bulk_done)
        # A caller that stops waiting (the engine failed) must not leave an unread exception.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return future

    def _bulk_done(self, _: asyncio.Future) -> None:
        self.bulk_pending -= 1

    def close(self, wait: bool = False) -> None:
        """Drop queued work; with `wait`, also wait for running jobs (each is bounded by the body
        limit), which is what the interpreter would do at exit anyway."""
        self.counter.close()
        for pool in (self._fast, self._bulk):
            if pool is not None:
                pool.shutdown(wait=wait, cancel_futures=True)
