"""`tandem bench`: one workload, sync then async, in one process; device idle time side by side.

`--workload shared-prefix` gives many requests over a few long system prompts and runs each loop
with prefix caching off and on: prefill tokens computed and saved, and throughput, side by side.
Every run starts with a cold prefix cache. `--workload llama8b-32x8k` is the experiment of
transformers' blog on asynchronous batching (32 requests at once, short prompts, long
generations): on CUDA on the 8B-shaped dummy model, on a CPU scaled down. `--workload chat` sends
real questions through the model's chat template and lets each answer end at the model's EOS, the
case the asynchronous loop speculates against: the report counts the tokens it discarded.
`--workload copy` asks for a shipped passage back, the case speculative decoding's drafts suit.
`--speculative-config` runs the workload with speculation off, as n-gram drafts, and with the
draft model when the config names one (each in every loop, switched by `Engine.configure`, one
engine): draft and accepted tokens, and tokens/s against speculation off.
`--workload json` runs the random workload with 0%, 25% and 100% of its requests under a shipped
JSON schema (`--json-fractions`): throughput, device idle, the bitmask's host time and the
device's wait for it, and the plain requests' ITL beside those of the unconstrained run.
`--profile` adds what a decode step must read (weights and KV) and the share of the device's
bandwidth its steps reached (`roofline.py`), and on CUDA the kernel-level idle figure of a window
of each run and the kernels the device idles before (`kernel_profile.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from tandem.bench.agent import AGENT_PRESET
from tandem.bench.agent_report import run_agent_bench
from tandem.bench.batches import check_batches_args, run_batches_bench
from tandem.bench.kernel_profile import (
    LONG_GAP_S,
    KernelProfiler,
    KernelWindow,
    shares_per_step,
)
from tandem.bench.lora import LORA_PRESET, parse_counts, parse_targets, random_adapters, spread
from tandem.bench.random_gguf import cached_random_gguf, config_folder
from tandem.bench.ratios import paired_ratio
from tandem.bench.roofline import Roofline, ceilings, decode_roofline
from tandem.bench.run import Run, describe_model, progress_bars, run_workload
from tandem.bench.workloads import (
    BATCHES_PRESET,
    BLOG_PRESET,
    CHAT_PRESET,
    COPY_JSON_PRESET,
    COPY_PRESET,
    JSON_PRESET,
    JSON_SCHEMA,
    Workload,
    constrain,
    json_schema_spec,
    make_chat_workload,
    make_copy_workload,
    make_workload,
    parse_json_fractions,
    profile_window,
    resolve_workload,
)
from tandem.config import EngineConfig, SpeculativeConfig, usable_cores
from tandem.engine.engine import Engine
from tandem.engine.grammar import GrammarCompiler, tokenizer_info
from tandem.lora import LoRARequest
from tandem.metrics import plot_timeline, write_chrome_trace
from tandem.models.catalog import DEFAULT_THINKING, cache_root
from tandem.request import StructuredOutputsParams


def add_kernel_rows(table: Table, windows: list[KernelWindow | None]) -> None:
    """--profile: the kernel-level idle figure of each run's window, and what it covers."""

    def cell(window: KernelWindow | None, text) -> str:
        if window is None:
            return "not reached"  # the run ended before its window
        return text(window) if window.kernels else "no kernels recorded"

    table.add_row(
        "device idle % (kernels)", *(cell(w, lambda w: f"{w.idle_pct:.2f}") for w in windows)
    )
    table.add_row(
        f"... less gaps over {LONG_GAP_S * 1e6:.0f} us (count, ms)",
        *(cell(w, lambda w: f"{w.boundary_idle_pct:.2f} ({w.long_gaps}, {w.long_gap_s * 1e3:.1f})")
          for w in windows),
    )  # fmt: skip
    table.add_row(
        "kernels per step",
        *(cell(w, lambda w: f"{w.kernels / max(1, w.steps):.0f}") for w in windows),
    )
    table.add_row(
        "kernel window: steps, kernels, ms",
        *(cell(w, lambda w: f"{w.steps}, {w.kernels}, {w.wall_s * 1e3:.0f}") for w in windows),
    )
    table.add_row(
        "profiler pause (ms, in wall)",
        *(cell(w, lambda w: f"{w.pause_s * 1e3:.0f}") for w in windows),
    )


def kernel_share_table(name: str, window: KernelWindow, top: int = 12) -> Table:
    """--profile: the kernels that end the most idle in one run's window, per step."""
    idle_us = max(window.wall_s - window.busy_s, 1e-12) * 1e6 / max(window.measured_steps, 1e-9)
    table = Table(title=f"{name}: the kernels the device idles before (per step)")
    for column in ("kernel", "launches", "busy (us)", "idle before (us)", "of the idle %"):
        table.add_column(column, justify="left" if column == "kernel" else "right")
    for share in shares_per_step(window, top):
        table.add_row(
            share["kernel"], f"{share['launches']:.1f}", f"{share['busy_us']:.1f}",
            f"{share['idle_before_us']:.2f}", f"{100 * share['idle_before_us'] / idle_us:.1f}",
        )  # fmt: skip
    return table


def add_roofline_rows(
    table: Table, rooflines: list[Roofline | None], streaming: float, nominal: float | None
) -> None:
    """--profile: what each run's decode steps read, and the share of bandwidth they reached."""

    def cell(roofline: Roofline | None, text) -> str:
        return "no decode steps" if roofline is None else text(roofline)

    def share(fraction: float | None) -> str:
        return "" if fraction is None else f"{100 * fraction:.1f}"

    table.add_row(
        "decode step reads (MB): weights + KV",
        *(cell(r, lambda r: f"{r.weight_bytes / 1e6:.1f} + {r.kv_bytes / 1e6:.1f}")
          for r in rooflines),
    )  # fmt: skip
    table.add_row(
        "decode step on the device (ms)",
        *(cell(r, lambda r: f"{r.device_s * 1e3:.3f} ({r.steps} steps)") for r in rooflines),
    )
    table.add_row(
        "bandwidth reached (GB/s)",
        *(cell(r, lambda r: f"{r.reached_bytes_per_s / 1e9:.1f}") for r in rooflines),
    )
    table.add_row(
        f"% of streaming read ({streaming / 1e9:.1f} GB/s)",
        *(cell(r, lambda r: share(r.fraction_of(streaming))) for r in rooflines),
    )
    if nominal is not None:
        table.add_row(
            f"% of nominal bandwidth ({nominal / 1e9:.0f} GB/s)",
            *(cell(r, lambda r: share(r.fraction_of(nominal))) for r in rooflines),
        )


def thinking_of(args: argparse.Namespace, engine: Engine) -> tuple[int, int] | None:
    """--thinking-budget's (start tag, budget), or None; refused for a model without a
    reasoning parser."""
    if args.thinking_budget is None:
        return None
    if engine.reasoning is None:
        raise ValueError(
            f"--thinking-budget needs a reasoning model: {engine.model_path} has no reasoning "
            f"parser (its chat template writes no <think>); try --model {DEFAULT_THINKING}"
        )
    return engine.reasoning.start, args.thinking_budget


def bench_workload(args: argparse.Namespace, engine: Engine) -> Workload:
    """The chat workload needs the model's tokenizer, copy uses it where there is one; the
    others need only the vocabulary size."""
    tokenizer, where = engine.tokenizer, str(engine.model_path)
    if args.workload == CHAT_PRESET:
        return make_chat_workload(args, tokenizer, engine.max_model_len, where)
    if args.workload in (COPY_PRESET, COPY_JSON_PRESET):
        vocab = engine.spec.vocab_size
        return make_copy_workload(args, tokenizer, vocab, engine.max_model_len, where)
    return make_workload(args, engine.spec.vocab_size, engine.max_model_len)


def add_finish_rows(table: Table, runs: list[Run]) -> None:
    """Workloads that end on EOS: how requests ended, and what the async loop's speculation
    that none would cost (tokens computed for a request already finished, and steps of such
    requests alone, skipped; see RunSummary)."""
    table.add_row(
        "requests finished by stop / length",
        *(f"{r.finished_by('stop')} / {r.finished_by('length')}" for r in runs),
    )

    def discarded(run: Run) -> str:
        total = run.summary.discarded_tokens
        return f"{total} ({total / max(1, len(run.finish_reasons)):.2f} / request)"

    table.add_row("speculative tokens discarded", *(discarded(r) for r in runs))
    table.add_row(
        "steps skipped (their requests had stopped)", *(str(r.summary.skipped_steps) for r in runs)
    )


def compute_layout(engine: Engine) -> tuple[int, int]:
    """(processes that compute, compute threads in each) of decode steps."""
    execution = engine.execution
    threads = execution.cpu_threads or torch.get_num_threads()
    return execution.tensor_parallel_size * execution.pipeline_parallel_size, threads


def layout_text(engine: Engine) -> str:
    processes, threads = compute_layout(engine)
    if engine.config.torch_device.type != "cpu":
        return f"{processes} process(es), 1 GPU each" if processes > 1 else "1 process, 1 GPU"
    if processes == 1:
        return f"1 process x {threads} thread(s)"
    return f"engine + {processes} ranks x {threads} thread(s)"


def cpu_overlap_note(engine: Engine, columns: Collection[str]) -> str | None:
    """On a CPU, say why async can or cannot beat sync here: the figures alone don't tell.
    `columns`: what the report compares (a note only where both loops are among them)."""
    if engine.config.torch_device.type != "cpu" or not {"sync", "async"} <= set(columns):
        return None
    processes, threads_each = compute_layout(engine)
    threads = processes * threads_each
    cores = usable_cores()
    if threads < cores:
        return (
            f"note: {threads} compute thread(s) on {cores} cores: the host schedules step N+1 on "
            "a core of its own while step N computes, so async hides the host's time. (Decode "
            "attention that reads 1 MiB of K or more per layer spreads over every core: at long "
            "contexts the host shares a core with it, and async gains less.)"
        )
    if processes > 1:
        return (
            f"note: {processes} ranks x {threads_each} thread(s) compute on {cores} cores, so the "
            "engine's scheduling of step N+1 takes a core from a rank, and the other ranks wait "
            "for it at the next all-reduce: on a CPU this cost is physical and async can at best "
            "break even here. Async wins where the ranks leave the host a core, and on GPUs."
        )
    return (
        f"note: all {cores} cores compute, so the host's scheduling of step N+1 takes a core "
        "from the compute team, which then waits for it at its next barrier: on a CPU this "
        "cost is physical and async can at best break even here. Async wins where a core is "
        f"left to the host (--cpu-threads {max(1, cores - 1)}; Tandem picks that itself when "
        "it does not slow the step by more than the host's share) and on a GPU."
    )


@dataclass(frozen=True, eq=False)
class Variant:
    """A version of the workload that every mode runs, one column per mode: the plain workload,
    prefix caching off or on (shared-prefix), a share of its requests under a JSON schema
    (json), or speculative decoding off, n-gram or draft model (--speculative-config). Runs of
    one `group` feed the same requests, so their outputs must be identical."""

    label: str  # the column's name, "{mode}" standing for the loop
    workload: Workload
    caching: bool  # enable_prefix_caching
    group: str = ""
    json_percent: int | None = None  # json: the share of constrained requests
    speculative: SpeculativeConfig | None = None  # the engine's speculation in this variant
    speculation: str = ""  # --speculative-config's variants: "off", "ngram", "suffix", "draft"
    thinking: bool = False  # json: the constrained requests think first (--thinking-budget)

    def column(self, mode: str) -> str:
        return self.label.format(mode=mode)

    def unconstrained(self) -> list[int]:
        """The requests (indices) under no grammar."""
        return [i for i in range(len(self.workload.prompts)) if self.workload.constraint(i) is None]


@dataclass(frozen=True)
class Column:
    name: str
    mode: str  # "sync" or "async"
    variant: Variant


def speculation_variants(
    workload: Workload, caching: bool, given: SpeculativeConfig
) -> list[Variant]:
    """Speculation off and `given` (ngram or suffix); a draft model's runs beside n-gram drafts
    of its draft length. Outputs, greedy or seeded, are the same whatever drafts them: one
    group."""
    named = [("off", None), (given.method, given)]
    if given.method == "draft_model":
        ngram = SpeculativeConfig(
            num_speculative_tokens=given.num_speculative_tokens, adaptive=given.adaptive
        )
        named[1:] = [("ngram", ngram), ("draft", given)]
    return [
        Variant(
            f"{name}, {{mode}}",
            workload,
            caching,
            "spec",
            speculative=spec,
            speculation=name,
        )
        for name, spec in named
    ]


def bench_columns(
    args: argparse.Namespace,
    caching: bool,
    workload: Workload,
    modes: list[str],
    speculative: SpeculativeConfig | None = None,
    thinking: tuple[int, int] | None = None,
    adapters: list[LoRARequest] | None = None,
) -> list[Column]:
    """The runs of one repeat, in order, one column each. `speculative`: the engine's config;
    shared-prefix and json run under it, the other workloads compare it with speculation off.
    `thinking` (start tag, budget): json's constrained requests think first. `adapters`: the
    lora workload's, spread over its requests in each count's runs."""
    if args.workload == LORA_PRESET:  # sync and async of one count side by side
        n = len(workload.prompts)
        variants = [
            Variant(f"{count} adapters, {{mode}}", replace(workload, loras=spread(adapters, count,
                    n)), caching, f"lora{count}")
            for count in parse_counts(args.lora_counts)
        ]  # fmt: skip
        return [Column(v.column(m), m, v) for v in variants for m in modes]
    if args.workload == "shared-prefix" and caching:  # caching off, then on, in each mode
        variants = [
            Variant(f"{{mode}}, cache {name}", workload, on, speculative=speculative)
            for name, on in (("off", False), ("on", True))
        ]
        return [Column(v.column(m), m, v) for m in modes for v in variants]
    if args.workload == JSON_PRESET:  # sync and async of one share side by side
        spec = json_schema_spec()
        shares = [(pct, None) for pct in parse_json_fractions(args.json_fractions)]
        if thinking is not None:  # each share also as a reasoning model's, after it
            shares = [s for pct, _ in shares for s in [(pct, None)] + [(pct, thinking)] * (pct > 0)]
        variants = [
            Variant(
                f"{pct}% {'json' if think is None else f'think {think[1]}+json'}, {{mode}}",
                constrain(workload, pct, spec, think),
                caching,
                f"{pct}{'' if think is None else 't'}",
                pct,
                speculative,
                thinking=think is not None,
            )
            for pct, think in shares
        ]
        return [Column(v.column(m), m, v) for v in variants for m in modes]
    if speculative is not None:  # sync and async of each side by side
        variants = speculation_variants(workload, caching, speculative)
        return [Column(v.column(m), m, v) for v in variants for m in modes]
    plain = Variant("{mode}", workload, caching)
    return [Column(m, m, plain) for m in modes]


def run_columns(
    engine: Engine,
    columns: list[Column],
    args: argparse.Namespace,
    window: tuple[int, int] | None,
    console: Console,
) -> dict[str, list[Run]]:
    """Every column's runs, repeats interleaved, each after a short warm-up in its settings."""
    runs: dict[str, list[Run]] = {c.name: [] for c in columns}
    # Speculation is switched only where some run has it (an engine built without it is left
    # alone: off is what it already does).
    speculating = any(c.variant.speculative is not None for c in columns)
    with progress_bars(console) as progress:
        for repeat in range(args.repeats):
            for column in columns:
                workload = column.variant.workload
                speculation = {"speculative_config": column.variant.speculative}
                engine.configure(
                    async_scheduling=column.mode == "async",
                    enable_prefix_caching=column.variant.caching,
                    **(speculation if speculating else {}),
                )
                run_workload(
                    engine, workload.warmup(), args.temperature, None, f"warmup-{column.mode}"
                )
                name = column.name if args.repeats == 1 else f"{column.name} #{repeat + 1}"
                trace = kernel_trace_path(args.kernel_trace, name) if window else None
                runs[column.name].append(
                    run_workload(engine, workload, args.temperature, progress, name, window, trace)
                )
    return runs


def kernel_trace_path(folder: str | None, run_name: str) -> str | None:
    """Where a run's kernel trace goes: `folder`/<the run's name, as a file name>.json.gz."""
    if folder is None:
        return None
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, re.sub(r"[^\w.-]+", "-", run_name).strip("-") + ".json.gz")


def identical_cells(columns: list[Column], runs: dict[str, list[Run]]) -> list[str]:
    """Whether every run of a group gave the first one's outputs: "yes" or "NO" in the group's
    last column (groups are contiguous), blank elsewhere."""
    cells = []
    for i, column in enumerate(columns):
        group = column.variant.group
        if i + 1 < len(columns) and columns[i + 1].variant.group == group:
            cells.append("")
            continue
        members = [run for c in columns if c.variant.group == group for run in runs[c.name]]
        cells.append("yes" if all(r.outputs == members[0].outputs for r in members) else "NO")
    return cells


def grammar_compile_line(engine: Engine) -> str:
    """Time the schema's compilation on a fresh compiler like the engine's: the tokenizer info
    (first in the process, with what it imports on first use, then again), the schema's first
    compile (the compiler's own tokenizer info built beforehand, by a trivial regex) and a
    cached compile. Then compile it on the engine's compiler, so that no run does."""
    grammars, spec = engine.grammars, json_schema_spec()
    if grammars.tokenizer is None:
        raise ValueError(
            f"the {JSON_PRESET} workload constrains outputs with a JSON schema, which needs the "
            f"model's tokenizer ({engine.model_path}), and it has none"
        )
    args = (grammars.tokenizer, grammars.vocab_size, grammars.eos_token_ids)
    times = [time.perf_counter()]

    def timed(work) -> None:
        work()
        times.append(time.perf_counter())

    compiler = GrammarCompiler(*args)
    timed(lambda: tokenizer_info(*args))
    timed(lambda: tokenizer_info(*args))
    timed(lambda: compiler.compile(StructuredOutputsParams(regex="a")))
    timed(lambda: compiler.compile(spec))
    timed(lambda: compiler.compile(spec))
    compiler.close()
    grammars.compile(spec)
    first, info, _, schema, cached = np.diff(times)
    return (
        f"grammar ({JSON_SCHEMA.name}): tokenizer info {info * 1e3:.1f} ms (first in this "
        f"process {first * 1e3:.1f} ms, imports included), schema compile {schema * 1e3:.1f} ms, "
        f"cached {cached * 1e6:.0f} us"
    )


def add_json_rows(table: Table, columns: list[Column], results: dict[str, Run]) -> None:
    """--workload json: the grammar's cost in each run, the unconstrained requests' latency, and
    each share against the run with none in the same loop."""

    def mean_device_wait_ms(run: Run) -> float:
        return 1e3 * float(np.mean([s.device_wait for s in run.records])) if run.records else 0.0

    def plain_itl_ms(column: Column) -> float | None:
        itl = results[column.name].itl_s(column.variant.unconstrained())
        return 1e3 * float(np.percentile(itl, 50)) if itl else None

    baseline = {c.mode: c.name for c in columns if c.variant.json_percent == 0}
    # --thinking-budget: each thinking column against the same share without thinking.
    plain_share = {
        (c.mode, c.variant.json_percent): c.name for c in columns if not c.variant.thinking
    }

    def vs_baseline(values: dict[str, float | None], column: Column, to: str = "") -> str:
        """The column's value over that of the 0% run of its loop (or of the run `to`)."""
        value, base = values[column.name], values.get(to or baseline.get(column.mode, ""))
        return f"{value / base:.3f}x" if value is not None and base else ""

    runs = [results[c.name] for c in columns]
    grammar_ms = [r.summary.host_ms_per_step.get("grammar", 0.0) for r in runs]
    table.add_row("host grammar / step (ms)", *(f"{ms:.3f}" for ms in grammar_ms))
    table.add_row(
        "device waited for bitmask / step (ms)", *(f"{mean_device_wait_ms(r):.3f}" for r in runs)
    )
    itl = {c.name: plain_itl_ms(c) for c in columns}
    table.add_row(
        "unconstrained ITL p50 (ms)",
        *("-" if itl[c.name] is None else f"{itl[c.name]:.2f}" for c in columns),
    )
    if baseline:
        table.add_row("unconstrained ITL vs 0%", *(vs_baseline(itl, c) for c in columns))
    if any(c.variant.thinking for c in columns):
        table.add_row(
            "unconstrained ITL vs no thinking",
            *(
                vs_baseline(itl, c, plain_share[c.mode, c.variant.json_percent])
                if c.variant.thinking
                else ""
                for c in columns
            ),
        )
    if "async" in baseline:
        rates = {c.name: results[c.name].summary.tokens_per_s for c in columns}
        table.add_row(
            "async tokens/s vs 0% async",
            *(vs_baseline(rates, c) if c.mode == "async" else "" for c in columns),
        )


def add_speculation_rows(
    table: Table, columns: list[Column], results: dict[str, Run], runs: dict[str, list[Run]]
) -> None:
    """Speculative decoding: its counters in each run (RunSummary.speculative), and with
    --speculative-config each method's tokens/s over that of speculation off in the same loop,
    paired by round (`runs`: each column's runs in round order): the median of the rounds'
    ratios, and their range when there are several."""

    def cells(text) -> list[str]:
        return [
            text(results[c.name].summary.speculative) if c.variant.speculative else "-"
            for c in columns
        ]

    table.add_row("spec decode: draft tokens", *cells(lambda s: str(s.drafted_tokens)))
    table.add_row("spec decode: accepted tokens", *cells(lambda s: str(s.accepted_tokens)))
    table.add_row(
        "spec decode: acceptance rate %", *cells(lambda s: f"{100 * s.acceptance_rate:.1f}")
    )
    table.add_row(
        "spec decode: mean accepted length", *cells(lambda s: f"{s.mean_accepted_length:.2f}")
    )
    off = {c.mode: runs[c.name] for c in columns if c.variant.speculation == "off"}
    for method in ("ngram", "suffix", "draft"):
        if not any(c.variant.speculation == method for c in columns) or not off:
            continue
        ratios = []
        for c in columns:
            base = off.get(c.mode)
            if c.variant.speculation != method or base is None:
                ratios.append("")
                continue
            mid, low, high = paired_ratio(
                [r.summary.tokens_per_s for r in runs[c.name]],
                [r.summary.tokens_per_s for r in base],
            )
            spread = f" ({low:.2f}-{high:.2f})" if len(base) > 1 else ""
            ratios.append("" if mid != mid else f"{mid:.3f}x{spread}")
        table.add_row(f"{method} vs off (tokens/s)", *ratios)


def add_lora_rows(
    table: Table, columns: list[Column], results: dict[str, Run], runs: dict[str, list[Run]]
) -> None:
    """The lora workload: each count's output tokens/s over the base model's alone in the same
    loop (paired by round: the median of the rounds' ratios), and the adapters its steps copied
    into slots (every adapter has a slot of its own, so only a warm-up copies)."""
    base = {c.mode: runs[c.name] for c in columns if c.variant.group == "lora0"}
    cells = []
    for c in columns:
        if c.mode not in base:
            cells.append("")
            continue
        mid, low, high = paired_ratio(
            [r.summary.tokens_per_s for r in runs[c.name]],
            [r.summary.tokens_per_s for r in base[c.mode]],
        )
        spread_text = f" ({low:.2f}-{high:.2f})" if len(base[c.mode]) > 1 else ""
        cells.append(f"{mid:.3f}x{spread_text}")
    table.add_row("output tokens/s vs 0 adapters", *cells)
    table.add_row("adapters copied into slots", *(str(results[c.name].adapter_loads)
                                                  for c in columns))  # fmt: skip


def load_bench_adapters(args: argparse.Namespace, engine: Engine) -> list[LoRARequest]:
    """The lora workload's random adapters, written once under the cache folder and loaded
    before any run (as a server loads its --lora-modules)."""
    count = max(parse_counts(args.lora_counts))
    adapters = random_adapters(
        cache_root() / "lora", engine.spec, engine.model_path.name, count, args.lora_rank,
        parse_targets(args.lora_targets),
    )  # fmt: skip
    for adapter in adapters:
        engine.adapters.add(adapter)
    return adapters


def speculation_line(config: EngineConfig) -> str:
    """What the speculating runs used, and the batch that bounds them."""
    spec = asdict(config.speculative_config)
    return (
        f"speculative decoding: {json.dumps(spec)}; at most {config.max_num_seqs} requests run "
        "at once (--max-num-seqs)"
    )


def random_model(args: argparse.Namespace, config: EngineConfig, console: Console) -> Path:
    """--random-gguf: the cached random-weight GGUF of --model's shape (written if absent)."""
    if config.load_format == "dummy":
        raise ValueError("--random-gguf writes weights to load: drop --load-format dummy")
    if args.num_layers is not None and args.num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {args.num_layers}")
    layers = {} if args.num_layers is None else {"num_hidden_layers": args.num_layers}
    return cached_random_gguf(
        config_folder(config.model), args.random_gguf, layers, log=console.print
    )


def run_bench(args: argparse.Namespace, config: EngineConfig) -> int:
    console = Console(stderr=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("sync", "async") for m in modes):
        raise ValueError(f"--modes takes sync and/or async, got {args.modes!r}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.kernel_trace and not args.profile:
        raise ValueError("--kernel-trace writes the window --profile times: add --profile")
    if args.profile and config.world_size > 1:
        raise ValueError(
            "--profile times one device: use it with --tensor-parallel-size 1 and "
            "--pipeline-parallel-size 1"
        )
    if args.workload == JSON_PRESET:
        parse_json_fractions(args.json_fractions)  # refused before the engine loads
    if args.thinking_budget is not None and (
        args.workload != JSON_PRESET or args.thinking_budget < 0
    ):
        raise ValueError(f"--thinking-budget is a budget (>= 0) of the {JSON_PRESET} workload")
    config = resolve_workload(args, config, config.torch_device.type)
    if args.workload == BATCHES_PRESET:
        check_batches_args(args, config)  # before a random GGUF is written
    if args.random_gguf is not None:
        config = replace(config, model=str(random_model(args, config, console)))
    elif args.num_layers is not None:
        raise ValueError("--num-layers shapes the file that --random-gguf writes: add it")
    if args.workload == AGENT_PRESET:  # closed-loop sessions: a feeding loop and report of its own
        return run_agent_bench(args, config, modes)
    if args.workload == BATCHES_PRESET:  # a fresh process per batch size, beside llama.cpp
        return run_batches_bench(args, config)
    engine = Engine(config)
    try:
        workload = bench_workload(args, engine)
        adapters = load_bench_adapters(args, engine) if args.workload == LORA_PRESET else None
        compile_line = grammar_compile_line(engine) if args.workload == JSON_PRESET else None
        thinking = thinking_of(args, engine)
    except ValueError:
        engine.close()
        raise
    speculative = config.speculative_config
    columns = bench_columns(
        args, config.enable_prefix_caching, workload, modes, speculative, thinking, adapters
    )
    console.print(describe_model(engine))
    if speculative is not None:
        console.print(speculation_line(config))
    if compile_line:
        console.print(compile_line)
    on_cuda = config.torch_device.type == "cuda"
    window = profile_window(workload) if args.profile and on_cuda else None
    if window is not None:
        KernelProfiler.warm_up()
    bandwidth = None
    if args.profile:  # a CPU streams on the engine's compute threads for decodes
        bandwidth = ceilings(config.torch_device, engine.execution.cpu_threads)
    runs = run_columns(engine, columns, args, window, console)
    engine.close()
    # Interleaved repeats and medians: a shared machine's noise is larger than the effect.
    results = {
        c: sorted(r, key=lambda run: run.summary.wall_s)[len(r) // 2] for c, r in runs.items()
    }
    identical = identical_cells(columns, runs)
    names = [c.name for c in columns]

    repeats = f", median of {args.repeats}" if args.repeats > 1 else ""
    kind = ""
    if args.workload == "shared-prefix":
        kind = f", {args.num_prefixes} shared prefixes of {args.prefix_len} tokens"
    elif args.workload == BLOG_PRESET:
        kind = f" x {args.output_len} output tokens ({BLOG_PRESET})"
    elif args.workload == CHAT_PRESET:
        kind = f" ({CHAT_PRESET}: chat-template prompts, EOS on, at most {args.output_len} tokens)"
    elif args.workload in (COPY_PRESET, COPY_JSON_PRESET):
        answer = " as JSON" if args.workload == COPY_JSON_PRESET else ""
        kind = (
            f" ({args.workload}: repeat-a-passage prompts{answer}, EOS on, "
            f"at most {args.output_len} tokens)"
        )
    elif args.workload == JSON_PRESET:
        shares = "/".join(str(c.variant.json_percent) for c in columns if c.mode == modes[0])
        kind = f" ({JSON_PRESET}: {shares}% of them under {JSON_SCHEMA.name}"
        if thinking is not None:
            kind += f", thinking {thinking[1]} tokens first"
        kind += ")"
    elif args.workload == LORA_PRESET:
        kind = (
            f" ({LORA_PRESET}: over {args.lora_counts} adapters of rank {args.lora_rank} on "
            f"{args.lora_targets})"
        )
    table = Table(title=f"tandem bench: {len(workload.prompts)} requests{kind}, "
                  f"{engine.model_path.name}, {config.torch_device.type}{repeats}")  # fmt: skip
    table.add_column("metric")
    for name in names:
        table.add_column(name, justify="right")
    table.add_row("compute processes x threads", *[layout_text(engine)] * len(names))
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
    stats = {name: run.summary.as_dict() for name, run in results.items()}
    for label, key, fmt in rows:
        table.add_row(label, *(fmt.format(stats[c].get(key, 0)) for c in names))
        if key == "device_idle_pct" and window is not None:
            add_kernel_rows(table, [results[c].kernels for c in names])
    if bandwidth is not None:
        weights = engine.execution.weight_bytes
        rooflines = [decode_roofline(results[c].records, weights) for c in names]
        add_roofline_rows(table, rooflines, *bandwidth)

    def all_tokens_per_s(column: Column) -> float:
        summary = results[column.name].summary
        prompt_tokens = sum(len(p) for p in column.variant.workload.prompts)
        return (prompt_tokens + summary.output_tokens) / summary.wall_s

    table.add_row("prompt + output tokens/s", *(f"{all_tokens_per_s(c):.1f}" for c in columns))
    table.add_row("prefill tokens computed", *(str(results[c].prefill_computed) for c in names))
    table.add_row("prefill tokens saved (cache)", *(str(results[c].prefill_saved) for c in names))

    def hit_rate(name: str) -> float:
        run = results[name]
        return 100 * run.prefill_saved / max(1, run.prefill_saved + run.prefill_computed)

    table.add_row("prefix cache hit rate %", *(f"{hit_rate(c):.1f}" for c in names))
    if any(c.variant.workload.ends_early for c in columns):
        add_finish_rows(table, [results[c] for c in names])
    if args.workload == JSON_PRESET:
        add_json_rows(table, columns, results)
    if speculative is not None:
        add_speculation_rows(table, columns, results, runs)
    if args.workload == LORA_PRESET:
        add_lora_rows(table, columns, results, runs)

    def ratio_row(label: str, pairs: dict[str, tuple[str, str]]) -> None:
        """`pairs`: column -> (numerator column, denominator column) of wall times."""
        cells = []
        for name in names:
            a, b = pairs.get(name, (None, None))
            wall = results[a].summary.wall_s / results[b].summary.wall_s if a else None
            cells.append(f"{wall:.3f}x" if wall else "")
        table.add_row(label, *cells)

    variants = list(dict.fromkeys(c.variant for c in columns))
    if "sync" in modes and "async" in modes:
        ratio_row(
            "speedup (sync wall / async wall)",
            {v.column("async"): (v.column("sync"), v.column("async")) for v in variants},
        )
    if args.workload == "shared-prefix" and len(variants) == 2:
        off, on = variants
        ratio_row(
            "speedup (cache off wall / cache on wall)",
            {on.column(m): (off.column(m), on.column(m)) for m in modes},
        )
    table.add_row("outputs identical (all runs)", *identical)
    Console().print(table)
    if window is not None:
        for name in names:
            kernels = results[name].kernels
            if kernels is not None and kernels.shares:
                Console(width=140).print(kernel_share_table(name, kernels))  # names unwrapped
    Console().print(f"execution: {engine.execution.describe()}")
    Console().print(describe_model(engine))
    if speculative is not None:
        Console().print(speculation_line(config))
    if compile_line:
        Console().print(compile_line)
    if not workload.ignore_eos and not any(r.finished_by("stop") for r in results.values()):
        Console().print(
            "note: no request ended on the model's EOS within --output-len (random weights "
            "rarely emit it), so the async loop had nothing to discard; a real model shows it"
        )
    # shared-prefix's columns compare caching and get no note; the others compare the loops.
    note = cpu_overlap_note(engine, list(results) if args.workload == "shared-prefix" else modes)
    if note:
        Console().print(note)
    timelines = {name: run.records for name, run in results.items()}
    if args.trace:
        write_chrome_trace(timelines, args.trace)
        console.print(f"trace written to {args.trace}")
    if args.plot:
        plot_timeline(timelines, args.plot)
        console.print(f"timeline written to {args.plot}")
    return 0 if "NO" not in identical else 1
