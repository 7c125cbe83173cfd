"""`tandem bench --workload batches`: for each B of --batch-sizes, B requests at once, every prompt
of --prompt-len tokens and every output of exactly --output-len: the prefill time, the decode
rate and the process's peak memory, beside llama.cpp's `llama-batched-bench` on the same GGUF.

Each batch size runs in a freshly spawned process that loads the model for it alone, so its peak
RSS is Tandem's own at that batch: not the bench's imports, not another batch's, not the writing
of a random GGUF. llama.cpp runs one process per batch and repeat too. Both engines' KV caches
hold just the B sequences. The decode rate counts the tokens returned after every request had
its first, over the time since (llama.cpp's S_TG); the prefill time is until then (its T_PP).
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tandem.bench.llama_cpp import default_bin_dir, find_llama_cpp, run_batched_bench
from tandem.bench.roofline import streaming_bandwidth
from tandem.bench.run import Run, describe_model, run_workload
from tandem.bench.workloads import make_batch_workload, parse_batch_sizes
from tandem.config import EngineConfig, usable_cores
from tandem.engine.engine import Engine
from tandem.models.catalog import checkpoint_path, is_gguf, resolve_model

GIB = 1024**3
RATIO = "Tandem/llama.cpp"


@dataclass(frozen=True)
class Shape:
    batch: int
    prompt_len: int
    output_len: int
    repeats: int
    seed: int


@dataclass(frozen=True)
class Measured:
    """One engine at one batch size: the medians of its repeats, and its peak RSS."""

    engine: str  # "Tandem" or "llama.cpp"
    batch: int
    threads: int
    prefill_s: float
    decode_tokens_per_s: float
    peak_rss: int  # bytes
    loaded_rss: int | None = None  # bytes, Tandem's peak once the model was loaded
    # Tandem at batch 1: the weights' bytes a token reads, and what the machine streams per
    # second in the same process (the decode rate's ceiling is their ratio)
    token_bytes: int | None = None
    streaming: float | None = None

    def stream_note(self) -> str | None:
        """How the decode rate compares with streaming a token's weights once."""
        if not self.token_bytes or not self.streaming:
            return None
        reached = self.token_bytes * self.decode_tokens_per_s
        return (
            f"Tandem at batch {self.batch}: a token reads {self.token_bytes / 1e6:.0f} MB of "
            f"weights (each sparse layer's top-k experts), {reached / 1e9:.1f} GB/s, "
            f"{reached / self.streaming:.0%} of the {self.streaming / 1e9:.1f} GB/s this machine "
            f"streamed in the same process: {self.streaming / reached:.2f}x the time to stream "
            "them once"
        )


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux counts KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def phases(run: Run) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of a run whose requests all arrived at once."""
    first = max(times[0] for times in run.token_times)
    later = [t for times in run.token_times for t in times if t > first]
    return max(run.summary.ttft_s), len(later) / (max(later) - first)


def batch_config(config: EngineConfig, shape: Shape) -> EngineConfig:
    """The engine of one batch size: B sequences at once and a KV cache of their blocks (one
    spare each), unless the flags fixed them."""
    length = shape.prompt_len + shape.output_len
    blocks = shape.batch * (-(-length // config.block_size) + 1)
    return replace(
        config,
        max_num_seqs=shape.batch,
        max_model_len=config.max_model_len or length,
        num_kv_blocks=config.num_kv_blocks or blocks,
    )


def tandem_batch(config: EngineConfig, shape: Shape) -> tuple[Measured, list[str]]:
    """One batch size in this (fresh) process: load, warm up, run the repeats. Returns the
    measurement and the lines that describe the model and its execution."""
    engine = Engine(batch_config(config, shape))
    try:
        loaded = peak_rss()
        workload = make_batch_workload(
            shape.batch, shape.prompt_len, shape.output_len, engine.spec.vocab_size, shape.seed
        )
        run_workload(engine, workload.warmup(shape.batch), 0.0, None, "warmup")
        runs = [
            phases(run_workload(engine, workload, 0.0, None, f"batch {shape.batch} #{i}"))
            for i in range(shape.repeats)
        ]
        threads = engine.execution.cpu_threads or torch.get_num_threads()
        model = engine.runner.model if shape.batch == 1 else None  # one request: exact bytes
        token_bytes = model.token_weight_bytes() if model is not None else None
        streaming = (
            streaming_bandwidth(engine.config.torch_device, threads) if model is not None else None
        )
        loop = "async" if engine.config.async_scheduling else "sync"
        notes = [
            describe_model(engine),
            f"execution: {engine.execution.describe()}; Tandem's loop: {loop}",
        ]
    finally:
        engine.close()
    prefill, decode = (statistics.median(values) for values in zip(*runs, strict=True))
    measured = Measured("Tandem", shape.batch, threads, prefill, decode, peak_rss(), loaded,
                        token_bytes, streaming)  # fmt: skip
    return measured, notes


def in_fresh_process(config: EngineConfig, shape: Shape) -> tuple[Measured, list[str]]:
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(tandem_batch, config, shape).result()


def llama_cpp_batch(bin_dir: Path, model: Path, shape: Shape, threads: int) -> Measured:
    runs = [
        run_batched_bench(bin_dir, model, shape.batch, shape.prompt_len, shape.output_len, threads)
        for _ in range(shape.repeats)
    ]
    return Measured(
        "llama.cpp",
        shape.batch,
        threads,
        statistics.median(r.prefill_s for r in runs),
        statistics.median(r.decode_tokens_per_s for r in runs),
        max(r.peak_rss for r in runs),
    )


def llama_cpp_for(option: str, model: Path) -> tuple[Path | None, str]:
    """(llama.cpp's binaries, or None; the note that says why not)."""
    bin_dir = find_llama_cpp(option)
    if not is_gguf(model):
        if option not in ("auto", "none"):
            raise ValueError(
                f"--llama-cpp runs a GGUF file; {model} is not one (try --random-gguf)"
            )
        return None, f"llama.cpp: not run ({model.name} is not a GGUF file)"
    if bin_dir is None:
        if option == "none":
            return None, "llama.cpp: not run (--llama-cpp none)"
        return None, (
            f"llama.cpp: not run (no llama-batched-bench in {default_bin_dir()}: build it with "
            "`bash benchmarks/setup_llama_server.sh build`, or give --llama-cpp DIR)"
        )
    return bin_dir, ""


def check_batches_args(args: argparse.Namespace, config: EngineConfig) -> list[int]:
    """The batch sizes; the flags refused before anything is loaded or written."""
    sizes = parse_batch_sizes(args.batch_sizes)
    if args.prompt_len < 1 or args.output_len < 2:
        raise ValueError("--prompt-len must be >= 1 and --output-len >= 2 (a token to decode)")
    if config.world_size > 1:
        raise ValueError(
            f"{args.workload} measures one process's memory: tensor and pipeline parallel size 1"
        )
    return sizes


def run_batches_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    sizes = check_batches_args(args, config)
    model = checkpoint_path(resolve_model(config.model))
    bin_dir, skipped = llama_cpp_for(args.llama_cpp, model)
    threads = config.cpu_threads or usable_cores()
    console = Console(stderr=True)
    results, described, notes = [], [], [skipped] if skipped else []
    for batch in sizes:
        shape = Shape(batch, args.prompt_len, args.output_len, args.repeats, args.workload_seed)
        console.print(f"batch {batch}: Tandem, in a fresh process")
        measured, described = in_fresh_process(config, shape)
        results.append(measured)
        if bin_dir is not None:
            console.print(f"batch {batch}: llama.cpp ({threads} threads)")
            results.append(llama_cpp_batch(bin_dir, model, shape, threads))
    Console(width=100).print(batches_table(args, model, results))  # its rows unwrapped
    if bin_dir is not None:
        notes.append(
            f"{RATIO}: Tandem's figure over llama.cpp's (prefill s and peak: below 1 is Tandem "
            "ahead; decode tok/s: above 1). loaded: Tandem's peak RSS once the model was "
            "loaded; peak: after the runs (llama.cpp's, the most of its runs)"
        )
    notes += [note for m in results if (note := m.stream_note())]
    for line in described + notes:
        Console().print(line)
    return 0


def batches_table(args: argparse.Namespace, model: Path, results: list[Measured]) -> Table:
    """Each batch's rows, Tandem's then llama.cpp's, and the ratio of the two where both ran."""
    size = model.stat().st_size if model.is_file() else None
    repeats = f", median of {args.repeats}" if args.repeats > 1 else ""
    file = f"{model.name} ({size / GIB:.2f} GiB)" if size else model.name
    table = Table(title=f"tandem bench: batches of {args.prompt_len}-token prompts x "
                  f"{args.output_len} output tokens, {file}{repeats}")  # fmt: skip
    for column in ("engine", "B", "threads", "prefill s", "decode tok/s", "loaded GiB",
                   "peak GiB", "peak/file"):  # fmt: skip
        table.add_column(column, justify="left" if column == "engine" else "right")

    def gib(n: int | None) -> str:
        return "-" if n is None else f"{n / GIB:.2f}"

    def ratio(ours: float, theirs: float) -> str:
        return f"{ours / theirs:.2f}x" if theirs else "-"

    for m in results:
        per_file = f"{m.peak_rss / size:.2f}" if size else "-"
        table.add_row(m.engine, str(m.batch), str(m.threads), f"{m.prefill_s:.3f}",
                      f"{m.decode_tokens_per_s:.1f}", gib(m.loaded_rss), gib(m.peak_rss),
                      per_file)  # fmt: skip
        ours = next((r for r in results if r.batch == m.batch and r.engine == "Tandem"), None)
        if m.engine == "llama.cpp" and ours is not None:
            table.add_row(RATIO, str(m.batch), "", ratio(ours.prefill_s, m.prefill_s),
                          ratio(ours.decode_tokens_per_s, m.decode_tokens_per_s), "",
                          ratio(ours.peak_rss, m.peak_rss), "", end_section=True)  # fmt: skip
    return table
