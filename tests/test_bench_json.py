"""`tandem bench --workload json`: the random workload with 0%, 25% and 100% of its requests under
the shipped JSON schema, sync and async side by side; the grammar's compile time, its mask time
per step, the device's wait for the bitmask, and the unconstrained requests' ITL."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tandem.bench.cli import Column, Variant, identical_cells
from tandem.bench.run import Run
from tandem.bench.workloads import (
    JSON_SCHEMA,
    Workload,
    constrain,
    json_schema_spec,
    parse_json_fractions,
)
from tandem.cli import main
from tandem.metrics import RunSummary

from helpers import bench_table

COLUMNS = [f"{pct}% json, {mode}" for pct in (0, 25, 100) for mode in ("sync", "async")]


def test_the_shipped_schema_and_the_shares():
    schema = json.loads(JSON_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    fields = schema["properties"].values()
    assert {"string", "integer", "boolean", "array"} <= {p.get("type") for p in fields}
    assert any("enum" in p for p in fields)
    assert parse_json_fractions("0,25,100") == [0, 25, 100]
    for bad in ("", "a", "101", "-1", "25,25"):
        with pytest.raises(ValueError, match="--json-fractions"):
            parse_json_fractions(bad)
    spec = json_schema_spec()
    work = Workload([[5]] * 8, [4] * 8, [0.0] * 8)
    quarter = constrain(work, 25, spec)  # every 4th request, from the first
    assert [s is not None for s in quarter.structured] == [True, False, False, False] * 2
    assert quarter.ends_early and quarter.constraint(4) is spec and quarter.constraint(3) is None
    assert constrain(work, 100, spec).structured == [spec] * 8
    none = constrain(work, 0, spec)
    assert none.structured == [None] * 8 and not none.ends_early


def test_outputs_are_compared_within_each_variant_only():
    def run(outputs: list[list[int]]) -> Run:
        return Run(RunSummary(1.0, 1.0, 1, 1, [], [], {}), [], outputs, 0, 0)

    work = Workload([[5]], [4], [0.0])
    plain, constrained = Variant("0% {mode}", work, True, "0"), Variant("x {mode}", work, True, "x")
    columns = [Column(v.column(m), m, v) for v in (plain, constrained) for m in ("sync", "async")]
    runs = {c.name: [run([[1, 2]] if c.variant is plain else [[3]])] for c in columns}
    assert identical_cells(columns, runs) == ["", "yes", "", "yes"]  # [[1, 2]] != [[3]]: fine
    runs[columns[3].name].append(run([[4]]))
    assert identical_cells(columns, runs) == ["", "yes", "", "NO"]


def test_json_bench_runs_every_share_sync_and_async(tiny_llama, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "400")  # one table row per line
    args = ["bench", "--workload", "json", "--model", str(tiny_llama), "--num-requests", "8",
            "--output-len", "12", "--prompt-len", "16", "--plot", str(tmp_path / "t.png")]  # fmt: skip
    assert main(args) == 0
    assert (tmp_path / "t.png").stat().st_size > 0  # the timeline draws the grammar spans
    captured = capsys.readouterr()
    out = captured.out
    print(out)
    header = next(line for line in out.splitlines() if "metric" in line)
    assert [c.strip() for c in header.split("┃")[2:-1]] == COLUMNS
    assert "8 requests (json: 0/25/100% of them under product_schema.json)" in " ".join(out.split())
    line = (
        r"grammar \(product_schema\.json\): tokenizer info [\d.]+ ms \(first in this process "
        r"[\d.]+ ms, imports included\), schema compile [\d.]+ ms, cached \d+ us"
    )
    assert re.search(line, out) and re.search(line, captured.err)  # before the runs, and after
    rows = bench_table(out)
    grammar = [float(x) for x in rows["host grammar / step (ms)"]]
    assert grammar[:2] == [0.0, 0.0] and all(x > 0 for x in grammar[2:])
    assert all(float(x) >= 0 for x in rows["device waited for bitmask / step (ms)"])
    itl = rows["unconstrained ITL p50 (ms)"]
    assert all(float(x) > 0 for x in itl[:4]) and itl[4:] == ["-", "-"]
    itl_ratio = rows["unconstrained ITL vs 0%"]
    assert itl_ratio[:2] == ["1.000x", "1.000x"] and itl_ratio[2].endswith("x")
    assert itl_ratio[4:] == ["", ""]  # 100%: no unconstrained request
    tokens = rows["async tokens/s vs 0% async"]
    assert tokens[0::2] == ["", "", ""] and tokens[1] == "1.000x" and tokens[5].endswith("x")
    assert [c.endswith("x") for c in rows["speedup (sync wall / async wall)"]] == [False, True] * 3
    for cell in rows["requests finished by stop / length"]:
        stop, length = map(int, cell.split(" / "))
        assert stop + length == 8
    assert rows["requests finished by stop / length"][:2] == ["0 / 8", "0 / 8"]  # ignore_eos
    assert rows["outputs identical (all runs)"] == ["", "yes"] * 3


def test_thinking_variant_runs_each_share_with_and_without_thinking(capsys, monkeypatch):
    """--thinking-budget on the default model's reasoning twin: each share with a grammar runs
    as a reasoning model's too (its requests open the block and think the budget first), and
    its unconstrained requests are compared with the same share's without thinking."""
    monkeypatch.setenv("COLUMNS", "400")
    args = ["bench", "--workload", "json", "--model", "default-thinking", "--num-requests", "8",
            "--output-len", "8", "--prompt-len", "16", "--json-fractions", "0,50",
            "--thinking-budget", "6"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "metric" in line)
    kinds = ["0% json", "50% json", "50% think 6+json"]
    assert [c.strip() for c in header.split("┃")[2:-1]] == [
        f"{k}, {m}" for k in kinds for m in ("sync", "async")
    ]
    rows = bench_table(out)
    assert rows["outputs identical (all runs)"] == ["", "yes"] * 3
    versus = rows["unconstrained ITL vs no thinking"]
    assert versus[:4] == [""] * 4 and all(v.endswith("x") for v in versus[4:])
    assert main(args[:3] + ["--num-requests", "2", "--thinking-budget", "6"]) == 2
    assert "needs a reasoning model" in capsys.readouterr().err


def test_constrain_with_thinking_opens_the_block_and_grows_the_lengths():
    spec = json_schema_spec()
    work = Workload([[5]] * 4, [4] * 4, [0.0] * 4)
    thinking = constrain(work, 50, spec, (99, 7))
    assert thinking.prompts == [[5, 99], [5], [5, 99], [5]]
    assert thinking.output_lens == [12, 4, 12, 4] and thinking.thinking == [7, None, 7, None]
    assert thinking.thinking_budget(0) == 7 and thinking.warmup().thinking == [7, None, 7, None]
