"""The adaptive draft policy's cost model and choices, on made-up step times: an odd slow step
does not stop drafting for good, untimed sizes are estimated from timed ones, and drafts that do
not pay are not made."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.request import Request, SamplingParams
from tandem.scheduling.draft_policy import TRUSTED, DraftPolicy, StepCosts


def make_request(name: str = "r") -> Request:
    return Request(name, [1, 2, 3], SamplingParams(), 0, (0.0, 0, 1.0, 0.0, 0), 64, 0.0)


def weight_bound(tokens: int) -> float:
    """A step bound by reading the weights: 10 ms, and 1 ms for every token beyond the first."""
    return 0.010 + 0.001 * (tokens - 1)


def test_no_costs_until_two_sizes_are_trusted():
    costs = StepCosts()
    for _ in range(TRUSTED):
        costs.add(1, weight_bound(1))
    costs.add(5, weight_bound(5))
    assert costs.costs(1, 5) is None  # one size trusted: no line yet
    for _ in range(TRUSTED - 1):
        costs.add(5, weight_bound(5))
    assert costs.costs(1, 5) == pytest.approx([weight_bound(t) for t in range(1, 6)])


def test_an_odd_slow_step_is_outvoted():
    """The median of a size's times: one step slowed by other work does not stick to it."""
    costs = StepCosts()
    for t in (1, 5):
        for seconds in (weight_bound(t), 5 * weight_bound(t), weight_bound(t)):
            costs.add(t, seconds)
    assert costs.costs(5, 5) == pytest.approx([weight_bound(5)])


def test_untimed_sizes_follow_the_line_and_never_cost_less_than_a_smaller_one():
    costs = StepCosts()
    times = {32: 0.100, 36: 0.110, 40: 0.200}  # 40 rows take a slower kernel
    for tokens, seconds in times.items():
        for _ in range(TRUSTED):
            costs.add(tokens, seconds)
    estimated = costs.costs(32, 44)
    assert estimated[0] == times[32] and estimated[4] == times[36] and estimated[8] == times[40]
    assert all(later >= times[40] for later in estimated[9:])  # the floor of the slow size
    tokens, seconds = np.array(list(times)), np.array(list(times.values()))
    slope, fixed = np.polyfit(tokens, seconds, 1)  # through the medians...
    assert fixed < 0  # ... would give a step of no tokens a negative cost, so:
    (through_origin,), *_ = np.linalg.lstsq(tokens[:, None], seconds, rcond=None)
    assert estimated[2] == pytest.approx(through_origin * 34)
    assert times[32] < estimated[2] < estimated[3] < times[40]


def test_a_line_that_falls_is_flat_at_the_mean():
    costs = StepCosts()
    for tokens, seconds in {4: 0.012, 8: 0.010}.items():  # noise: the larger step timed faster
        for _ in range(TRUSTED):
            costs.add(tokens, seconds)
    assert costs.costs(2, 3) == [pytest.approx(0.011), pytest.approx(0.011)]
    assert costs.costs(9, 9) == [pytest.approx(0.012)]  # never below a smaller count's cost


def test_a_slow_first_verification_does_not_stop_drafting():
    """At batch 1 of a weight-bound model, drafts that are usually accepted pay; a first
    five-token step slowed fivefold (a kernel run for the first time) must not end drafting."""
    policy = DraftPolicy(max_drafts=4)
    request = make_request()
    slow_first = True
    for _ in range(40):
        (drafts,) = policy.allot([request], base_tokens=1, room=4)
        seconds = weight_bound(1 + drafts)
        if drafts and slow_first:
            seconds, slow_first = 5 * seconds, False
        policy.observe_step(1 + drafts, seconds)
        if drafts:
            policy.observe(request, drafts, drafts)  # a copy: every draft accepted
    assert [policy.allot([request], 1, 4)[0] for _ in range(5)] == [4] * 5


def test_drafts_that_do_not_pay_are_not_made():
    """A compute-bound large batch (every token costs a token's time) whose drafts are mostly
    rejected: after the first timings, no drafts; a batch whose tokens are nearly free and
    whose drafts hold takes every draft."""

    def run(seconds_per_step, accepted_of) -> list[int]:
        policy = DraftPolicy(max_drafts=4)
        requests = [make_request(f"r{i}") for i in range(32)]
        made = []
        for _ in range(30):
            allotted = policy.allot(requests, base_tokens=32, room=4)
            tokens = 32 + sum(allotted)
            policy.observe_step(tokens, seconds_per_step(tokens))
            for r, k in zip(requests, allotted, strict=True):
                if k:
                    policy.observe(r, k, accepted_of(k))
            made.append(sum(allotted))
        return made

    compute_bound = run(lambda tokens: 0.003 * tokens, lambda k: 0)
    assert compute_bound[-10:] == [0] * 10
    cheap = run(lambda tokens: 0.010 + 0.0001 * tokens, lambda k: k)  # bound by the weights
    assert cheap[-10:] == [32 * 4] * 10
