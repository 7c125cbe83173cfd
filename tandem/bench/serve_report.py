"""What `tandem bench serve` shows: the result as text (vLLM's layout), as a JSON file (vLLM's
`--save-result` naming), and as a picture of the distributions and the run over time."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

from tandem.bench.serve_client import RequestResult
from tandem.bench.serve_metrics import METRIC_NAMES, MetricsSpec, finite, percentile_key

WIDTH = 50


def print_result(result: dict, spec: MetricsSpec) -> None:
    def line(label: str, value: object) -> None:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label + ':':<40} {shown:>10}")

    def rule(title: str, fill: str = "-") -> None:
        print(f" {title} ".center(WIDTH, fill))

    rule("Serving Benchmark Result", "=")
    sent = result["completed"] + result["failed"]
    line("Model", result["model_id"])
    line("Successful requests", f"{result['completed']}/{sent}")
    if result["error_kinds"]:
        line("Failed requests", ", ".join(f"{k} x{n}" for k, n in result["error_kinds"].items()))
    line("Benchmark duration (s)", result["duration"])
    line("Total input tokens", result["total_input_tokens"])
    line("Total generated tokens", result["total_output_tokens"])
    line("Request throughput (req/s)", result["request_throughput"])
    if "request_goodput" in result:
        line("Request goodput (req/s)", result["request_goodput"])
        line("  objectives (ms)", " ".join(f"{k}:{v:g}" for k, v in spec.slos_ms.items()))
    line("Output token throughput (tok/s)", result["output_throughput"])
    line("Total token throughput (tok/s)", result["total_token_throughput"])
    for metric in spec.metrics:
        rule(METRIC_NAMES[metric].capitalize())
        name = metric.upper()
        line(f"Mean {name} (ms)", result[f"mean_{metric}_ms"])
        line(f"Median {name} (ms)", result[f"median_{metric}_ms"])
        for p in spec.percentiles:
            if p == 50:  # the median, just above
                continue
            key = percentile_key(p)
            line(f"{key.upper()} {name} (ms)", result[f"{key}_{metric}_ms"])
    if "server_idle_median" in result:
        rule("Server (Tandem's /metrics, every second)")
        line("Device idle, all streams busy: median", result["server_idle_median"])
        line("Device idle, all streams busy: max", result["server_idle_max"])
    if "later_ttft_p50_ms" in result:
        rule("Agent sessions")
        line("First-turn TTFT p50 (ms)", result["first_ttft_p50_ms"])
        line("Later-turn TTFT p50 (ms)", result["later_ttft_p50_ms"])
        line("Later-turn TTFT p90 (ms)", result["later_ttft_p90_ms"])
        share = result["cached_share"]
        line("Prompt tokens cached", f"{share:.1%}" if math.isfinite(share) else "unknown")
        line("Turns not of the answer length", result["short_turns"])
    print("=" * WIDTH)


def result_path(result: dict, args: argparse.Namespace) -> Path:
    """--result-dir/--result-filename, by default named as vLLM names its results."""
    name = args.result_filename
    if name is None:
        model = str(result["model_id"]).rstrip("/").split("/")[-1]
        name = (
            f"tandem-{result['api']}-{result['request_rate']}qps-concurrency"
            f"{result['max_concurrency']}-{model}-{result['date']}.json"
        )
    return Path(args.result_dir or ".") / name


def save_result(result: dict, args: argparse.Namespace) -> Path:
    path = result_path(result, args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(result), indent=2) + "\n")
    return path


def draw(results: Sequence[RequestResult], path: str | Path, title: str) -> None:
    """Three panels: TTFT's and ITL's distributions (ms), and output tokens/s with the requests
    in flight over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    itl = [gap * 1e3 for r in ok for gap in r.itls]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, values, name in (
        (left, ttft, "time to first token"),
        (middle, itl, "inter-token latency"),
    ):
        if values:
            ax.hist(values, bins=40, color="C0" if ax is left else "C1")
            for q, style in ((50, "-"), (99, "--")):
                ax.axvline(np.percentile(values, q), color="k", ls=style, lw=1, label=f"p{q}")
            ax.legend(fontsize=8)
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("requests" if ax is left else "gaps")
    if itl:
        middle.set_yscale("log")
    if results:
        t0 = min(r.start for r in results)
        end = max(r.end for r in results) - t0
        edges = np.linspace(0.0, max(end, 1e-3), 41)
        tokens = np.zeros(len(edges) - 1)
        for r in ok:  # a request's tokens spread over its chunks
            if r.chunk_times:
                times = np.asarray(r.chunk_times) - t0
                weights = np.full(len(times), r.completion_tokens / len(times))
                tokens += np.histogram(times, edges, weights=weights)[0]
        width = edges[1] - edges[0]
        right.plot(edges[:-1] + width / 2, tokens / width, color="C2", label="output tokens/s")
        right.set_xlabel("s since the first request")
        right.set_ylabel("output tokens/s")
        flight = right.twinx()
        moments = sorted([(r.start - t0, 1) for r in results] + [(r.end - t0, -1) for r in results])
        times, counts = zip(*moments, strict=True)
        flight.step(
            times,
            np.cumsum(counts),
            where="post",
            color="C3",
            alpha=0.6,
            label="requests in flight",
        )
        flight.set_ylabel("requests in flight")
        lines = right.get_lines() + flight.get_lines()
        right.legend(lines, [ln.get_label() for ln in lines], loc="best", fontsize=8)
    right.set_title("over the run")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
