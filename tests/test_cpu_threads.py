"""The start-up choice of compute threads: timed so that a moment of contention cannot make it."""

from types import SimpleNamespace

import pytest
import torch

from tandem.execution import cpu_threads


class Clock:
    """Wall and process CPU time of a fake machine with two cores and a neighbour that takes
    one of them for the first `busy_runs` two-thread runs (or for good)."""

    def __init__(self, busy_runs: int):
        self.busy_runs = busy_runs
        self.wall = self.cpu = 0.0
        self.two_thread_runs = 0

    def perf_counter(self) -> float:
        return self.wall

    def process_time(self) -> float:
        return self.cpu

    def run_step(self) -> None:
        threads = torch.get_num_threads()
        if threads == 1:
            seconds, busy_cores = 0.090, 1.0
        else:
            self.two_thread_runs += 1
            contended = self.two_thread_runs <= self.busy_runs
            seconds, busy_cores = (0.140, 1.2) if contended else (0.050, 2.0)
        self.wall += seconds
        self.cpu += seconds * busy_cores


class FakeModel:
    spec = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=4, vocab_size=8)

    def __init__(self, clock: Clock):
        self.clock = clock

    def __call__(self, ids, positions, caches, meta) -> torch.Tensor:
        self.clock.run_step()
        return torch.zeros(len(ids), 4)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(hidden), 8)


def tune(monkeypatch, busy_runs: int) -> tuple[dict[int, float], Clock]:
    clock = Clock(busy_runs)
    monkeypatch.setattr(cpu_threads, "time", clock)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    timings = cpu_threads.tune_cpu_threads(FakeModel(clock), batch=4)
    assert torch.get_num_threads() == before
    return timings, clock


def test_runs_that_lost_a_core_do_not_decide(monkeypatch) -> None:
    # The neighbour holds a core through the warm-up and the first 12 timed two-thread runs,
    # past the rounds a quiet machine needs: the rounds go on until 3 runs had their cores.
    timings, clock = tune(monkeypatch, busy_runs=14)
    assert timings == pytest.approx({1: 90.0, 2: 50.0})
    assert cpu_threads.pick_cpu_threads(timings, batch=4) == 2
    timed = clock.two_thread_runs - cpu_threads.WARM_RUNS
    assert timed == 12 + cpu_threads.CLEAN_RUNS


def test_a_core_taken_for_good_is_timed_as_it_is(monkeypatch) -> None:
    timings, clock = tune(monkeypatch, busy_runs=10**6)
    # No two-thread run had its cores: the fastest of all stands.
    assert timings == pytest.approx({1: 90.0, 2: 140.0})
    assert cpu_threads.pick_cpu_threads(timings, batch=4) == 1
    assert clock.two_thread_runs == cpu_threads.WARM_RUNS + cpu_threads.MAX_ROUNDS


def test_a_quiet_machine_takes_the_fewest_rounds(monkeypatch) -> None:
    timings, clock = tune(monkeypatch, busy_runs=0)
    assert timings == pytest.approx({1: 90.0, 2: 50.0})
    assert clock.two_thread_runs == cpu_threads.WARM_RUNS + cpu_threads.MIN_ROUNDS
