"""The engines of the offline comparison: what each one must do (`Engine`), Tandem's two loops,
and starting the asked-for ones. The peers live in peers_hf, peers_vllm and peers_llama.

Only the generate calls are timed: loading, start-up, compilation and one warm-up call per
workload (other prompts, same lengths) are not. An engine that is not installed, cannot run the
model or fails is named with the reason and never gets a row.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from tandem.bench.compare_workload import TANDEM_BLOCK_SIZE, Limits, Model, Workload

LABELS = {
    "tandem-async": "Tandem async",
    "tandem-sync": "Tandem sync",
    "hf": "HF generate_batch",
    "vllm": "vLLM (CPU build)",
    "llamacpp": "llamacpp",  # the row adds the GGUF's weight types: llamacpp (Q8_0)
}


@dataclass
class Run:
    """One call: generated ids per request (prompt order), wall time, latencies where measured."""

    outputs: list[list[int]]
    wall_s: float
    ttft_s: list[float] | None = None
    itl_s: list[float] | None = None
    finish_reasons: list[str] | None = None  # as the engine reported them, where it does
    discarded: int | None = None  # Tandem: tokens computed past a finish (RunSummary)


class EngineError(RuntimeError):
    """An engine failed: the message says why; the engine gets no row."""


class Engine:
    """One engine, started once: a warm-up and timed runs per workload."""

    name = ""
    latency_from = "timed runs"  # or "a separate streamed run" (latency()) or "n/a"

    @property
    def label(self) -> str:
        return LABELS[self.name]

    def describe(self) -> str:
        return ""

    def warm(self, work: Workload) -> None:
        raise NotImplementedError

    def run(self, work: Workload) -> Run:
        raise NotImplementedError

    def latency(self, work: Workload) -> Run | None:
        """A separate run for TTFT/ITL, for engines whose timed call cannot report them."""
        return None

    def close(self) -> None:
        pass


class TandemShared:
    """One Tandem engine serves both rows: same weights, the loop switched between runs."""

    def __init__(self, args: argparse.Namespace, model: Model, limits: Limits):
        from tandem import LLM

        start = time.perf_counter()
        self.llm = LLM(
            args.tandem_model or str(model.path),
            dtype=args.dtype,
            device=args.device,
            block_size=TANDEM_BLOCK_SIZE,
            num_kv_blocks=limits.tandem_kv_blocks,
            max_num_batched_tokens=limits.max_batch_tokens,
            max_num_seqs=limits.max_num_seqs,
            max_model_len=limits.max_model_len,
            cpu_threads=args.tandem_threads,
            # Repeated runs (and the second loop on this engine) send the same prompts: a prefix
            # cache would skip their prefill. vLLM's and HF's are off too.
            enable_prefix_caching=False,
        )
        self.startup_s = time.perf_counter() - start
        self.users = 0

    def close(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.llm.close()


class TandemEngine(Engine):
    def __init__(self, name: str, shared: TandemShared):
        self.name = name
        self.shared = shared
        self.async_mode = name == "tandem-async"
        shared.users += 1

    def describe(self) -> str:
        import tandem

        e = self.shared.llm.engine
        return (
            f"tandem {getattr(tandem, '__version__', '?')}: {e.execution.describe()}; "
            f"{e.num_kv_blocks} KV blocks of {TANDEM_BLOCK_SIZE}; "
            f"started in {self.shared.startup_s:.1f} s"
        )

    def _generate(self, prompts: list[list[int]], n: int, eos: list[int] | None) -> Run:
        from tandem import SamplingParams

        llm = self.shared.llm
        llm.engine.configure(async_scheduling=self.async_mode)
        mark = llm.engine.history.mark()
        # Chat: EOS honoured; the workload's EOS ids are Tandem's own (eos_token_ids).
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=eos is None)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        summary = llm.engine.history.summary(since=mark)
        return Run(
            [list(o.token_ids) for o in outs],
            wall,
            summary.ttft_s,
            summary.itl_s,
            [o.finish_reason for o in outs],
            summary.discarded_tokens,
        )

    def warm(self, work: Workload) -> None:
        self._generate(work.warm_prompts, work.warm_output_len, work.eos_ids)

    def run(self, work: Workload) -> Run:
        return self._generate(work.prompts, work.output_len, work.eos_ids)

    def close(self) -> None:
        self.shared.close()
