"""What the asynchronous loop's overlap costs and saves, per decode step, beside the synchronous.

The synchronous loop leaves the device idle while the host retires a step and builds the next
(the gap between device steps); the asynchronous one closes that gap, but where the device is
the CPU's own cores the host's work then shares them with the computation and lengthens the
device's step. This prints both per round, the loops alternated on one engine (full batches of
decodes only), and whole-job times.

    python benchmarks/loop_overlap.py [--model smollm2-135m-instruct] [--requests 32]
                                      [--prompt-len 64] [--output-len 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from itertools import pairwise

from tandem import EngineConfig, SamplingParams
from tandem.engine.engine import Engine

PHASES = ("schedule", "build", "launch", "update")


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams, asynchronous: bool):
    """One job in one loop: (wall s, device ms, gap ms, host ms) per full decode step, medians."""
    engine.configure(async_scheduling=asynchronous)
    engine.reset_prefix_cache()
    mark = engine.history.mark()
    for prompt in prompts:
        engine.add_request(prompt, params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    full = len(prompts)
    steps = [
        r
        for r in engine.history.steps(since=mark)
        if r.num_seqs == full and r.num_tokens == full and not r.skipped
    ]
    device = [1e3 * (r.device[1] - r.device[0]) for r in steps]
    gaps = [1e3 * (b.device[0] - a.device[1]) for a, b in pairwise(steps)]
    host = [1e3 * sum(r.spans[p][1] - r.spans[p][0] for p in PHASES) for r in steps]
    return wall, statistics.median(device), statistics.median(gaps), statistics.median(host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine = Engine(
        EngineConfig(
            model=args.model,
            max_num_seqs=args.requests,
            max_model_len=args.prompt_len + args.output_len + 16,
        )
    )
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for asynchronous in (False, True):  # warm-up: kernels, caches, the thread pools
        run(engine, prompts[:4], SamplingParams(max_tokens=4, temperature=0.0), asynchronous)
    print(f"{'round':>5} {'loop':>5} {'job s':>7} {'device ms':>10} {'gap ms':>7} {'host ms':>8} "
          f"{'step + gap':>11}")  # fmt: skip
    walls: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.rounds):
        for asynchronous in (False, True):
            wall, device, gap, host = run(engine, prompts, params, asynchronous)
            walls[asynchronous].append(wall)
            loop = "async" if asynchronous else "sync"
            print(f"{i + 1:>5} {loop:>5} {wall:>7.2f} {device:>10.2f} {gap:>7.2f} {host:>8.2f} "
                  f"{device + gap:>11.2f}")  # fmt: skip
    ratios = [s / a for s, a in zip(walls[False], walls[True], strict=True)]
    each = ", ".join(f"{r:.3f}x" for r in ratios)
    print(f"async speed over sync (sync job time / async), per round: {each}")
    engine.close()


if __name__ == "__main__":
    main()
