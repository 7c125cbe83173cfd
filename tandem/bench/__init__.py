"""The benchmark: workloads, runs on one engine, and the `tandem bench` report."""

from tandem.bench.cli import add_bench_args, layout_text, run_bench
from tandem.bench.run import Run, run_workload
from tandem.bench.workloads import Workload, make_workload, profile_window

__all__ = [
    "Run",
    "Workload",
    "add_bench_args",
    "layout_text",
    "make_workload",
    "profile_window",
    "run_bench",
    "run_workload",
]
