"""One load, several OpenAI-compatible servers: `tandem serve`, llama.cpp's `llama-server`, vLLM.

Every server gets the same streamed requests (the same random prompts, greedy, EOS ignored so
each request generates exactly --max-tokens tokens) for each mode (chat, completions) and number
of concurrent streams, from the client in serve_load.py. Each server is started once, on the same
model: Tandem and vLLM on the fp32 Hugging Face folder from real_model.py, llama-server on the
F32 GGUF converted from that folder (and, with `llama-q8_0` in --servers, on a Q8_0 one).

What each server gets:
  tandem        python -m tandem serve --model DIR --port P [--tandem-args]: its defaults (the
                engine core picks its compute threads at start-up; the front end is unpinned)
  tandem-sync   the same with --no-async
  tandem-offline
                no server: each run is the same requests through `LLM.generate` in a fresh
                process (offline_same_load.py: the async loop, max_num_seqs = streams,
                --context as max_model_len), the figure the served throughput is held to;
                only output tok/s
  tandem-q8_0   the same on the Q8_0 GGUF, its blocks kept, with --int8-activations (llama.cpp's
                numerics: the pairing for llama-q8_0)
  llama-f32     llama-server -m F32.gguf -np MAX_STREAMS -c MAX_STREAMS*CONTEXT -t THREADS
                -tb THREADS [--llama-args]: THREADS defaults to one per core, like Tandem
  llama-q8_0    the same on the Q8_0 GGUF
  vllm          python -m vllm.entrypoints.openai.api_server --model DIR --max-model-len CONTEXT
                --max-num-seqs MAX_STREAMS [--vllm-args]: vLLM's own CPU defaults (threads bound by
                VLLM_CPU_OMP_THREADS_BIND, KV cache VLLM_CPU_KVCACHE_SPACE GiB, 4 unless set);
                skipped when vLLM is not installed

The repeats are interleaved: repeat 1 of every server, then repeat 2, and so on; a server that is
not being measured is paused (SIGSTOP on its process group) so its idle threads take no CPU from
the one that is (--no-pause keeps them running). The table holds the medians over the repeats;
the ratio lines under it pair the repeats (Tandem's figure over another server's in the same
repeat, median and range), which keeps this machine's drift from minute to minute out of them:
for a close comparison, many short repeats (`--num-requests` of one or two waves) beat a few
long ones.
While Tandem runs, its /metrics is read every second; "device idle" is the
tandem_device_idle_fraction gauge (every sample, whatever its labels) over the readings taken
while all streams were busy: after every stream of the first wave had its first token (plus the
gauge's ~1 s window), until the last request started. Every server process is stopped on exit,
Ctrl-C included.

`--workload agent` replays coding-agent sessions instead (serve_agent.py: a long shared head of
tool definitions, then turns that each add the answer the server gave and a tool result, each
turn sent when the previous answer is complete), --sessions at once, on one model file for
every server (--model; a GGUF, or a packaged short name such as smollm2-135m-instruct):
  tandem        as above; tandem-int8kv: with --kv-cache-dtype int8
  llama         llama-server -m GGUF -np SESSIONS -c SESSIONS*CONTEXT -t THREADS -tb THREADS
                (its prompt cache on, as by default); llama-q8kv: the same with
                --cache-type-k q8_0 --cache-type-v q8_0 -fa on
  vllm          as above, with --enable-prefix-caching, on --vllm-model (its CPU build runs no
                GGUF; for SmolLM2's, real_model.py's float32 folder of the same weights)
The table: first-turn TTFT p50, later turns' TTFT p50 and p90, wall time, output tok/s and the
share of prompt tokens served from a cache (where the server says), medians over the repeats;
each repeat's head names its own tool set, so no run reuses an earlier run's cache.

Setup, then a run (40-70 minutes on 2 cores with the defaults):
    bash benchmarks/setup_llama_server.sh
    python benchmarks/serve_compare.py --plot serving.png     # the table on stdout, and a picture
    python benchmarks/serve_compare.py --servers tandem,llama-f32,llama-q8_0 --repeats 1 \\
        --concurrency 8 --max-tokens 16 --plot /tmp/serving.png
    python benchmarks/serve_compare.py --workload agent --model smollm2-135m-instruct \\
        --servers tandem,llama,llama-q8kv --sessions 4 --turns 4 --head-len 4096 --plot agent.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.bench.agent import AGENT_OUTPUT_LEN, AGENT_SIZES, AGENT_TASKS, AgentShape, AgentTexts
from tandem.bench.ratios import paired_ratio
from tandem.models.catalog import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model  # noqa: E402
import serve_agent  # noqa: E402
import serve_load  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LLAMA_SERVER = Path.home() / ".cache" / "tandem" / "llama.cpp" / "bin" / "llama-server"
VLLM_VENV_PYTHON = REPO / ".venv-vllm-cpu" / "bin" / "python"
SERVER_NAMES = (
    "tandem", "tandem-sync", "tandem-offline", "tandem-q8_0", "tandem-int8kv", "llama-f32",
    "llama-q8_0", "llama", "llama-q8kv", "vllm",
)  # fmt: skip
LLAMA_Q8_KV = ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "-fa", "on"]
MODES = ("chat", "completions")


@dataclass
class Server:
    """One server to benchmark: how to start it and, once started, its process."""

    name: str
    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    reads_idle_gauge: bool = False
    offline: bool = False  # `command` runs once per cell and prints output tok/s, no server
    port: int = 0
    process: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class CellRun:
    """One repeat of one (server, mode, streams) cell: the client's summary and the gauge."""

    summary: dict
    ttft_p90_ms: float
    itl_p90_ms: float
    short_requests: int
    idle_readings: list[float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def core_count() -> int:
    return len(os.sched_getaffinity(0))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def find_vllm_python(requested: str | None) -> str | None:
    """This interpreter when it imports vLLM, else the repository's vLLM CPU environment
    (benchmarks/setup_vllm_cpu.sh), else None."""
    candidates = [requested] if requested else [sys.executable, str(VLLM_VENV_PYTHON)]
    for python in candidates:
        if not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", "import vllm"], capture_output=True)
        if probe.returncode == 0:
            return python
    return None


def tandem_env(args: argparse.Namespace) -> dict[str, str]:
    """The checkout whose package runs: --tandem-path ahead of any PYTHONPATH already set."""
    paths = [str(args.tandem_path), os.environ.get("PYTHONPATH")]
    return {"PYTHONPATH": os.pathsep.join(filter(None, paths))}


def plan_servers(args: argparse.Namespace) -> tuple[list[Server], list[str]]:
    """The servers asked for that can run here, and a line for each one skipped."""
    max_streams = max(args.concurrency)
    servers, skipped = [], []
    for name in args.servers:
        if name in ("tandem", "tandem-sync", "tandem-q8_0", "tandem-int8kv"):
            env = tandem_env(args)
            model = args.gguf_q8_0 if name == "tandem-q8_0" else args.model
            if not Path(model).exists():
                skipped.append(f"{name}: skipped: no {model} (run setup_llama_server.sh)")
                continue
            command = [sys.executable, "-m", "tandem", "serve", "--model", str(model)]
            command += ["--host", "127.0.0.1", "--port", "{port}", *shlex.split(args.tandem_args)]
            label = "tandem"
            if name == "tandem-sync":  # the synchronous loop: what the async one must beat
                command.append("--no-async")
                label = "tandem --no-async"
            if name == "tandem-q8_0":
                command.append("--int8-activations")
                label = "tandem Q8_0 int8 act."
            if name == "tandem-int8kv":
                command += ["--kv-cache-dtype", "int8"]
                label = "tandem int8 KV"
            servers.append(Server(name, label, command, env, reads_idle_gauge=True))
        elif name == "tandem-offline":
            env = tandem_env(args)
            command = [sys.executable, str(Path(__file__).with_name("offline_same_load.py"))]
            command += ["--model", str(args.model), "--max-tokens", str(args.max_tokens)]
            command += ["--prompt-words", str(args.prompt_words), "--max-model-len"]
            command += [str(args.context), "--one", "async"]
            servers.append(Server(name, "tandem offline", command, env, offline=True))
        elif name in ("llama-f32", "llama-q8_0", "llama", "llama-q8kv"):
            gguf = {"llama-f32": args.gguf_f32, "llama-q8_0": args.gguf_q8_0}.get(name, args.gguf)
            if not args.llama_server.is_file():
                skipped.append(
                    f"{name}: skipped: no {args.llama_server} (run setup_llama_server.sh)"
                )
                continue
            if not gguf.is_file():
                skipped.append(f"{name}: skipped: no {gguf} (run setup_llama_server.sh)")
                continue
            command = [str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1"]
            command += ["--port", "{port}", "-np", str(max_streams)]
            command += ["-c", str(max_streams * args.context)]
            command += ["-t", str(args.threads), "-tb", str(args.threads)]
            command += shlex.split(args.llama_args)
            label = "llama-server " + ("F32" if name == "llama-f32" else "Q8_0")
            if name in ("llama", "llama-q8kv"):
                label = "llama-server" + (" q8_0 KV" if name == "llama-q8kv" else "")
                command += LLAMA_Q8_KV if name == "llama-q8kv" else []
            servers.append(Server(name, label, command))
        elif name == "vllm":
            python = find_vllm_python(args.vllm_python)
            if python is None:
                skipped.append("vllm: skipped: vLLM is not installed (import vllm failed)")
                continue
            command = [
                python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(args.vllm_model or args.model),
            ]
            command += ["--host", "127.0.0.1", "--port", "{port}"]
            command += ["--max-model-len", str(args.context), "--max-num-seqs", str(max_streams)]
            command += ["--enable-prefix-caching"] if args.workload == "agent" else []
            command += shlex.split(args.vllm_args)
            env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
            env["VLLM_NO_USAGE_STATS"] = "1"
            servers.append(Server(name, "vLLM", command, env))
    return servers, skipped


async def start(server: Server, timeout_s: float, log_dir: Path) -> None:
    """Starts the server in its own process group (so it can be paused and stopped as one) and
    waits until /health says 200."""
    server.port = free_port()
    command = [part.replace("{port}", str(server.port)) for part in server.command]
    server.log_path = log_dir / f"{server.name}.log"
    print(f"{server.name}: starting: {shlex.join(command)}", file=sys.stderr)
    print(f"{server.name}: log: {server.log_path}", file=sys.stderr, flush=True)
    with server.log_path.open("w") as log:
        server.process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **server.env},
            cwd=log_dir,  # not the repository, so PYTHONPATH alone decides which tandem runs
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=server.url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(f"exited with {server.process.returncode}: {log_tail(server)}")
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"no 200 from /health within {timeout_s:.0f} s: {log_tail(server)}")


def log_lines(server: Server) -> list[str]:
    if server.log_path is None or not server.log_path.is_file():
        return []
    return server.log_path.read_text(errors="replace").splitlines()


def execution_lines(server: Server) -> list[str]:
    """Tandem's start-up report of how it executes (the line naming its compute threads)."""
    marker = "execution: "
    return [line.split(marker, 1)[1] for line in log_lines(server) if marker in line]


def log_tail(server: Server, lines: int = 15) -> str:
    tail = log_lines(server)[-lines:]
    return "\n" + "\n".join(tail) if tail else ""


def signal_group(server: Server, sig: signal.Signals) -> None:
    if server.process is not None and server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, sig)


def stop(server: Server) -> None:
    """SIGTERM to the whole process group (resumed first, in case it was paused), then SIGKILL
    for whatever is still there after a grace period."""
    if server.process is None:
        return
    signal_group(server, signal.SIGCONT)
    signal_group(server, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)  # stragglers in the group, if any
    server.process.wait()
    server.process = None


def request_body(model: str, mode: str, prompt: str, max_tokens: int) -> dict:
    """One streamed, greedy request that generates exactly max_tokens tokens: every server here
    takes `ignore_eos` (llama-server also reads `max_tokens` as its `n_predict`)."""
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if mode == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def run_cell(
    server: Server,
    mode: str,
    streams: int,
    num_requests: int,
    max_tokens: int,
    prompt_words: int,
    seed: str,
    timeout_s: float,
) -> CellRun:
    """Sends num_requests at once with at most `streams` in flight, through serve_load's client.
    The prompts depend on `seed` only, so every server gets the same ones."""
    rng = random.Random(seed)
    prompts = [serve_load.make_prompt(rng, prompt_words) for _ in range(num_requests)]
    api = serve_load.APIS["chat" if mode == "chat" else "completions"]
    readings: list[tuple[float, list[float]]] = []
    async with serve_load.session(server.url, streams, timeout_s) as client:
        model = await serve_load.first_model(client)
        gate = asyncio.Semaphore(streams)

        async def gated(body: dict) -> serve_load.Result:
            async with gate:
                return await serve_load.one_request(client, body, api)

        watcher = None
        if server.reads_idle_gauge:
            watcher = asyncio.create_task(serve_load.watch_idle_gauge(server.url, readings))
        start = time.perf_counter()
        bodies = [request_body(model, mode, p, max_tokens) for p in prompts]
        results = await asyncio.gather(*(gated(b) for b in bodies))
        wall = time.perf_counter() - start
        if watcher is not None:
            watcher.cancel()
    summary = serve_load.summarize(results, wall, model, {})
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    return CellRun(
        summary=summary,
        ttft_p90_ms=serve_load.pct(ttft, 90),
        itl_p90_ms=serve_load.pct(itl, 90),
        short_requests=sum(r.completion_tokens != max_tokens for r in ok),
        idle_readings=serve_load.steady_idle(results, readings, streams),
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
        cwd=tempfile.gettempdir(),  # not the repository, so PYTHONPATH alone decides
    )
    if out.returncode != 0:
        raise RuntimeError(f"{server.name} failed: {out.stderr[-2000:]}")
    nan = float("nan")
    summary = {
        "output_tokens_per_s": float(out.stdout.strip().splitlines()[-1]),
        "ttft_p50_ms": nan,
        "itl_p50_ms": nan,
        "errors": 0,
        "completed": num_requests,
        "requests": num_requests,
    }
    return CellRun(summary, nan, nan, short_requests=0, idle_readings=[])


async def warm(server: Server, args: argparse.Namespace) -> None:
    """A burst at the largest concurrency in each mode, so first-call costs (kernel selection,
    allocator growth, compiled shapes) fall outside the measured runs."""
    streams = max(args.concurrency)
    for mode in args.modes:
        run = await run_cell(server, mode, streams, streams, 8, args.prompt_words, "warm", 600)
        if run.summary["errors"]:
            raise RuntimeError(f"warm-up errors: {run.summary['error_kinds']}")


def median(values: list[float]) -> float:
    clean = [v for v in values if v == v]  # drop NaN
    return statistics.median(clean) if clean else float("nan")


def summarize_cell(runs: list[CellRun]) -> dict:
    idle = [v for run in runs for v in run.idle_readings]
    return {
        "output_tokens_per_s": median([r.summary["output_tokens_per_s"] for r in runs]),
        "ttft_p50_ms": median([r.summary["ttft_p50_ms"] for r in runs]),
        "ttft_p90_ms": median([r.ttft_p90_ms for r in runs]),
        "itl_p50_ms": median([r.summary["itl_p50_ms"] for r in runs]),
        "itl_p90_ms": median([r.itl_p90_ms for r in runs]),
        "idle_max": max(idle) if idle else None,
        "idle_median": statistics.median(idle) if idle else None,
        "idle_readings": len(idle),
        "errors": sum(r.summary["errors"] for r in runs),
        "short_requests": sum(r.short_requests for r in runs),
        "repeats": len(runs),
        "tokens_per_s_by_repeat": [r.summary["output_tokens_per_s"] for r in runs],
        "itl_p50_ms_by_repeat": [r.summary["itl_p50_ms"] for r in runs],
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| server | mode | streams | output tok/s | TTFT p50 (ms) | TTFT p90 (ms) "
        "| ITL p50 (ms) | ITL p90 (ms) | device idle max / median |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if row["idle_max"] is None:
            idle = "n/a" if row["server"] == "tandem" else ""
        else:
            idle = f"{row['idle_max']:.1%} / {row['idle_median']:.1%}"
        figures = [
            shown(row[key], digits)
            for key, digits in (("output_tokens_per_s", 1), ("ttft_p50_ms", 0), ("ttft_p90_ms", 0),
                                ("itl_p50_ms", 1), ("itl_p90_ms", 1))
        ]  # fmt: skip
        lines.append(
            f"| {row['label']} | {row['mode']} | {row['streams']} | {' | '.join(figures)} "
            f"| {idle} |"
        )
    return "\n".join(lines)


def shown(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "–"


def tandem_ratios(rows: list[dict]) -> list[str]:
    """`tandem` against every other row, cell by cell, paired by repeat: its output tok/s over
    theirs and its ITL p50 over theirs (the figures the targets are stated in: async over sync,
    served over offline, against llama-server)."""
    cells: dict[tuple[str, int], dict[str, dict]] = {(r["mode"], r["streams"]): {} for r in rows}
    for row in rows:
        cells[(row["mode"], row["streams"])][row["label"]] = row
    lines = []
    for (mode, streams), by_label in cells.items():
        ours = by_label.get("tandem")
        if ours is None:
            continue
        for label, theirs in by_label.items():
            if label == "tandem":
                continue
            parts = []
            for key, name in (("tokens_per_s_by_repeat", "output tok/s"),
                              ("itl_p50_ms_by_repeat", "ITL p50")):  # fmt: skip
                mid, low, high = paired_ratio(ours[key], theirs[key])
                if math.isfinite(mid):
                    parts.append(f"{name} {mid:.3f}x ({low:.2f}-{high:.2f})")
            if parts:
                lines.append(f"tandem / {label}, {mode} x{streams}: " + ", ".join(parts))
    return lines


def draw(rows: list[dict], path: Path, title: str) -> None:
    """Output tok/s (top) and TTFT p50 with a whisker to p90 (bottom), grouped by concurrency,
    one bar per server, one column per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib import ticker

    labels = list(dict.fromkeys(row["label"] for row in rows))
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    streams = sorted({row["streams"] for row in rows})
    cell = {(r["label"], r["mode"], r["streams"]): r for r in rows}
    fig, axes = plt.subplots(2, len(modes), figsize=(5.5 * len(modes), 7), squeeze=False)
    width = 0.8 / len(labels)
    # log bars need a common floor, or the axis starts at the shortest bar and hides it
    fastest = min((r["ttft_p50_ms"] for r in rows if r["ttft_p50_ms"] > 0), default=1.0)
    ttft_floor = 10 ** math.floor(math.log10(fastest))
    x = np.arange(len(streams))
    for column, mode in enumerate(modes):
        top, bottom = axes[0][column], axes[1][column]
        for i, label in enumerate(labels):
            found = [cell.get((label, mode, s)) for s in streams]
            offset = x + (i - (len(labels) - 1) / 2) * width
            tps = [r["output_tokens_per_s"] if r else np.nan for r in found]
            p50 = np.array([r["ttft_p50_ms"] if r else np.nan for r in found])
            p90 = np.array([r["ttft_p90_ms"] if r else np.nan for r in found])
            bars = top.bar(offset, tps, width, label=label, color=f"C{i}")
            top.bar_label(bars, fmt="%.0f", fontsize=7)
            whisker = [np.zeros_like(p50), np.clip(p90 - p50, 0, None)]
            bottom.bar(offset, p50, width, yerr=whisker, capsize=2, color=f"C{i}", label=label)
        top.set_title(f"{mode}: output tokens/s (higher is better)")
        bottom.set_title(f"{mode}: TTFT p50, whisker to p90 (ms, lower is better)")
        bottom.set_yscale("log")
        bottom.set_ylim(bottom=ttft_floor)
        bottom.yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
        bottom.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        bottom.yaxis.set_minor_formatter(ticker.NullFormatter())
        for ax in (top, bottom):
            ax.set_xticks(x, [str(s) for s in streams])
            ax.set_xlabel("concurrent streams")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def benchmark(args: argparse.Namespace, servers: list[Server], log_dir: Path) -> list[dict]:
    """Starts and warms every server, then runs the repeats interleaved across servers."""
    ready = []
    for server in servers:
        if server.offline:
            ready.append(server)
            continue
        try:
            await start(server, args.start_timeout, log_dir)
            await warm(server, args)
        except (RuntimeError, httpx.HTTPError) as exc:
            print(f"{server.name}: skipped: {exc}", file=sys.stderr)
            stop(server)
            continue
        print(f"{server.name}: ready on {server.url}", file=sys.stderr, flush=True)
        for line in execution_lines(server):  # what it chose: its compute threads above all
            print(f"{server.name}: {line}", file=sys.stderr, flush=True)
        if args.pause:
            signal_group(server, signal.SIGSTOP)
        ready.append(server)
    runs: dict[tuple[str, str, int], list[CellRun]] = {}
    for repeat in range(args.repeats):
        for server in ready:
            signal_group(server, signal.SIGCONT)
            for mode in args.modes:
                for streams in args.concurrency:
                    num_requests = args.num_requests or 4 * streams
                    seed = f"{args.seed}-{mode}-{streams}-{repeat}"
                    if server.offline:
                        run = await run_offline_cell(server, mode, streams, num_requests, seed)
                    else:
                        run = await run_cell(
                            server,
                            mode,
                            streams,
                            num_requests,
                            args.max_tokens,
                            args.prompt_words,
                            seed,
                            args.request_timeout,
                        )
                    runs.setdefault((server.name, mode, streams), []).append(run)
                    s = run.summary
                    print(
                        f"repeat {repeat + 1}/{args.repeats} {server.name} {mode} x{streams}: "
                        f"{s['output_tokens_per_s']:.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:.0f} ms"
                        f", {s['completed']}/{s['requests']} ok",
                        file=sys.stderr,
                        flush=True,
                    )
            if args.pause:
                signal_group(server, signal.SIGSTOP)
    rows = []
    for server in ready:
        for mode in args.modes:
            for streams in args.concurrency:
                cell = summarize_cell(runs[(server.name, mode, streams)])
                rows.append(
                    {
                        "server": server.name,
                        "label": server.label,
                        "mode": mode,
                        "streams": streams,
                        **cell,
                    }
                )
    return rows


async def agent_benchmark(
    args: argparse.Namespace, servers: list[Server], log_dir: Path
) -> list[dict]:
    """--workload agent: starts and warms every server (one short session), then runs the
    sessions on each, repeats interleaved; each repeat's texts (its own tool set) are every
    server's."""
    from tandem.models.loader import find_tokenizer

    shape = agent_shape(args)
    tokenizer = find_tokenizer(args.model)
    warm_shape = AgentShape(1, 2, 256, 64, 8)
    warm_texts = AgentTexts(tokenizer, 256, 64, seed=-1)
    ready = []
    for server in servers:
        if server.offline:
            print(f"{server.name}: skipped: no offline run of the agent workload", file=sys.stderr)
            continue
        try:
            await start(server, args.start_timeout, log_dir)
            warm = await serve_agent.run_sessions(server.url, warm_texts, warm_shape, 600)
            if len(warm.ok) != warm_shape.turns:
                raise RuntimeError(f"warm-up failed: {[t.error for t in warm.turns]}")
        except (RuntimeError, httpx.HTTPError) as exc:
            print(f"{server.name}: skipped: {exc}", file=sys.stderr)
            stop(server)
            continue
        print(f"{server.name}: ready on {server.url}", file=sys.stderr, flush=True)
        if args.pause:
            signal_group(server, signal.SIGSTOP)
        ready.append(server)
    cells: dict[str, list[serve_agent.AgentCell]] = {s.name: [] for s in ready}
    for repeat in range(args.repeats):
        texts = AgentTexts(
            tokenizer, shape.head_len, shape.tool_result_len, args.seed + repeat, shape.task
        )
        for server in ready:
            signal_group(server, signal.SIGCONT)
            cell = await serve_agent.run_sessions(server.url, texts, shape, args.request_timeout)
            cells[server.name].append(cell)
            print(
                f"repeat {repeat + 1}/{args.repeats} {server.name}: wall {cell.wall_s:.2f} s, "
                f"later TTFT p50 {cell.ttft_ms(True, 50):.0f} ms, "
                f"{len(cell.ok)}/{shape.sessions * shape.turns} turns ok",
                file=sys.stderr,
                flush=True,
            )
            if args.pause:
                signal_group(server, signal.SIGSTOP)
    return [serve_agent.summarize(s.label, cells[s.name], shape) for s in ready]


def agent_report(args: argparse.Namespace, rows: list[dict]) -> int:
    """--workload agent: the table, the ratios to Tandem's, and the picture."""
    shape = agent_shape(args)
    header = (
        f"{args.model.name}: {shape.sessions} agent sessions x {shape.turns} turns, a "
        f"~{shape.head_len}-token head, ~{shape.tool_result_len}-token tool results, "
        f"{shape.output_len}-token answers; {core_count()} cores of {cpu_name()}, "
        f"median of {args.repeats}"
    )
    print(f"\n{header}\n")
    print(serve_agent.markdown_table(rows))
    ours = next((r for r in rows if r["label"] == "tandem"), None)
    for row in rows:
        if ours is not None and row is not ours:
            parts = []
            for key, name in (("wall_s_by_repeat", "wall"),
                              ("later_ttft_p50_ms_by_repeat", "later TTFT p50")):  # fmt: skip
                mid, low, high = paired_ratio(ours[key], row[key])
                if math.isfinite(mid):
                    parts.append(f"{name} {mid:.3f}x ({low:.2f}-{high:.2f})")
            print(f"tandem / {row['label']}: " + ", ".join(parts))
        if row["failed_turns"] or row["short_turns"]:
            print(
                f"{row['label']}: {row['failed_turns']} turns failed, {row['short_turns']} "
                f"without exactly {shape.output_len} tokens"
            )
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=2, default=str))
    if args.plot is not None:
        serve_agent.draw(rows, args.plot, header)
        print(f"\nplot: {args.plot}", file=sys.stderr)
    return 0


def comma_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {choices}")
        return names

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--servers",
        type=comma_list(SERVER_NAMES),
        default=None,
        help=f"comma-separated, in run order, from {', '.join(SERVER_NAMES)} "
        "(default: tandem,tandem-sync,tandem-offline,llama-f32,vllm; agent: "
        "tandem,llama,llama-q8kv,vllm)",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=real_model.DEFAULT_OUTPUT,
        help="HF folder for Tandem and vLLM (default: real_model.py's, built if missing)",
    )
    p.add_argument("--gguf-f32", type=Path, help="default: MODEL-f32.gguf")
    p.add_argument("--gguf-q8_0", type=Path, help="default: MODEL-q8_0.gguf")
    p.add_argument(
        "--llama-server",
        type=Path,
        default=Path(os.environ.get("LLAMA_SERVER", LLAMA_SERVER)),
        help="the llama-server binary ($LLAMA_SERVER; default: setup_llama_server.sh's)",
    )
    p.add_argument(
        "--vllm-python", help="python that imports vllm (default: this one, else .venv-vllm-cpu)"
    )
    p.add_argument(
        "--tandem-path",
        type=Path,
        default=REPO,
        help="source tree whose tandem package is served (default: this checkout)",
    )
    p.add_argument(
        "--tandem-args", default="", help='extra `tandem serve` flags, e.g. "--no-async"'
    )
    p.add_argument("--llama-args", default="", help="extra llama-server flags")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    p.add_argument(
        "--threads",
        type=int,
        default=core_count(),
        help="llama-server -t/-tb (default: one per core, as Tandem's default)",
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens per stream: llama-server -c is this times the most streams; vLLM "
        "--max-model-len (default 1024; agent: a whole session's length)",
    )
    p.add_argument("--modes", type=comma_list(MODES), default=list(MODES), help="chat,completions")
    p.add_argument(
        "--concurrency",
        type=lambda t: [int(v) for v in t.split(",")],
        default=[1, 8, 32],
        help="comma-separated numbers of concurrent streams (default: 1,8,32)",
    )
    p.add_argument("--num-requests", type=int, default=0, help="per run (default: 4 x streams)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"output tokens of every request (default 64; agent: {AGENT_OUTPUT_LEN})",
    )
    p.add_argument("--prompt-words", type=int, default=32, help="words per random prompt")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the table has medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-pause",
        dest="pause",
        action="store_false",
        help="leave the servers not being measured running instead of SIGSTOPped",
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="s to wait for /health")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="per-request read timeout, s"
    )
    p.add_argument(
        "--plot",
        type=Path,
        help="a PNG of tok/s and TTFT per server, written at the end of the run",
    )
    p.add_argument("--json", type=Path, help="also write the table's rows as JSON here")
    p.add_argument(
        "--workload",
        choices=("load", "agent"),
        default="load",
        help="load: --concurrency streams of random prompts; agent: coding-agent sessions",
    )
    a = p.add_argument_group("agent workload (tandem bench --workload agent's shape)")
    a.add_argument("--gguf", type=Path, help="llama and llama-q8kv's file (default: --model)")
    a.add_argument("--vllm-model", type=Path,
                   help="vLLM's model folder, its CPU build running no GGUF (default, for the "
                   "packaged SmolLM2 GGUF: real_model.py's float32 folder of the same weights)")  # fmt: skip
    a.add_argument("--sessions", type=int, default=AGENT_SIZES["sessions"])
    a.add_argument("--turns", type=int, default=AGENT_SIZES["turns"])
    a.add_argument("--head-len", type=int, default=AGENT_SIZES["head_len"])
    a.add_argument("--tool-result-len", type=int, default=AGENT_SIZES["tool_result_len"])
    a.add_argument("--session-stagger", type=float, default=0.0, metavar="SECONDS")
    a.add_argument("--agent-task", choices=AGENT_TASKS, default="explain",
                   help="explain, or edit: each file read is to be repeated back with a line "
                   "changed (as tandem bench --agent-task)")  # fmt: skip
    args = p.parse_args(argv)
    agent = args.workload == "agent"
    if args.max_tokens is None:
        args.max_tokens = AGENT_OUTPUT_LEN if agent else 64
    if args.servers is None:
        args.servers = (
            ["tandem", "llama", "llama-q8kv", "vllm"]
            if agent
            else ["tandem", "tandem-sync", "tandem-offline", "llama-f32", "vllm"]
        )
    if agent:
        args.concurrency = [args.sessions]  # a slot per session
        if not args.model.exists():  # a packaged model's short name
            args.model = resolve_model(str(args.model))
        if args.vllm_model is None and args.model.name == real_model.GGUF_NAME:
            args.vllm_model = real_model.ensure_model()
    args.model = args.model.expanduser()
    args.gguf_f32 = args.gguf_f32 or Path(f"{args.model}-f32.gguf")
    args.gguf_q8_0 = args.gguf_q8_0 or Path(f"{args.model}-q8_0.gguf")
    if args.gguf is None:  # the same file as Tandem's where --model is one
        args.gguf = args.model if args.model.suffix == ".gguf" else args.gguf_f32
    if args.context is None:
        args.context = agent_shape(args).context() if agent else 1024
    return args


def agent_shape(args: argparse.Namespace) -> AgentShape:
    return AgentShape(
        args.sessions, args.turns, args.head_len, args.tool_result_len, args.max_tokens,
        args.session_stagger, args.agent_task,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model == real_model.DEFAULT_OUTPUT:
        real_model.ensure_model(args.model)
    servers, skipped = plan_servers(args)
    for line in skipped:
        print(line, file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the servers
    log_dir = Path(tempfile.mkdtemp(prefix="serve-compare-"))
    run = agent_benchmark if args.workload == "agent" else benchmark
    try:
        rows = asyncio.run(run(args, servers, log_dir))
    except KeyboardInterrupt:
        print("interrupted: no table, no plot", file=sys.stderr)
        return 130
    finally:
        for server in servers:
            stop(server)
    if not rows:
        print("no server ran", file=sys.stderr)
        return 1
    if args.workload == "agent":
        return agent_report(args, rows)
    header = (
        f"{args.model.name}, {args.max_tokens} output tokens per request, "
        f"{args.prompt_words}-word prompts, {core_count()} cores of {cpu_name()}, "
        f"median of {args.repeats}"
    )
    print(f"\n{header}\n")
    print(markdown_table(rows))
    print()
    print("\n".join(tandem_ratios(rows)))
    for row in rows:
        if row["errors"] or row["short_requests"]:
            print(
                f"\n{row['label']} {row['mode']} x{row['streams']}: {row['errors']} errors, "
                f"{row['short_requests']} requests without exactly {args.max_tokens} tokens"
            )
    if args.json:
        finite = [  # a figure a row does not have (offline TTFT) as null, not NaN
            {
                k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in row.items()
            }
            for row in rows
        ]
        args.json.write_text(json.dumps({"header": header, "rows": finite}, indent=2))
    if args.plot is not None:
        draw(rows, args.plot, header)
        print(f"\nplot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
