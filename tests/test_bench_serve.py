"""`tandem bench serve` without a server: bad flags are refused in one line before anything is
sent, the old script's flag names still parse, and arrivals follow vLLM's gamma process. (The
load against a live server: tests/test_server.py.)"""

from __future__ import annotations

import statistics

import pytest

from tandem.bench.serve import arrival_times, random_prompts
from tandem.cli import build_parser, main

NO_SERVER = "http://127.0.0.1:9"  # never reached: the flags are refused first


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--goodput", "foo"], "--goodput takes METRIC:MS"),
        (["--goodput", "ttft:-1"], "--goodput takes METRIC:MS"),
        (["--percentile-metrics", "ttft,tokens"], "--percentile-metrics takes some of"),
        (["--metric-percentiles", "0,50"], "--metric-percentiles takes numbers in (0, 100]"),
        (["--compare", "chat,smoke-signals"], "--compare: unknown API 'smoke-signals'"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--burstiness", "0"], "--burstiness must be a number > 0"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--token-prompts", "--api", "chat"], "--token-prompts sends completions prompts"),
        (["--dataset-name", "agent", "--api", "messages"], "--dataset-name agent replays"),
        (["--compare", "chat,completions", "--plot", "x.png"], "--plot draws one run"),
        (["--dataset-name", "agent", "--request-rate", "4"], "no --request-rate"),
    ],
)
def test_bad_serve_bench_flags_are_refused_in_one_line(flags, message, capsys) -> None:
    assert main(["bench", "serve", "--base-url", NO_SERVER, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem bench: error: ") and message in err, err
    assert err.count("\n") == 1


def test_the_load_scripts_old_flag_names_still_parse() -> None:
    old = ["--url", "http://h:1", "--num-requests", "5", "--concurrency", "2", "--rate", "3",
           "--max-tokens", "7", "--no-ignore-eos", "--chat"]  # fmt: skip
    new = ["--base-url", "http://h:1", "--num-prompts", "5", "--max-concurrency", "2",
           "--request-rate", "3", "--random-output-len", "7", "--no-ignore-eos",
           "--api", "chat"]  # fmt: skip
    parse = build_parser().parse_args
    assert vars(parse(["bench", "serve", *old])) == vars(parse(["bench", "serve", *new]))


def test_arrivals_are_gamma_with_the_rate_as_mean_and_prompts_do_not_depend_on_them() -> None:
    assert arrival_times(4, float("inf"), 1.0, 0) == [0.0] * 4
    for burstiness in (0.25, 1.0, 4.0):
        times = arrival_times(4000, 50.0, burstiness, seed=1)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert statistics.mean(gaps) == pytest.approx(1 / 50, rel=0.1)
        # a gamma of shape k has coefficient of variation 1/sqrt(k): burstier below 1
        cv = statistics.stdev(gaps) / statistics.mean(gaps)
        assert cv == pytest.approx(burstiness**-0.5, rel=0.15)
    assert arrival_times(10, 5.0, 1.0, 3) == arrival_times(10, 5.0, 1.0, 3)
    assert random_prompts(0, 3, 8) == random_prompts(0, 3, 8) != random_prompts(1, 3, 8)
