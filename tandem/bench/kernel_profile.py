"""Kernel-level device busy time: what the step-level idle figure cannot see.

The step-level figure (`metrics.summarize`) times each step with one event pair, so a gap between
two kernels *inside* a step counts as busy: on a GPU whose kernels finish faster than the host
launches them, the device idles there too. Here the kernels themselves are timed, by
torch.profiler's CUDA activity (CUPTI; no CPU op tracing, which would slow the very host being
measured), over a bounded window of steps, and the busy time is the union of their intervals
(kernels on concurrent streams are not counted twice). Copies and memsets are not kernels: a copy
engine at work while no kernel runs leaves the compute units idle.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

# Of the window's kernel span, the first and last EDGE_FRACTION are left out: they hold the
# profiler's start and its stop (which waits for the device), not the loop's steady state.
EDGE_FRACTION = 0.1


@dataclass
class KernelWindow:
    """What the kernels of one profiled window add up to."""

    steps: int  # engine steps launched while the profiler recorded
    kernels: int
    busy_s: float  # union of kernel intervals within the measured span
    wall_s: float  # the measured span
    pause_s: float  # host time spent starting and stopping the profiler (in the run's wall)

    @property
    def idle_pct(self) -> float:
        return 100 * (1 - self.busy_s / self.wall_s) if self.wall_s > 0 else 0.0


def union_busy(
    intervals: Iterable[tuple[float, float]], window: tuple[float, float] | None = None
) -> tuple[float, float]:
    """(busy, wall): the length of the union of `intervals` (start, end) clipped to `window`,
    and the window's length. Without a window: from the first start to the last end."""
    spans = sorted((a, b) for a, b in intervals if b > a)
    if window is None:
        if not spans:
            return 0.0, 0.0
        window = (spans[0][0], max(b for _, b in spans))
    lo, hi = window
    busy, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if cur_b is not None and a <= cur_b:  # overlaps (or touches) the current run: extend it
            cur_b = max(cur_b, b)
            continue
        if cur_b is not None:
            busy += cur_b - cur_a
        cur_a, cur_b = a, b
    if cur_b is not None:
        busy += cur_b - cur_a
    return busy, max(0.0, hi - lo)


def measure(intervals: list[tuple[float, float]], steps: int, pause_s: float) -> KernelWindow:
    """The busy fraction over the window's kernel span, less its edges (EDGE_FRACTION)."""
    if not intervals:
        return KernelWindow(steps, 0, 0.0, 0.0, pause_s)
    first = min(a for a, _ in intervals)
    last = max(b for _, b in intervals)
    edge = (last - first) * EDGE_FRACTION
    busy, wall = union_busy(intervals, (first + edge, last - edge))
    return KernelWindow(steps, len(intervals), busy, wall, pause_s)


class KernelProfiler:
    """torch.profiler recording CUDA kernels only, started and stopped around a window of steps."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CUDA])
        self._pause_s = 0.0
        self.running = False

    @staticmethod
    def warm_up() -> None:
        """Initialise CUPTI once, outside any measured run (its first start is slow)."""
        profiler = KernelProfiler()
        profiler.start()
        profiler.stop(0)

    def start(self) -> None:
        t0 = time.perf_counter()
        self._profile.start()
        self._pause_s += time.perf_counter() - t0
        self.running = True

    def stop(self, steps: int) -> KernelWindow:
        t0 = time.perf_counter()
        self._profile.stop()  # waits for the device, collects the trace
        self._pause_s += time.perf_counter() - t0
        self.running = False
        return measure(kernel_intervals(self._profile), steps, self._pause_s)


def kernel_intervals(profile) -> list[tuple[float, float]]:
    """(start, end) in seconds of every CUDA kernel a stopped torch.profiler recorded: not the
    copies and memsets, nor the GPU-side spans of annotations (they cover the gaps)."""
    from torch.autograd import DeviceType

    intervals = []
    for event in profile.profiler.kineto_results.events():
        if event.device_type() != DeviceType.CUDA:
            continue
        if hasattr(event, "activity_type"):  # kineto's kind: "kernel", "gpu_memcpy", ...
            if event.activity_type() != "kernel":
                continue
        elif event.name().startswith(("Memcpy", "Memset")) or event.is_user_annotation():
            continue
        if hasattr(event, "start_ns"):
            start, duration = event.start_ns() * 1e-9, event.duration_ns() * 1e-9
        else:  # older torch
            start, duration = event.start_us() * 1e-6, event.duration_us() * 1e-6
        intervals.append((start, start + duration))
    return intervals
