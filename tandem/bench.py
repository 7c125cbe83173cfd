"""`tandem bench`: one workload, sync then async, in one process; device idle time side by side."""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tandem.config import EngineConfig
from tandem.engine import Engine
from tandem.metrics import RunSummary, StepRecord, plot_timeline, write_chrome_trace
from tandem.request import SamplingParams


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--prompt-len", type=int, default=128, help="mean prompt length (tokens)")
    g.add_argument("--output-len", type=int, default=128, help="mean output length (tokens)")
    g.add_argument("--len-spread", type=float, default=0.5,
                   help="lengths are uniform in mean * [1 - spread, 1 + spread]")  # fmt: skip
    g.add_argument("--arrivals", choices=("offline", "poisson"), default="offline",
                   help="offline: all at once; poisson: at --rate requests/s")  # fmt: skip
    g.add_argument("--rate", type=float, default=8.0, help="Poisson arrival rate (requests/s)")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy; else seeded sampling"
    )
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--modes", default="sync,async", help="which loops to run, in order")
    g.add_argument("--repeats", type=int, default=1,
                   help="run the modes this many times, interleaved; report each mode's median run")  # fmt: skip
    g.add_argument("--trace", help="write a Chrome/Perfetto trace (JSON) of both runs")
    g.add_argument("--plot", help="write a PNG timeline of both runs")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrival_times: list[float]  # seconds after start


def make_workload(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> Workload:
    rng = random.Random(args.workload_seed)

    def length(mean: int) -> int:
        lo, hi = (
            max(1, round(mean * (1 - args.len_spread))),
            max(1, round(mean * (1 + args.len_spread))),
        )
        return rng.randint(lo, hi)

    prompts, outputs, arrivals, t = [], [], [], 0.0
    for _ in range(args.num_requests):
        n_out = min(length(args.output_len), max_model_len - 1)
        n_in = min(length(args.prompt_len), max_model_len - n_out)
        prompts.append([rng.randrange(3, vocab_size) for _ in range(n_in)])
        outputs.append(n_out)
        if args.arrivals == "poisson":
            t += rng.expovariate(args.rate)
        arrivals.append(t)
    return Workload(prompts, outputs, arrivals)


def run_workload(
    engine: Engine, workload: Workload, temperature: float, progress: Progress | None, label: str
) -> tuple[RunSummary, list[StepRecord], list[list[int]]]:
    """Feed the workload by its arrival times; returns the summary, step records and outputs."""
    engine.reset_metrics()
    params = [
        SamplingParams(max_tokens=n, temperature=temperature, seed=i, ignore_eos=True)
        for i, n in enumerate(workload.output_lens)
    ]
    task = progress.add_task(label, total=len(params)) if progress else None
    outputs: dict[str, list[int]] = {}
    order = [f"{label}-{i}" for i in range(len(params))]
    start, next_i = time.perf_counter(), 0
    while next_i < len(params) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_i < len(params) and workload.arrival_times[next_i] <= now:
            engine.add_request(workload.prompts[next_i], params[next_i], order[next_i])
            next_i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, workload.arrival_times[next_i] - now))
            continue
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
                if progress:
                    progress.advance(task)
    return engine.summary(), list(engine.step_records), [outputs[r] for r in order]


def cpu_overlap_note(engine: Engine, results: dict) -> str | None:
    """On a CPU, say why async can or cannot beat sync here: the figures alone don't tell."""
    if engine.config.torch_device.type != "cpu" or not {"sync", "async"} <= results.keys():
        return None
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if threads < cores:
        return (
            f"note: {threads} compute thread(s) on {cores} cores: the host schedules step N+1 on "
            "a core of its own while step N computes, so async hides the host's time."
        )
    return (
        f"note: all {cores} cores compute, so the host's scheduling of step N+1 takes a core "
        "from the compute team, which then waits for it at its next barrier: on a CPU this "
        "cost is physical and async can at best break even here. Async wins where a core is "
        f"left to the host (--cpu-threads {max(1, cores - 1)}; Tandem picks that itself when "
        "it does not slow the step by more than the host's share) and on a GPU."
    )


def run_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    console = Console(stderr=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("sync", "async") for m in modes):
        raise ValueError(f"--modes takes sync and/or async, got {args.modes!r}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    engine = Engine(config)
    workload = make_workload(args, engine.spec.vocab_size, engine.max_model_len)
    warmup = Workload(workload.prompts[:4], [4] * min(4, len(workload.prompts)), [0.0] * 4)
    runs: dict[str, list[tuple[RunSummary, list[StepRecord], list[list[int]]]]] = {
        m: [] for m in modes
    }
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        for repeat in range(args.repeats):
            for mode in modes:
                engine.async_scheduling = mode == "async"
                run_workload(engine, warmup, args.temperature, None, f"warmup-{mode}")
                label = mode if args.repeats == 1 else f"{mode} #{repeat + 1}"
                runs[mode].append(run_workload(engine, workload, args.temperature, progress, label))
    engine.close()
    # Interleaved repeats and medians: a shared machine's noise is larger than the effect.
    results = {
        mode: sorted(r, key=lambda run: run[0].wall_s)[len(r) // 2] for mode, r in runs.items()
    }
    identical = all(run[2] == runs[modes[0]][0][2] for r in runs.values() for run in r)

    repeats = f", median of {args.repeats}" if args.repeats > 1 else ""
    table = Table(title=f"tandem bench: {len(workload.prompts)} requests, "
                  f"{engine.model_path.name}, {config.torch_device.type}{repeats}")  # fmt: skip
    table.add_column("metric")
    for mode in results:
        table.add_column(mode, justify="right")
    rows = [
        ("wall time (s)", "wall_s", "{:.3f}"),
        ("device busy %", "device_busy_pct", "{:.1f}"),
        ("device idle %", "device_idle_pct", "{:.1f}"),
        ("output tokens/s", "tokens_per_s", "{:.1f}"),
        ("steps", "steps", "{:d}"),
        ("TTFT p50 (ms)", "ttft_p50_ms", "{:.1f}"),
        ("TTFT p99 (ms)", "ttft_p99_ms", "{:.1f}"),
        ("ITL p50 (ms)", "itl_p50_ms", "{:.2f}"),
        ("ITL p99 (ms)", "itl_p99_ms", "{:.2f}"),
        ("host schedule / step (ms)", "host_schedule_ms", "{:.3f}"),
        ("host build / step (ms)", "host_build_ms", "{:.3f}"),
        ("host launch / step (ms)", "host_launch_ms", "{:.3f}"),
        ("host update / step (ms)", "host_update_ms", "{:.3f}"),
    ]
    stats = {mode: summary.as_dict() for mode, (summary, _, _) in results.items()}
    for label, key, fmt in rows:
        table.add_row(label, *(fmt.format(stats[m].get(key, 0)) for m in results))
    if "sync" in results and "async" in results:
        speedup = results["sync"][0].wall_s / results["async"][0].wall_s
        table.add_row("speedup (sync wall / async wall)", "", f"{speedup:.3f}x")
    table.add_row(
        "outputs identical (all runs)", *[""] * (len(results) - 1), "yes" if identical else "NO"
    )
    Console().print(table)
    Console().print(f"execution: {engine.execution.describe()}")
    note = cpu_overlap_note(engine, results)
    if note:
        Console().print(note)
    timelines = {mode: records for mode, (_, records, _) in results.items()}
    if args.trace:
        write_chrome_trace(timelines, args.trace)
        console.print(f"trace written to {args.trace}")
    if args.plot:
        plot_timeline(timelines, args.plot)
        console.print(f"timeline written to {args.plot}")
    return 0 if identical else 1
