"""Seconds from nothing to serving: `tandem serve` until /health answers (and the CPU-seconds its
processes spent by then), and `LLM(model)` built in a fresh process (its imports apart), per
model; medians of fresh processes.

    python benchmarks/start_time.py [--models default,smollm2-135m-instruct,gemma3-270m]
        [--what serve,load] [--repeats 3] [--baseline DIR]

`--baseline DIR` alternates this checkout with another (`git worktree add DIR <commit>`), each
process run with its tree first on PYTHONPATH, and prints both medians and their ratio (the
baseline's time over this checkout's).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOAD = (
    "import time; from tandem import LLM; t = time.perf_counter(); "
    "llm = LLM({model}, max_model_len=512, kv_cache_memory_gib=0.05); "
    "print(time.perf_counter() - t); llm.close()"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) of the live processes in a process group, from /proc."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def serve_seconds(tree: Path, model: str | None) -> tuple[float, float]:
    """From the command's start until /health answers 200; and the CPU-seconds that took."""
    port = free_port()
    command = [sys.executable, "-m", "tandem", "serve", "--port", str(port)]
    command += ["--model", model] if model else []
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
        start_new_session=True,
    )  # fmt: skip
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {server.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    return time.perf_counter() - start, group_cpu_seconds(server.pid)
            except OSError:
                time.sleep(0.02)
    finally:
        server.terminate()
        server.wait(30)


def load_seconds(tree: Path, model: str | None) -> tuple[float, None]:
    """`LLM(model)`'s construction in a fresh process, as that process times it."""
    code = LOAD.format(model=repr(model))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd="/", check=True
    )
    return float(done.stdout.split()[-1]), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,smollm2-135m-instruct,gemma3-270m")
    parser.add_argument("--what", default="serve,load", help="serve, load or both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to alternate with")
    args = parser.parse_args()
    trees = [ROOT] if args.baseline is None else [args.baseline.resolve(), ROOT]
    timers = {"serve": serve_seconds, "load": load_seconds}
    times: dict[tuple[str, str, Path], list[tuple[float, float | None]]] = {}
    for _ in range(args.repeats):
        for what in args.what.split(","):
            for model in args.models.split(","):
                for tree in trees:
                    name = None if model == "default" else model
                    times.setdefault((what, model, tree), []).append(timers[what](tree, name))
    for what in args.what.split(","):
        for model in args.models.split(","):
            runs = [times[what, model, tree] for tree in trees]
            medians = [statistics.median(wall for wall, _ in r) for r in runs]
            line = f"{what:5} {model:24}" + "".join(f" {m:7.2f} s" for m in medians)
            if what == "serve":
                cpu = [statistics.median(c for _, c in r) for r in runs]
                line += "  CPU" + "".join(f" {c:6.2f} s" for c in cpu)
            if len(trees) == 2:
                line += f"   baseline / this {medians[0] / medians[1]:.2f}x"
                if what == "serve":
                    line += f" (CPU {cpu[0] / cpu[1]:.2f}x)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
