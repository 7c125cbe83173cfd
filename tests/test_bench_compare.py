"""`tandem bench compare`: Tandem beside its peers, offline and `--served`, through the command
line. The peers (vLLM's environment, llama.cpp's binaries) are never needed here: the runs name
Tandem's rows only."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main


def test_offline_compare_gives_both_loops_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "compare.json"
    args = ["bench", "compare", "--engines", "tandem-sync,tandem-async", "--model", "default",
            "--num-requests", "4", "--output-len", "8", "--tandem-threads", "1",
            "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    assert "tokens equal Tandem async" in capsys.readouterr().out
    result = json.loads(out.read_text())
    (workload,) = result["workloads"]
    rows = {row["engine"]: row for row in workload["rows"]}
    assert set(rows) == {"tandem-sync", "tandem-async"}
    assert workload["reference"] == "tandem-async"  # whatever order --engines names them in
    for row in rows.values():
        assert row["requests"] == 4 and row["output_tokens"] == 4 * 8
        assert row["equal"] == 4 and row["lengths_ok"] and row["first_divergence"] is None
    assert result["settings"]["limits"]["max_num_seqs"] == 256  # the offline defaults filled in

    picture = tmp_path / "compare.png"  # --from draws a saved run again, nothing re-run
    assert main(["bench", "compare", "--from", str(out), "--plot", str(picture)]) == 0
    assert picture.stat().st_size > 0


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--concurrency", "4"], "--concurrency"),  # served-only, offline
        (["--no-pause"], "--no-pause"),
        (["--served", "--engines", "hf"], "--engines"),  # offline-only, served
        (["--served", "--max-num-seqs", "8"], "--max-num-seqs"),
        (["--workload", "agent"], "--workload agent"),  # the other mode's workload
        (["--served", "--workload", "chat"], "--workload chat"),
    ],
)
def test_a_flag_of_the_other_mode_is_refused_by_name(flags, named, capsys):
    assert main(["bench", "compare", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1


def test_old_flag_names_still_parse():
    """The old scripts' flags translate 1:1: --max-tokens is --output-len's other name."""
    from tandem.cli import build_parser

    args = build_parser().parse_args(["bench", "compare", "--served", "--max-tokens", "16"])
    assert args.output_len == 16 and args.served


def test_served_compare_against_tandem_serve(tmp_path):
    out = tmp_path / "served.json"
    args = ["bench", "compare", "--served", "--servers", "tandem", "--model", "default",
            "--concurrency", "2", "--modes", "completions", "--repeats", "1",
            "--num-requests", "2", "--max-tokens", "4", "--context", "256",
            "--tandem-args", "--cpu-threads 1 --max-model-len 256", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["server"], row["mode"], row["streams"]) == ("tandem", "completions", 2)
    assert row["errors"] == 0 and row["short_requests"] == 0
    assert row["output_tokens_per_s"] > 0
