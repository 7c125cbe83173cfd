"""`tandem bench latency` (one batch at a time: latency, TTFT, ITL per loop) and the bench's
subcommands: `tandem bench throughput` is bare `tandem bench` by name."""

from __future__ import annotations

import json
import statistics

import pytest

from tandem.cli import build_parser, main


def test_latency_times_every_batch_of_both_loops_with_equal_tokens(tiny_llama, tmp_path, capsys):
    report = tmp_path / "latency.json"
    args = ["bench", "latency", "--model", str(tiny_llama), "--input-len", "12", "--output-len",
            "5", "--batch-size", "3", "--num-iters", "2", "--num-iters-warmup", "1",
            "--output-json", str(report)]  # fmt: skip
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tokens equal across loops: yes" in out and "TTFT p50" in out
    figures = json.loads(report.read_text())
    assert figures["tokens_equal"] is True
    for mode in ("sync", "async"):
        loop = figures[mode]
        assert len(loop["latencies_s"]) == 2  # the timed batches, not the warm-up
        assert loop["latency_s"]["p50"] == pytest.approx(statistics.median(loop["latencies_s"]))
        # every request's first token comes before its batch ends, and 5 tokens make 4 gaps
        assert 0 < loop["ttft_s"]["p99"] <= max(loop["latencies_s"])
        assert loop["itl_s"]["p50"] > 0
        assert loop["tokens_per_s"] == pytest.approx(2 * 3 * 5 / sum(loop["latencies_s"]))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--modes", "sync,fast"], "--modes takes sync and/or async"),
        (["--input-len", "2000", "--max-model-len", "256"], "exceeds the context limit 256"),
    ],
)
def test_latency_refuses_bad_sizes_with_their_flag(tiny_llama, capsys, flags, message):
    assert main(["bench", "latency", "--model", str(tiny_llama), *flags]) == 2
    assert message in capsys.readouterr().err


def test_throughput_is_the_bare_bench_by_name():
    parser = build_parser()
    flags = ["--workload", "chat", "--num-requests", "3", "--max-num-seqs", "7"]
    bare = vars(parser.parse_args(["bench", *flags]))
    named = vars(parser.parse_args(["bench", "throughput", *flags]))
    assert named.pop("bench_command") == "throughput" and bare.pop("bench_command") is None
    assert named == bare
