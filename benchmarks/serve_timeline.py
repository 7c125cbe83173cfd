"""Where the device waited: read a server's step trace (`tandem serve --trace PATH`) and print
the device's idle time, per 1 s window and in all, and the longest gaps with what the core was
doing in them.

    tandem serve --model DIR --trace /tmp/serve.json &   # run a load, then stop the server
    python benchmarks/serve_timeline.py /tmp/serve.json

A gap is the time between one step leaving the device and the next one starting on it: a step
launched only after the device had finished (the synchronous loop, a host late with the next
step, or nothing to run until a request arrived), or the device thread slow to pick it up.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Step:
    step_id: int
    tokens: int = 0
    seqs: int = 0
    device: tuple[float, float] = (0.0, 0.0)
    host: dict[str, tuple[float, float]] = field(default_factory=dict)  # ms


def read_trace(path: str) -> list[Step]:
    """The steps of a trace written by `tandem.metrics.write_chrome_trace` (one engine)."""
    steps: dict[int, Step] = defaultdict(lambda: Step(0))
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    for event in events:
        if event.get("ph") != "X":
            continue
        phase, step_id = event["name"].rsplit(" ", 1)
        step = steps[int(step_id)]
        step.step_id = int(step_id)
        span = (event["ts"] / 1e3, (event["ts"] + event["dur"]) / 1e3)
        if event["tid"] == 1:
            step.device = span
            step.tokens, step.seqs = event["args"]["tokens"], event["args"]["seqs"]
        else:
            step.host[phase] = span
    return [steps[i] for i in sorted(steps)]


def gaps(steps: list[Step]) -> list[tuple[Step, float, bool]]:
    """(step, the device's wait before it in ms, whether the host launched it late)."""
    out = []
    for before, step in zip(steps, steps[1:], strict=False):
        wait = max(0.0, step.device[0] - before.device[1])
        launched = step.host.get("launch", (0.0, 0.0))[1]
        out.append((step, wait, launched > before.device[1]))
    return out


def windows(steps: list[Step], seconds: float, min_seqs: int) -> list[float]:
    """Device idle fraction of consecutive windows of `seconds`, counting only windows whose
    steps all ran at least `min_seqs` sequences (the steady state of a load)."""
    out = []
    start = steps[0].device[0]
    busy, full = 0.0, True
    for step in steps:  # a window ends with the step whose device end closes it
        busy += step.device[1] - step.device[0]
        full = full and step.seqs >= min_seqs
        end = step.device[1]
        if end - start >= seconds * 1e3:
            if full:
                out.append(1 - busy / (end - start))
            start, busy, full = end, 0.0, True
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a trace from `tandem serve --trace`")
    p.add_argument("--window", type=float, default=1.0, help="seconds per window")
    p.add_argument("--min-seqs", type=int, default=16, help="steady state: steps this full")
    p.add_argument("--top", type=int, default=8, help="longest gaps to list")
    args = p.parse_args(argv)
    steps = read_trace(args.trace)
    if len(steps) < 2:
        print("fewer than two steps in the trace")
        return 1
    waits = gaps(steps)
    span = steps[-1].device[1] - steps[0].device[0]
    late = sum(w for _, w, is_late in waits if is_late)
    total = sum(w for _, w, _ in waits)
    print(f"{len(steps)} steps over {span / 1e3:.1f} s; the device waited {total:.0f} ms "
          f"({100 * total / span:.2f}%), {late:.0f} ms of it before steps launched only after "
          f"it had finished the one before")  # fmt: skip
    readings = windows(steps, args.window, args.min_seqs)
    if readings:
        print(f"{len(readings)} windows of {args.window:g} s with >= {args.min_seqs} sequences: "
              f"idle median {100 * statistics.median(readings):.2f}%, "
              f"max {100 * max(readings):.2f}%")  # fmt: skip
    print("longest gaps (ms): wait | step, tokens, seqs, device ms | core's host spans")
    for step, wait, is_late in sorted(waits, key=lambda g: -g[1])[: args.top]:
        spans = ", ".join(f"{k} {b - a:.1f}" for k, (a, b) in sorted(step.host.items(),
                          key=lambda kv: kv[1][0]))  # fmt: skip
        print(f"  {wait:7.1f} | {step.step_id}, {step.tokens}, {step.seqs}, "
              f"{step.device[1] - step.device[0]:.1f}{' (launched after)' if is_late else ''} "
              f"| {spans}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
