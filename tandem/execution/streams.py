"""Where launched work runs: one interface, a CUDA stream or a CPU worker thread.

`submit(fn)` returns at once with a `StepHandle`; `handle.wait()` is the one deliberate
host-device synchronisation of a step. Both record when the device started and finished each step
(on the host's perf_counter clock), which is what the idle-time metrics are made of.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tandem.ops import cpu_kernels


class StepHandle:
    """A launched step; `wait()` blocks until the device has finished it and returns its result."""

    def wait(self) -> Any:
        raise NotImplementedError

    @property
    def device_span(self) -> tuple[float, float]:
        """(start, end) of the step on the device, perf_counter seconds; valid after wait()."""
        raise NotImplementedError

    @property
    def device_wait(self) -> float:
        """Seconds within the span the device waited for the host (a grammar's bitmask)."""
        return 0.0


class JoinedHandle(StepHandle):
    """A step launched in two parts on one stream (the second after a grammar's bitmask)."""

    def __init__(self, first: StepHandle, second: StepHandle):
        self._first = first
        self._second = second

    def wait(self) -> Any:
        self._first.wait()
        return self._second.wait()

    @property
    def device_span(self) -> tuple[float, float]:
        return self._first.device_span[0], self._second.device_span[1]

    @property
    def device_wait(self) -> float:
        return max(0.0, self._second.device_span[0] - self._first.device_span[1])


class _CPUHandle(StepHandle):
    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._span = (0.0, 0.0)

    def wait(self) -> Any:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def device_span(self) -> tuple[float, float]:
        return self._span


# How long a thread may hold the GIL while another waits for it (Python's default is 5 ms). The
# worker needs the GIL briefly at each end of a step; behind a host thread that is scheduling the
# next step it would otherwise wait for the host's whole Python phase, and the overlap would be
# lost. A fraction of a millisecond keeps its waits short at a negligible switching cost.
GIL_SWITCH_INTERVAL_S = 2e-4

# How long a CPU stream's worker waits for work before it frees its OpenMP team: far longer than
# the host's turn between two steps, so a running engine keeps its team.
IDLE_RELEASE_S = 0.05


class CPUStream:
    """Runs submitted work in order on one worker thread.

    Torch kernels release the GIL, so while the worker computes step N the host thread schedules
    and builds step N+1: the CPU stand-in for a CUDA stream. Creating one lowers the interpreter's
    GIL switch interval to `GIL_SWITCH_INTERVAL_S` (process-wide; never raises it).
    """

    def __init__(self) -> None:
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._held: _CPUHandle | None = None  # finished, its waiter not yet woken
        self._thread = threading.Thread(target=self._work, name="tandem-device", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> StepHandle:
        # The work's OpenMP team is this stream's thread's; one the submitting thread kept would
        # make libgomp's waiting threads sleep instead of spin (`release_openmp_threads`).
        cpu_kernels.release_openmp_threads()
        handle = _CPUHandle()
        self._queue.put((fn, handle))
        return handle

    def _work(self) -> None:
        torch.set_grad_enabled(False)
        while (job := self._next_job()) is not None:
            handle = self._run(*job)
            # Finished work is let go before its waiter wakes: it pins the runner and its KV
            # cache, which a caller that then drops the engine expects to be freed.
            del job
            self._finish(handle)
        self.wake_waiters()  # the last job, held back behind the stop

    def _next_job(self) -> tuple | None:
        """The next job; an idle worker first frees its OpenMP team, so that an engine at rest
        does not slow another one's steps in this process (`release_openmp_threads`)."""
        try:
            return self._queue.get(timeout=IDLE_RELEASE_S)
        except queue.Empty:
            cpu_kernels.release_openmp_threads()
            return self._queue.get()

    def _run(self, fn: Callable[[], Any], handle: _CPUHandle) -> _CPUHandle:
        start = time.perf_counter()
        try:
            handle._result = fn()
        except BaseException as exc:  # handed to the waiter, never lost in the thread
            handle._error = exc
        handle._span = (start, time.perf_counter())
        return handle

    def _finish(self, handle: _CPUHandle) -> None:
        """Wake the waiters: the job before this one if it was held back, and this one's unless
        the next job is queued (then it waits for that job's forward: `wake_waiters`)."""
        self.wake_waiters()
        if self._queue.empty():
            handle._done.set()
        else:
            self._held = handle

    def wake_waiters(self) -> None:
        """On the worker: wake the waiter of the finished job held back for the next one.

        Why: with a next step queued, the worker's Python before that step's forward (inputs,
        metadata) and the host's Python on the finished step's results would take turns at the
        GIL, and the forward would start late by the host's share. Held back until the next
        step enters its forward (`ModelRunner` calls this there; any job's end does as well),
        the host does that work while the forward runs, without the GIL wanted by the worker.
        """
        if self._held is not None:
            self._held._done.set()
            self._held = None

    def close(self) -> None:
        """Stop the worker after its queued work. From the worker itself (a dropped runner's
        finalizer, run where its last reference, a finished job's, went) it cannot be joined."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)


class _CUDAHandle(StepHandle):
    def __init__(
        self, stream: CUDAStream, result: Any, start: torch.cuda.Event, end: torch.cuda.Event
    ):
        self._stream = stream
        self._result = result
        self._start = start
        self._end = end
        self._span = (0.0, 0.0)

    def wait(self) -> Any:
        self._end.synchronize()  # the step's one deliberate sync
        origin_event, origin_time = self._stream.origin
        self._span = (
            origin_time + origin_event.elapsed_time(self._start) / 1e3,
            origin_time + origin_event.elapsed_time(self._end) / 1e3,
        )
        result = self._result
        return result() if callable(result) else result

    @property
    def device_span(self) -> tuple[float, float]:
        return self._span


class CUDAStream:
    """Work is enqueued on a dedicated compute stream; timing events place it on the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        event = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)  # once, at start-up: anchors device time to host time
        event.record(self.stream)
        event.synchronize()
        self.origin = (event, time.perf_counter())

    def submit(self, fn: Callable[[], Any]) -> StepHandle:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            result = fn()
            end.record(self.stream)
        return _CUDAHandle(self, result, start, end)

    def wake_waiters(self) -> None:
        """Nothing to do: a CUDA step's waiter waits on the device's event, not the host's."""

    def close(self) -> None:
        self.stream.synchronize()


def make_stream(device: torch.device) -> CPUStream | CUDAStream:
    return CUDAStream(device) if device.type == "cuda" else CPUStream()
