"""transformers' own continuous batching (`model.generate_batch`) as a peer of the offline
comparison, in this process."""

from __future__ import annotations

import argparse
import logging
import math
import time

import torch

from tandem.bench.compare_engines import Engine, EngineError, Run
from tandem.bench.compare_workload import Limits, Model, Workload

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine(Engine):
    """`generate_batch` on a warm, persistent continuous-batching manager.

    Why the explicit sizes: left unset, transformers sizes the paged cache from free memory (on
    CPU, 60% of system RAM). Why the persistent manager: `generate_batch` otherwise builds (and
    allocates) a fresh manager on every call, which would be timed; the warm-up call builds it and
    the timed calls reuse it. A new manager per workload, as it is sized from the first call's
    requests. Block sharing (HF's prefix cache) is off: repeated runs would hit it.
    """

    name = "hf"

    def __init__(self, args: argparse.Namespace, model: Model, limits: Limits):
        from transformers import AutoModelForCausalLM, GenerationConfig

        # Its per-call "persistent manager was sized for the requests passed" warning: the sizes
        # here come from the config (rebuilt per workload), not from the warm-up call.
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model.path, dtype=DTYPES[args.dtype])
        self.model.to(args.device).eval()
        self.startup_s = time.perf_counter() - start
        self.args = args
        self.limits = limits
        self.gen_config = GenerationConfig(
            do_sample=False,  # greedy: argmax over the logits
            eos_token_id=-1,  # no EOS stop; None would fall back to the model config's EOS
            pad_token_id=self.model.config.pad_token_id,
        )
        self.cb_config = None

    def describe(self) -> str:
        import transformers

        manager = getattr(self.model, "_cached_continuous_batching_manager", None)
        text = f"transformers {transformers.__version__}, "
        text += f"attn_implementation={self.model.config._attn_implementation!r}"
        if manager is not None:
            c = manager.continuous_batching_config
            text += (
                f", {c.num_blocks} pages of {c.page_size}, use_async_batching="
                f"{c.use_async_batching}, use_cuda_graph={c.use_cuda_graph}"
            )
        return text + f"; loaded in {self.startup_s:.1f} s"

    def warm(self, work: Workload) -> None:
        from transformers import ContinuousBatchingConfig

        self.model.destroy_cached_continuous_batching_manager()
        # The manager built by the warm-up call keeps this config: set per workload. Chat: the
        # workload's EOS ids; otherwise -1, no EOS (None would fall back to the model's).
        self.gen_config.eos_token_id = work.eos_ids or -1
        page = self.args.hf_page_size
        self.cb_config = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=sum(math.ceil(n / page) for n in work.seq_lens()) + 1,
            max_batch_tokens=self.limits.max_batch_tokens,
            max_requests_per_batch=self.limits.max_num_seqs,
            allow_block_sharing=False,
            seed=self.args.seed,
        )
        if self.args.device == "cuda":
            # Sizes the flash decode path's block table; left unset it would come from the
            # warm-up call (which builds the persistent manager) and be too small.
            blocks = math.ceil(max(work.seq_lens()) / page) + 1
            self.cb_config.max_blocks_per_request = blocks + blocks % 2
        self._generate(work.warm_prompts, work.warm_output_len)

    def run(self, work: Workload) -> Run:
        return self._generate(work.prompts, work.output_len)

    def _generate(self, prompts: list[list[int]], n: int) -> Run:
        # torch's thread count is per thread, latched when a thread first runs an op; Tandem sets
        # its own choice process-wide, so HF's generation thread (started by the warm-up call)
        # must find --threads set when it starts. Restored afterwards for Tandem's host thread.
        before = torch.get_num_threads()
        torch.set_num_threads(self.args.threads)
        try:
            return self._generate_timed(prompts, n)
        finally:
            torch.set_num_threads(before)

    def _generate_timed(self, prompts: list[list[int]], n: int) -> Run:
        start = time.perf_counter()
        results = self.model.generate_batch(
            inputs=prompts,
            generation_config=self.gen_config,
            continuous_batching_config=self.cb_config,
            persistent_manager=True,
            record_timestamps=True,  # one perf_counter per token: when it was appended
            max_new_tokens=n,
        )
        wall = time.perf_counter() - start
        outs = list(results.values())  # generate_batch returns them in input order
        failed = [o.request_id for o in outs if o.error is not None]
        if len(outs) != len(prompts) or failed:
            raise EngineError(f"generate_batch: {len(outs)}/{len(prompts)} back, failed {failed}")
        ttft, itl = [], []
        for o in outs:
            ts = o.timestamps or []
            if len(ts) != len(o.generated_tokens):  # not one time per token: not measurable
                ttft = itl = None
                break
            if ts:
                ttft.append(ts[0] - o.created_time)
                itl.extend(b - a for a, b in zip(ts, ts[1:], strict=False))
        return Run([list(o.generated_tokens) for o in outs], wall, ttft, itl)

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()


def skip_reason(args: argparse.Namespace, model: Model) -> str | None:
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        import transformers

        return (
            f"transformers {transformers.__version__} has no continuous batching (generate_batch)"
        )
    return None


def start(args: argparse.Namespace, model: Model, limits: Limits) -> HFEngine:
    return HFEngine(args, model, limits)
