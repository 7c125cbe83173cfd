"""`tandem bench latency`: one batch at a time, as a user waiting on it sees the engine.

Where `tandem bench throughput` fills the engine, this sends `--batch-size` requests of
`--input-len` random tokens, waits until all have their `--output-len` tokens, and repeats:
the end-to-end latency of each batch, and per request its time to first token and the gaps
between its tokens. The loops take turns batch by batch on one engine, so both meet the same
machine; greedy, so their tokens must agree.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table

from tandem.bench.run import describe_model, run_workload
from tandem.bench.workloads import Workload
from tandem.config import EngineConfig
from tandem.engine.engine import Engine

PERCENTILES = (50, 90, 99)
COLUMNS = (("latency", "latency_s"), ("TTFT", "ttft_s"), ("ITL", "itl_s"))


@dataclass
class LoopLatencies:
    """One loop's timed batches."""

    latency_s: list[float] = field(default_factory=list)  # per batch: submit to last token
    ttft_s: list[float] = field(default_factory=list)  # per request
    itl_s: list[float] = field(default_factory=list)  # per gap between two tokens
    output_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)  # the first batch's tokens

    def percentiles(self) -> dict[str, dict[str, float]]:
        figures = {"latency_s": self.latency_s, "ttft_s": self.ttft_s, "itl_s": self.itl_s}
        return {
            name: {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}
            | {"mean": float(np.mean(values))}
            for name, values in figures.items()
            if values
        }

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / sum(self.latency_s) if self.latency_s else 0.0


def check_latency_args(args: argparse.Namespace) -> list[str]:
    """The loops asked for; a bad size is refused before the model loads."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("sync", "async") for m in modes) or len(set(modes)) < len(modes):
        raise ValueError(f"--modes takes sync and/or async, got {args.modes!r}")
    for flag in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    return modes


def latency_workload(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> Workload:
    if args.input_len + args.output_len > max_model_len:
        raise ValueError(
            f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the "
            f"context limit {max_model_len} (--max-model-len)"
        )
    rng = random.Random(args.workload_seed)
    prompts = [
        [rng.randrange(3, vocab_size) for _ in range(args.input_len)]
        for _ in range(args.batch_size)
    ]
    return Workload(prompts, [args.output_len] * args.batch_size, [0.0] * args.batch_size)


def time_loops(engine: Engine, workload: Workload, args: argparse.Namespace, modes: list[str]):
    """Every loop's batches, the loops taking turns, after their warm-up batches."""
    loops = {mode: LoopLatencies() for mode in modes}
    for i in range(args.num_iters_warmup + args.num_iters):
        for mode in modes if i % 2 == 0 else modes[::-1]:  # neither loop always goes first
            engine.configure(async_scheduling=mode == "async")
            run = run_workload(engine, workload, 0.0, None, f"{mode}-{i}")
            if i < args.num_iters_warmup:
                continue
            loop = loops[mode]
            loop.latency_s.append(run.summary.wall_s)
            loop.ttft_s.extend(run.summary.ttft_s)
            loop.itl_s.extend(run.summary.itl_s)
            loop.output_tokens += run.summary.output_tokens
            loop.outputs = loop.outputs or run.outputs
    return loops


def latency_table(loops: dict[str, LoopLatencies]) -> Table:
    table = Table(title="latency per batch, and per request (ms)")
    table.add_column("loop")
    for name, _ in COLUMNS:
        for p in PERCENTILES:
            table.add_column(f"{name} p{p}", justify="right")
    table.add_column("output tok/s", justify="right")
    for mode, loop in loops.items():
        figures = loop.percentiles()
        cells = [
            f"{1000 * figures[key][f'p{p}']:.1f}" if key in figures else "-"
            for _, key in COLUMNS
            for p in PERCENTILES
        ]
        table.add_row(mode, *cells, f"{loop.tokens_per_s:.1f}")
    return table


def run_latency_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    modes = check_latency_args(args)
    console = Console(stderr=True)
    engine = Engine(config)
    try:
        workload = latency_workload(args, engine.spec.vocab_size, engine.max_model_len)
        console.print(describe_model(engine))
        console.print(
            f"{args.num_iters} batches of {args.batch_size} x ({args.input_len} in, "
            f"{args.output_len} out) per loop, after {args.num_iters_warmup} warm-up"
        )
        loops = time_loops(engine, workload, args, modes)
    finally:
        engine.close()
    Console(width=150).print(latency_table(loops))  # its rows unwrapped
    same = len({json.dumps(loop.outputs) for loop in loops.values()}) == 1
    if len(loops) > 1:
        print(f"tokens equal across loops: {'yes' if same else 'NO'}")
    if args.output_json:
        report = {
            mode: {"latencies_s": loop.latency_s, **loop.percentiles()}
            | {"tokens_per_s": loop.tokens_per_s}
            for mode, loop in loops.items()
        }
        with open(args.output_json, "w") as f:
            json.dump(report | {"tokens_equal": same}, f, indent=2)
    return 0 if same else 1
