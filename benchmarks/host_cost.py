"""Host time per decode step as the number of running requests grows (8 .. 1024).

The asynchronous loop hides the host's work behind the device's only while the host step is
shorter than the device step; this prints both. Runs the synchronous loop so that the host spans
are not stretched by the device thread competing for the GIL.

    python benchmarks/host_cost.py [--model PATH] [--sizes 8,32,128,512,1024]
                                   [--features plain|penalties|logprobs|all]
"""

from __future__ import annotations

import argparse
import random
import time
from itertools import pairwise

import numpy as np

from tandem import EngineConfig, SamplingParams
from tandem.engine.engine import Engine

FEATURES = {
    "plain": {},
    "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "logit_bias": {5: 1.0}},
    "logprobs": {"logprobs": 5},
}
FEATURES["all"] = {**FEATURES["penalties"], **FEATURES["logprobs"], "min_tokens": 4}


def measure(
    engine: Engine, n: int, prompt_len: int, steps: int, features: str = "plain"
) -> dict[str, float]:
    """n requests of `steps` tokens in the engine's loop, from a cold prefix cache: per full
    decode step the host's phases, the device's time and the gap before the next device step
    (medians, ms), and the whole job's seconds."""
    rng = random.Random(n)
    engine.reset_prefix_cache()
    mark = engine.history.mark()
    params = SamplingParams(
        max_tokens=steps, temperature=0.0, ignore_eos=True, **FEATURES[features]
    )
    for _ in range(n):
        engine.add_request(
            [rng.randrange(3, engine.spec.vocab_size) for _ in range(prompt_len)], params
        )
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    decode = [r for r in engine.history.steps(since=mark) if r.num_seqs == n and r.num_tokens == n]
    phases = ("schedule", "build", "launch", "update")
    ms = {
        p: 1e3 * float(np.median([r.spans[p][1] - r.spans[p][0] for r in decode])) for p in phases
    }
    ms["host"] = sum(ms[p] for p in phases)
    ms["device"] = 1e3 * float(np.median([r.device[1] - r.device[0] for r in decode]))
    ms["gap"] = 1e3 * float(np.median([b.device[0] - a.device[1] for a, b in pairwise(decode)]))
    ms["steps"] = len(decode)
    ms["wall_s"] = wall
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--sizes", default="8,32,128,512,1024")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--features", choices=sorted(FEATURES), default="plain")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    engine = Engine(
        EngineConfig(
            model=args.model,
            async_scheduling=False,
            max_num_seqs=max(sizes),
            max_num_batched_tokens=max(2048, max(sizes) * args.prompt_len),
            max_model_len=args.prompt_len + args.steps + 16,
        )
    )
    measure(engine, 8, args.prompt_len, 4)  # warm-up
    print(f"{'running':>8} {'schedule':>9} {'build':>8} {'launch':>8} {'update':>8} "
          f"{'host ms':>8} {'us/req':>7} {'device ms':>10}")  # fmt: skip
    for n in sizes:
        ms = measure(engine, n, args.prompt_len, args.steps, args.features)
        print(f"{n:>8} {ms['schedule']:>9.3f} {ms['build']:>8.3f} {ms['launch']:>8.3f} "
              f"{ms['update']:>8.3f} {ms['host']:>8.3f} {1e3 * ms['host'] / n:>7.2f} "
              f"{ms['device']:>10.2f}")  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
