"""Kernel-level device busy time: what the step-level idle figure cannot see.

The step-level figure (`metrics.summarize`) times each step with one event pair, so a gap between
two kernels *inside* a step counts as busy: on a GPU whose kernels finish faster than the host
launches them, the device idles there too. Here the kernels themselves are timed, by
torch.profiler's CUDA activity (CUPTI; no CPU op tracing, which would slow the very host being
measured), over a bounded window of steps, and the busy time is the union of their intervals
(kernels on concurrent streams are not counted twice). Copies and memsets are not kernels: a copy
engine at work while no kernel runs leaves the compute units idle. Each kernel's name is kept:
the window's idle is also told by the kernel that ends each gap (`KernelShare`), which shows the
boundaries that cost most.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

# Of the window's kernel span, the first and last EDGE_FRACTION are left out: they hold the
# profiler's start and its stop (which waits for the device), not the loop's steady state.
EDGE_FRACTION = 0.1
# A gap between kernels this long is not a kernel boundary: the next step's work reached the
# device late (the host), reported apart from the boundaries' idle.
LONG_GAP_S = 100e-6
NAME_CHARS = 80  # a kernel's name as shown: templated C++ names run to thousands


@dataclass
class KernelEvent:
    name: str
    start: float  # seconds
    end: float


@dataclass
class KernelShare:
    """One kernel's part of a window: its launches, their time, and the idle just before them."""

    name: str
    count: int
    busy_s: float
    idle_before_s: float  # between the end of the kernels before and each of its starts


@dataclass
class KernelWindow:
    """What the kernels of one profiled window add up to."""

    steps: int  # engine steps launched while the profiler recorded
    kernels: int
    busy_s: float  # union of kernel intervals within the measured span
    wall_s: float  # the measured span
    pause_s: float  # host time spent starting and stopping the profiler (in the run's wall)
    span_s: float = 0.0  # the kernels' whole span, of which wall_s is the middle
    long_gaps: int = 0  # gaps of LONG_GAP_S or more between kernels, within wall_s
    long_gap_s: float = 0.0  # ... and their total
    shares: list[KernelShare] = field(default_factory=list)  # most idle before them first

    @property
    def idle_pct(self) -> float:
        return 100 * (1 - self.busy_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def boundary_idle_pct(self) -> float:
        """The idle between kernels less the long gaps (LONG_GAP_S): what kernel boundaries
        cost, without the host's late steps."""
        wall = self.wall_s - self.long_gap_s
        return 100 * (1 - self.busy_s / wall) if wall > 0 else 0.0

    @property
    def measured_steps(self) -> float:
        """The steps the measured middle of the span holds, for figures per step."""
        return self.steps * self.wall_s / self.span_s if self.span_s > 0 else float(self.steps)


def merged_runs(
    intervals: Iterable[tuple[float, float]], window: tuple[float, float]
) -> list[tuple[float, float]]:
    """The union of `intervals` (start, end) clipped to `window`, as ordered disjoint runs
    (overlapping or touching intervals, as on two streams, make one run)."""
    lo, hi = window
    runs: list[tuple[float, float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if runs and a <= runs[-1][1]:  # overlaps (or touches) the current run: extend it
            runs[-1] = (runs[-1][0], max(runs[-1][1], b))
        else:
            runs.append((a, b))
    return runs


def union_busy(
    intervals: Iterable[tuple[float, float]], window: tuple[float, float] | None = None
) -> tuple[float, float]:
    """(busy, wall): the length of the union of `intervals` (start, end) clipped to `window`,
    and the window's length. Without a window: from the first start to the last end."""
    intervals = list(intervals)
    if window is None:
        spans = [(a, b) for a, b in intervals if b > a]
        if not spans:
            return 0.0, 0.0
        window = (min(a for a, _ in spans), max(b for _, b in spans))
    busy = sum(b - a for a, b in merged_runs(intervals, window))
    return busy, max(0.0, window[1] - window[0])


def long_gaps(
    intervals: Iterable[tuple[float, float]], window: tuple[float, float], threshold: float
) -> tuple[int, float]:
    """(count, seconds) of the gaps of `threshold` or more between the union of `intervals`
    within `window`."""
    runs = merged_runs(intervals, window)
    gaps = [a - b for (_, b), (a, _) in pairwise(runs) if a - b >= threshold]
    return len(gaps), sum(gaps)


def measure_events(events: list[KernelEvent], steps: int, pause_s: float) -> KernelWindow:
    """`measure`, with each kernel name's share of the measured span."""
    intervals = [(e.start, e.end) for e in events]
    window = measure(intervals, steps, pause_s)
    if events:
        window.shares = idle_by_kernel(events, window_span(intervals))
    return window


def window_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """The kernels' span less its edges (EDGE_FRACTION at each end)."""
    first = min(a for a, _ in intervals)
    last = max(b for _, b in intervals)
    edge = (last - first) * EDGE_FRACTION
    return first + edge, last - edge


def measure(intervals: list[tuple[float, float]], steps: int, pause_s: float) -> KernelWindow:
    """The busy fraction over the window's kernel span, less its edges (EDGE_FRACTION)."""
    if not intervals:
        return KernelWindow(steps, 0, 0.0, 0.0, pause_s)
    lo, hi = window_span(intervals)
    busy, wall = union_busy(intervals, (lo, hi))
    span = max(b for _, b in intervals) - min(a for a, _ in intervals)
    gaps, gap_s = long_gaps(intervals, (lo, hi), LONG_GAP_S)
    return KernelWindow(steps, len(intervals), busy, wall, pause_s, span, gaps, gap_s)


def idle_by_kernel(events: list[KernelEvent], window: tuple[float, float]) -> list[KernelShare]:
    """Per kernel name, within `window`: launches, busy time, and the idle that ends at its
    starts (from the latest end of the kernels started before it). The idle adds up to the
    window's, less a gap that the window's end cuts; most idle first."""
    lo, hi = window
    shares: dict[str, KernelShare] = {}
    reach = lo  # the latest end so far, from the window's start
    for event in sorted(events, key=lambda e: e.start):
        start, end = max(event.start, lo), min(event.end, hi)
        if end <= start:
            reach = max(reach, min(event.end, hi))
            continue
        share = shares.setdefault(event.name, KernelShare(event.name, 0, 0.0, 0.0))
        share.count += 1
        share.busy_s += end - start
        share.idle_before_s += max(0.0, start - reach)
        reach = max(reach, end)
    return sorted(shares.values(), key=lambda s: (-s.idle_before_s, s.name))


def shares_per_step(window: KernelWindow, top: int) -> list[dict]:
    """The `top` kernels that end the most idle, each figure per measured step: launches,
    busy_us, idle_before_us (what the report prints and a device run's JSON keeps)."""
    steps = window.measured_steps
    if steps <= 0:
        return []
    return [
        {"kernel": s.name, "launches": s.count / steps, "busy_us": s.busy_s * 1e6 / steps,
         "idle_before_us": s.idle_before_s * 1e6 / steps}
        for s in window.shares[:top]
    ]  # fmt: skip


def short_name(name: str) -> str:
    """A kernel's name without its return type and arguments, cut to NAME_CHARS."""
    name = name.removeprefix("void ")
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the argument list: the first "(" outside template brackets
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth <= 0:
            cut = i
            break
    name = name[:cut]
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 3] + "..."


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
        return measure_events(kernel_events(self._profile), steps, self._pause_s)

    def export(self, path: str) -> None:
        """The stopped window's every activity (kernels, copies, memsets, on each stream) as a
        Chrome trace, gzipped if `path` ends in .gz; slow, so called after the timed run."""
        self._profile.export_chrome_trace(path)


def kernel_events(profile) -> list[KernelEvent]:
    """Every CUDA kernel a stopped torch.profiler recorded, named: not the copies and memsets,
    nor the GPU-side spans of annotations (they cover the gaps)."""
    from torch.autograd import DeviceType

    events = []
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
        events.append(KernelEvent(short_name(event.name()), start, start + duration))
    return events
