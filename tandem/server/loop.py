"""The engine loop thread: the one thread that calls engine.step().

It never touches asyncio objects: each step's outputs are reduced to plain `Delta`s here (the
engine's cumulative token list of a running request is live and keeps changing, so only this
thread may read it) and handed to `on_outputs`, which is expected to forward them to the event
loop with one `call_soon_threadsafe` per step. The HTTP side only ever calls the engine's
thread-safe `make_request` / `submit` / `abort`, so neither side waits on the other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.engine import Engine
from tandem.request import RequestOutput, TokenLogprobs

logger = logging.getLogger("tandem.server")
# Step records kept for the device-idle gauge: its window is one stats interval (1 s), so a
# server holds about 2 MB of records, not the offline history (beyond 2048 steps a second, the
# window is the last 2048 steps).
GAUGE_HISTORY_STEPS = 2048
GAUGE_HISTORY_REQUESTS = 100


@dataclass(frozen=True)
class Delta:
    """What one engine output means to a client: new text and tokens, and how it ended (for one
    sample of the request)."""

    request_id: str
    text: str
    num_new_tokens: int
    num_output_tokens: int  # cumulative
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    index: int = 0  # the sample (engine side), then the choice (once the service routed it)
    logprobs: list[TokenLogprobs] | None = None  # of the new tokens, when asked for

    @classmethod
    def from_output(cls, output: RequestOutput) -> Delta:
        return cls(
            request_id=output.request_id,
            text=output.delta_text,
            num_new_tokens=len(output.delta_token_ids),
            num_output_tokens=len(output.token_ids),
            finished=output.finished,
            finish_reason=output.finish_reason,
            error=output.error,
            index=output.index,
            logprobs=_new(output.logprobs, len(output.delta_token_ids)),
        )


def _new(values: list | None, n: int) -> list | None:
    """The last n of a live list, copied (the engine thread keeps appending to it)."""
    return None if values is None else values[len(values) - n :]


class EngineLoop:
    """Runs the engine on a daemon thread until `stop()`; a crash is reported, never swallowed."""

    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[Delta]], None],
        on_crash: Callable[[BaseException], None],
        poll_s: float = 0.05,
        stats_interval_s: float = 1.0,
    ):
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_crash = on_crash
        self._poll_s = poll_s  # how long an idle loop sleeps before it rechecks `stop()`
        self._stats_interval_s = stats_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.device_idle_fraction = 0.0
        # The gauge reads one window of steps at a time; nothing here reads request timings.
        engine.history.keep(steps=GAUGE_HISTORY_STEPS, requests=GAUGE_HISTORY_REQUESTS)
        self._window_start = engine.history.mark()
        self.crashed: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tandem-engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.crashed is None

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        engine = self.engine
        last_stats = time.perf_counter()
        try:
            while not self._stop.is_set():
                if engine.wait_for_work(self._poll_s):
                    outputs = engine.step()
                    if outputs:
                        self._on_outputs([Delta.from_output(o) for o in outputs])
                now = time.perf_counter()
                if now - last_stats >= self._stats_interval_s:
                    self._refresh_stats()
                    last_stats = now
        except BaseException as exc:  # reported to every waiting client, then the loop ends
            logger.exception("engine loop crashed")
            self.crashed = exc
            self._on_crash(exc)

    def _refresh_stats(self) -> None:
        """Summarise the steps since the last refresh, so the gauge describes the latest window
        rather than the whole (bounded) history. Only this thread appends to the history, so
        nothing races with the engine."""
        history = self.engine.history
        if history.mark().steps == self._window_start.steps:
            return
        self.device_idle_fraction = history.summary(since=self._window_start).device_idle_fraction
        self._window_start = history.mark()
