"""Time to first token of a short tail after a cached prefix: a repeated prompt, a chat's next turn.

A prompt whose prefix is in the cache computes only its tail, but every tail token attends to the
whole cached context. This times `LLM.generate` (one output token) of --context cached tokens
plus a fresh tail of each --tails length, the median of --rounds, in one process per checkout.
`--baseline DIR` alternates this checkout with another (`git worktree add DIR <commit>`), one
process each per --repeats, and prints both medians and their ratio (baseline over this).
`--in-place-bounds A,B` compares, in one process with the rounds alternated, chunks of up to A
and up to B queries attending in place as decodes (`cpu_kernels.decode_like_tokens`; longer ones
gather their context for SDPA), which separate processes would blur with their own noise.

    python benchmarks/cached_tail.py [--model smollm2-135m-instruct] [--context 2000]
        [--tails 1,4,8,16] [--rounds 7] [--baseline DIR] [--repeats 2] [--in-place-bounds 4,64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(
    model: str, context: int, tails: list[int], rounds: int, bounds: list[int] | None = None
) -> dict[tuple[int, int | None], float]:
    """Median ms per (tail length, in-place bound), the prefix cached before each timed request;
    the bounds (None: the module's own) alternate within each round, in turn first."""
    from tandem import LLM, SamplingParams
    from tandem.ops import cpu_kernels

    llm = LLM(model, max_model_len=context + max(tails) + 8, max_num_seqs=1)
    rng = random.Random(0)
    vocab = min(llm.engine.spec.vocab_size, 32000)
    prefix = [rng.randrange(10, vocab) for _ in range(context)]
    params = SamplingParams(max_tokens=1, temperature=0)
    bounds = bounds or [None]
    own = cpu_kernels.decode_like_tokens  # the build's bound, replaced per run below
    times: dict[tuple[int, int | None], list[float]] = {}
    for tail in tails:
        for r in range(rounds):
            for bound in bounds[r % len(bounds) :] + bounds[: r % len(bounds)]:
                cpu_kernels.decode_like_tokens = own if bound is None else lambda b=bound: b
                llm.generate([prefix], params)  # the prefix cached (and its blocks recently used)
                prompt = prefix + [rng.randrange(10, vocab) for _ in range(tail)]
                start = time.perf_counter()
                llm.generate([prompt], params)
                times.setdefault((tail, bound), []).append(time.perf_counter() - start)
    cpu_kernels.decode_like_tokens = own
    llm.close()
    return {key: statistics.median(t) * 1e3 for key, t in times.items()}


def run_in(checkout: Path, args: argparse.Namespace) -> dict[int, float]:
    """`measure` in a process importing `checkout`'s tandem."""
    command = [sys.executable, __file__, "--model", args.model, "--context", str(args.context),
               "--tails", args.tails, "--rounds", str(args.rounds), "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return {int(k): v for k, v in json.loads(out.splitlines()[-1]).items()}


def compare_bounds(args: argparse.Namespace, tails: list[int]) -> None:
    """Each tail with chunks of up to A and of up to B queries in place, in one process."""
    a, b = (int(x) for x in args.in_place_bounds.split(","))
    ms = measure(args.model, args.context, tails, args.rounds, [a, b])
    print(f"{args.model}, context {args.context}; ms, median of {args.rounds} rounds")
    print(f"{'tail':>5} {f'up to {a}':>9} {f'up to {b}':>9} {'ratio':>6}")
    for tail in tails:
        print(f"{tail:5d} {ms[tail, a]:9.1f} {ms[tail, b]:9.1f} {ms[tail, a] / ms[tail, b]:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--tails", default="1,4,8,16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", type=Path, help="another checkout to alternate with")
    parser.add_argument("--repeats", type=int, default=2, help="processes per side (--baseline)")
    parser.add_argument("--in-place-bounds", metavar="A,B", help="compare two in-place bounds")
    parser.add_argument("--json", action="store_true", help="print one JSON line (internal)")
    args = parser.parse_args()
    tails = [int(t) for t in args.tails.split(",")]
    if args.json:
        ms = measure(args.model, args.context, tails, args.rounds)
        print(json.dumps({tail: t for (tail, _), t in ms.items()}))
        return
    if args.in_place_bounds:
        compare_bounds(args, tails)
        return
    if args.baseline is None:
        for (tail, _), ms in measure(args.model, args.context, tails, args.rounds).items():
            print(f"context {args.context} + tail {tail:3d}: {ms:7.1f} ms")
        return
    runs: dict[str, list[dict[int, float]]] = {"this": [], "baseline": []}
    for _ in range(args.repeats):
        runs["this"].append(run_in(ROOT, args))
        runs["baseline"].append(run_in(args.baseline, args))
    print(f"{args.model}, context {args.context}; ms, median of each process's medians")
    print(f"{'tail':>5} {'this':>8} {'baseline':>9} {'baseline/this':>14}")
    for tail in tails:
        this = statistics.median(r[tail] for r in runs["this"])
        base = statistics.median(r[tail] for r in runs["baseline"])
        print(f"{tail:5d} {this:8.1f} {base:9.1f} {base / this:14.2f}")


if __name__ == "__main__":
    main()
