"""The choice of compute threads: timed at start-up so that a moment of contention cannot make
it, and applied per step by the K/V positions the step reads."""

import random
from types import SimpleNamespace

import pytest
import torch

from tandem import SamplingParams
from tandem.execution import cpu_threads, thread_timings_cache
from tandem.execution.fast_path import ExecutionPlan
from tandem.execution.thread_plan import PREFILL_TOKENS_FOR_ALL_THREADS, DecodeTimings, ThreadPlan

from helpers import make_llm


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

    def sleep(self, seconds: float) -> None:
        self.wall += seconds

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

    def weight_bytes(self) -> int:
        return 1 << 20

    def __call__(self, ids, positions, caches, meta) -> torch.Tensor:
        self.clock.run_step()
        return torch.zeros(len(ids), 4)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(hidden), 8)


def tune(monkeypatch, busy_runs: int) -> tuple[dict[int, float], bool, Clock]:
    clock = Clock(busy_runs)
    monkeypatch.setattr(cpu_threads, "time", clock)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    timings, settled = cpu_threads.tune_cpu_threads(FakeModel(clock), batch=4)
    assert torch.get_num_threads() == before
    return timings, settled, clock


def test_runs_that_lost_a_core_do_not_decide(monkeypatch) -> None:
    # The neighbour holds a core through the warm-up and the first 12 timed two-thread runs,
    # past the rounds a quiet machine needs: the rounds go on until 3 runs had their cores.
    timings, settled, clock = tune(monkeypatch, busy_runs=14)
    assert timings == pytest.approx({1: 90.0, 2: 50.0}) and settled
    assert cpu_threads.pick_cpu_threads(timings, batch=4) == 2
    timed = clock.two_thread_runs - cpu_threads.WARM_RUNS
    assert timed == 12 + cpu_threads.CLEAN_RUNS


def test_a_core_taken_for_good_is_timed_as_it_is(monkeypatch) -> None:
    timings, settled, clock = tune(monkeypatch, busy_runs=10**6)
    # No two-thread run had its cores: the fastest of all stands, not settled (not kept).
    assert timings == pytest.approx({1: 90.0, 2: 140.0}) and not settled
    assert cpu_threads.pick_cpu_threads(timings, batch=4) == 1
    assert clock.two_thread_runs == cpu_threads.WARM_RUNS + cpu_threads.MAX_ROUNDS


def test_a_quiet_machine_takes_the_fewest_rounds(monkeypatch) -> None:
    timings, settled, clock = tune(monkeypatch, busy_runs=0)
    assert timings == pytest.approx({1: 90.0, 2: 50.0}) and settled
    assert clock.two_thread_runs == cpu_threads.WARM_RUNS + cpu_threads.MIN_ROUNDS


def test_runs_too_short_to_judge_take_the_fewest_rounds(monkeypatch) -> None:
    """A tiny model's step of half a millisecond leaves two threads short of their share (the
    team's wake-up), with no neighbour: such runs are not judged, or every start would time
    the most rounds."""
    clock = Clock(busy_runs=10**6)
    clock.run_step = lambda: short_step(clock)
    monkeypatch.setattr(cpu_threads, "time", clock)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    timings, settled = cpu_threads.tune_cpu_threads(FakeModel(clock), batch=4)
    assert timings == pytest.approx({1: 0.6, 2: 0.5}) and settled
    assert clock.two_thread_runs == cpu_threads.WARM_RUNS + cpu_threads.MIN_ROUNDS


def short_step(clock: Clock) -> None:
    two = torch.get_num_threads() == 2
    clock.two_thread_runs += two
    seconds = 0.0005 if two else 0.0006
    clock.wall += seconds
    clock.cpu += seconds * (1.1 if two else 1.0)  # two threads, far short of 2x the wall time


class FakeRunner:
    """The stream runs what it is given at once; the plan set is noted."""

    def __init__(self):
        self.stream = SimpleNamespace(submit=lambda fn: SimpleNamespace(wait=fn))
        self.plan = None

    def set_cpu_threads(self, plan: ThreadPlan) -> None:
        self.plan = plan


def test_settled_timings_are_kept_for_the_next_start(monkeypatch, tmp_path) -> None:
    """A start times each context's step and keeps the timings; the next start of the same model
    and step shape plans from them without timing (and says so); another batch, or a damaged
    file, is timed anew; timings that never settled are used but not kept."""
    monkeypatch.setattr(thread_timings_cache, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    timed: list[int] = []  # the contexts timed, over every start
    tune = cpu_threads.tune_cpu_threads

    def counted_tune(model, batch, context, *args):
        timed.append(context)
        return tune(model, batch, context, *args)

    monkeypatch.setattr(cpu_threads, "tune_cpu_threads", counted_tune)

    def start(batch: int = 4, busy_runs: int = 0) -> tuple[ExecutionPlan, FakeRunner]:
        clock = Clock(busy_runs)
        monkeypatch.setattr(cpu_threads, "time", clock)
        plan, runner = ExecutionPlan("fused-cpu", packed_gemm=True, kernels=None), FakeRunner()
        cpu_threads.apply_cpu_threads(runner, FakeModel(clock), plan, None, batch, 4096)
        return plan, runner

    def kept() -> list:
        return sorted((tmp_path / "thread-timings").glob("*.json"))

    first, runner = start()
    assert len(timed) == 2 and not first.thread_timings_kept  # a short and a long context
    [file] = kept()
    second, again = start()
    assert len(timed) == 2 and second.thread_timings_kept  # nothing timed
    assert second.thread_timings == first.thread_timings and again.plan == runner.plan
    assert "timed at an earlier start" in second.describe()
    assert "timed at an earlier start" not in first.describe()
    start(batch=8)  # another step shape: timed, and kept beside the first
    assert len(timed) == 4 and len(kept()) == 2
    file.write_text("{not json")
    damaged, _ = start()
    assert len(timed) == 6 and not damaged.thread_timings_kept
    assert start()[0].thread_timings_kept and len(timed) == 6  # rewritten whole
    start(batch=16, busy_runs=10**6)  # a neighbour held a core throughout: used, not kept
    assert len(timed) == 8 and len(kept()) == 2


# A host's share of 0.5 ms a step (20 requests): charged to a step on both cores, and to the
# part of a one-thread step beyond its short time (its attention, on both cores).
SHORT = DecodeTimings(1000, {1: 2.0, 2: 1.8})


def test_one_thread_below_the_crossing_two_from_it() -> None:
    # Charged: one thread 2.0 ms short, 10 + 0.5 * 8 / 10 = 10.4 long; two threads 2.3 and 9.0.
    # The lines cross 0.3 / 1.7 of the way: 1000 + 8000 * 0.3 / 1.7 = 2411.8 positions.
    long = DecodeTimings(9000, {1: 10.0, 2: 8.5})
    plan = cpu_threads.plan_threads(SHORT, long, batch=20)
    assert plan == ThreadPlan((0, 2412), (1, 2), prefill=2)
    assert cpu_threads.step_cost(1, 2411, SHORT, long, 20) < cpu_threads.step_cost(
        2, 2411, SHORT, long, 20
    )
    assert [plan.threads(0, p) for p in (0, 1000, 2411, 2412, 10**6)] == [1, 1, 1, 2, 2]
    assert plan.threads(PREFILL_TOKENS_FOR_ALL_THREADS, 0) == 2  # a prefill: every core
    assert plan.describe() == "1 below 2412, 2 from 2412 K/V positions a step"


def test_a_count_that_wins_at_both_sizes_and_grows_slower_is_kept() -> None:
    twos = cpu_threads.plan_threads(
        DecodeTimings(1000, {1: 2.0, 2: 1.0}), DecodeTimings(9000, {1: 10.0, 2: 8.0}), 20
    )
    assert twos == ThreadPlan.fixed(2, 2)
    ones = cpu_threads.plan_threads(SHORT, DecodeTimings(9000, {1: 5.0, 2: 5.6}), batch=20)
    assert ones == ThreadPlan.fixed(1, 2) and ones.describe() == "1"


def test_one_core_is_never_charged() -> None:
    only = DecodeTimings(1000, {1: 2.0})
    plan = cpu_threads.plan_threads(only, DecodeTimings(9000, {1: 9.0}), batch=20)
    assert plan == ThreadPlan.fixed(1, 1)


def test_a_plan_must_start_at_zero_with_a_count_per_bound() -> None:
    with pytest.raises(ValueError, match="rise from 0"):
        ThreadPlan((5, 10), (1, 2), 2)
    with pytest.raises(ValueError, match="one decode count per bound"):
        ThreadPlan((0, 10), (1,), 2)


class RecordingPlan(ThreadPlan):
    """A plan that notes each decode step's K/V positions and count."""

    def threads(self, prefill_tokens: int, kv_positions: int) -> int:
        count = super().threads(prefill_tokens, kv_positions)
        if prefill_tokens == 0:
            DECODES.append((kv_positions, count))
        return count


DECODES: list[tuple[int, int]] = []


def test_the_count_switched_per_step_changes_no_token(tiny_llama) -> None:
    """Greedy and seeded outputs are the same bits with one thread, two, and a plan that goes
    from one to two as the contexts grow: each output is computed by one thread."""
    DECODES.clear()
    llm = make_llm(tiny_llama, cpu_threads=1)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(20 + 3 * i)] for i in range(4)]
    params = [SamplingParams(max_tokens=24, temperature=t, seed=5) for t in (0.0, 1.0)] * 2
    # Decode steps read from 21 + 24 + 27 + 30 positions to 4 x 23 more: the switch falls half way.
    plans = [ThreadPlan.fixed(1, 1), ThreadPlan.fixed(2, 2), RecordingPlan((0, 150), (1, 2), 2)]
    outputs = []
    try:
        for plan in plans:
            llm.engine.runner.set_cpu_threads(plan)
            outputs.append([o.token_ids for o in llm.generate(prompts, params)])
    finally:
        llm.close()
    assert outputs[0] == outputs[1] == outputs[2]
    assert {count for _, count in DECODES} == {1, 2}
    assert all(count == (1 if positions < 150 else 2) for positions, count in DECODES)
