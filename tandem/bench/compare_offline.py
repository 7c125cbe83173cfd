"""`tandem bench compare` offline: one seeded workload through each installed engine in turn,
one table.

The same local checkpoint, the same token-id prompts, the same number of output tokens per
request, greedy, EOS ignored, every request submitted at once (`--workload chat`: real questions
with EOS honoured, so each engine ends each answer where the model does). Engines (--engines;
default: every one installed): `tandem-async` and `tandem-sync` (one `tandem.LLM`, the loop
switched between runs), `hf` (transformers' `generate_batch`), `vllm` (its CPU build in its own
environment, through vllm_runner.py) and `llamacpp` (llama-server on --llamacpp-gguf). With
--repeats N the engines take turns, N rounds, and each row is the engine's median; the first
Tandem row is the reference the others' tokens are checked against.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from tandem.bench import peers_hf, peers_llama, peers_vllm
from tandem.bench.agent import common_prefix
from tandem.bench.compare_args import ENGINES
from tandem.bench.compare_engines import Engine, Run, TandemEngine, TandemShared
from tandem.bench.compare_report import Row, plot, print_table
from tandem.bench.compare_workload import (
    CHAT,
    MODEL_KINDS,
    WORKLOADS,
    Limits,
    Model,
    Workload,
    load_model_facts,
    make_limits,
    make_workload,
    resolve_bench_model,
)
from tandem.bench.machine import core_count, machine_info

T = TypeVar("T")
DEFAULTS = {
    "model": "small", "workload": "offline", "repeats": 1, "max_num_seqs": 256,
    "max_batch_tokens": 2048, "max_model_len": 2048, "dtype": "float32", "device": "cpu",
    "hf_page_size": 256, "vllm_start_timeout": 1200.0, "vllm_bind": "cores",
    "no_vllm_stream": False,
}  # fmt: skip


def start_engines(
    args: argparse.Namespace, model: Model, limits: Limits
) -> tuple[list[Engine], dict[str, str]]:
    """Starts each asked-for engine; a missing or failing one is named with why, never faked."""
    peers = {"hf": peers_hf, "vllm": peers_vllm, "llamacpp": peers_llama}
    engines: list[Engine] = []
    skipped: dict[str, str] = {}
    shared = None
    for name in args.engines:
        try:
            if name.startswith("tandem"):
                shared = shared or TandemShared(args, model, limits)
                engines.append(TandemEngine(name, shared))
                continue
            reason = peers[name].skip_reason(args, model)
            if reason is not None:
                skipped[name] = f"skipped: {reason}"
            else:
                engines.append(peers[name].start(args, model, limits))
        except Exception as exc:  # a failed start is reported; the other engines still run
            skipped[name] = f"failed to start: {type(exc).__name__}: {exc}"
        if name in skipped:
            print(f"{name}: {skipped[name]}", flush=True)
    for e in engines:
        print(f"{e.name}: {e.describe()}", flush=True)
    return engines, skipped


def resolve_offline_args(args: argparse.Namespace) -> None:
    """Fills in the offline defaults and checks the values (ValueError names the flag)."""
    for dest, value in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if args.from_json:
        if not args.plot:
            raise ValueError("--from needs --plot")
        return
    args.engines = args.engines or list(ENGINES)
    args.threads = args.threads or core_count()
    if args.tandem_threads in (None, "auto"):
        args.tandem_threads = None
    elif not args.tandem_threads.isdigit() or int(args.tandem_threads) < 1:
        raise ValueError("--tandem-threads must be auto or a positive number")
    else:
        args.tandem_threads = int(args.tandem_threads)
    if min(args.repeats, args.threads, args.max_num_seqs, args.max_batch_tokens) < 1:
        raise ValueError("--repeats, --threads, --max-num-seqs and --max-batch-tokens must be >= 1")
    args.prompt_range = None
    if args.prompt_lens:
        try:
            lo, hi = (int(x) for x in args.prompt_lens.split("-"))
        except ValueError:
            raise ValueError("--prompt-lens must look like MIN-MAX, e.g. 16-256") from None
        if not 1 <= lo <= hi:
            raise ValueError("--prompt-lens needs 1 <= MIN <= MAX")
        args.prompt_range = (lo, hi)
    for flag, value in (("--num-requests", args.num_requests), ("--output-len", args.output_len)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1")


def reference_engine(names: list[str]) -> str | None:
    """The engine every other's tokens are checked against: Tandem's async loop, else its sync."""
    return next((n for n in ("tandem-async", "tandem-sync") if n in names), None)


def p50_ms(values: list[float] | None) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def first_divergence(outputs: list[list[int]], reference: list[list[int]]) -> str | None:
    """Where the first mismatching request first differs: the step a numeric tie flipped."""
    for i, (a, b) in enumerate(zip(outputs, reference, strict=True)):
        if a != b:
            return f"request {i} first differs at output token {common_prefix(a, b)}"
    return None


def finish_counts(run: Run, work: Workload) -> tuple[int, int]:
    """(ended on EOS, reached output_len): as the engine reported, else read off the tokens
    (HF's outputs carry no reason; the EOS it stopped on is kept in them)."""
    eos = set(work.eos_ids or ())
    reasons = run.finish_reasons or [
        "stop" if o and o[-1] in eos else "length" for o in run.outputs
    ]
    return reasons.count("stop"), reasons.count("length")


def run_workload(
    work: Workload, engines: list[Engine], repeats: int, failed: dict[str, str]
) -> list[Row]:
    """Warm every engine, then `repeats` rounds with the engines taking turns (order rotated).
    An engine that fails is named in `failed` and leaves the table; the others go on."""
    live = [e for e in engines if e.name not in failed]

    def attempt(e: Engine, what: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except Exception as exc:  # any engine failure: reported, the engine leaves the table
            lines = str(exc).strip().splitlines() or [""]
            failed[e.name] = (
                f"failed on {work.name} ({what}): {type(exc).__name__}: {lines[0][:300]}"
            )
            print(f"{e.name}: {failed[e.name]}", flush=True)
            if len(lines) > 1:
                print("\n".join(lines[1:40]), file=sys.stderr)
            return None

    for e in live:
        attempt(e, "warm-up", lambda e=e: e.warm(work))
    runs: dict[str, list[Run]] = {e.name: [] for e in live}
    for r in range(repeats):
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for e in order:
            if e.name in failed:
                continue
            run = attempt(e, f"run {r + 1}", lambda e=e: e.run(work))
            if run is not None:
                runs[e.name].append(run)
                print(f"  {e.name}: {run.wall_s:.2f} s", file=sys.stderr, flush=True)
    extra = {
        e.name: attempt(e, "latency run", lambda e=e: e.latency(work))
        for e in live
        if e.name not in failed
    }
    ok = [e for e in live if e.name not in failed and runs[e.name]]
    ref = reference_engine([e.name for e in ok])
    reference = runs[ref][0].outputs if ref else None
    rows = [make_row(e, runs[e.name], extra.get(e.name), work, reference) for e in ok]
    vllm = next((r for r in rows if r.engine == "vllm"), None)
    for row in rows:
        row.vs_vllm = row.tokens_per_s / vllm.tokens_per_s if vllm else None
    return rows


def make_row(
    e: Engine, rs: list[Run], lat: Run | None, work: Workload, reference: list[list[int]] | None
) -> Row:
    """An engine's row: the median wall time, its first run's tokens checked against the
    reference's, TTFT and ITL from its timed runs or its separate streamed one."""
    walls = [r.wall_s for r in rs]
    outputs = rs[0].outputs
    if lat is not None:
        ttft, itl, source = lat.ttft_s, lat.itl_s, e.latency_from
        if lat.outputs != outputs:
            print(f"{e.name}: WARNING: its streamed run gave other tokens than its timed run")
    elif e.latency_from == "timed runs" and all(r.ttft_s is not None for r in rs):
        ttft = [t for r in rs for t in r.ttft_s]
        itl = [t for r in rs for t in (r.itl_s or [])]
        source = "timed runs"
    else:
        ttft = itl = None
        source = "n/a"
    wall = statistics.median(walls)
    tokens = sum(len(o) for o in outputs)
    stop, length = finish_counts(rs[0], work) if work.eos_ids is not None else (None, None)
    return Row(
        engine=e.name,
        wall_s=wall,
        walls_s=walls,
        output_tokens=tokens,
        tokens_per_s=tokens / wall if wall > 0 else float("nan"),
        ttft_p50_ms=p50_ms(ttft),
        itl_p50_ms=p50_ms(itl),
        latency_from=source,
        equal=None
        if reference is None
        else sum(a == b for a, b in zip(outputs, reference, strict=True)),
        requests=len(outputs),
        first_divergence=None if reference is None else first_divergence(outputs, reference),
        repeats_agree=all(r.outputs == outputs for r in rs),
        lengths_ok=work.lengths_ok(outputs),
        latency_run_wall_s=lat.wall_s if lat is not None else None,
        finished_stop=stop,
        finished_length=length,
        discarded=rs[0].discarded,
        label=e.label,
    )


def run_offline(args: argparse.Namespace) -> int:
    resolve_offline_args(args)
    if args.from_json:
        plot([json.loads(Path(f).read_text()) for f in args.from_json], args.plot)
        return 0
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    model = load_model_facts(args.model, resolve_bench_model(args.model))
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    max_len = min(args.max_model_len, model.max_positions)
    specs = {**WORKLOADS, CHAT.name: CHAT}
    workloads = [make_workload(args, specs[n], model, max_len) for n in names]
    limits = make_limits(args, model, workloads)
    machine = machine_info()
    print(
        f"machine: {machine['cpu']}, {machine['cpus_usable']} CPUs usable, "
        f"{machine['memory_gib']} GiB; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; threads: HF, vLLM, llama.cpp {args.threads}, Tandem "
        f"{args.tandem_threads or 'auto'}; load average "
        f"{machine['load_avg_at_start'][0]:.1f}\n"
        f"model: {model.describe()}, {args.dtype} on {args.device}"
        f"{f'; Tandem loads it as {args.tandem_model}' if args.tandem_model else ''}\n"
        f"limits (every engine): {limits.max_num_seqs} sequences and {limits.max_batch_tokens} "
        f"tokens per step, max_model_len {limits.max_model_len}; KV caches hold the whole "
        f"workload (no preemption); median of {args.repeats} timed run(s) after a warm-up",
        flush=True,
    )
    load = machine["load_avg_at_start"][0]
    if load > 0.5 * machine["cpus_usable"]:
        print(
            f"WARNING: the machine is busy (load average {load:.1f} on {machine['cpus_usable']} "
            "CPUs): every engine's numbers swing, and OpenMP engines whose threads wait at "
            "barriers (vLLM's pinned ones most) can be slowed many times over",
            flush=True,
        )
    engines, failed = start_engines(args, model, limits)
    skipped = dict(failed)
    described = {e.name: e.describe() for e in engines}
    results = []
    try:
        for work in workloads:
            print(f"\n{work.describe()}", flush=True)
            rows = run_workload(work, engines, args.repeats, failed)
            reference = reference_engine([r.engine for r in rows])
            print_table(rows, reference, chat=work.eos_ids is not None)
            print(f"load average now: {os.getloadavg()[0]:.1f}")
            results.append(
                {
                    "name": work.name,
                    "description": work.describe(),
                    "reference": reference,
                    "rows": [asdict(r) for r in rows],
                    "failed": {k: v for k, v in failed.items() if k not in skipped},
                    "load_avg_after": os.getloadavg(),
                }
            )
    finally:
        for e in engines:
            e.close()
    out: dict[str, Any] = {
        "machine": machine,
        "model": {
            "name": model.name,
            "path": str(model.path),
            "params": model.params,
            "head_dim": model.head_dim,
            "layers": model.num_layers,
            "kind": MODEL_KINDS.get(model.name, ""),
        },
        "settings": {
            "threads": args.threads,
            "tandem_threads": args.tandem_threads or "auto",
            "repeats": args.repeats,
            "dtype": args.dtype,
            "device": args.device,
            "limits": asdict(limits),
            "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        },
        "engines": described,
        "skipped": skipped,
        "workloads": results,
    }
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is KiB
    print(f"peak RSS of this process (Tandem and HF): {peak_gib:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        plot([out], args.plot)
    return 0
