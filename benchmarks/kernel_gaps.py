"""Where a CUDA step's device time between kernels goes, from a `tandem bench --kernel-trace` file.

`--profile` counts a copy as idle (no kernel runs); this reads the same window's trace with its
copies and memsets, on the stream that ran most kernels, and sums each gap between two of its
activities by what ends and what starts it (a graph's last kernel and the copy out, two copies,
a copy and the next graph's first kernel, ...), and each copy's own time, per step:

    tandem bench ... --profile --kernel-trace traces
    python benchmarks/kernel_gaps.py traces/async.json.gz --steps 64
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from tandem.bench.kernel_profile import EDGE_FRACTION, short_name, window_span

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
NAME_CHARS = 48


@dataclass
class Activity:
    kind: str
    name: str
    start: float  # microseconds
    end: float


@dataclass
class Transition:
    """The gaps between one pair of activities (what ends, what starts), over the window."""

    before: str
    after: str
    gaps: list[float]

    @property
    def total(self) -> float:
        return sum(self.gaps)


def load(path: Path) -> list[Activity]:
    """The trace's device activities, on the stream with the most kernels, in order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_KINDS]
    kernels = Counter(e.get("tid") for e in device if e["cat"] == "kernel")
    if not kernels:
        raise SystemExit(
            f"{path}: no kernels in the trace (was it written with --profile on CUDA?)"
        )
    stream = kernels.most_common(1)[0][0]
    return sorted(
        (
            Activity(e["cat"], _short(e["name"], e["cat"]), e["ts"], e["ts"] + e.get("dur", 0.0))
            for e in device
            if e.get("tid") == stream
        ),
        key=lambda a: a.start,
    )


def _short(name: str, kind: str) -> str:
    if kind == "kernel":
        name = short_name(name)  # as --profile's table names kernels, cut shorter
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 3] + "..."


def transitions(activities: list[Activity]) -> tuple[list[Transition], dict[str, list[float]]]:
    """Within the window's middle: the gaps by (before, after), most idle first, and each copy
    or memset's durations by name."""
    lo, hi = window_span([(a.start, a.end) for a in activities])  # as `tandem bench --profile`
    gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
    copies: dict[str, list[float]] = defaultdict(list)
    reach, before = activities[0].end, activities[0].name
    for a in activities[1:]:
        if lo <= a.start <= hi:
            gaps[before, a.name].append(max(0.0, a.start - reach))
            if a.kind != "kernel":
                copies[a.name].append(a.end - a.start)
        if a.end >= reach:
            reach, before = a.end, a.name
    found = [Transition(b, a, g) for (b, a), g in gaps.items()]
    return sorted(found, key=lambda t: -t.total), dict(copies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="a --kernel-trace file (.json or .json.gz)")
    parser.add_argument("--steps", type=float, required=True,
                        help="the engine steps the window holds (bench --profile's window)")  # fmt: skip
    parser.add_argument("--top", type=int, default=8, help="transitions to show")
    args = parser.parse_args(argv)
    found, copies = transitions(load(args.trace))
    steps = args.steps * (1 - 2 * EDGE_FRACTION)  # the middle of the window
    total = sum(t.total for t in found)
    print(f"idle between activities: {total / steps:.1f} us a step ({steps:g} steps measured)")
    print(f"{'before':<{NAME_CHARS}}  {'after':<{NAME_CHARS}}  a step  median us   max us"
          "  us a step")  # fmt: skip
    for t in found[: args.top]:
        print(f"{t.before:<{NAME_CHARS}}  {t.after:<{NAME_CHARS}}  {len(t.gaps) / steps:6.2f}  "
              f"{statistics.median(t.gaps):9.2f}  {max(t.gaps):7.1f}  "
              f"{t.total / steps:9.2f}")  # fmt: skip
    for name, durations in sorted(copies.items()):
        print(
            f"{name}: {len(durations) / steps:.2f} a step, median {statistics.median(durations):.2f} us"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
