"""Offline throughput: Tandem (sync and async) against Hugging Face transformers' continuous batching.

The same seeded workload (random prompt token ids, a fixed number of greedy output tokens per
request, EOS ignored) runs on the same local checkpoint through three systems, one after the other
in one process:

* ``model.generate_batch(...)`` from transformers' continuous batching, the reference;
* ``tandem.LLM(..., async_scheduling=False)``;
* ``tandem.LLM(..., async_scheduling=True)``.

Each system gets a small warm-up run with other prompts before it is timed, and only the timed
``generate`` / ``generate_batch`` calls are measured (model loading, cache allocation and warm-up
are not); with ``--repeats N`` the median of N timed runs is reported. Both systems get the same
scheduling limits (tokens per step, sequences per step) and a KV cache large enough to hold the
whole workload at once, so neither has to preempt.

Run ``python benchmarks/throughput.py --help`` for the knobs; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# No network to model hubs: everything below reads local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
)

from tandem import LLM, SamplingParams  # noqa: E402

TANDEM_BLOCK_SIZE = 16  # Tandem's default KV block size (tokens per block)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Workload:
    """Prompts as token id lists plus the exact number of tokens every request must generate."""

    prompts: list[list[int]]
    output_len: int

    @property
    def max_seq_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.output_len


@dataclass
class RunResult:
    """One timed run: what came out and how long it took."""

    system: str
    outputs: list[list[int]]  # generated token ids, in prompt order
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local HF checkpoint folder (default: Tandem's built-in model)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128, help="new tokens per request (exact)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids and lengths")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="most sequences per step (Tandem max_num_seqs, HF max_requests_per_batch)")  # fmt: skip
    p.add_argument("--max-batch-tokens", type=int, default=2048,
                   help="most tokens per step (Tandem max_num_batched_tokens, HF max_batch_tokens)")  # fmt: skip
    p.add_argument("--hf-page-size", type=int, default=256,
                   help="tokens per HF cache page (its ContinuousBatchingConfig default is 256)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per system after its warm-up; the median wall time is reported")  # fmt: skip
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch CPU threads")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--tandem-async", dest="tandem_modes", action="store_const",
                       const=("async",), help="time only Tandem's async loop")  # fmt: skip
    modes.add_argument("--no-async", dest="tandem_modes", action="store_const",
                       const=("sync",), help="time only Tandem's sync loop")  # fmt: skip
    p.add_argument("--skip-hf", action="store_true", help="time Tandem only (no equality column)")
    p.set_defaults(tandem_modes=("sync", "async"))
    args = p.parse_args(argv)
    if not 1 <= args.min_prompt_len <= args.max_prompt_len:
        p.error("need 1 <= --min-prompt-len <= --max-prompt-len")
    if min(args.num_requests, args.output_len, args.repeats) < 1:
        p.error("--num-requests, --output-len and --repeats must be >= 1")
    return args


def make_workload(
    num_requests: int,
    min_len: int,
    max_len: int,
    output_len: int,
    allowed_ids: list[int],
    seed: int,
) -> Workload:
    """Seeded random prompts; special tokens are left out so no prompt carries a stray BOS/EOS."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_requests):
        n = rng.randint(min_len, max_len)
        prompts.append([rng.choice(allowed_ids) for _ in range(n)])
    return Workload(prompts, output_len)


def non_special_ids(model_path: Path) -> list[int]:
    """Every id below the model's vocab size that the tokenizer does not call special."""
    vocab_size = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
    try:
        special = set(AutoTokenizer.from_pretrained(model_path).all_special_ids)
    except (OSError, ValueError):  # no tokenizer shipped: only the config's ids are known
        special = set()
    return [i for i in range(vocab_size) if i not in special]


def timed_runs(
    call: Callable[[Workload], tuple[list[list[int]], float]],
    work: Workload,
    warm: Workload,
    n: int,
) -> tuple[list[list[int]], float]:
    """Warm up once, then time ``n`` runs; outputs of the first, median wall time of all.

    The median because the host may be shared: one unlucky run should not decide the row.
    """
    call(warm)
    outputs, wall = call(work)
    walls = [wall]
    for _ in range(n - 1):
        again, wall = call(work)
        if again != outputs:
            print("WARNING: a repeated run gave different tokens than the first", file=sys.stderr)
        walls.append(wall)
    return outputs, statistics.median(walls)


# --------------------------------------------------------------------------------------------- HF
def run_hf(args: argparse.Namespace, model_path: Path, work: Workload, warm: Workload) -> RunResult:
    """Time ``generate_batch`` on a warm, persistent continuous-batching manager.

    Why the explicit sizes: left unset, transformers sizes the paged cache from free memory (on CPU,
    60% of system RAM), which takes many GB. ``num_blocks`` caps the cache at what the workload
    needs. Why the persistent manager: ``generate_batch`` otherwise builds (and allocates) a fresh
    manager on every call, which would be timed; with ``persistent_manager=True`` the warm-up call
    builds it and the timed calls reuse it. Block sharing (HF's prefix cache) is off, as Tandem's
    is: the random prompts share no prefixes, but repeated timed runs would hit the cache.
    """
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[args.dtype])
    model.to(args.device).eval()
    pages_needed = sum(
        math.ceil((len(p) + work.output_len) / args.hf_page_size) for p in work.prompts
    )
    cb_config = ContinuousBatchingConfig(
        page_size=args.hf_page_size,
        num_blocks=pages_needed + 1,
        max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=args.max_num_seqs,
        # Off on both sides: either cache would serve repeated prompts (--repeats) from cache.
        allow_block_sharing=False,
        seed=args.seed,
    )
    if args.device == "cuda":
        # Sizes the flash decode path's block table; left unset, it would be derived from the
        # warm-up call (which builds the persistent manager) and be too small for the real run.
        blocks = math.ceil(work.max_seq_len / args.hf_page_size) + 1
        cb_config.max_blocks_per_request = blocks + blocks % 2
    gen_config = GenerationConfig(
        do_sample=False,  # greedy: argmax over the logits
        max_new_tokens=work.output_len,
        eos_token_id=-1,  # no EOS stop; None would fall back to the model config's EOS
        pad_token_id=model.config.pad_token_id,
    )

    def call(w: Workload) -> tuple[list[list[int]], float]:
        start = time.perf_counter()
        results = model.generate_batch(
            inputs=w.prompts,
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            persistent_manager=True,
            max_new_tokens=w.output_len,
        )
        wall = time.perf_counter() - start
        outs = list(results.values())  # generate_batch returns them in input order
        failed = [o.request_id for o in outs if o.error is not None]
        if len(outs) != len(w.prompts) or failed:
            raise RuntimeError(
                f"HF generate_batch: {len(outs)}/{len(w.prompts)} back, failed {failed}"
            )
        return [list(o.generated_tokens) for o in outs], wall

    try:
        outputs, wall = timed_runs(call, work, warm, args.repeats)
        manager = model._cached_continuous_batching_manager
        resolved = manager.continuous_batching_config
        print(
            f"HF: attn_implementation={model.config._attn_implementation!r}, "
            f"num_blocks={resolved.num_blocks} x page_size={resolved.page_size}, "
            f"max_batch_tokens={resolved.max_batch_tokens}, "
            f"max_requests_per_batch={resolved.max_requests_per_batch}, "
            f"use_async_batching={resolved.use_async_batching}, "
            f"use_cuda_graph={resolved.use_cuda_graph}",
            file=sys.stderr,
        )
    finally:
        model.destroy_cached_continuous_batching_manager()
    return RunResult("HF generate_batch", outputs, wall)


# ----------------------------------------------------------------------------------------- Tandem
def run_tandem(
    args: argparse.Namespace, model_path: Path, mode: str, work: Workload, warm: Workload
) -> RunResult:
    """Time ``LLM.generate`` on a warm engine given the same limits as HF (own engine per mode)."""
    blocks_needed = sum(
        math.ceil((len(p) + work.output_len) / TANDEM_BLOCK_SIZE) for p in work.prompts
    )
    llm = LLM(
        str(model_path),
        dtype=args.dtype,
        device=args.device,
        async_scheduling=mode == "async",
        block_size=TANDEM_BLOCK_SIZE,
        num_kv_blocks=blocks_needed + 1,
        max_num_batched_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max(work.max_seq_len, warm.max_seq_len),
        enable_prefix_caching=False,  # as HF's block sharing: repeats must not hit the cache
    )

    def call(w: Workload) -> tuple[list[list[int]], float]:
        params = SamplingParams(max_tokens=w.output_len, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        return [list(o.token_ids) for o in outs], wall

    try:
        outputs, wall = timed_runs(call, work, warm, args.repeats)
    finally:
        llm.close()
    return RunResult(f"Tandem {mode}", outputs, wall)


# ---------------------------------------------------------------------------------------- report
def equal_fraction(run: RunResult, reference: RunResult | None) -> str:
    """Share of requests whose generated ids match the reference exactly, as 'k/n (x.xx)'."""
    if reference is None:
        return "n/a"
    if run is reference:
        return "(reference)"
    n = len(reference.outputs)
    same = sum(a == b for a, b in zip(run.outputs, reference.outputs, strict=True))
    return f"{same}/{n} ({same / n:.2f})"


def first_divergence(run: RunResult, reference: RunResult) -> str | None:
    """Where the first mismatching request first differs: the step a numeric tie flipped."""
    for i, (a, b) in enumerate(zip(run.outputs, reference.outputs, strict=True)):
        if a != b:
            pos = next(
                (t for t, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)),
            )
            return f"request {i} first differs at output token {pos}"
    return None


def print_table(runs: list[RunResult], reference: RunResult | None, expected: int) -> None:
    """A plain-text table (no rich markup) so the output pastes cleanly into notes and issues."""
    header = ["system", "requests", "output tokens", "wall s", "output tokens/s"]
    header.append("greedy tokens equal HF")
    left = {0}  # the system name; numbers are right-aligned
    rows = [header]
    for r in runs:
        rows.append(
            [
                r.system,
                str(len(r.outputs)),
                str(r.output_tokens),
                f"{r.wall_s:.2f}",
                f"{r.tokens_per_s:.1f}",
                equal_fraction(r, reference),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for n, row in enumerate(rows):
        cells = [
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells))
        if n == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for r in runs:
        counts = sorted({len(o) for o in r.outputs})
        print(f"{r.system}: generated tokens per request: {counts} (expected [{expected}])")
        if reference is not None and r is not reference:
            where = first_divergence(r, reference)
            if where:
                print(f"  vs HF: {where}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        model_path = Path(args.model)
    else:
        from tandem.default_model import default_model_path

        model_path = default_model_path()

    allowed = non_special_ids(model_path)
    work = make_workload(
        args.num_requests,
        args.min_prompt_len,
        args.max_prompt_len,
        args.output_len,
        allowed,
        args.seed,
    )
    # Warm-up: a few requests with other prompts (other seed), same length range, short outputs.
    warm = make_workload(
        min(8, args.num_requests),
        args.min_prompt_len,
        args.max_prompt_len,
        8,
        allowed,
        args.seed + 1,
    )
    print(
        f"model {model_path} ({args.dtype}, {args.device}, {args.threads} threads), "
        f"torch {torch.__version__}, transformers {transformers.__version__}\n"
        f"workload: {len(work.prompts)} requests, prompt lengths {args.min_prompt_len}..."
        f"{args.max_prompt_len} (mean {sum(map(len, work.prompts)) / len(work.prompts):.0f}), "
        f"{work.output_len} new tokens each, greedy, EOS ignored, seed {args.seed}; "
        f"limits: {args.max_batch_tokens} tokens / {args.max_num_seqs} seqs per step",
        flush=True,
    )

    runs: list[RunResult] = []
    reference = None
    if not args.skip_hf:
        reference = run_hf(args, model_path, work, warm)
        runs.append(reference)
        gc.collect()
        print(f"done: {reference.system} in {reference.wall_s:.1f}s", file=sys.stderr, flush=True)
    for mode in args.tandem_modes:
        runs.append(run_tandem(args, model_path, mode, work, warm))
        gc.collect()
        print(f"done: {runs[-1].system} in {runs[-1].wall_s:.1f}s", file=sys.stderr, flush=True)

    print()
    print_table(runs, reference, work.output_len)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is KiB
    print(f"peak RSS of this process: {peak_gib:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
