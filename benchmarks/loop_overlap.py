"""What the asynchronous loop's overlap costs and saves, per decode step, beside the synchronous.

The synchronous loop leaves the device idle while the host retires a step and builds the next
(the gap between device steps); the asynchronous one closes that gap, but where the device is
the CPU's own cores the host's work then shares them with the computation and lengthens the
device's step. This prints both per round, the loops alternated on one engine (full batches of
decodes only, as `host_cost.py` measures them), and whole-job times.

    python benchmarks/loop_overlap.py [--model smollm2-135m-instruct] [--requests 32]
                                      [--prompt-len 64] [--output-len 64] [--rounds 3]
"""

from __future__ import annotations

import argparse

from host_cost import measure

from tandem import EngineConfig
from tandem.engine.engine import Engine


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
    for asynchronous in (False, True):  # warm-up: kernels, caches, the thread pools
        engine.configure(async_scheduling=asynchronous)
        measure(engine, 4, args.prompt_len, 4)
    print(f"{'round':>5} {'loop':>5} {'job s':>7} {'device ms':>10} {'gap ms':>7} {'host ms':>8} "
          f"{'step + gap':>11}")  # fmt: skip
    walls: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.rounds):
        for asynchronous in (False, True):
            engine.configure(async_scheduling=asynchronous)
            ms = measure(engine, args.requests, args.prompt_len, args.output_len)
            walls[asynchronous].append(ms["wall_s"])
            loop = "async" if asynchronous else "sync"
            print(f"{i + 1:>5} {loop:>5} {ms['wall_s']:>7.2f} {ms['device']:>10.2f} "
                  f"{ms['gap']:>7.2f} {ms['host']:>8.2f} {ms['device'] + ms['gap']:>11.2f}")  # fmt: skip
    ratios = [s / a for s, a in zip(walls[False], walls[True], strict=True)]
    each = ", ".join(f"{r:.3f}x" for r in ratios)
    print(f"async speed over sync (sync job time / async), per round: {each}")
    engine.close()


if __name__ == "__main__":
    main()
