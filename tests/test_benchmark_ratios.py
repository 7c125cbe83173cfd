"""`tandem bench compare --served`'s ratio lines: Tandem over another server, paired by repeat."""

from tandem.bench.compare_served_report import tandem_ratios
from tandem.bench.ratios import paired_ratio


def row(label: str, tokens_per_s: list[float], itl_ms: list[float]) -> dict:
    return {
        "label": label,
        "mode": "chat",
        "streams": 1,
        "tokens_per_s_by_repeat": tokens_per_s,
        "itl_p50_ms_by_repeat": itl_ms,
    }


def test_ratios_pair_each_repeat_with_the_same_repeat_of_the_other_server() -> None:
    # Per repeat Tandem ran 1.3x, 1.05x and 0.8x the other's speed, the machine faster in
    # repeat 2: medians taken apart (130 over 100) would report 1.3x.
    ours = row("tandem", [130.0, 210.0, 40.0], [10.0, 5.0, 25.0])
    theirs = row("llama-server F32", [100.0, 200.0, 50.0], [13.0, 5.25, 20.0])
    mid, low, high = paired_ratio(ours["tokens_per_s_by_repeat"], theirs["tokens_per_s_by_repeat"])
    assert (round(mid, 9), round(low, 9), round(high, 9)) == (1.05, 0.8, 1.3)
    assert tandem_ratios([ours, theirs]) == [
        "tandem / llama-server F32, chat x1: output tok/s 1.050x (0.80-1.30), "
        "ITL p50 0.952x (0.77-1.25)"
    ]


def test_a_repeat_without_a_figure_is_left_out_of_its_ratio() -> None:
    nan = float("nan")
    assert paired_ratio([2.0, nan, 3.0], [1.0, 1.0, 1.0]) == (2.5, 2.0, 3.0)
    assert all(v != v for v in paired_ratio([nan], [1.0]))
