"""`tandem bench --workload agent`: coding-agent sessions, each loop in turn, and what decides how
an agent feels: the time to first token of every turn, how much of each prompt the prefix cache
served, and how many sessions of the final length the KV cache holds."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from tandem.bench.agent import AgentShape, Conversations, make_conversations
from tandem.bench.agent_run import AgentRun, run_agent
from tandem.bench.ratios import paired_ratio
from tandem.bench.run import progress_bars, run_workload
from tandem.bench.workloads import Workload
from tandem.config import EngineConfig, SpeculativeConfig
from tandem.engine.engine import Engine

GIB = 1024**3


def agent_shape(args: argparse.Namespace) -> AgentShape:
    return AgentShape(
        args.sessions, args.turns, args.head_len, args.tool_result_len, args.output_len,
        args.session_stagger, args.agent_task,
    )  # fmt: skip


def conversations_of(args: argparse.Namespace, engine: Engine, shape: AgentShape) -> Conversations:
    """A fresh set of sessions (each run's prompts follow its own answers)."""
    return make_conversations(
        shape, engine.tokenizer, engine.spec.vocab_size, engine.max_model_len,
        args.workload_seed, args.agent_prompts,
    )  # fmt: skip


def speculation_rows(
    table: Table,
    runs: dict[str, list[AgentRun]],
    results: dict[str, AgentRun],
    columns: list[AgentColumn],
) -> None:
    """Draft tokens, accepted ones, and each speculating column's output tokens/s over the
    same loop's without speculation (median and range of the repeats' pairs)."""
    spec = {c.name: results[c.name].summary.speculative for c in columns}
    table.add_row("spec decode: draft / accepted tokens",
                  *(f"{s.drafted_tokens} / {s.accepted_tokens}" for s in spec.values()))  # fmt: skip
    off = {c.mode: c.name for c in columns if c.speculation is None}
    cells = []
    for c in columns:
        if c.speculation is None:
            cells.append("")
            continue
        rates = [[r.summary.tokens_per_s for r in runs[name]] for name in (c.name, off[c.mode])]
        mid, low, high = paired_ratio(*rates)
        cells.append(f"{mid:.3f}x ({low:.2f}-{high:.2f})")
    method = next(c.speculation.method for c in columns if c.speculation is not None)
    table.add_row(f"{method} vs off (output tokens/s)", *cells)


def block_bytes(engine: Engine) -> int:
    """Bytes one KV block id holds: its positions in each layer of a group (every layer where
    all attend alike), scales included where the cache is quantized."""
    groups = engine.scheduler.groups
    per_layer = engine.kv_bytes_per_token // engine.spec.num_layers
    return per_layer * groups.places * engine.config.block_size


def sessions_that_fit(engine: Engine, run: AgentRun, gib: float) -> tuple[int, int, int, int]:
    """(blocks in `gib`, blocks a session of the run's final length holds, sessions that fit
    with private blocks, sessions that fit sharing the head's blocks)."""
    bs, groups = engine.config.block_size, engine.scheduler.groups
    final = max(t.prompt_len + len(t.output) for t in run.turns)
    budget = int(gib * GIB) // block_bytes(engine)
    per_session = groups.max_blocks(final, bs, engine.config.max_num_batched_tokens)
    full_groups = sum(1 for g in groups.groups if g.window is None)
    head = (run.shared_head // bs) * full_groups
    private = budget // per_session
    shared = (budget - head) // max(1, per_session - head) if budget >= per_session else 0
    return budget, per_session, private, shared


@dataclass(frozen=True)
class AgentColumn:
    name: str  # "sync", or with speculation "off, sync", "suffix, async", ...
    mode: str  # "sync" or "async"
    speculation: SpeculativeConfig | None


def agent_columns(engine: Engine, modes: list[str]) -> list[AgentColumn]:
    """Each loop; with --speculative-config, each loop with speculation off and on."""
    spec = engine.speculative_config
    if spec is None:
        return [AgentColumn(mode, mode, None) for mode in modes]
    return [
        AgentColumn(f"{name}, {mode}", mode, config)
        for name, config in (("off", None), (spec.method, spec))
        for mode in modes
    ]


def run_agent_bench(args: argparse.Namespace, config: EngineConfig, modes: list[str]) -> int:
    shape = agent_shape(args)
    console = Console(stderr=True)
    engine = Engine(config)
    try:
        columns = agent_columns(engine, modes)
        runs = _run_columns(args, engine, shape, columns, console)
        table, notes, identical = agent_table(args, engine, shape, runs, columns)
    finally:
        engine.close()
    Console().print(table)
    for note in notes:
        Console().print(note)
    return 0 if identical else 1


def _run_columns(
    args: argparse.Namespace,
    engine: Engine,
    shape: AgentShape,
    columns: list[AgentColumn],
    console: Console,
) -> dict[str, list[AgentRun]]:
    """Each column's runs, repeats interleaved, each after a short warm-up in its loop."""
    runs: dict[str, list[AgentRun]] = {c.name: [] for c in columns}
    with progress_bars(console) as progress:
        for repeat in range(args.repeats):
            for column in columns:
                engine.configure(
                    async_scheduling=column.mode == "async", speculative_config=column.speculation
                )
                warm = conversations_of(args, engine, shape).first(0)[:64]
                run_workload(engine, Workload([warm] * 2, [4] * 2, [0.0] * 2), 0.0, None, "warmup")
                name = column.name if args.repeats == 1 else f"{column.name} #{repeat + 1}"
                runs[column.name].append(
                    run_agent(engine, shape, conversations_of(args, engine, shape), progress, name)
                )
    return runs


def agent_table(
    args: argparse.Namespace,
    engine: Engine,
    shape: AgentShape,
    runs: dict[str, list[AgentRun]],
    columns: list[AgentColumn],
) -> tuple[Table, list[str], bool]:
    """The report: each column's median run (by wall time), the notes printed under it, and
    whether every run gave the same outputs."""
    results = {
        m: sorted(r, key=lambda run: run.summary.wall_s)[len(r) // 2] for m, r in runs.items()
    }
    modes = [c.name for c in columns]
    first = results[modes[0]]
    repeats = f", median of {args.repeats}" if args.repeats > 1 else ""
    title = (
        f"tandem bench: {shape.sessions} agent sessions x {shape.turns} turns, "
        f"{engine.model_path.name}, {engine.config.torch_device.type}{repeats}"
    )
    table = Table(title=title)
    table.add_column("metric")
    for mode in modes:
        table.add_column(mode, justify="right")

    def row(label: str, text) -> None:
        table.add_row(label, *(text(results[m]) for m in modes))

    def turns_sum(run: AgentRun, later: bool, what: str) -> int:
        chosen = [t for t in run.turns if (t.turn > 0) == later and (later or t.session > 0)]
        return sum(getattr(t, what) for t in chosen)

    def efficiency(run: AgentRun) -> str:
        new, computed = turns_sum(run, True, "new_tokens"), turns_sum(run, True, "computed_tokens")
        return f"{100 * new / computed:.1f}" if computed else "-"

    row("wall time (s)", lambda r: f"{r.summary.wall_s:.3f}")
    row("output tokens/s", lambda r: f"{r.summary.tokens_per_s:.1f}")
    row(
        "TTFT first turns p50 / p90 (ms)",
        lambda r: f"{r.ttft_ms(False, 50):.1f} / {r.ttft_ms(False, 90):.1f}",
    )
    row(
        "TTFT later turns p50 / p90 (ms)",
        lambda r: f"{r.ttft_ms(True, 50):.1f} / {r.ttft_ms(True, 90):.1f}",
    )
    row("prefill tokens computed", lambda r: str(r.prefill_computed))
    row("prefill tokens served from cache", lambda r: str(r.prefill_saved))
    if shape.sessions > 1:
        row(
            "first turns after session 0: new / computed",
            lambda r: (
                f"{turns_sum(r, False, 'new_tokens')} / {turns_sum(r, False, 'computed_tokens')}"
            ),
        )
    if shape.turns > 1:
        row(
            "later turns: new / computed tokens",
            lambda r: (
                f"{turns_sum(r, True, 'new_tokens')} / {turns_sum(r, True, 'computed_tokens')}"
            ),
        )
        row("later turns: reuse efficiency % (new / computed)", efficiency)
        row(
            "later turns: earlier tokens written otherwise",
            lambda r: str(turns_sum(r, True, "rewritten")),
        )
    per_block = block_bytes(engine)
    row("peak KV blocks held", lambda r: str(r.peak_blocks))
    row("peak KV held (MiB)", lambda r: f"{r.peak_blocks * per_block / 2**20:.1f}")
    if any(c.speculation is not None for c in columns):
        speculation_rows(table, runs, results, columns)
    identical = all(run.outputs == first.outputs for rs in runs.values() for run in rs)
    table.add_row(
        "outputs identical (all runs)", *[""] * (len(modes) - 1), "yes" if identical else "NO"
    )

    gib = engine.config.kv_cache_memory_gib
    budget, per_session, private, shared = sessions_that_fit(engine, first, gib)
    final = max(t.prompt_len + len(t.output) for t in first.turns)
    kind = engine.config.kv_cache_dtype
    kv = "the model's dtype" if kind == "auto" else kind
    head = (
        f"head of {first.shared_head} tokens shared by every session's first prompt"
        if shape.sessions > 1
        else f"head of ~{shape.head_len} tokens"
    )
    notes = [
        f"prompts ({args.agent_prompts if engine.tokenizer is not None else 'token ids'}): a "
        f"{head}, tool "
        f"results of ~{shape.tool_result_len} tokens, answers of {shape.output_len} tokens "
        f"(greedy, EOS ignored), task {shape.task}; sessions start {shape.stagger_s:g} s apart, "
        "each next turn "
        "submitted when its previous answer is complete",
        f"KV cache ({kv}): {per_block} bytes a block of {engine.config.block_size} tokens; a "
        f"session of {final} tokens holds {per_session} blocks ({per_session * per_block / 2**20:.1f} "
        f"MiB); in {gib:g} GiB ({budget} blocks) {private} such sessions fit, {shared} with the "
        "head's blocks shared",
    ]
    if math.isnan(first.ttft_ms(True, 50)):
        notes.append("one turn per session: no later turns to report")
    return table, notes, identical
