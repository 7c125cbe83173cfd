"""The offline comparison's report: a row per engine, the plain-text table (no markup, so it pastes
cleanly into notes and issues), the machine it ran on, and the bar chart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.bench.compare_args import ENGINES
from tandem.bench.compare_engines import LABELS


@dataclass
class Row:
    engine: str
    wall_s: float
    walls_s: list[float]
    output_tokens: int
    tokens_per_s: float
    ttft_p50_ms: float | None
    itl_p50_ms: float | None
    latency_from: str  # "timed runs", "a separate streamed run" or "n/a"
    equal: int | None  # requests whose ids equal the reference engine's
    requests: int
    first_divergence: str | None = None
    repeats_agree: bool = True
    lengths_ok: bool = True
    vs_vllm: float | None = None
    latency_run_wall_s: float | None = None  # the separate streamed run's wall time, if any
    finished_stop: int | None = None  # chat: requests that ended on an EOS
    finished_length: int | None = None  # chat: requests that reached output_len
    discarded: int | None = None  # Tandem: speculative tokens discarded (timed run 1)
    label: str = ""  # the table's name for the engine (LABELS, or the engine's own)


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def print_rows(table: list[list[str]]) -> None:
    """The header row, a rule, then the rows: the first column left-aligned, the others right."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for n, row in enumerate(table):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]  # fmt: skip
        print("  ".join(cells))
        if n == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))


def discarded_text(row: Row) -> str:
    """Tandem's speculative tokens discarded, total and per finished request; n/a elsewhere."""
    if row.discarded is None:
        return "n/a"
    return f"{row.discarded} ({row.discarded / max(1, row.requests):.2f}/req)"


def print_table(rows: list[Row], reference_name: str | None, chat: bool = False) -> None:
    """The table, then a line of notes per row where there are any. `chat`: with how requests
    finished, and Tandem's discarded speculative tokens."""
    ref_label = LABELS.get(reference_name, "-") if reference_name else "-"
    header = ["engine", "wall s", "output tok/s", "vs vLLM", "TTFT p50 ms", "ITL p50 ms",
              f"tokens equal {ref_label}"]  # fmt: skip
    if chat:
        header += ["stop / length", "discarded"]
    table = [header]
    for r in rows:
        if r.equal is None:
            equal = "n/a"
        elif r.engine == reference_name:
            equal = "(reference)"
        else:
            equal = f"{r.equal}/{r.requests}"
        table.append(
            [
                r.label,
                f"{r.wall_s:.2f}",
                f"{r.tokens_per_s:.1f}",
                fmt(r.vs_vllm, ".2f") + ("x" if r.vs_vllm is not None else ""),
                fmt(r.ttft_p50_ms, ".1f"),
                fmt(r.itl_p50_ms, ".2f"),
                equal,
            ]
            + ([f"{r.finished_stop} / {r.finished_length}", discarded_text(r)] if chat else [])
        )
    print_rows(table)
    for r in rows:
        notes = []
        if len(r.walls_s) > 1:
            notes.append("walls " + ", ".join(f"{w:.2f}" for w in r.walls_s))
        if r.latency_from not in ("timed runs", "n/a"):
            notes.append(f"TTFT/ITL from {r.latency_from} (wall {r.latency_run_wall_s:.2f} s)")
        if r.first_divergence and r.engine != reference_name:
            notes.append(r.first_divergence)
        if not r.repeats_agree:
            notes.append("WARNING: repeated runs gave different tokens")
        if not r.lengths_ok:
            notes.append(
                "WARNING: not every request generated the asked-for number of tokens"
                + (" or ended on an EOS" if chat else "")
            )
        if notes:
            print(f"  {r.label}: " + "; ".join(notes))


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Grouped bars: one panel per model, workloads on the x axis, one bar per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"tandem-async": "#c44e52", "tandem-sync": "#dd8452", "hf": "#4c72b0", "vllm": "#55a868", "llamacpp": "#8172b3"}  # fmt: skip
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        workloads = res["workloads"]
        engines = [
            e for e in ENGINES if any(r["engine"] == e for w in workloads for r in w["rows"])
        ]
        width = 0.8 / max(1, len(engines))
        for j, eng in enumerate(engines):
            xs, ys, label = [], [], LABELS[eng]
            for i, w in enumerate(workloads):
                row = next((r for r in w["rows"] if r["engine"] == eng), None)
                if row is not None:
                    xs.append(i + (j - (len(engines) - 1) / 2) * width)
                    ys.append(row["tokens_per_s"])
                    label = row.get("label") or label  # older JSON files have none
            bars = ax.bar(xs, ys, width, label=label, color=colors[eng])
            ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
        ax.set_xticks(range(len(workloads)), [w["name"] for w in workloads])
        ax.set_ylabel("output tokens/s")
        m = res["model"]
        kind = f", {m['kind']}" if m.get("kind") else ""
        runs = res["settings"]["repeats"]
        median = f"median of {runs}" if runs > 1 else "1 run each"
        ax.set_title(f"{m['name']} ({m['params'] / 1e6:.1f}M params{kind}); {median}", fontsize=10)
        ax.legend(fontsize=8)
    mach = results[0]["machine"]
    settings = results[0]["settings"]
    fig.suptitle(
        f"output tokens/s; {mach['cpu']}, {mach['cpus_usable']} CPUs; threads: HF, vLLM, "
        f"llama.cpp {settings['threads']}, Tandem {settings.get('tandem_threads', 'auto')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
