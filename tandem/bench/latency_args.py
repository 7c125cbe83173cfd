"""The `tandem bench latency` flags (vLLM's `bench latency` names), apart from the benchmark so
that building the command line imports no engine."""

from __future__ import annotations

import argparse


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("latency")
    g.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    g.add_argument("--batch-size", type=int, default=1, help="requests sent at once")
    g.add_argument("--num-iters-warmup", type=int, default=2, help="batches before timing")
    g.add_argument("--num-iters", type=int, default=10,
                   help="timed batches per loop, the loops taking turns")  # fmt: skip
    g.add_argument("--modes", default="sync,async", help="the loops to time: sync and/or async")
    g.add_argument("--workload-seed", type=int, default=0, help="seeds the random prompts")
    g.add_argument("--output-json", default=None, metavar="PATH",
                   help="also write the latencies (every iteration's, and percentiles) here")  # fmt: skip
