"""Time to first token of a short tail after a cached prefix: a repeated prompt, a chat's next turn.

A prompt whose prefix is in the cache computes only its tail, but every tail token attends to the
whole cached context. This times `LLM.generate` (one output token) of --context cached tokens
plus a fresh tail of each --tails length, the median of --rounds, in one process per checkout.
`--baseline DIR` alternates this checkout with another (`git worktree add DIR <commit>`), one
process each per --repeats, and prints both medians and their ratio (baseline over this).

    python benchmarks/cached_tail.py [--model smollm2-135m-instruct] [--context 2000]
        [--tails 1,4,8,16] [--rounds 7] [--baseline DIR] [--repeats 2]
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


def measure(model: str, context: int, tails: list[int], rounds: int) -> dict[int, float]:
    """Median ms per tail length, the prefix cached before each timed request."""
    from tandem import LLM, SamplingParams

    llm = LLM(model, max_model_len=context + max(tails) + 8, max_num_seqs=1)
    rng = random.Random(0)
    vocab = min(llm.engine.spec.vocab_size, 32000)
    prefix = [rng.randrange(10, vocab) for _ in range(context)]
    params = SamplingParams(max_tokens=1, temperature=0)
    medians = {}
    for tail in tails:
        times = []
        for _ in range(rounds):
            llm.generate([prefix], params)  # the prefix cached (and its blocks recently used)
            prompt = prefix + [rng.randrange(10, vocab) for _ in range(tail)]
            start = time.perf_counter()
            llm.generate([prompt], params)
            times.append(time.perf_counter() - start)
        medians[tail] = statistics.median(times) * 1e3
    llm.close()
    return medians


def run_in(checkout: Path, args: argparse.Namespace) -> dict[int, float]:
    """`measure` in a process importing `checkout`'s tandem."""
    command = [sys.executable, __file__, "--model", args.model, "--context", str(args.context),
               "--tails", args.tails, "--rounds", str(args.rounds), "--json"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return {int(k): v for k, v in json.loads(out.splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--tails", default="1,4,8,16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline", type=Path, help="another checkout to alternate with")
    parser.add_argument("--repeats", type=int, default=2, help="processes per side (--baseline)")
    parser.add_argument("--json", action="store_true", help="print one JSON line (internal)")
    args = parser.parse_args()
    tails = [int(t) for t in args.tails.split(",")]
    if args.json:
        print(json.dumps(measure(args.model, args.context, tails, args.rounds)))
        return
    if args.baseline is None:
        for tail, ms in measure(args.model, args.context, tails, args.rounds).items():
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
