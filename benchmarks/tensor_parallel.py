"""Tensor parallelism on this machine: TP=2 (one process per rank) against TP=1, side by side.

Every configuration is started once and kept; runs are interleaved (config by config, repeat by
repeat) and each cell is the median run, since a shared machine's noise is larger than some of
the effects. All configurations must produce the same tokens.

    python benchmarks/tensor_parallel.py                     # the built-in default model
    python benchmarks/tensor_parallel.py --model ~/.cache/tandem/bench-models/medium-v1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from types import SimpleNamespace

from tandem.bench.cli import layout_text
from tandem.bench.run import run_workload
from tandem.bench.workloads import make_workload
from tandem.config import EngineConfig
from tandem.engine.engine import Engine

CONFIGS = {  # name -> engine options
    "tp1-2threads": {"tensor_parallel_size": 1, "cpu_threads": 2},
    "tp1-1thread": {"tensor_parallel_size": 1, "cpu_threads": 1},
    "tp2-1thread-each": {"tensor_parallel_size": 2, "cpu_threads": 1},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: built-in)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    args = parser.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    engines = {
        name: Engine(EngineConfig(model=args.model, num_kv_blocks=1024, **CONFIGS[name]))
        for name in names
    }
    first = next(iter(engines.values()))
    shape = SimpleNamespace(
        workload="random", num_requests=args.num_requests, prompt_len=args.prompt_len,
        output_len=args.output_len, len_spread=0.5, arrivals="offline", rate=0.0,
        workload_seed=0, num_prefixes=1, prefix_len=0,
    )  # fmt: skip
    workload = make_workload(shape, first.spec.vocab_size, first.max_model_len)
    warmup = type(workload)(workload.prompts[:4], [4] * 4, [0.0] * 4)
    walls: dict[tuple[str, str], list[float]] = {(n, m): [] for n in names for m in modes}
    tokens: dict[tuple[str, str], list] = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            for mode in modes:
                engine.configure(async_scheduling=mode == "async")
                run_workload(engine, warmup, 0.0, None, "warmup")
                run = run_workload(engine, workload, 0.0, None, f"{name}-{mode}")
                walls[name, mode].append(run.summary.wall_s)
                tokens[name, mode] = run.outputs
    output_tokens = sum(workload.output_lens)
    cores = len(os.sched_getaffinity(0))
    model = first.model_path.name
    print(f"{args.num_requests} requests, prompt ~{args.prompt_len}, output ~{args.output_len}, "
          f"{model}, {cores} cores, median of {args.repeats}; output tokens/s")  # fmt: skip
    print(
        f"{'configuration':<22} {'processes x threads':<30} " + " ".join(f"{m:>8}" for m in modes)
    )
    base = statistics.median(walls[names[0], modes[0]])
    for name, engine in engines.items():
        cells = [f"{output_tokens / statistics.median(walls[name, m]):8.1f}" for m in modes]
        print(f"{name:<22} {layout_text(engine):<30} " + " ".join(cells))
    for name in names:
        ratios = ", ".join(f"{m} {base / statistics.median(walls[name, m]):.2f}x" for m in modes)
        print(f"  {name} vs {names[0]} {modes[0]}: {ratios}")
    identical = len({str(t) for t in tokens.values()}) == 1
    print(f"outputs identical across configurations and loops: {'yes' if identical else 'NO'}")
    for engine in engines.values():
        engine.close()
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
