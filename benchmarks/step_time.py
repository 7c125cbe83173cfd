"""Decode step time against context length: Tandem's fast path and its portable (eager) path.

For each context length L, ``--batch`` requests with L-token prompts are prefilled and then
decode together; the engine's step records give the device time of the first ``--steps`` pure
decode steps (one new token for each of the ``--batch`` sequences, context about L); the median is
reported. The sync loop is used so that nothing else runs beside the step on the CPU; prefill is
not measured.

    python benchmarks/step_time.py                       # default model, batch 32, both paths
    python benchmarks/step_time.py --plot step_time.png --json step_time.json

The K/V bytes a step reads (batch x context x layers x 2 x KV heads x head_dim x element size)
are printed beside the times: at long contexts attention reads the whole cache every step. Each
path's `GB/s` is the rate at which its steps read K/V, from the shortest context to each longer
one (extra K/V bytes / extra step time: what attention's reading costs, the rest of the step
being the same), printed beside what this machine streams on one core and on all of them
(`x.sum()` over a buffer far larger than the caches).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.bench.compare_workload import load_model_facts, resolve_bench_model  # noqa: E402
from tandem.bench.machine import machine_info  # noqa: E402
from tandem.bench.roofline import STREAM_BYTES, streaming_bandwidth  # noqa: E402

BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default",
                   help="default (Tandem's built-in model), small, medium or a checkpoint folder")  # fmt: skip
    p.add_argument("--contexts", default="128,512,1024,2048,3072",
                   help="comma-separated context lengths (prompt tokens)")  # fmt: skip
    p.add_argument("--batch", type=int, default=32, help="sequences decoding together")
    p.add_argument("--steps", type=int, default=8, help="decode steps measured per context")
    p.add_argument("--paths", default="fast,eager",
                   help="fast: Tandem's default execution; eager: enforce_eager=True")  # fmt: skip
    p.add_argument("--threads", type=int,
                   help="Tandem's compute threads (default: Tandem's own choice, timed at start)")  # fmt: skip
    p.add_argument("--prefill-tokens", type=int, default=4096,
                   help="max_num_batched_tokens: prefill chunk size (not measured)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--plot", help="write a PNG: ms per decode step against context length")
    args = p.parse_args(argv)
    args.context_list = sorted({int(x) for x in args.contexts.split(",") if x.strip()})
    args.path_list = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not args.context_list or min(args.context_list) < 1:
        p.error("--contexts must be positive integers")
    if set(args.path_list) - {"fast", "eager"} or not args.path_list:
        p.error("--paths: fast and/or eager")
    if min(args.batch, args.steps, args.threads or 1) < 1:
        p.error("--batch, --steps and --threads must be >= 1")
    return args


def extra_tokens(args: argparse.Namespace, ctx: int) -> int:
    """Tokens a request may need: the decode steps measured, plus one per step of the others'
    prefill (a request that finishes its prefill early decodes while the rest still prefill)."""
    chunk = max(args.prefill_tokens, args.batch)
    return args.steps + math.ceil(args.batch * ctx / chunk) + 2


def measure(args: argparse.Namespace, model_path: Path, allowed: list[int], path: str) -> dict:
    """Median device time of the pure decode steps at each context length, on one engine.

    The requests are stepped by hand until ``--steps`` steps have decoded all ``--batch`` of them
    at once (one token each), then aborted: only those steps are measured.
    """
    longest = max(args.context_list) + extra_tokens(args, max(args.context_list))
    # A fresh process's default (one thread per core) for each engine: a thread count an earlier
    # engine chose would otherwise carry over to this one's device thread.
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    llm = LLM(
        str(model_path),
        enforce_eager=path == "eager",
        async_scheduling=False,
        block_size=BLOCK_SIZE,
        num_kv_blocks=args.batch * math.ceil(longest / BLOCK_SIZE) + 1,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(args.prefill_tokens, args.batch),
        max_model_len=longest,
        cpu_threads=args.threads,
        enable_prefix_caching=False,  # every prefill computed: the cache holds only these requests
    )
    engine = llm.engine
    rng = random.Random(args.seed)
    try:
        warm = [[rng.choice(allowed) for _ in range(16)] for _ in range(args.batch)]
        llm.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        points = []
        for ctx in args.context_list:
            params = SamplingParams(
                max_tokens=extra_tokens(args, ctx), temperature=0, ignore_eos=True
            )
            mark = engine.history.mark()
            start = time.perf_counter()
            ids = [
                engine.add_request([rng.choice(allowed) for _ in range(ctx)], params)
                for _ in range(args.batch)
            ]
            decode: list[float] = []
            while len(decode) < args.steps and engine.has_unfinished():
                engine.step()
                decode = [
                    s.device[1] - s.device[0]
                    for s in engine.history.steps(since=mark)
                    if s.num_seqs == args.batch and s.num_tokens == args.batch
                ]
            wall = time.perf_counter() - start
            for request_id in ids:
                engine.abort(request_id)
            while engine.has_unfinished():
                engine.step()
            if len(decode) < args.steps:
                raise RuntimeError(f"only {len(decode)} pure decode steps at context {ctx}")
            decode = decode[: args.steps]
            points.append(
                {
                    "context": ctx,
                    "ms_per_step": 1e3 * statistics.median(decode),
                    "ms_min": 1e3 * min(decode),
                    "decode_steps": len(decode),
                    "run_wall_s": wall,
                }
            )
            print(
                f"  {path:5s} context {ctx:5d}: {points[-1]['ms_per_step']:7.2f} ms per decode "
                f"step (median of {len(decode)}; prefill and all {wall:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
        return {
            "path": path,
            "execution": engine.execution.describe(),
            "threads": engine.execution.cpu_threads or torch.get_num_threads(),  # decode steps
            "points": points,
        }
    finally:
        llm.close()


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = {"fast": ("#c44e52", "fast path"), "eager": ("#4c72b0", "portable (enforce_eager)")}
    for run in result["runs"]:
        xs = [p["context"] for p in run["points"]]
        ys = [p["ms_per_step"] for p in run["points"]]
        color, label = styles[run["path"]]
        ax.plot(xs, ys, "o-", color=color, label=f"{label}, {run['threads']} thread(s)")
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel(f"ms per decode step (batch {result['batch']})")
    ax.set_ylim(bottom=0)
    kv = ax.twinx()
    xs = [p["context"] for p in result["runs"][0]["points"]]
    kv.plot(xs, [result["kv_bytes_per_token"] * result["batch"] * x / 2**20 for x in xs],
            "--", color="#888888", label="K/V read per step")  # fmt: skip
    kv.set_ylabel("K/V MiB read per step", color="#666666")
    kv.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = kv.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    m = result["machine"]
    ax.set_title(
        f"{result['model']}: decode step time; {m['cpu']}, {m['cpus_usable']} CPUs",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = load_model_facts(args.model, resolve_bench_model(args.model))
    kv_per_token = model.num_layers * 2 * model.num_kv_heads * model.head_dim * 4  # fp32
    print(
        f"model: {model.describe()}; batch {args.batch}, {args.steps} decode steps per "
        f"context, threads {args.threads or 'auto'}, sync loop; {platform.node()}",
        flush=True,
    )
    runs = [measure(args, model.path, model.allowed_ids, path) for path in args.path_list]
    cores = os.cpu_count() or 1
    stream = {n: streaming_bandwidth(torch.device("cpu"), n) / 1e9 for n in (1, cores)}
    print(
        f"this machine streams {stream[1]:.1f} GB/s on one core, {stream[cores]:.1f} GB/s on "
        f"{cores} (x.sum() over {STREAM_BYTES['cpu'] // 2**20} MiB, median of 7)"
    )
    header = f"{'context':>7}  {'K/V MiB/step':>12}" + "".join(
        f"  {r['path'] + ' ms':>9}  {r['path'] + ' GB/s':>10}" for r in runs
    )
    for r in runs:
        print(f"{r['path']}: {r['execution']}; the step ran on {r['threads']} thread(s)")
    print(header)
    print("-" * len(header))
    mibs = [kv_per_token * args.batch * ctx / 2**20 for ctx in args.context_list]
    for r in runs:  # K/V read rate from the shortest context to each longer one
        ms = [point["ms_per_step"] for point in r["points"]]
        for i, point in enumerate(r["points"]):
            extra_s = (ms[i] - ms[0]) / 1e3
            point["kv_gbs"] = (mibs[i] - mibs[0]) * 2**20 / extra_s / 1e9 if extra_s > 0 else None
    for i, ctx in enumerate(args.context_list):
        cells = ""
        for r in runs:
            gbs = r["points"][i]["kv_gbs"]
            cells += f"  {r['points'][i]['ms_per_step']:9.2f}  " + (
                f"{gbs:10.1f}" if gbs is not None else f"{'-':>10}"
            )
        print(f"{ctx:7d}  {mibs[i]:12.1f}{cells}")
    result = {
        "machine": machine_info(),
        "model": model.name,
        "model_path": str(model.path),
        "batch": args.batch,
        "steps": args.steps,
        "threads": args.threads,
        "kv_bytes_per_token": kv_per_token,
        "streaming_gbs": {str(k): v for k, v in stream.items()},
        "runs": runs,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
