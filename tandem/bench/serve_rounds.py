"""`tandem bench serve --compare` and `--dashboard-ab`: the same load in several variants, round
after round, each round starting with the next variant so that no order favours one; medians
and ratios to the first variant. Through each API: what translating it costs the host. With the
server's /dashboard open in a headless Chromium: what a page watching the engines costs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np

from tandem.bench.serve import args_prompts, load_config, result_metadata, run_load
from tandem.bench.serve_metrics import MetricsSpec, finite

# Headless Chromium as the probe that tested the pages runs it: no background connections.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGE_OPEN = "+dashboard"


@contextlib.contextmanager
def dashboard_browser(url: str, chromium: str) -> Iterator[Callable[[bool], None]]:
    """The callable opens `url`/dashboard in a headless Chromium of its own (True), or closes it:
    the page polls and draws as it would on a screen until the browser is stopped."""
    browser: list[subprocess.Popen] = []
    profile = tempfile.TemporaryDirectory(prefix="tandem-dashboard-")

    def show(open_: bool) -> None:
        while browser:
            process = browser.pop()
            process.terminate()
            process.wait(10)
        if open_:
            flags = [*CHROMIUM_FLAGS, "--headless", f"--user-data-dir={profile.name}"]
            browser.append(
                subprocess.Popen(
                    [chromium, *flags, f"{url}/dashboard"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            time.sleep(3.0)  # started, the page loaded and polling, before the load begins

    try:
        yield show
    finally:
        show(False)
        profile.cleanup()


def run_rounds(args: argparse.Namespace, url: str, spec: MetricsSpec) -> int:
    """Every variant, --repeats rounds; a table of medians. 1 when a request failed."""
    apis = args.compare.split(",") if args.compare else [args.api]
    pages = (False, True) if args.dashboard_ab else (False,)
    names = [api + (PAGE_OPEN if page else "") for api in apis for page in pages]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    prompts = args_prompts(args)
    model = args.model
    with contextlib.ExitStack() as stack:
        show = (
            stack.enter_context(dashboard_browser(url, args.chromium))
            if args.dashboard_ab
            else None
        )
        for round_ in range(args.repeats):
            turn = round_ % len(names)
            for name in names[turn:] + names[:turn]:
                if show is not None:
                    show(name.endswith(PAGE_OPEN))
                run = asyncio.run(
                    run_load(url, prompts, load_config(args, name.removesuffix(PAGE_OPEN)))
                )
                model = run.model
                summary = run.summary(spec)
                runs[name].append(summary)
                print(
                    f"round {round_ + 1} {name:<21} {summary['output_throughput']:8.1f} tok/s, "
                    f"{summary['failed']} failed",
                    file=sys.stderr,
                )
    rows = [row(name, runs[name], runs[names[0]]) for name in names]
    if args.json or args.save_result:
        from tandem.bench.serve_report import save_result

        result = result_metadata(args, url, model or "") | {"compare": rows, "runs": runs}
        if args.save_result:
            print(f"result: {save_result(result, args)}", file=sys.stderr)
        if args.json:
            print(json.dumps(finite(result), indent=2))
            return 1 if any(r["failed"] for r in rows) else 0
    print_rows(rows)
    return 1 if any(r["failed"] for r in rows) else 0


def row(name: str, runs: list[dict], reference: list[dict]) -> dict:
    """One variant's medians over its rounds (device idle: the median over rounds of each
    run's median while every stream ran)."""
    rate = float(np.median([s["output_throughput"] for s in runs]))
    idle = [s.get("server_idle_median") for s in runs]
    return {
        "name": name,
        "output_throughput": rate,
        "ratio": rate / float(np.median([s["output_throughput"] for s in reference])),
        "median_ttft_ms": float(np.median([s["median_ttft_ms"] for s in runs]))
        if "median_ttft_ms" in runs[0]
        else float("nan"),
        "server_idle_median": float(np.median(idle)) if None not in idle else None,
        "failed": sum(s["failed"] for s in runs),
    }


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'api':<21} {'tok/s (median)':>15} {'ratio':>7} {'TTFT p50 ms':>12} "
        f"{'device idle':>12} {'failed':>7}"
    )
    for r in rows:
        idle = r["server_idle_median"]
        idle_text = f"{idle:.3f}" if idle is not None else "n/a"
        print(
            f"{r['name']:<21} {r['output_throughput']:15.1f} {r['ratio']:6.3f}x "
            f"{r['median_ttft_ms']:12.1f} {idle_text:>12} {r['failed']:7d}"
        )
