"""The served comparison's report: the table (markdown: it goes into docs as printed), Tandem's
figures over each other server's paired by repeat (tandem.bench.ratios), the JSON and the picture.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from tandem.bench import serve_agent
from tandem.bench.machine import core_count, cpu_name
from tandem.bench.ratios import paired_ratio
from tandem.bench.serve_metrics import finite  # NaN (offline TTFT) as null: JSON has no NaN


def shown(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "–"


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


def paired(ours: dict, theirs: dict, keys: tuple[tuple[str, str], ...]) -> str:
    """ "output tok/s 1.050x (0.80-1.30), ...": for each (key of per-repeat figures, name), the
    median and range of ours over theirs, repeat by repeat; a figure neither has is left out."""
    parts = []
    for key, name in keys:
        mid, low, high = paired_ratio(ours[key], theirs[key])
        if math.isfinite(mid):
            parts.append(f"{name} {mid:.3f}x ({low:.2f}-{high:.2f})")
    return ", ".join(parts)


def tandem_ratios(rows: list[dict]) -> list[str]:
    """`tandem` against every other row, cell by cell, paired by repeat: its output tok/s over
    theirs and its ITL p50 over theirs (the figures the targets are stated in: async over sync,
    served over offline, against llama-server)."""
    cells: dict[tuple[str, int], dict[str, dict]] = {(r["mode"], r["streams"]): {} for r in rows}
    for row in rows:
        cells[(row["mode"], row["streams"])][row["label"]] = row
    keys = (("tokens_per_s_by_repeat", "output tok/s"), ("itl_p50_ms_by_repeat", "ITL p50"))
    lines = []
    for (mode, streams), by_label in cells.items():
        ours = by_label.get("tandem")
        if ours is None:
            continue
        for label, theirs in by_label.items():
            text = paired(ours, theirs, keys) if label != "tandem" else ""
            if text:
                lines.append(f"tandem / {label}, {mode} x{streams}: {text}")
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


def load_report(args: argparse.Namespace, rows: list[dict]) -> None:
    """The load workload: the table, the ratio lines, the cells that went wrong, JSON, plot."""
    header = (
        f"{args.model.name}, {args.output_len} output tokens per request, "
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
                f"{row['short_requests']} requests without exactly {args.output_len} tokens"
            )
    write_outputs(args, header, rows, draw)


def write_outputs(args: argparse.Namespace, header: str, rows: list[dict], draw_rows) -> None:
    """--json: the header and rows; --plot: the picture `draw_rows` makes of them."""
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": finite(rows)}, indent=2))
    if args.plot is not None:
        draw_rows(rows, args.plot, header)
        print(f"\nplot: {args.plot}", file=sys.stderr)


def agent_report(args: argparse.Namespace, rows: list[dict]) -> None:
    """--workload agent: the table, the ratios to Tandem's, JSON and the picture."""
    shape = serve_agent.agent_shape(args)
    header = (
        f"{args.model.name}: {shape.sessions} agent sessions x {shape.turns} turns, a "
        f"~{shape.head_len}-token head, ~{shape.tool_result_len}-token tool results, "
        f"{shape.output_len}-token answers; {core_count()} cores of {cpu_name()}, "
        f"median of {args.repeats}"
    )
    print(f"\n{header}\n")
    print(serve_agent.markdown_table(rows))
    ours = next((r for r in rows if r["label"] == "tandem"), None)
    keys = (("wall_s_by_repeat", "wall"), ("later_ttft_p50_ms_by_repeat", "later TTFT p50"))
    for row in rows:
        if ours is not None and row is not ours:
            print(f"tandem / {row['label']}: " + paired(ours, row, keys))
        if row["failed_turns"] or row["short_turns"]:
            print(
                f"{row['label']}: {row['failed_turns']} turns failed, {row['short_turns']} "
                f"without exactly {shape.output_len} tokens"
            )
    write_outputs(args, header, rows, serve_agent.draw)
