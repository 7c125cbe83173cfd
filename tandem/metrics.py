"""Step spans and what they add up to: device busy and idle time, throughput, TTFT, ITL.

Host spans (schedule, build, launch, wait, update) come from the engine loop; device spans come
from the stream (CUDA events or the CPU worker's clock), all on the host's perf_counter clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HOST_PHASES = ("schedule", "build", "launch", "grammar", "wait", "update")


@dataclass
class StepRecord:
    step_id: int
    num_tokens: int
    num_seqs: int
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)  # host phases
    device: tuple[float, float] = (0.0, 0.0)
    device_wait: float = 0.0  # seconds within `device` the device waited for a grammar bitmask
    discarded: int = 0  # sampled tokens dropped at retirement: their request had finished
    skipped: bool = False  # not run: every request in it had ended on a stop id (StopCheck)
    kv_bytes: int = 0  # K and V its attention reads at least (engine.stats.kv_bytes_read)
    # Speculative decoding: draft tokens verified, how many of them were accepted, and the
    # requests that verified drafts (each also gains one token of its own). A request that had
    # finished a step earlier (the async loop's extra step) counts in `discarded` only.
    drafted: int = 0
    accepted: int = 0
    verified: int = 0


@dataclass
class SpeculativeStats:
    """Speculative decoding's counters (vLLM's spec_decode metrics): draft tokens verified,
    accepted, and the (request, step) pairs that verified drafts."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    num_verified: int = 0

    def add(self, record: StepRecord) -> None:
        self.drafted_tokens += record.drafted
        self.accepted_tokens += record.accepted
        self.num_verified += record.verified

    def count(self, drafted: int, accepted: int) -> None:
        """One verification of `drafted` tokens that kept `accepted` of them."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.num_verified += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per drafted one."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gains per verifying step: its accepted drafts plus one of its own."""
        return 1 + self.accepted_tokens / self.num_verified if self.num_verified else 0.0


@dataclass
class RequestTiming:
    arrival: float
    token_times: list[float]


@dataclass
class RunSummary:
    """What a window of steps adds up to.

    `discarded_tokens`: tokens computed for a request that had already finished, dropped at
    retirement, never streamed. The synchronous loop retires each step before scheduling the
    next, so it discards none. The asynchronous loop schedules step N+1 before step N's tokens
    are known, so a request that ends in step N on EOS, a stop token or a stop string holds one
    more token in step N+1, and that token is discarded: exactly one per such request, unless
    step N+1 did not hold it (its token in step N was its last allowed by `max_tokens` or the
    context, or step N+1 left it out for want of token budget or KV blocks), or step N+1 was
    skipped: on a CPU, a step whose requests all ended in step N on stop ids is not run
    (`skipped_steps`; `num_steps` counts the steps run). A request aborted while a step holding
    it is in flight has that step's token discarded too.
    """

    wall_s: float
    device_busy_s: float
    num_steps: int
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    host_ms_per_step: dict[str, float]
    discarded_tokens: int = 0
    speculative: SpeculativeStats = field(default_factory=lambda: SpeculativeStats())
    skipped_steps: int = 0

    @property
    def device_idle_fraction(self) -> float:
        return max(0.0, 1.0 - self.device_busy_s / self.wall_s) if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "wall_s": self.wall_s,
            "device_busy_pct": 100 * (1 - self.device_idle_fraction),
            "device_idle_pct": 100 * self.device_idle_fraction,
            "tokens_per_s": self.tokens_per_s,
            "steps": self.num_steps,
            "output_tokens": self.output_tokens,
            "discarded_tokens": self.discarded_tokens,
            "skipped_steps": self.skipped_steps,
            "drafted_tokens": self.speculative.drafted_tokens,
            "accepted_tokens": self.speculative.accepted_tokens,
            "acceptance_rate": self.speculative.acceptance_rate,
            "mean_accepted_length": self.speculative.mean_accepted_length,
            "ttft_p50_ms": _pct(self.ttft_s, 50) * 1e3,
            "ttft_p99_ms": _pct(self.ttft_s, 99) * 1e3,
            "itl_p50_ms": _pct(self.itl_s, 50) * 1e3,
            "itl_p99_ms": _pct(self.itl_s, 99) * 1e3,
            **{f"host_{k}_ms": v for k, v in self.host_ms_per_step.items()},
        }


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def summarize(
    steps: list[StepRecord], requests: list[RequestTiming], after: StepRecord | None = None
) -> RunSummary:
    """Wall time runs from the first step's scheduling to the last step's retirement.

    `after`, the step retired just before `steps` (a window of a longer run): the wall time then
    starts no earlier than that step's device end. Under the asynchronous loop a window's first
    step was scheduled a whole step before that, while the device was busy with `after`; counted
    from its scheduling, every window would add a step's time to its wall and read as idle.
    """
    if not steps:
        return RunSummary(0.0, 0.0, 0, 0, [], [], {})
    start = min(s.spans["schedule"][0] for s in steps)
    if after is not None:
        start = max(start, after.device[1])
    end = max(max(span[1] for span in s.spans.values()) for s in steps)
    busy = sum(s.device[1] - s.device[0] - s.device_wait for s in steps)
    ttft = [r.token_times[0] - r.arrival for r in requests if r.token_times]
    itl = [float(x) for r in requests for x in np.diff(r.token_times)]
    host = {
        phase: 1e3
        * float(np.mean([s.spans[phase][1] - s.spans[phase][0] for s in steps if phase in s.spans]))
        for phase in HOST_PHASES
        if any(phase in s.spans for s in steps)
    }
    tokens = sum(len(r.token_times) for r in requests)
    discarded = sum(s.discarded for s in steps)
    speculative = SpeculativeStats()
    for s in steps:
        speculative.add(s)
    skipped = sum(s.skipped for s in steps)
    return RunSummary(
        end - start,
        busy,
        len(steps) - skipped,
        tokens,
        ttft,
        itl,
        host,
        discarded,
        speculative,
        skipped,
    )


def chrome_trace(runs: dict[str, list[StepRecord]]) -> dict:
    """A Chrome/Perfetto trace: one process per run, a host lane and a device lane."""
    events = []
    for pid, (name, steps) in enumerate(runs.items()):
        if not steps:
            continue
        origin = min(s.spans["schedule"][0] for s in steps)
        events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
        for tid, lane in ((0, "host"), (1, "device")):
            events.append(
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}}
            )
        for s in steps:
            lanes = [(0, phase, span) for phase, span in s.spans.items()] + [(1, "step", s.device)]
            for tid, phase, (a, b) in lanes:
                events.append({
                    "ph": "X", "pid": pid, "tid": tid, "name": f"{phase} {s.step_id}",
                    "ts": (a - origin) * 1e6, "dur": max(0.0, b - a) * 1e6,
                    "args": {"tokens": s.num_tokens, "seqs": s.num_seqs},
                })  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(runs: dict[str, list[StepRecord]], path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(runs)))


def plot_timeline(runs: dict[str, list[StepRecord]], path: str | Path, max_steps: int = 24) -> None:
    """A PNG of `max_steps` steps from the middle of each run: host phases above, device below.

    Device steps alternate two shades so that the gaps between them (device idle) stand out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"schedule": "#4c72b0", "build": "#55a868", "launch": "#8172b2", "grammar": "#937860",
              "wait": "#cccccc", "update": "#dd8452", "device": "#c44e52"}  # fmt: skip
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.8 * len(runs) + 0.6), squeeze=False)
    for ax, (name, steps) in zip(axes[:, 0], runs.items(), strict=True):
        steps = list(steps)
        first = max(0, len(steps) // 2 - max_steps // 2)
        steps = steps[first : first + max_steps]
        if not steps:
            continue
        origin = min(s.spans["schedule"][0] for s in steps)
        for i, s in enumerate(steps):
            for phase, (a, b) in s.spans.items():
                ax.broken_barh([((a - origin) * 1e3, (b - a) * 1e3)], (10, 8), color=colors[phase])
            a, b = s.device
            shade = colors["device"] if i % 2 == 0 else "#8c2d2f"
            ax.broken_barh([((a - origin) * 1e3, (b - a) * 1e3)], (0, 8), color=shade)
        ax.set_yticks([4, 14], ["device", "host"])
        ax.set_title(
            f"{name}: steps {steps[0].step_id}-{steps[-1].step_id}", loc="left", fontsize=10
        )
        ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", ncol=len(colors), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=120)
    plt.close(fig)
