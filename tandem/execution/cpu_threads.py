"""How many CPU threads compute a step: timed at start-up on the thread the steps run on, then
chosen per step by the K/V positions it reads (`thread_plan.ThreadPlan`).

A decode step is GEMMs, whose time depends on the thread count, and attention, whose time grows
with the K/V it reads and which spreads over every core from a size on whatever the count
(csrc `attend_runs`). So each candidate count is timed at a short context and at a long one,
which gives it a line, step time against K/V positions read, once the host's share of a core is
charged where it lands; a step takes the count whose line is lowest at its positions. Steps
that prefill use every core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tandem.config import usable_cores
from tandem.execution import thread_timings_cache
from tandem.execution.fast_path import ExecutionPlan
from tandem.execution.kv_cache import allocate_kv_cache
from tandem.execution.runner import ModelRunner
from tandem.execution.thread_plan import DecodeTimings, ThreadPlan
from tandem.models.llama import LlamaModel
from tandem.ops.attention_metadata import AttentionMetadata
from tandem.ops.kv_quant import row_width

# The long timing's step reads at least this much K/V (past the last-level cache, as a long
# context's step does) and KV_PER_WEIGHT times the weights' bytes, so that its attention, not
# its GEMMs, makes the difference to the short timing (a slope read above the noise), up to
# MOST_KV_BYTES (a few tens of milliseconds a run).
LONG_KV_BYTES = 64 << 20
KV_PER_WEIGHT = 4
MOST_KV_BYTES = 512 << 20
# Far past any step's K/V positions: the plan's bounds are searched up to here.
MOST_POSITIONS = 1 << 40


def apply_cpu_threads(
    runner: ModelRunner,
    model: LlamaModel,
    plan: ExecutionPlan,
    threads: int | None,
    batch: int,
    max_model_len: int,
    kv_dtype: torch.dtype = torch.float32,
) -> None:
    """Fix the runner's compute threads: `threads` if the user chose, else the plan the timings
    give: those an earlier start kept for this machine, model and step shape, or new ones.

    The timing runs where the steps will run (the device thread, with its own OpenMP team)."""
    if threads is not None:
        runner.set_cpu_threads(ThreadPlan.fixed(threads, threads))
        plan.cpu_threads = threads
        return
    long = long_context(model, batch, kv_dtype, max_model_len)
    contexts = (SHORT_CONTEXT, long) if long > SHORT_CONTEXT else (SHORT_CONTEXT,)
    key = thread_timings_cache.timings_key(model, plan, batch, contexts, kv_dtype)
    timings = thread_timings_cache.load(key)
    plan.thread_timings_kept = timings is not None
    if timings is None:

        def timed() -> list[tuple[dict[int, float], bool]]:
            return [tune_cpu_threads(model, batch, c, kv_dtype) for c in contexts]

        tuned = runner.stream.submit(timed).wait()
        timings = [DecodeTimings(batch * c, ms) for c, (ms, _) in zip(contexts, tuned, strict=True)]
        if all(settled for _, settled in tuned):
            thread_timings_cache.store(key, timings)
    if len(timings) == 1:  # a context too short to time a long step: one count throughout
        one = pick_cpu_threads(timings[0].ms, batch)
        chosen = ThreadPlan.fixed(one, max(timings[0].ms))
    else:
        chosen = plan_threads(timings[0], timings[1], batch)
    plan.thread_timings = timings
    plan.thread_plan = chosen
    plan.cpu_threads = chosen.decode[0]
    runner.set_cpu_threads(chosen)


# Timing rounds: each round runs every candidate once, in turn, so that something else taking
# the cores for a while slows every candidate's runs alike instead of one candidate's only.
WARM_RUNS = 2  # per candidate, untimed: caches and thread pools
MIN_ROUNDS, MAX_ROUNDS = 8, 40
CLEAN_RUNS = 3  # runs per candidate that had their cores, wanted before stopping early
# A run had its cores when its process used at least this share of threads x wall time: the
# compute team's threads stay on their cores (they spin between regions), so a smaller share
# means another process took one of them.
CLEAN_SHARE = 0.85
# A run shorter than this is not judged (taken as clean): the team's wake-up alone leaves a
# sub-millisecond run's threads short of their share, with no neighbour in sight, and a
# neighbour that takes a core for so short a time cannot be told apart.
JUDGED_RUN_S = 0.002
# After a run on more threads, the team's idle workers spin for some milliseconds before they
# sleep, on the core a run on fewer threads wants for its attention's helper: wait them out, as
# a step of a steady count never meets them.
SETTLE_S = 0.01
BLOCK_SIZE = 16
SHORT_CONTEXT = BLOCK_SIZE + 1  # two blocks a request: a step whose GEMMs decide


@dataclass
class ThreadRuns:
    """One candidate count's timed runs (ms): all of them, and those that had their cores."""

    every: list[float] = field(default_factory=list)
    clean: list[float] = field(default_factory=list)

    def best(self) -> float:
        """The fastest run that had its cores; the fastest of all if none had."""
        return min(self.clean or self.every)

    @property
    def settled(self) -> bool:
        return len(self.clean) >= CLEAN_RUNS


def long_context(model: LlamaModel, batch: int, kv_dtype: torch.dtype, max_model_len: int) -> int:
    """Tokens a request of the long timing holds: the step reads the K/V bytes above (in the
    cache's dtype), within the context a request may have."""
    spec = model.spec
    row_bytes = row_width(spec.head_dim, kv_dtype) * kv_dtype.itemsize
    per_position = 2 * spec.num_layers * spec.num_kv_heads * row_bytes
    kv_bytes = max(LONG_KV_BYTES, min(KV_PER_WEIGHT * (model.weight_bytes() or 0), MOST_KV_BYTES))
    wanted = max(2 * SHORT_CONTEXT, kv_bytes // (batch * per_position))
    return min(wanted, max_model_len)


def tune_cpu_threads(
    model: LlamaModel,
    batch: int,
    context: int = SHORT_CONTEXT,
    kv_dtype: torch.dtype = torch.float32,
    block_size: int = BLOCK_SIZE,
) -> tuple[dict[int, float], bool]:
    """The fastest decode-step time (ms) of `model` at `batch` requests of `context` tokens,
    for each candidate count; and whether they settled (every count had its `CLEAN_RUNS` runs
    with its cores within `MAX_ROUNDS`).

    Why: a second compute thread speeds the step up, but takes the core the asynchronous host
    would schedule on; on a model small enough, one thread is as fast. Timing synthetic steps
    per count settles it for this machine. The choice lasts the engine's life, so one
    disturbed measurement must not make it: candidates alternate run by run, a run during
    which the process did not have its threads' cores (`CLEAN_SHARE`) is set aside, and the
    rounds go on (up to `MAX_ROUNDS`) until every count has `CLEAN_RUNS` runs that had them.
    Results are the same whatever the count (each output is computed by one thread), so the
    choice changes speed only. Candidates go up to the cores this process may run on; torch's
    thread count is left as it was found.
    """
    spec = model.spec
    before = torch.get_num_threads()
    most = usable_cores()
    candidates = sorted({1, max(1, most - 1), most})
    blocks_each = -(-context // block_size)
    caches = allocate_kv_cache(
        spec.num_layers, batch * blocks_each, block_size, spec.num_kv_heads, spec.head_dim,
        kv_dtype, torch.device("cpu"),
    )  # fmt: skip
    tables = torch.arange(batch * blocks_each).view(batch, blocks_each)
    meta = AttentionMetadata(
        slot_mapping=tables[:, -1] * block_size + (context - 1) % block_size,
        block_tables=tables,
        context_lens=torch.full((batch,), context),
        num_decodes=batch,
        decode_max_blocks=blocks_each,
        prefills=[],
        block_size=block_size,
    )
    ids = torch.randint(0, spec.vocab_size, (batch,))
    positions = torch.full((batch,), context - 1)

    def step() -> None:
        model.compute_logits(model(ids, positions, caches, meta)).argmax(-1)

    runs = {n: ThreadRuns() for n in candidates}
    try:
        with torch.inference_mode():
            for n in candidates:
                torch.set_num_threads(n)
                for _ in range(WARM_RUNS):
                    step()
            previous = candidates[-1]
            for round_index in range(MAX_ROUNDS):
                for n in candidates:
                    torch.set_num_threads(n)
                    if previous > n:
                        time.sleep(SETTLE_S)
                    previous = n
                    wall, cpu = time.perf_counter(), time.process_time()
                    step()
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    runs[n].every.append(wall * 1e3)
                    if wall < JUDGED_RUN_S or cpu >= CLEAN_SHARE * n * wall:
                        runs[n].clean.append(wall * 1e3)
                if round_index + 1 >= MIN_ROUNDS and all(r.settled for r in runs.values()):
                    break
    finally:
        torch.set_num_threads(before)
    return {n: r.best() for n, r in runs.items()}, all(r.settled for r in runs.values())


def host_ms(batch: int) -> float:
    """The host's work per step at `batch` requests (measured by benchmarks/host_cost.py)."""
    return 0.2 + 0.015 * batch


def charged_ms(n: int, at: DecodeTimings, short: DecodeTimings, batch: int) -> float:
    """The step time (ms) of `n` threads at `at`, with the host's share of a core charged for
    the time every core computes: all of the step when every core computes (the host's
    Python takes a core from the team, which then waits for it at its next barrier); with
    fewer threads, the part beyond the short step's time, the attention that spreads over every
    core from a size on."""
    cores = max(at.ms)
    if cores == 1:
        return at.ms[n]
    grown = max(0.0, at.ms[n] - short.ms[n])
    share = 1.0 if n == cores else grown / max(at.ms[n], 1e-9)
    return at.ms[n] + host_ms(batch) * share


def step_cost(
    n: int, positions: int, short: DecodeTimings, long: DecodeTimings, batch: int
) -> float:
    """A decode step's charged time (ms) on `n` threads at `positions` K/V positions: linear
    between its charged times at the two timings (K/V read grows the step linearly), the short
    one's below it."""
    low, high = charged_ms(n, short, short, batch), charged_ms(n, long, short, batch)
    slope = (high - low) / max(1, long.positions - short.positions)
    return low + slope * max(0, positions - short.positions)


def pick_cpu_threads(timings_ms: dict[int, float], batch: int) -> int:
    """The count with the shortest step at one size once the host's share is charged."""
    at = DecodeTimings(0, timings_ms)
    return min(timings_ms, key=lambda n: step_cost(n, 0, at, at, batch))


def plan_threads(short: DecodeTimings, long: DecodeTimings, batch: int) -> ThreadPlan:
    """Each decode step's count: the cheapest by `step_cost` at its positions. The bounds where
    the cheapest changes are found by doubling the positions from the short step's, then
    bisecting the interval where it changed. Prefill steps take every core."""

    def cheapest(positions: int) -> int:
        return min(short.ms, key=lambda n: step_cost(n, positions, short, long, batch))

    bounds, counts = [0], [cheapest(short.positions)]
    low = max(1, short.positions)
    while low < MOST_POSITIONS:
        high = 2 * low
        while cheapest(high) != counts[-1]:
            below, above = low, high  # cheapest(below) is counts[-1]; cheapest(above) is not
            while above - below > 1:
                middle = (below + above) // 2
                if cheapest(middle) == counts[-1]:
                    below = middle
                else:
                    above = middle
            bounds.append(above)
            counts.append(cheapest(above))
            low = above
        low = high
    return ThreadPlan(tuple(bounds), tuple(counts), max(short.ms))
