"""`tandem bench --workload copy` (and `copy-json`) and `--speculative-config`'s columns.

The copy workload asks for a shipped passage back (through the chat template where the model has
one; a model without a tokenizer gets prompts whose second half repeats the first), answers
ending at EOS or --output-len. With --speculative-config the report runs speculation off and as
n-gram drafts (and the draft model when the config names one), each in both loops, on one
engine; greedy outputs must not depend on the drafts, so all of them form one group."""

from __future__ import annotations

import argparse
import io

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from tandem.bench.cli import Column, add_speculation_rows, bench_columns
from tandem.bench.run import Run
from tandem.bench.workloads import (
    COPY_INSTRUCTION,
    COPY_JSON_INSTRUCTION,
    COPY_JSON_SCHEMA,
    COPY_OUTPUT_LEN,
    Workload,
    copy_passages,
    copy_prompt_ids,
    make_copy_workload,
    resolve_workload,
)
from tandem.cli import build_parser, engine_config, main
from tandem.config import SpeculativeConfig
from tandem.metrics import RunSummary, SpeculativeStats
from tandem.request import StructuredOutputsParams

from helpers import bench_table

NGRAM3 = '{"method": "ngram", "num_speculative_tokens": 3}'


def _bench_args(*flags: str) -> argparse.Namespace:
    args = build_parser().parse_args(["bench", *flags])
    resolve_workload(args, engine_config(args), "cpu")
    return args


def _header(out: str) -> list[str]:
    header = next(line for line in out.splitlines() if "metric" in line)
    return [c.strip() for c in header.split("┃")[2:-1]]


# ------------------------------------------------------------------ the workload
def test_copy_prompts_ask_for_each_passage_back(tiny_llama):
    passages = copy_passages()
    assert len(passages) >= 16 and len(set(passages)) == len(passages)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = copy_prompt_ids(tokenizer, len(passages) + 2)
    for passage, ids in zip(passages, prompts, strict=False):
        messages = [{"role": "user", "content": COPY_INSTRUCTION + passage}]
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert ids == expected
    assert prompts[len(passages) :] == prompts[:2]  # --num-requests beyond them: cycling

    tokenizer.chat_template = None  # a base model: the plain text, tokenized as the engine does
    plain = copy_prompt_ids(tokenizer, 2)
    assert plain == [tokenizer(COPY_INSTRUCTION + p).input_ids for p in passages[:2]]

    args = _bench_args("--workload", "copy", "--num-requests", "3", "--output-len", "16")
    work = make_copy_workload(args, tokenizer, 1024, 2048)
    assert work.prompts == copy_prompt_ids(tokenizer, 3) and work.output_lens == [16] * 3
    assert not work.ignore_eos and work.ends_early and work.arrival_times == [0.0] * 3
    assert _bench_args("--workload", "copy").output_len == COPY_OUTPUT_LEN


def test_copy_json_asks_for_each_passage_back_under_its_schema(tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    args = _bench_args("--workload", "copy-json", "--num-requests", "3")
    work = make_copy_workload(args, tokenizer, 1024, 2048)
    assert work.prompts == copy_prompt_ids(tokenizer, 3, COPY_JSON_INSTRUCTION)
    assert work.prompts != copy_prompt_ids(tokenizer, 3)
    assert work.structured == [StructuredOutputsParams(json=COPY_JSON_SCHEMA)] * 3
    assert work.output_lens == [COPY_OUTPUT_LEN] * 3 and work.ends_early


def test_a_model_without_a_tokenizer_gets_a_repeated_span():
    args = _bench_args("--workload", "copy", "--num-requests", "8", "--prompt-len", "40")
    work = make_copy_workload(args, None, 500, 2048)
    assert len(work.prompts) == 8 and not work.ignore_eos
    for ids in work.prompts:
        assert 20 <= len(ids) <= 60 and all(3 <= t < 500 for t in ids)
        half = (len(ids) + 1) // 2
        assert ids[half:] == ids[: len(ids) - half]  # the second half repeats the first
    assert work.prompts != [work.prompts[0]] * 8
    assert make_copy_workload(args, None, 500, 2048).prompts == work.prompts  # seeded


# ------------------------------------------------------------------ the columns
def test_speculation_columns_and_groups():
    work = Workload([[5]], [4], [0.0])
    modes = ["sync", "async"]
    ngram = SpeculativeConfig.of(NGRAM3)
    columns = bench_columns(_bench_args(), True, work, modes, ngram)
    assert [c.name for c in columns] == ["off, sync", "off, async", "ngram, sync", "ngram, async"]
    assert [c.variant.speculative for c in columns] == [None, None, ngram, ngram]
    assert {c.variant.group for c in columns} == {"spec"}  # the same outputs: one group

    draft = SpeculativeConfig(method="draft_model", model="/a/draft", num_speculative_tokens=5)
    columns = bench_columns(_bench_args("--temperature", "0.8"), True, work, modes, draft)
    assert [c.name for c in columns][4:] == ["draft, sync", "draft, async"]
    assert columns[4].variant.speculative is draft
    n = columns[2].variant.speculative  # n-gram drafts of the draft model's length
    assert n.method == "ngram" and n.num_speculative_tokens == 5 and n.model is None
    assert {c.variant.group for c in columns} == {"spec"}  # seeded sampling too

    plain = bench_columns(_bench_args(), True, work, modes)
    assert [c.name for c in plain] == modes and plain[0].variant.speculative is None
    # Workloads with variants of their own run every column under the engine's config.
    json_columns = bench_columns(_bench_args("--workload", "json"), True, work, modes, ngram)
    assert len(json_columns) == 6 and all(c.variant.speculative is ngram for c in json_columns)


def test_speculation_rows_from_the_run_summaries():
    def run(drafted: int, accepted: int, verified: int, tokens: int) -> Run:
        stats = SpeculativeStats(drafted, accepted, verified)
        return Run(RunSummary(1.0, 1.0, 1, tokens, [], [], {}, 0, stats), [], [], 0, 0)

    work, ngram = Workload([[5]], [4], [0.0]), SpeculativeConfig()
    columns: list[Column] = bench_columns(_bench_args(), True, work, ["sync", "async"], ngram)
    results = dict(zip([c.name for c in columns], [run(0, 0, 0, 100), run(0, 0, 0, 200),
                        run(40, 30, 10, 150), run(40, 10, 20, 500)], strict=True))  # fmt: skip
    table = Table()
    table.add_column("metric")
    for c in columns:
        table.add_column(c.name)
    runs = {name: [run] for name, run in results.items()}
    add_speculation_rows(table, columns, results, runs)
    console = Console(file=io.StringIO(), width=300)
    console.print(table)
    rows = bench_table(console.file.getvalue())
    assert rows["spec decode: draft tokens"] == ["-", "-", "40", "40"]
    assert rows["spec decode: accepted tokens"] == ["-", "-", "30", "10"]
    assert rows["spec decode: acceptance rate %"] == ["-", "-", "75.0", "25.0"]
    assert rows["spec decode: mean accepted length"] == ["-", "-", "4.00", "1.50"]
    assert rows["ngram vs off (tokens/s)"] == ["", "", "1.500x", "2.500x"]
    assert "draft vs off (tokens/s)" not in rows


def test_speculation_ratio_pairs_each_round_with_the_same_round_off():
    """Three rounds in which ngram ran 1.3x, 1.05x and 0.8x speculation off, the machine
    faster in round 2: medians taken apart (130 over 100) would report 1.3x."""

    def run(tokens_per_s: float) -> Run:
        stats = SpeculativeStats(4, 2, 1)
        return Run(RunSummary(1.0, 1.0, 1, tokens_per_s, [], [], {}, 0, stats), [], [], 0, 0)

    work, ngram = Workload([[5]], [4], [0.0]), SpeculativeConfig()
    columns = bench_columns(_bench_args(), True, work, ["sync"], ngram)
    off, on = (c.name for c in columns)
    runs = {off: [run(100), run(200), run(50)], on: [run(130), run(210), run(40)]}
    results = {off: runs[off][0], on: runs[on][0]}
    table = Table()
    table.add_column("metric")
    for c in columns:
        table.add_column(c.name)
    add_speculation_rows(table, columns, results, runs)
    console = Console(file=io.StringIO(), width=300)
    console.print(table)
    assert bench_table(console.file.getvalue())["ngram vs off (tokens/s)"] == [
        "",
        "1.050x (0.80-1.30)",
    ]


# ------------------------------------------------------------------ the report
def test_copy_bench_runs_both_loops(tiny_llama, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one table row per line
    args = ["bench", "--workload", "copy", "--model", str(tiny_llama), "--num-requests", "4",
            "--output-len", "16"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    print(out)
    assert _header(out) == ["sync", "async"]
    assert "4 requests (copy: repeat-a-passage prompts, EOS on, at most 16 tokens)" in " ".join(
        out.split()
    )
    rows = bench_table(out)
    for cell in rows["requests finished by stop / length"]:
        stop, length = map(int, cell.split(" / "))
        assert stop + length == 4
    assert "spec decode: draft tokens" not in rows  # no --speculative-config
    assert rows["outputs identical (all runs)"] == ["", "yes"]


def test_copy_bench_with_speculation_off_and_ngram(tiny_llama, capsys, monkeypatch):
    """Needs the engine's speculative decoding (Engine.configure(speculative_config=...))."""
    monkeypatch.setenv("COLUMNS", "300")
    args = ["bench", "--workload", "copy", "--model", str(tiny_llama), "--num-requests", "4",
            "--output-len", "24", "--max-num-seqs", "2", "--speculative-config", NGRAM3]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    print(out)
    assert _header(out) == ["off, sync", "off, async", "ngram, sync", "ngram, async"]
    assert '"num_speculative_tokens": 3' in out and "at most 2 requests run at once" in out
    rows = bench_table(out)
    drafted = rows["spec decode: draft tokens"]
    accepted = rows["spec decode: accepted tokens"]
    assert drafted[:2] == accepted[:2] == ["-", "-"]  # speculation off
    assert all(0 <= int(a) <= int(d) for a, d in zip(accepted[2:], drafted[2:], strict=True))
    for cell in rows["spec decode: acceptance rate %"][2:]:
        assert 0 <= float(cell) <= 100
    assert [c.endswith("x") for c in rows["ngram vs off (tokens/s)"]] == [False, False, True, True]
    assert [c.endswith("x") for c in rows["speedup (sync wall / async wall)"]] == [False, True] * 2
    assert rows["outputs identical (all runs)"] == ["", "", "", "yes"]  # one greedy group


def test_copy_json_bench_drafts_under_the_grammar(tiny_llama, capsys, monkeypatch):
    """Every answer is under a grammar and still drafts; the outputs do not depend on it."""
    monkeypatch.setenv("COLUMNS", "300")
    args = ["bench", "--workload", "copy-json", "--model", str(tiny_llama), "--num-requests", "3",
            "--output-len", "16", "--speculative-config", NGRAM3]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    print(out)
    assert "(copy-json: repeat-a-passage prompts as JSON, EOS on" in " ".join(out.split())
    rows = bench_table(out)
    assert all(int(d) > 0 for d in rows["spec decode: draft tokens"][2:])
    assert rows["outputs identical (all runs)"] == ["", "", "", "yes"]
