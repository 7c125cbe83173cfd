"""How many tokens to draft for each request in the next step: adaptive, per request and per step.

Per request: the draft length follows what the request's recent verifications accepted (it grows
by two while every draft is accepted and shrinks to one more than was accepted otherwise, down
to none; a request at none tries one draft again every `PROBE_INTERVAL` steps).

Per step: a draft token costs device time even when it is rejected. The policy keeps a running
least-squares fit of a decoding step's device time against its token count (time = fixed +
per_token * tokens, refreshed from every retired step without a prefill) and drafts a token only while the chance that it is
accepted exceeds the share of a step's output that its cost could have bought: with `D` tokens
already in the step and `G` expected from it, a draft accepted with probability p pays off when
p > per_token * G / (fixed + per_token * D). Where steps are bound by reading the weights (a small
batch) the fixed part dominates and drafts are nearly free; where they are bound by compute (a
large batch) only drafts that are almost sure to be accepted are made, so speculation does not
slow a large batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.request import Request

PROBE_INTERVAL = 8  # steps a request drafts nothing before it tries one draft again
ACCEPTANCE_DECAY = 0.7  # weight of a request's earlier acceptance in its running estimate
FIT_DECAY = 0.98  # weight of earlier steps in the time fit (about the last 50 steps count)


@dataclass
class StepCostFit:
    """Exponentially weighted least squares of device time against tokens per step."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = FIT_DECAY
        self.n = d * self.n + 1
        self.sx = d * self.sx + tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + tokens * tokens
        self.sxy = d * self.sxy + tokens * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None until steps of different sizes were seen."""
        var = self.n * self.sxx - self.sx * self.sx
        if self.n < 4 or var <= 1e-9 * max(self.sxx, 1.0) * self.n:
            return None
        per_token = max((self.n * self.sxy - self.sx * self.sy) / var, 0.0)
        fixed = max((self.sy - per_token * self.sx) / self.n, 0.0)
        return fixed, per_token


class DraftPolicy:
    """The draft lengths of the next step, from each request's acceptance and the cost fit."""

    def __init__(self, max_drafts: int, adaptive: bool = True):
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.fit = StepCostFit()

    def wanted(self, request: Request) -> int:
        """The request's own draft length for its next step (before the step's budget)."""
        if not self.adaptive or request.num_drafts is None:
            return self.max_drafts
        if request.num_drafts == 0:
            request.steps_without_drafts += 1
            if request.steps_without_drafts < PROBE_INTERVAL:
                return 0
            request.steps_without_drafts = 0
            request.draft_probe = True
            return 1
        return request.num_drafts

    def observe(self, request: Request, drafted: int, accepted: int) -> None:
        """A retired verification: `accepted` of the request's `drafted` tokens were kept."""
        if drafted == 0:
            return
        request.draft_probe = False
        rate = accepted / drafted
        request.draft_acceptance = (
            ACCEPTANCE_DECAY * request.draft_acceptance + (1 - ACCEPTANCE_DECAY) * rate
        )
        if accepted == drafted:
            request.num_drafts = min(self.max_drafts, max(request.num_drafts or 0, drafted) + 2)
        else:
            request.num_drafts = min(self.max_drafts, accepted + 1) if accepted else 0

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.fit.add(num_tokens, seconds)

    def allot(self, wanted: list[tuple[Request, int]], base_tokens: int) -> list[int]:
        """Each request's drafts for this step, given the tokens the step holds without them
        (each of the `wanted` requests samples one of its own).

        Drafts are taken in order of their chance of acceptance (a request's j-th draft is
        accepted with about acceptance ** j) while they pay for their cost; a probe (one draft
        after a pause) is always taken, or a request that stopped drafting would never learn
        that its drafts became good."""
        allotted = [0] * len(wanted)
        coefficients = self.fit.coefficients() if self.adaptive else None
        if coefficients is None:
            return [k for _, k in wanted]
        fixed, per_token = coefficients
        candidates = sorted(
            (
                (r.draft_acceptance ** (j + 1), i)
                for i, (r, k) in enumerate(wanted)
                for j in range(k)
            ),
            reverse=True,
        )
        tokens, gain = base_tokens, float(len(wanted))
        for p, i in candidates:
            if p < 1 and p * (fixed + per_token * tokens) <= per_token * gain:
                break
            allotted[i] += 1
            tokens += 1
            gain += p
        return allotted


def can_draft(request: Request) -> bool:
    """Whether the request's tokens may be drafted: not under a grammar or penalties (their
    state follows tokens the host has not seen), and past min_tokens (whose mask needs the
    exact output index)."""
    processing = request.processing
    return (
        request.compiled_grammar is None
        and (processing is None or not processing.uses_penalties)
        and len(request.output_token_ids) >= request.params.min_tokens
    )
