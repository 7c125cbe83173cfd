"""The command line, the built-in default model, and the metrics/trace/plot outputs."""

from __future__ import annotations

import json
import random

import pytest

from tandem.cli import build_parser, main
from tandem.metrics import chrome_trace, plot_timeline

from conftest import random_prompts
from helpers import TEST_KV_CACHE_GIB, greedy, make_llm

# The commands' engines compute on one thread, not timing the counts at start-up, with a tiny
# model's cache (TEST_KV_CACHE_GIB), not the 1 GiB default.
ONE_THREAD = ["--cpu-threads", "1", "--kv-cache-memory-gib", str(TEST_KV_CACHE_GIB)]


def test_generate_prints_text_and_json(tiny_llama, capsys, monkeypatch):
    args = ["generate", "Hello there", "The café", "--model", str(tiny_llama), "--max-tokens", "5",
            *ONE_THREAD]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Hello there") and out[1].startswith("The café")

    assert main([*args, "--json", "--no-async"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello there", "The café"]
    assert all(
        len(r["token_ids"]) <= 5 and r["finish_reason"] in ("stop", "length") for r in records
    )


def test_generate_n_samples_without_prefix_caching(tiny_llama, capsys):
    args = ["generate", "Hello there", "--model", str(tiny_llama), "--max-tokens", "6", "-n", "3",
            "--temperature", "1", "--sampling-seed", "4", "--ignore-eos", "--json",
            *ONE_THREAD]  # fmt: skip
    results = []
    for extra in ([], ["--no-prefix-caching"]):
        assert main([*args, *extra]) == 0
        results.append([json.loads(line) for line in capsys.readouterr().out.splitlines()])
    assert results[0] == results[1]
    assert [r["index"] for r in results[0]] == [0, 1, 2]
    assert len({tuple(r["token_ids"]) for r in results[0]}) == 3


def test_generate_reads_prompts_from_a_file_and_stdin(tiny_llama, tmp_path, capsys, monkeypatch):
    import io

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\n\ntwo\n")
    args = ["--model", str(tiny_llama), "--json", *ONE_THREAD]
    assert main(["generate", "--file", str(prompts), *args]) == 0
    assert [json.loads(x)["prompt"] for x in capsys.readouterr().out.splitlines()] == ["one", "two"]
    monkeypatch.setattr("sys.stdin", io.StringIO("three\n"))
    assert main(["generate", *args, "--max-tokens", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "three"


def test_cli_errors_are_one_clear_line(tiny_llama, capsys):
    assert main(["generate", "x", "--model", str(tiny_llama), "--temperature", "-3"]) == 2
    assert "temperature must be in [0, 100]" in capsys.readouterr().err
    assert main(["generate", "x", "--model", str(tiny_llama / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_reads_well(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    for command in ("generate", "bench", "serve"):
        assert command in text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = capsys.readouterr().out
    assert "--no-async" in text and "--trace" in text and "--arrivals" in text


def test_bench_compares_both_loops_and_writes_trace_and_plot(tiny_llama, tmp_path, capsys):
    trace, plot = tmp_path / "trace.json", tmp_path / "timeline.png"
    args = ["bench", "--model", str(tiny_llama), "--num-requests", "6", "--prompt-len", "12",
            "--output-len", "8", "--trace", str(trace), "--plot", str(plot), *ONE_THREAD]  # fmt: skip
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "device idle %" in table and "speedup" in table
    assert "outputs identical" in table and "yes" in table
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert lanes == {"host", "device"}
    assert {e["name"].split()[0] for e in events if e["ph"] == "X"} >= {
        "schedule", "build", "launch", "wait", "update", "step",
    }  # fmt: skip
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_shared_prefix_compares_caching_off_and_on(tiny_llama, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    args = ["bench", "--model", str(tiny_llama), "--workload", "shared-prefix",
            "--num-requests", "8", "--num-prefixes", "2", "--prefix-len", "64",
            "--prompt-len", "8", "--output-len", "4", "--block-size", "8", *ONE_THREAD]  # fmt: skip
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    row = {line.split("│")[1].strip(): line.split("│")[2:-1] for line in lines if "│" in line}
    cells = {name: [c.strip() for c in values] for name, values in row.items()}
    # Columns: sync off, sync on, async off, async on. 6 of 8 requests reuse 64 tokens.
    assert cells["prefill tokens saved (cache)"] == ["0", "384", "0", "384"]
    assert (
        cells["prefix cache hit rate %"][0] == "0.0"
        and float(cells["prefix cache hit rate %"][1]) > 50
    )
    computed = [int(c) for c in cells["prefill tokens computed"]]
    assert computed[0] - computed[1] == 384 == computed[2] - computed[3]
    assert cells["speedup (cache off wall / cache on wall)"][1].endswith("x")
    assert cells["outputs identical (all runs)"][-1] == "yes"


def test_bench_with_poisson_arrivals(tiny_llama, capsys):
    args = ["bench", "--model", str(tiny_llama), "--num-requests", "5", "--prompt-len", "8",
            "--output-len", "4", "--arrivals", "poisson", "--rate", "200", "--modes", "async,sync",
            "--repeats", "2",
            "--temperature", "0.8", *ONE_THREAD]  # fmt: skip
    assert main(args) == 0
    assert "async" in capsys.readouterr().out


def test_summary_figures_are_consistent(tiny_llama):
    llm = make_llm(tiny_llama)
    prompts = random_prompts(random.Random(0), 5, 1024, 3, 30)
    mark = llm.engine.history.mark()
    llm.generate(prompts, greedy(7))
    summary = llm.engine.history.summary(since=mark)
    assert summary.output_tokens == 35 and len(summary.ttft_s) == 5 and len(summary.itl_s) == 30
    assert 0 < summary.device_busy_s <= summary.wall_s
    assert 0 <= summary.device_idle_fraction < 1
    assert all(x > 0 for x in summary.ttft_s) and all(x >= 0 for x in summary.itl_s)
    records = llm.engine.history.steps()
    assert all(r.device[0] <= r.device[1] for r in records)
    assert chrome_trace({"run": records})["traceEvents"]


def test_plot_handles_several_runs(tiny_llama, tmp_path):
    llm = make_llm(tiny_llama)
    llm.generate([[5, 6, 7]], greedy(3))
    plot_timeline(
        {"a": llm.engine.history.steps(), "b": llm.engine.history.steps()}, tmp_path / "p.png"
    )
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_default_model_is_built_once_and_served(tmp_path, monkeypatch):
    from tandem import LLM
    from tandem.models.default_model import default_model_path

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    assert (path / "config.json").is_file() and path.parent == tmp_path
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # cached, not rebuilt
    llm = LLM(dtype="float32", device="cpu", cpu_threads=1, kv_cache_memory_gib=TEST_KV_CACHE_GIB)
    assert llm.engine.model_path == path
    out = llm.generate("Once upon a time", greedy(6))[0]
    assert len(out.token_ids) == 6 and out.text
