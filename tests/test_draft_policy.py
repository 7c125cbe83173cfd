"""The adaptive draft policy's cost model and choices, on made-up step times: an odd slow step
does not stop drafting for good, untimed sizes are estimated from timed ones, and drafts that do
not pay are not made."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.request import Request, SamplingParams
from tandem.scheduling.draft_policy import TRUSTED, DraftPolicy, StepCosts, count_band


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
    times = {32: 0.100, 48: 0.140, 64: 0.300}  # 64 rows take a slower kernel
    for tokens, seconds in times.items():
        for _ in range(TRUSTED):
            costs.add(tokens, seconds)
    estimated = dict(zip(range(32, 81), costs.costs(32, 80), strict=True))
    assert all(estimated[t] >= times[64] for t in range(64, 81))  # the floor of the slow size
    tokens, seconds = np.array(list(times)), np.array(list(times.values()))
    slope, fixed = np.polyfit(tokens, seconds, 1)  # through the medians...
    assert fixed < 0  # ... would give a step of no tokens a negative cost, so:
    (through_origin,), *_ = np.linalg.lstsq(tokens[:, None], seconds, rcond=None)
    assert estimated[40] == pytest.approx(through_origin * 40)
    assert times[32] <= estimated[33] < estimated[40] < estimated[56] < times[64]


def compute_bound_with_a_slow_base(base: int = 28) -> StepCosts:
    """Steps of 2.2 ms a token, except the base band's, all timed while the machine ran 1.5x
    slower (a neighbour's burst)."""
    costs = StepCosts()
    for tokens in (4, 8, 16, 20, 24):
        for _ in range(TRUSTED):
            costs.add(tokens, 0.0022 * tokens)
    for _ in range(TRUSTED):
        costs.add(base, 1.5 * 0.0022 * base)
    return costs


def test_a_base_timed_slow_does_not_make_larger_steps_look_free():
    """An untimed larger step costs the base's own time plus the line's cost per token for its
    extra tokens, more than the line alone says (13% over the slow base's time for 43% more
    tokens)."""
    costs = compute_bound_with_a_slow_base()
    base, *larger = costs.costs(28, 40)
    assert base == pytest.approx(1.5 * 0.0022 * 28)
    fixed, per_token = costs._line
    assert larger[-1] == pytest.approx(base + per_token * 12)
    assert larger[-1] > fixed + per_token * 40


def test_a_base_timed_slow_does_not_make_drafts_pay():
    """28 requests copying well (85% of drafts kept) on a compute-bound machine: a draft costs
    a token's time and brings 0.85 of one, so none is made, even with the base band's times
    taken in a slow moment."""
    policy = DraftPolicy(max_drafts=4)
    policy.costs = compute_bound_with_a_slow_base()
    requests = [make_request(f"r{i}") for i in range(28)]
    for r in requests:
        r.draft_hits, r.draft_tries = 8.5, 10.0
    assert policy.allot(requests, base_tokens=28, room=4 * 28) == [0] * 28


def test_steps_of_scattered_sizes_are_timed_in_bands():
    """Drafted steps seldom repeat a size: above 15 tokens sizes are timed in bands (four per
    doubling), so they still make trusted points, which move the line."""
    assert [count_band(t) for t in (1, 15, 16, 19, 20, 32, 39, 40, 64, 79, 80, 150)] == [
        1, 15, 16, 16, 20, 32, 32, 40, 64, 64, 80, 128
    ]  # fmt: skip
    costs = StepCosts()
    for tokens in (1, 1, 1, 32, 32, 32):
        costs.add(tokens, 0.010 + 0.002 * tokens)
    low = costs.costs(48, 48)[0]  # within reach of the trusted 32
    for tokens in (97, 103, 110):  # three drafted steps, three sizes, 30% slower than the line
        costs.add(tokens, 1.3 * (0.010 + 0.002 * tokens))
    assert costs.costs(48, 48)[0] > 1.2 * low


def test_steps_far_beyond_the_timed_ones_are_not_estimated():
    """A line through steps of 1 and 32 tokens is not trusted for 49 (over 1.5x the largest
    timed count): such a step costs infinity, so drafts grow band by band, each timed first."""
    costs = StepCosts()
    for tokens in (1, 1, 1, 32, 32, 32):
        costs.add(tokens, 0.010 + 0.0001 * tokens)  # bound by the weights: drafts nearly free
    assert costs.costs(48, 49) == [pytest.approx(0.0148), math.inf]
    policy = DraftPolicy(max_drafts=4)
    policy.costs = costs
    requests = [make_request(f"r{i}") for i in range(32)]  # every draft kept
    for r in requests:
        r.draft_hits, r.draft_tries = 100.0, 100.0
    assert sum(policy.allot(requests, base_tokens=32, room=4)) == 16  # up to 48 tokens


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


def drafts_at_32_rows(policy, steps: int, seconds_per_step, accepted_of) -> list[int]:
    """Drive `policy` through `steps` steps of 32 decoding requests (each step timed by
    `seconds_per_step` of its tokens; `accepted_of(k)`: a request's kept drafts of k) and
    return the drafts each step made."""
    requests = [make_request(f"r{i}") for i in range(32)]
    made = []
    for _ in range(steps):
        allotted = policy.allot(requests, base_tokens=32, room=4)
        tokens = 32 + sum(allotted)
        policy.observe_step(tokens, seconds_per_step(tokens))
        for r, k in zip(requests, allotted, strict=True):
            if k:
                policy.observe(r, k, accepted_of(k))
        made.append(sum(allotted))
    return made


def test_drafts_that_do_not_pay_are_not_made():
    """A compute-bound large batch (every token costs a token's time) whose drafts are mostly
    rejected: after the first timings, no drafts; a batch whose tokens are nearly free and
    whose drafts hold takes every draft."""
    compute_bound = drafts_at_32_rows(
        DraftPolicy(4), 30, lambda tokens: 0.003 * tokens, lambda k: 0
    )
    assert compute_bound[-10:] == [0] * 10
    cheap = drafts_at_32_rows(  # bound by the weights
        DraftPolicy(4), 30, lambda tokens: 0.010 + 0.0001 * tokens, lambda k: k
    )
    assert cheap[-10:] == [32 * 4] * 10


def test_a_compute_bound_batch_stops_drafting_though_small_steps_were_cheap():
    """Small steps bound by the weights, large ones by compute (every token a token's time):
    a line through both gives large steps a fixed part they do not have and drafts a cost too
    low. The drafts the line lets through are timed where they are made: drafted steps of
    scattered sizes must still teach the model, so that it stops drafting."""

    def hockey_stick(tokens: int) -> float:
        return max(0.010, 0.0022 * tokens)

    policy = DraftPolicy(max_drafts=4)
    for tokens in (2, 4, 6, 12, 16):  # a batch's tail: few requests left
        for _ in range(TRUSTED):
            policy.observe_step(tokens, hockey_stick(tokens))
    rng = np.random.default_rng(0)
    # Most drafts kept, more or fewer by request and step: scattered step sizes.
    made = drafts_at_32_rows(
        policy, 60, hockey_stick, lambda k: int(rng.integers(max(0, k - 2), k + 1))
    )
    assert made[-20:] == [0] * 20, made
