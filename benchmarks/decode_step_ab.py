"""A decode step with this checkout's CPU kernels against another checkout's, in one process.

Kernel benchmarks (`quantized_gemm.py`, `decode_attention.py`) time one kernel; a change to the
one-call forward's glue (how K/V reach the cache, what a layer allocates) shows only in a whole
step. Runs minutes apart on a shared machine differ by more than such a change does, so one
engine runs the same requests again and again, its `torch.ops.tandem` kernels swapped between
this checkout's and those of `--baseline DIR` (built beside them by `baseline_kernels.py`) from
run to run, the order alternating by round. Each run's pure decode steps (every request adding
one token) give their median device time from the engine's step records; the figure is the
median over rounds of each round's baseline / current ratio. Both builds must give the same
tokens (checked) and read the weights in the same layout.

    git worktree add /tmp/before HEAD
    python benchmarks/decode_step_ab.py --baseline /tmp/before
    python benchmarks/decode_step_ab.py --baseline /tmp/before --requests 1,4,32 --rounds 9

The synchronous loop runs, so that nothing beside the step competes for the cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from baseline_kernels import load_baseline  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.ops import cpu_kernels  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, metavar="DIR",
                   help="a checkout whose kernels to time beside these")  # fmt: skip
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a model name, folder or GGUF file, or 'default' (Tandem's built-in "
                        "model); default: the packaged SmolLM2")  # fmt: skip
    p.add_argument("--requests", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=48, help="decode steps per run")
    p.add_argument("--rounds", type=int, default=7, help="runs of each build per batch size")
    return p.parse_args(argv)


def decode_step_ms(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[float, list]:
    """One run: the median device time of its pure decode steps (ms), and its tokens."""
    engine = llm.engine
    mark = engine.history.mark()
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    times = [
        s.device[1] - s.device[0]
        for s in engine.history.steps(since=mark)
        if s.num_seqs == len(prompts) and s.num_tokens == len(prompts)
    ]
    if not times:
        raise RuntimeError("no step decoded every request at once")
    return 1e3 * statistics.median(times), [o.token_ids for o in outputs]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    build = cpu_kernels.load()
    if not build.available:
        raise SystemExit(f"fused CPU kernels not built: {build.error}")
    builds = {"current": torch.ops.tandem, "baseline": load_baseline(args.baseline)}
    sizes = [int(r) for r in args.requests.split(",") if r.strip()]
    llm = LLM(
        None if args.model == "default" else args.model,
        async_scheduling=False,
        max_num_seqs=max(sizes),
        enable_prefix_caching=False,  # every run prefills its prompts again
    )
    vocab = llm.engine.spec.vocab_size
    print(f"{args.model}: {args.steps} decode steps a run, prompts of {args.prompt_len} tokens")
    try:
        for size in sizes:
            prompts = [
                [(7 + 131 * r + 17 * i) % (vocab - 10) + 10 for i in range(args.prompt_len)]
                for r in range(size)
            ]
            times: dict[str, list[float]] = {name: [] for name in builds}
            tokens: dict[str, list] = {}
            for round_ in range(args.rounds + 1):  # round 0 warms both builds up
                order = list(builds) if round_ % 2 == 0 else list(reversed(builds))
                for name in order:
                    torch.ops.tandem = builds[name]
                    ms, tokens[name] = decode_step_ms(llm, prompts, args.steps)
                    if round_:
                        times[name].append(ms)
                if tokens["current"] != tokens["baseline"]:
                    raise SystemExit(f"{size} requests: the two builds' tokens differ")
            ratios = [b / c for b, c in zip(times["baseline"], times["current"], strict=True)]
            print(
                f"{size:3d} requests: current {statistics.median(times['current']):.3f} ms, "
                f"baseline {statistics.median(times['baseline']):.3f} ms a step (medians of "
                f"{args.rounds} runs); baseline / current {statistics.median(ratios):.3f} "
                f"(rounds {min(ratios):.3f}-{max(ratios):.3f}), same tokens",
                flush=True,
            )
    finally:
        torch.ops.tandem = builds["current"]
        llm.close()


if __name__ == "__main__":
    sys.exit(main())
