"""`tandem bench compare --served`: one load, several OpenAI-compatible servers (`tandem serve`,
llama.cpp's `llama-server`, vLLM's), each started once on the same model.

Every server gets the same streamed requests (the same random prompts, greedy, EOS ignored so
each request generates exactly --max-tokens tokens) for each mode (chat, completions) and number
of concurrent streams, through `tandem bench serve`'s client (tandem.bench.serve.run_load). The
repeats are interleaved (repeat 1 of every server, then repeat 2, ...) and a server not being
measured is paused (SIGSTOP on its process group; --no-pause keeps it running). The table holds
medians over the repeats; the ratio lines pair the repeats, which keeps the machine's drift from
minute to minute out of them. While Tandem runs, its /metrics idle gauge is read every second;
"device idle" is the readings taken while every stream was busy. `--workload agent` replays
coding-agent sessions instead (tandem.bench.serve_agent). Which server runs what:
compare_served_plan.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.bench import launch
from tandem.bench.agent import AgentShape, AgentTexts
from tandem.bench.compare_served_plan import plan_servers, resolve_served_args
from tandem.bench.compare_served_report import agent_report, load_report
from tandem.bench.launch import Server
from tandem.bench.serve import LoadConfig, random_prompts, run_load
from tandem.bench.serve_agent import AgentCell, agent_shape, run_sessions, summarize
from tandem.bench.serve_client import Sampling

WARM_TOKENS = 8


@dataclass
class CellRun:
    """One repeat of one (server, mode, streams) cell: the client's figures and the gauge's."""

    tokens_per_s: float
    ttft_p50_ms: float = math.nan
    ttft_p90_ms: float = math.nan
    itl_p50_ms: float = math.nan
    itl_p90_ms: float = math.nan
    requests: int = 0
    completed: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    short_requests: int = 0  # completed without exactly max_tokens tokens
    idle_readings: list[float] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return self.requests - self.completed


async def run_cell(
    server: Server, mode: str, streams: int, num_requests: int, max_tokens: int,
    prompt_words: int, seed: str, timeout_s: float,
) -> CellRun:  # fmt: skip
    """Sends num_requests at once with at most `streams` in flight. The prompts depend on
    `seed` only, so every server gets the same ones."""
    config = LoadConfig(
        api=mode,
        sampling=Sampling(max_tokens=max_tokens),
        max_concurrency=streams,
        timeout_s=timeout_s,
        watch_idle=server.reads_idle_gauge,
    )
    run = await run_load(server.url, random_prompts(seed, num_requests, prompt_words), config)
    s = run.summary()
    ok = [r for r in run.results if r.ok]
    return CellRun(
        tokens_per_s=s["output_throughput"],
        ttft_p50_ms=s["median_ttft_ms"],
        ttft_p90_ms=s["p90_ttft_ms"],
        itl_p50_ms=s["median_itl_ms"],
        itl_p90_ms=s["p90_itl_ms"],
        requests=len(run.results),
        completed=len(ok),
        error_kinds=s["error_kinds"],
        short_requests=sum(r.completion_tokens != max_tokens for r in ok),
        idle_readings=run.steady_idle(),
    )


async def run_offline_cell(
    server: Server, mode: str, streams: int, num_requests: int, seed: str
) -> CellRun:
    """The cell's requests (the same prompts as the servers get for `seed`) through the offline
    engine in a fresh process; its model load and warm-up are outside the timed `generate`."""
    command = [*server.command, "--concurrency", str(streams), "--num-requests", str(num_requests)]
    command += ["--seed", seed] + (["--chat"] if mode == "chat" else [])
    out = await asyncio.to_thread(
        subprocess.run,
        command,
        capture_output=True,
        text=True,
        env={**os.environ, **server.env},
        cwd=tempfile.gettempdir(),  # not a checkout, so PYTHONPATH alone decides
    )
    if out.returncode != 0:
        raise RuntimeError(f"{server.name} failed: {out.stderr[-2000:]}")
    tokens_per_s = float(out.stdout.strip().splitlines()[-1])
    return CellRun(tokens_per_s, requests=num_requests, completed=num_requests)


async def warm(server: Server, args: argparse.Namespace) -> None:
    """A burst at the largest concurrency in each mode, so first-call costs (kernel selection,
    allocator growth, compiled shapes) fall outside the measured runs."""
    streams = max(args.concurrency)
    for mode in args.modes:
        run = await run_cell(server, mode, streams, streams, WARM_TOKENS, args.prompt_words,
                             "warm", 600)  # fmt: skip
        if run.errors:
            raise RuntimeError(f"warm-up errors: {run.error_kinds}")


async def start_all(
    args: argparse.Namespace,
    servers: list[Server],
    log_dir: Path,
    warm_up: Callable[[Server], Awaitable[None]],
) -> list[Server]:
    """Starts and warms each server (`warm_up(server)`); one that fails is named and left out.
    Each ready server is paused until its turn."""
    ready = []
    for server in servers:
        if server.offline:
            ready.append(server)
            continue
        try:
            await launch.start(server, args.start_timeout, log_dir)
            await warm_up(server)
        except Exception as exc:  # a server that cannot start or answer: reported, left out
            print(f"{server.name}: skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
            launch.stop(server)
            continue
        print(f"{server.name}: ready on {server.url}", file=sys.stderr, flush=True)
        for line in launch.execution_lines(server):  # what it chose: its compute threads above all
            print(f"{server.name}: {line}", file=sys.stderr, flush=True)
        pause(args, server)
        ready.append(server)
    return ready


def pause(args: argparse.Namespace, server: Server) -> None:
    if args.pause:
        launch.signal_group(server, signal.SIGSTOP)


def median(values: list[float]) -> float:
    clean = [v for v in values if v == v]  # drop NaN
    return statistics.median(clean) if clean else math.nan


def summarize_cell(runs: list[CellRun]) -> dict:
    idle = [v for run in runs for v in run.idle_readings]
    return {
        "output_tokens_per_s": median([r.tokens_per_s for r in runs]),
        "ttft_p50_ms": median([r.ttft_p50_ms for r in runs]),
        "ttft_p90_ms": median([r.ttft_p90_ms for r in runs]),
        "itl_p50_ms": median([r.itl_p50_ms for r in runs]),
        "itl_p90_ms": median([r.itl_p90_ms for r in runs]),
        "idle_max": max(idle) if idle else None,
        "idle_median": statistics.median(idle) if idle else None,
        "idle_readings": len(idle),
        "errors": sum(r.errors for r in runs),
        "short_requests": sum(r.short_requests for r in runs),
        "repeats": len(runs),
        "tokens_per_s_by_repeat": [r.tokens_per_s for r in runs],
        "itl_p50_ms_by_repeat": [r.itl_p50_ms for r in runs],
    }


async def load_benchmark(
    args: argparse.Namespace, servers: list[Server], log_dir: Path
) -> list[dict]:
    """The load workload: every cell of every server, repeats interleaved across servers."""
    ready = await start_all(args, servers, log_dir, lambda server: warm(server, args))
    runs: dict[tuple[str, str, int], list[CellRun]] = {}
    for repeat in range(args.repeats):
        for server in ready:
            launch.signal_group(server, signal.SIGCONT)
            for mode in args.modes:
                for streams in args.concurrency:
                    num_requests = args.num_requests or 4 * streams
                    seed = f"{args.seed}-{mode}-{streams}-{repeat}"
                    if server.offline:
                        run = await run_offline_cell(server, mode, streams, num_requests, seed)
                    else:
                        run = await run_cell(server, mode, streams, num_requests, args.output_len,
                                             args.prompt_words, seed, args.request_timeout)  # fmt: skip
                    runs.setdefault((server.name, mode, streams), []).append(run)
                    print(
                        f"repeat {repeat + 1}/{args.repeats} {server.name} {mode} x{streams}: "
                        f"{run.tokens_per_s:.1f} tok/s, TTFT p50 {run.ttft_p50_ms:.0f} ms, "
                        f"{run.completed}/{run.requests} ok",
                        file=sys.stderr,
                        flush=True,
                    )
            pause(args, server)
    return [
        {"server": s.name, "label": s.label, "mode": mode, "streams": streams,
         **summarize_cell(runs[(s.name, mode, streams)])}
        for s in ready
        for mode in args.modes
        for streams in args.concurrency
    ]  # fmt: skip


async def agent_benchmark(
    args: argparse.Namespace, servers: list[Server], log_dir: Path
) -> list[dict]:
    """--workload agent: every server warmed by one short session, then the sessions on each,
    repeats interleaved; each repeat's texts (its own tool set, so no run reuses an earlier
    run's cache) are every server's."""
    from tandem.models.loader import find_tokenizer

    shape = agent_shape(args)
    tokenizer = find_tokenizer(args.model)
    warm_shape = AgentShape(1, 2, 256, 64, WARM_TOKENS)
    warm_texts = AgentTexts(tokenizer, 256, 64, seed=-1)

    async def warm_up(server: Server) -> None:
        cell = await run_sessions(server.url, warm_texts, warm_shape, 600)
        if len(cell.ok) != warm_shape.turns:
            raise RuntimeError(f"warm-up failed: {[t.error for t in cell.turns]}")

    for server in servers:
        if server.offline:
            print(f"{server.name}: skipped: no offline run of the agent workload", file=sys.stderr)
    online = [s for s in servers if not s.offline]
    ready = await start_all(args, online, log_dir, warm_up)
    cells: dict[str, list[AgentCell]] = {s.name: [] for s in ready}
    for repeat in range(args.repeats):
        texts = AgentTexts(
            tokenizer, shape.head_len, shape.tool_result_len, args.seed + repeat, shape.task
        )
        for server in ready:
            launch.signal_group(server, signal.SIGCONT)
            cell = await run_sessions(server.url, texts, shape, args.request_timeout)
            cells[server.name].append(cell)
            print(
                f"repeat {repeat + 1}/{args.repeats} {server.name}: wall {cell.wall_s:.2f} s, "
                f"later TTFT p50 {cell.ttft_ms(True, 50):.0f} ms, "
                f"{len(cell.ok)}/{shape.sessions * shape.turns} turns ok",
                file=sys.stderr,
                flush=True,
            )
            pause(args, server)
    return [summarize(s.label, cells[s.name], shape) for s in ready]


def run_served(args: argparse.Namespace) -> int:
    resolve_served_args(args)
    servers, skipped = plan_servers(args)
    for line in skipped:
        print(line, file=sys.stderr)
    agent = args.workload == "agent"
    log_dir = Path(tempfile.mkdtemp(prefix="serve-compare-"))
    # SIGTERM as an exception, so that `finally` stops the servers; the handler is restored.
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread: signals cannot be caught here
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        run = agent_benchmark if agent else load_benchmark
        rows = asyncio.run(run(args, servers, log_dir))
    except KeyboardInterrupt:
        print("interrupted: no table, no plot", file=sys.stderr)
        return 130
    finally:
        for server in servers:
            launch.stop(server)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if not rows:
        print("no server ran", file=sys.stderr)
        return 1
    (agent_report if agent else load_report)(args, rows)
    return 0
