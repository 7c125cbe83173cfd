"""What reaches the engine from other threads: requests and aborts, queued until the loop's
thread takes them between steps, and the ids in use (no two live requests share one)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from tandem.request import Request


class Inbox:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: set[str] = set()  # ids submitted and not yet finished
        self.wakeup = threading.Event()  # set by every message: an idle loop waits on it

    def add(self, request: Request) -> None:
        with self._lock:
            if request.request_id in self._live:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._live.add(request.request_id)
        self._queue.put(("add", request))
        self.wakeup.set()

    def abort(self, request_id: str, index: int | None) -> None:
        self._queue.put(("abort", (request_id, index)))
        self.wakeup.set()

    def release(self, request_id: str) -> None:
        """Every sample of the request has finished: its id may be used again."""
        with self._lock:
            self._live.discard(request_id)

    def any_live(self) -> bool:
        with self._lock:
            return bool(self._live)

    def take(self) -> Iterator[tuple[str, object]]:
        """The messages queued so far, oldest first: ("add", request), ("abort", (id, index))."""
        while True:
            try:
                yield self._queue.get_nowait()
            except queue.Empty:
                return

    def wait(self, timeout: float | None) -> None:
        self.wakeup.wait(timeout)
        self.wakeup.clear()
