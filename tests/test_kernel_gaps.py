"""benchmarks/kernel_gaps.py: a kernel trace's idle between activities, by what ends and starts it."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import kernel_gaps  # noqa: E402


def _trace(tmp_path: Path, steps: int) -> Path:
    """`steps` steps on stream 7 of: kernel A (10 us), 1 us idle, kernel B (20 us), 3 us idle, a
    copy out (2 us), 6 us idle; and a copy on stream 9 (another stream: ignored)."""
    events, t = [], 0.0
    for _ in range(steps):
        for name, cat, duration, idle in (
            ("void A(int)", "kernel", 10.0, 1.0),
            ("B", "kernel", 20.0, 3.0),
            ("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", 2.0, 6.0),
        ):
            events.append({"ph": "X", "cat": cat, "name": name, "ts": t, "dur": duration, "tid": 7})
            t += duration + idle
        events.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": t - 20,
                       "dur": 15.0, "tid": 9})  # fmt: skip
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5.0, "dur": 1e4, "tid": 1})
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_gaps_are_summed_by_what_ends_and_starts_them(tmp_path, capsys):
    path = _trace(tmp_path, steps=100)
    activities = kernel_gaps.load(path)
    assert {a.name for a in activities} == {"A", "B", "Memcpy DtoH (Device -> Pinned)"}
    found, copies = kernel_gaps.transitions(activities)
    by_pair = {(t.before, t.after): t for t in found}
    assert [(t.before, t.after) for t in found] == [
        ("Memcpy DtoH (Device -> Pinned)", "A"), ("B", "Memcpy DtoH (Device -> Pinned)"),
        ("A", "B"),
    ]  # fmt: skip
    assert set(by_pair["A", "B"].gaps) == {1.0} and set(by_pair["B", found[1].after].gaps) == {3.0}
    assert set(copies["Memcpy DtoH (Device -> Pinned)"]) == {2.0}
    assert kernel_gaps.main([str(path), "--steps", "100"]) == 0
    out = capsys.readouterr().out
    assert "idle between activities: 10.0 us a step (80 steps measured)" in out
    assert "Memcpy DtoH (Device -> Pinned): 1.00 a step, median 2.00 us" in out


def test_a_trace_without_kernels_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"traceEvents": []}))
    try:
        kernel_gaps.load(path)
    except SystemExit as exc:
        assert "no kernels in the trace" in str(exc)
    else:
        raise AssertionError("an empty trace was accepted")
