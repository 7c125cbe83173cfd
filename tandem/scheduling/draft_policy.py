"""How many tokens to draft for each request in the next step: from what drafts cost and what
they are worth.

Worth: each request estimates the chance that its next draft is accepted: its accepted drafts
over its tries (each verification tries its accepted drafts and the one rejected after them, if
any), both counts decaying, with `PRIOR_WEIGHT` tries at the rate over all requests added, so
that one miss does not stop a request that copies well and a new request starts from what the
engine has seen. Its j-th draft is then accepted with about acceptance ** j.

Per step: a draft token costs device time even when it is rejected, and what it costs depends
on the step's size and the device (where a step is bound by reading the weights, a few more
tokens are almost free; where it is bound by compute, each costs nearly a token's time; kernels
change at some row counts). The policy measures it: the device time of decoding steps by their
token count (small counts each on its own, larger ones in bands, since drafted steps' sizes
scatter; the median of a band's latest times once it has a few, a least-squares line through
those medians for the others), and gives each step the number of drafts, taken in order
of their chance of acceptance, that maximises the expected tokens per second of device time. So
speculation does not slow a large batch: it drafts there only what pays. In a small step, a
request that got no drafts for `PROBE_INTERVAL` steps gets one (a probe), or it would never
learn that its drafts became good; the interval doubles after each verification that accepted
nothing (free text probes rarely), and resets on an accepted draft.
Until the line exists, every other step drafts: one request, or as many as it takes to reach
the next band of step sizes (two bands to time). The engine keeps the step times for its life
(`DraftPolicy(costs=...)`), so only its first speculating steps pay for that.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tandem.request import Request

PROBE_INTERVAL = 4  # steps a request drafts nothing before it tries one draft again...
MAX_PROBE_BACKOFF = 4  # ... doubled after each verification that accepted nothing, up to 16x
# Probes only in steps this small: in a large step a probe's token costs nearly a token's time
# (compute-bound), and where drafts are cheap the cost model lets them through anyway.
PROBE_MAX_TOKENS = 8
COUNT_DECAY = 0.9  # weight of a request's earlier tries in its estimate (about the last 10)
PRIOR_WEIGHT = 2.0  # tries at the rate over all requests added to each request's own
POOLED_DECAY = 0.8  # weight of earlier verifications in the rate over all requests
INITIAL_ACCEPTANCE = 0.7
COST_WINDOW = 9  # a band's latest step times kept; its cost is their median
TRUSTED = 3  # step times of a band before its median stands for it
EXACT_COUNTS = 16  # token counts below this are timed each on its own; above, in bands
# Steps of more than this many times the largest trusted count are not estimated (they are
# not taken): a line through nearby counts, extrapolated far, has charged steps of 4x the
# tokens two thirds of what they took. So the drafts of a large batch grow band by band, each
# timed before the next is tried.
REACH = 1.5
# Drafts are made only where they promise this much more tokens per second than none: the
# estimates are noisy, and a draft that barely pays in them may cost in fact (a large batch).
MIN_GAIN = 1.1


def count_band(tokens: int) -> int:
    """The band a step's token count is timed in: the count itself below `EXACT_COUNTS`, then
    four bands per doubling (16-19, 20-23, ..., 32-39, ...), so that drafted steps, whose sizes
    scatter, still add up to trusted times."""
    if tokens < EXACT_COUNTS:
        return tokens
    width = 1 << (tokens.bit_length() - 3)
    return tokens - tokens % width


@dataclass
class StepCosts:
    """Device seconds of a decoding step by its token count.

    Steps are timed by band (`count_band`). A band timed `TRUSTED` times stands for the median
    of its latest `COST_WINDOW` steps (their median count and median time): other work on the
    machine only lengthens steps, and a mean would keep an odd slow step (a first run of a
    kernel, a busy neighbour) for good, since a count that looks slow is not chosen, so never
    timed, again. A count of its own band costs that time; any other count what the
    least-squares line through the trusted points says, and never less than a trusted point at
    or below it (more tokens never cost less), nor less than the first count asked for plus the
    line's cost per token for the tokens it adds: a base band timed while the machine ran slow
    would otherwise make the untimed larger steps beside it look free. Counts beyond `REACH`
    times the largest trusted one cost infinity (untried). None until two bands are
    trusted."""

    times: dict[int, deque[tuple[int, float]]] = field(default_factory=dict)
    _trusted: dict[int, tuple[float, float]] = field(default_factory=dict)  # band -> point
    _line: tuple[float, float] | None = None

    def add(self, tokens: int, seconds: float) -> None:
        band = count_band(tokens)
        times = self.times.setdefault(band, deque(maxlen=COST_WINDOW))
        times.append((tokens, seconds))
        if len(times) >= TRUSTED:
            counts, seconds_ = zip(*times, strict=True)
            self._trusted[band] = (statistics.median(counts), statistics.median(seconds_))
            self._line = self._fit()

    def _fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token): least squares through the trusted points,
        neither part below zero (a line bent to zero at one end is refitted with that part
        fixed, so the other still fits the points)."""
        if len(self._trusted) < 2:
            return None
        points = list(self._trusted.values())
        n = len(points)
        sx = sum(t for t, _ in points)
        sy = sum(c for _, c in points)
        sxx = sum(t * t for t, _ in points)
        sxy = sum(t * c for t, c in points)
        per_token = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        fixed = (sy - per_token * sx) / n
        if per_token < 0:  # larger steps timed faster (noise): a flat line at the mean
            return sy / n, 0.0
        if fixed < 0:  # a steep line: through the origin
            return 0.0, sxy / sxx
        return fixed, per_token

    def costs(self, first: int, last: int) -> list[float] | None:
        """The costs of steps of `first` to `last` tokens (None until the line exists)."""
        if self._line is None:
            return None
        fixed, per_token = self._line
        points = sorted(self._trusted.values())
        reach = REACH * points[-1][0]
        costs: list[float] = []
        for tokens in range(first, last + 1):
            if tokens > reach:
                costs.append(math.inf)
                continue
            own = self._trusted.get(tokens) if tokens < EXACT_COUNTS else None
            if own:
                costs.append(own[1])
                continue
            floor = max((c for t, c in points if t <= tokens), default=0.0)
            if costs:
                floor = max(floor, costs[0] + per_token * (tokens - first))
            costs.append(max(fixed + per_token * tokens, floor))
        return costs


class DraftPolicy:
    """The draft lengths of the next step, from each request's acceptance and measured costs."""

    def __init__(self, max_drafts: int, adaptive: bool = True, costs: StepCosts | None = None):
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.costs = StepCosts() if costs is None else costs  # the engine's, kept across policies
        self.acceptance = INITIAL_ACCEPTANCE  # over all requests
        self._untimed_steps = 0  # steps allotted before the cost line existed

    def observe(self, request: Request, drafted: int, accepted: int) -> None:
        """A retired verification: `accepted` of the request's `drafted` tokens were kept."""
        if drafted == 0:
            return
        # Each draft is accepted only if the ones before it were: the chance that the next one
        # holds is estimated from the accepted ones and the one that was not (if any).
        tries = accepted + (accepted < drafted)
        request.draft_hits = COUNT_DECAY * request.draft_hits + accepted
        request.draft_tries = COUNT_DECAY * request.draft_tries + tries
        rate = accepted / tries
        self.acceptance = POOLED_DECAY * self.acceptance + (1 - POOLED_DECAY) * rate
        backoff = request.probe_backoff + 1 if accepted == 0 else 0
        request.probe_backoff = min(backoff, MAX_PROBE_BACKOFF)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.costs.add(num_tokens, seconds)

    def allot(self, requests: list[Request], base_tokens: int, room: int) -> list[int]:
        """Each request's drafts for this step, given the tokens the step holds without them
        (each of `requests` samples one of its own) and the most drafts one may take (`room`).

        Drafts are ranked by their chance of acceptance; the step takes the leading ones that
        give the most expected tokens per second (if that beats none by `MIN_GAIN`), and every
        probe."""
        k = max(min(self.max_drafts, room), 0)
        if not self.adaptive or k == 0:
            return [k] * len(requests)
        costs = self.costs.costs(base_tokens, base_tokens + len(requests) * k)
        if costs is None:  # time steps with and without drafts first, in two bands
            self._untimed_steps += 1
            if self._untimed_steps % 2 == 0:
                return [0] * len(requests)
            band = count_band(base_tokens)
            next_band = band + (1 if band < EXACT_COUNTS else 1 << (band.bit_length() - 3))
            drafting = -(-(next_band - base_tokens) // k)  # requests to reach the next band
            return [k * (i < drafting) for i in range(len(requests))]
        probing = base_tokens <= PROBE_MAX_TOKENS
        probes = [
            probing and r.steps_without_drafts >= PROBE_INTERVAL << r.probe_backoff
            for r in requests
        ]
        # Every (request, j-th draft) pair's chance, probes' first drafts ranked first; then
        # the expected tokens per second of taking the leading d, for every d at once.
        chances = np.array([self._acceptance(r) for r in requests])[:, None] ** np.arange(1, k + 1)
        probe_first = np.zeros(chances.shape, dtype=bool)
        probe_first[:, 0] = probes
        order = np.argsort(-(chances + 2 * probe_first), axis=None, kind="stable")
        gains = len(requests) + np.concatenate([[0.0], np.cumsum(chances.ravel()[order])])
        rates = gains / np.maximum(np.asarray(costs[: len(gains)]), 1e-9)
        forced = sum(probes)
        best = forced
        if forced < len(order):
            d = forced + 1 + int(np.argmax(rates[forced + 1 :]))  # the first of the best
            if rates[d] > MIN_GAIN * rates[forced]:
                best = d
        allotted = np.bincount(order[:best] // k, minlength=len(requests)).tolist()
        for r, n in zip(requests, allotted, strict=True):
            r.steps_without_drafts = 0 if n else r.steps_without_drafts + 1
        return allotted

    def _acceptance(self, request: Request) -> float:
        prior = PRIOR_WEIGHT * self.acceptance
        return (request.draft_hits + prior) / (request.draft_tries + PRIOR_WEIGHT)


def can_draft(request: Request) -> bool:
    """Whether the request's tokens may be drafted: past min_tokens (whose mask needs the
    exact output index), and not a reasoning model's sample (its phase moves per token on the
    device: a verification's rows would each need their own)."""
    return request.reasoning is None and len(request.output_token_ids) >= request.params.min_tokens
