"""Decode throughput while something else takes the compute's cores for moments.

On a CPU the engine's steps share the cores with the host's scheduling, a server's front end and
its clients. This runs `LLM.generate` (exactly --max-tokens tokens a request, greedy) at 1 and
at 32 requests, alone and beside a process that spins for --busy-ms every --period-ms (10% of
one core by default), each run in a fresh process; with `--baseline DIR` the same runs from
another checkout too, alternated round by round. It prints the median output tokens/s of each
cell and, beside a baseline, the ratios.

    python benchmarks/shared_cores.py --rounds 5
    git worktree add /tmp/before HEAD~1 && python benchmarks/shared_cores.py --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPIN = """
import sys, time
busy, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(max(0.0, period - busy))
"""


def run_once(args: argparse.Namespace) -> dict:
    """Output tokens per second of `args.one` requests (median of --repeats, in this process),
    and where the tandem package that ran came from."""
    import tandem
    from tandem import LLM, SamplingParams

    llm = LLM(str(args.model), max_model_len=args.max_model_len, max_num_seqs=max(args.batches))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"Tell me story number {i} about a dragon and a knight." for i in range(args.one)]
    llm.generate(prompts, params)  # warm-up: kernels, thread pools, caches
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        rates.append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
    llm.close()
    return {"rate": statistics.median(rates), "package": tandem.__file__}


def measure(args: argparse.Namespace, checkout: Path, batch: int) -> float:
    command = [sys.executable, __file__, "--one", str(batch), "--model", str(args.model)]
    command += ["--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
    command += ["--max-model-len", str(args.max_model_len)]
    command += ["--batches", ",".join(map(str, args.batches))]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env, cwd=checkout)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(result["package"]).resolve().is_relative_to(checkout.resolve()):
        raise SystemExit(f"{checkout}: ran the tandem package at {result['package']} instead")
    return result["rate"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=real_model.DEFAULT_OUTPUT)
    p.add_argument("--baseline", type=Path, help="another checkout, timed in the same rounds")
    p.add_argument("--batches", default="1,32", help="requests per run, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--busy-ms", type=float, default=0.5)
    p.add_argument("--period-ms", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="generate calls timed per run")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.one:
        print(json.dumps(run_once(args)))
        return 0
    real_model.ensure_model(args.model)
    checkouts = {"current": REPO}
    if args.baseline:
        checkouts["baseline"] = args.baseline.resolve()
    results: dict[tuple[str, str, int], list[float]] = {}
    for r in range(args.rounds):
        for load in ("alone", "busy"):
            spinner = None
            if load == "busy":
                spin = [sys.executable, "-c", SPIN, str(args.busy_ms), str(args.period_ms)]
                spinner = subprocess.Popen(spin)
            try:
                for name, checkout in checkouts.items():
                    for batch in args.batches:
                        rate = measure(args, checkout, batch)
                        results.setdefault((name, load, batch), []).append(rate)
                        print(f"round {r + 1}: {name} {load} batch {batch}: {rate:.1f} tok/s")
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
    print(f"\nmedian output tok/s over {args.rounds} rounds (busy: {args.busy_ms} ms of a core")
    print(f"every {args.period_ms} ms)\n")
    print("| checkout | batch | alone | busy | busy / alone |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in checkouts:
        for batch in args.batches:
            alone = statistics.median(results[(name, "alone", batch)])
            busy = statistics.median(results[(name, "busy", batch)])
            print(f"| {name} | {batch} | {alone:.1f} | {busy:.1f} | {busy / alone:.2f} |")
    if args.baseline:
        print("\ncurrent / baseline, per round's pair (median):")
        for load in ("alone", "busy"):
            for batch in args.batches:
                pairs = zip(
                    results[("current", load, batch)],
                    results[("baseline", load, batch)],
                    strict=True,
                )
                ratios = [c / b for c, b in pairs]
                spread = ", ".join(f"{x:.2f}" for x in ratios)
                print(f"  {load}, batch {batch}: {statistics.median(ratios):.2f} ({spread})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
