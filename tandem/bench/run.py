"""One benchmark run: feed a workload to the engine by its arrival times and keep its records."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tandem.bench.kernel_profile import KernelProfiler, KernelWindow
from tandem.bench.workloads import Workload
from tandem.engine.engine import Engine
from tandem.metrics import RunSummary, StepRecord
from tandem.models.spec import checkpoint_shapes
from tandem.request import SamplingParams


def progress_bars(console: Console) -> Progress:
    """The bench's progress display: a bar per run, its requests done and the time taken."""
    bars = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    return Progress(*bars, console=console, transient=False)


@dataclass
class Run:
    summary: RunSummary
    records: list[StepRecord]
    outputs: list[list[int]]
    prefill_computed: int  # prompt tokens computed (recomputation after preemption included)
    prefill_saved: int  # prompt tokens served from the prefix cache
    kernels: KernelWindow | None = None  # --profile: the profiled window's kernel busy time
    finish_reasons: list[str] = field(default_factory=list)  # per request: "stop" or "length"
    # Per request: when each of its tokens reached the caller (engine.step() returned it).
    token_times: list[list[float]] = field(default_factory=list)
    adapter_loads: int = 0  # LoRA adapters copied into a slot by its steps

    def finished_by(self, reason: str) -> int:
        return self.finish_reasons.count(reason)

    def itl_s(self, requests: list[int]) -> list[float]:
        """The inter-token latencies of these requests (indices in the workload's order)."""
        return [float(x) for i in requests for x in np.diff(self.token_times[i])]


def run_workload(
    engine: Engine,
    workload: Workload,
    temperature: float,
    progress: Progress | None,
    label: str,
    profile: tuple[int, int] | None = None,
    kernel_trace: str | None = None,
) -> Run:
    """Feed the workload by its arrival times, from a cold prefix cache. `profile`: steps
    [first, stop) whose kernels are timed (CUDA); `kernel_trace`: where their Chrome trace
    goes, if anywhere."""
    mark = engine.history.mark()
    engine.reset_prefix_cache()
    before = engine.stats().prefix_cache
    slots = engine.scheduler.lora_slots
    loads_before = slots.num_loads if slots is not None else 0
    params = [
        SamplingParams(
            max_tokens=n,
            temperature=temperature,
            seed=i,
            ignore_eos=workload.ignore_eos and workload.constraint(i) is None,
            structured_outputs=workload.constraint(i),
            thinking_token_budget=workload.thinking_budget(i),
        )
        for i, n in enumerate(workload.output_lens)
    ]
    task = progress.add_task(label, total=len(params)) if progress else None
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    order = [f"{label}-{i}" for i in range(len(params))]
    times: dict[str, list[float]] = {r: [] for r in order}
    start, next_i = time.perf_counter(), 0
    steps, profiler, kernels = 0, None, None
    while next_i < len(params) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_i < len(params) and workload.arrival_times[next_i] <= now:
            engine.add_request(
                workload.prompts[next_i], params[next_i], order[next_i], workload.lora(next_i)
            )
            next_i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, workload.arrival_times[next_i] - now))
            continue
        if profile is not None and steps == profile[0]:
            profiler = KernelProfiler()
            profiler.start()
        step_outputs = engine.step()
        returned = time.perf_counter()
        for out in step_outputs:
            times[out.request_id].extend([returned] * len(out.delta_token_ids))
            if out.finished:
                outputs[out.request_id] = out.token_ids
                reasons[out.request_id] = out.finish_reason
                if progress:
                    progress.advance(task)
        steps += 1
        if profiler is not None and profiler.running and steps == profile[1]:
            kernels = profiler.stop(steps - profile[0])
    if profiler is not None and profiler.running:  # the run ended inside the window
        kernels = profiler.stop(steps - profile[0])
    if kernels is not None and kernel_trace is not None:
        profiler.export(kernel_trace)
    after = engine.stats().prefix_cache
    saved = after.hit_tokens - before.hit_tokens
    return Run(
        engine.history.summary(since=mark),
        engine.history.steps(since=mark),
        [outputs[r] for r in order],
        after.query_tokens - before.query_tokens - saved,
        saved,
        kernels,
        [reasons[r] for r in order],
        [times[r] for r in order],
        (slots.num_loads if slots is not None else 0) - loads_before,
    )


def describe_model(engine: Engine) -> str:
    """Which model ran, and its shape: the figures mean little without it."""
    s, config = engine.spec, engine.config
    params = sum(math.prod(shape) for shape in checkpoint_shapes(s).values())
    weights = (
        f"dummy weights, seed {config.seed}" if config.load_format == "dummy" else "its weights"
    )
    dtype = str(config.torch_dtype).removeprefix("torch.")
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return (
        f"model: {engine.model_path.name} ({weights}): {s.num_layers} layers, hidden "
        f"{s.hidden_size}, {s.num_heads} heads ({s.num_kv_heads} KV) of {s.head_dim}, "
        f"intermediate {s.intermediate_size}, vocab {s.vocab_size}, {count} parameters, {dtype}"
    )
