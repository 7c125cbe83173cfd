"""How many CPU threads compute a step: timed once at start-up, on the thread the steps run on.

Decode steps use the count that gives the shortest step once the host's share of a core is
charged; steps that prefill switch to every core (`ModelRunner.set_cpu_threads`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tandem.config import usable_cores
from tandem.execution.fast_path import ExecutionPlan
from tandem.execution.runner import ModelRunner
from tandem.models.llama import LlamaModel
from tandem.ops.attention_metadata import AttentionMetadata


def apply_cpu_threads(
    runner: ModelRunner, model: LlamaModel, plan: ExecutionPlan, threads: int | None, batch: int
) -> None:
    """Fix the runner's compute threads: `threads` if the user chose, else the timed best.

    The timing runs where the steps will run (the device thread, with its own OpenMP team)."""
    if threads is not None:
        runner.set_cpu_threads(threads, threads)
        plan.cpu_threads = threads
        return
    timings = runner.stream.submit(lambda: tune_cpu_threads(model, batch)).wait()
    plan.thread_timings_ms = timings
    plan.cpu_threads = pick_cpu_threads(timings, batch)
    runner.set_cpu_threads(plan.cpu_threads, max(timings))


# Timing rounds: each round runs every candidate once, in turn, so that something else taking
# the cores for a while slows every candidate's runs alike instead of one candidate's only.
WARM_RUNS = 2  # per candidate, untimed: caches and thread pools
MIN_ROUNDS, MAX_ROUNDS = 8, 40
CLEAN_RUNS = 3  # runs per candidate that had their cores, wanted before stopping early
# A run had its cores when its process used at least this share of threads x wall time: the
# compute team's threads stay on their cores (they spin between regions), so a smaller share
# means another process took one of them.
CLEAN_SHARE = 0.85


@dataclass
class ThreadRuns:
    """One candidate count's timed runs (ms): all of them, and those that had their cores."""

    every: list[float] = field(default_factory=list)
    clean: list[float] = field(default_factory=list)

    def best(self) -> float:
        """The fastest run that had its cores; the fastest of all if none had."""
        return min(self.clean or self.every)


def tune_cpu_threads(model: LlamaModel, batch: int, block_size: int = 16) -> dict[int, float]:
    """The fastest decode-step time (ms) of `model` at `batch` requests, for each candidate count.

    Why: a second compute thread speeds the step up, but takes the core the asynchronous host
    would schedule on; on a model small enough, one thread is as fast. Timing one synthetic
    step per count settles it for this machine. The choice lasts the engine's life, so one
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
    blocks_each, context = 2, block_size + 1
    caches = [
        torch.zeros(2, batch * blocks_each, block_size, spec.num_kv_heads, spec.head_dim)
        for _ in range(spec.num_layers)
    ]
    tables = torch.arange(batch * blocks_each).view(batch, blocks_each)
    meta = AttentionMetadata(
        slot_mapping=tables[:, 1] * block_size,
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
            for round_index in range(MAX_ROUNDS):
                for n in candidates:
                    torch.set_num_threads(n)
                    wall, cpu = time.perf_counter(), time.process_time()
                    step()
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    runs[n].every.append(wall * 1e3)
                    if cpu >= CLEAN_SHARE * n * wall:
                        runs[n].clean.append(wall * 1e3)
                done = all(len(r.clean) >= CLEAN_RUNS for r in runs.values())
                if round_index + 1 >= MIN_ROUNDS and done:
                    break
    finally:
        torch.set_num_threads(before)
    return {n: r.best() for n, r in runs.items()}


def pick_cpu_threads(timings_ms: dict[int, float], batch: int) -> int:
    """The count with the shortest step once the host's share is charged where it lands.

    With every core computing, the host's scheduling of the next step (its cost per request is
    measured by benchmarks/host_cost.py) takes a core from the compute team, which
    then waits for it at its next barrier; with a core left free the host runs beside the step.
    """
    cores = max(timings_ms)
    host_ms = 0.2 + 0.015 * batch
    cost = {n: ms + (host_ms if n == cores and cores > 1 else 0.0) for n, ms in timings_ms.items()}
    return min(cost, key=cost.get)
