"""A load run's figures under vLLM's names (`vllm bench serve`'s result JSON), so one reader
takes both tools' results: throughput, percentiles of the latencies asked for, and goodput, the
requests per second that met every service-level objective."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tandem.bench.serve_args import METRICS
from tandem.bench.serve_client import RequestResult

METRIC_NAMES = {
    "ttft": "time to first token",
    "tpot": "time per output token",
    "itl": "inter-token latency",
    "e2el": "end-to-end latency",
}


@dataclass(frozen=True)
class MetricsSpec:
    """What to report: percentiles of which metrics, and the objectives of goodput (ms)."""

    metrics: tuple[str, ...] = ("ttft", "itl", "e2el")
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    slos_ms: dict[str, float] = field(default_factory=dict)


def parse_metrics_spec(
    percentile_metrics: str, metric_percentiles: str, goodput: Sequence[str] | None
) -> MetricsSpec:
    """The flags' values, checked: a bad one raises ValueError naming the flag."""
    metrics = tuple(m.strip() for m in percentile_metrics.split(",") if m.strip())
    unknown = [m for m in metrics if m not in METRICS]
    if not metrics or unknown:
        raise ValueError(
            f"--percentile-metrics takes some of {','.join(METRICS)}, got {percentile_metrics!r}"
        )
    try:
        percentiles = tuple(float(p) for p in metric_percentiles.split(","))
    except ValueError:
        percentiles = ()
    if not percentiles or not all(0 < p <= 100 for p in percentiles):
        raise ValueError(
            f"--metric-percentiles takes numbers in (0, 100], e.g. 50,90,99, got "
            f"{metric_percentiles!r}"
        )
    slos: dict[str, float] = {}
    for item in goodput or []:
        name, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if name not in METRICS or not ms > 0:
            raise ValueError(
                f"--goodput takes METRIC:MS with METRIC one of {','.join(METRICS)} "
                f"and MS > 0, e.g. ttft:500 e2el:8000; got {item!r}"
            )
        slos[name] = ms
    return MetricsSpec(metrics, percentiles, slos)


def values_s(results: Sequence[RequestResult], metric: str) -> list[float]:
    """A metric's values (seconds) over completed requests; itl: every gap of every request."""
    ok = [r for r in results if r.ok]
    if metric == "itl":
        return [gap for r in ok for gap in r.itls]
    picked = (r.ttft if metric == "ttft" else r.tpot if metric == "tpot" else r.e2el for r in ok)
    return [v for v in picked if v is not None]


def meets(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Completed, and within every objective (itl: its largest gap; a metric the request does
    not have, e.g. no text streamed, is not met)."""
    if not result.ok:
        return False
    for metric, limit_ms in slos_ms.items():
        if metric == "itl":
            value = max(result.itls, default=0.0) if result.ttft is not None else None
        else:
            value = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2el}[metric]
        if value is None or value * 1e3 > limit_ms:
            return False
    return True


def percentile_key(p: float) -> str:
    return f"p{int(p) if int(p) == p else p}"


def pct_ms(values_in_s: Sequence[float], q: float) -> float:
    return float(np.percentile(values_in_s, q)) * 1e3 if len(values_in_s) else math.nan


def summarize(results: Sequence[RequestResult], duration_s: float, spec: MetricsSpec) -> dict:
    """The run's figures (times in ms, NaN where no request has the metric)."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "incomplete"] = errors.get(r.error or "incomplete", 0) + 1
    output = sum(r.completion_tokens for r in ok)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    summary: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "error_kinds": errors,
        "duration": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(ok) / duration_s,
    }
    if spec.slos_ms:
        good = sum(meets(r, spec.slos_ms) for r in results)
        summary |= {"good_requests": good, "request_goodput": good / duration_s}
    summary["output_throughput"] = output / duration_s
    summary["total_token_throughput"] = (prompt + output) / duration_s
    for metric in spec.metrics:
        values = values_s(results, metric)
        mean = float(np.mean(values)) * 1e3 if values else math.nan
        summary[f"mean_{metric}_ms"] = mean
        summary[f"median_{metric}_ms"] = pct_ms(values, 50)
        summary[f"std_{metric}_ms"] = float(np.std(values)) * 1e3 if values else math.nan
        for p in spec.percentiles:
            summary[f"{percentile_key(p)}_{metric}_ms"] = pct_ms(values, p)
    return summary


def detailed(results: Sequence[RequestResult]) -> dict:
    """Every request's figures, as vLLM's --save-detailed writes them (seconds)."""
    return {
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.completion_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itls for r in results],
        "e2els": [r.e2el for r in results],
        "errors": [r.error or "" for r in results],
    }


def finite(value: object) -> object:
    """`value` with every NaN or infinity as None: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value
