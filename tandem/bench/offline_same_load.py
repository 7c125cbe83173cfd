"""The served comparison's requests, run offline: what the server's throughput is measured against.

`tandem bench compare --served` sends `--num-requests` prompts with at most `--concurrency` in
flight; the offline engine with `max_num_seqs = concurrency` runs the same prompts (the same
words, the same chat template, greedy, exactly --max-tokens tokens each) in the same way: as one
finishes, the next is admitted. Output tokens per second over the whole `generate`, median of
--repeats, in one process per loop (sync, async) so each gets a fresh engine. The comparison's
`tandem-offline` row runs one loop of one cell (`--one async`) in a fresh process.

    python -m tandem.bench.offline_same_load --model ~/.cache/tandem/models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tandem.bench.real_model import DEFAULT_OUTPUT
from tandem.bench.serve import random_prompts


def prompts(seed: str, num_requests: int, prompt_words: int, chat: bool, tokenizer: Any) -> list:
    """The served comparison's prompts for this seed; chat ones as the server's template
    renders them."""
    words = random_prompts(seed, num_requests, prompt_words)
    if not chat:
        return words
    return [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": w}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        ).input_ids
        for w in words
    ]


def run_once(args: argparse.Namespace, async_scheduling: bool) -> float:
    """Output tokens per second of one run (in this process)."""
    from tandem import LLM, SamplingParams

    llm = LLM(
        str(args.model),
        max_num_seqs=args.concurrency,
        max_model_len=args.max_model_len,
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = prompts("warm", args.concurrency, args.prompt_words, args.chat, llm.get_tokenizer())
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    batch = prompts(args.seed, args.num_requests, args.prompt_words, args.chat, llm.get_tokenizer())
    start = time.perf_counter()
    outputs = llm.generate(batch, params)
    wall = time.perf_counter() - start
    llm.close()
    return sum(len(o.token_ids) for o in outputs) / wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_OUTPUT)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=0, help="default: 4 x concurrency")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--seed", default="0-chat-32-0", help="the served comparison's seed of a cell")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--one", choices=("sync", "async"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.num_requests = args.num_requests or 4 * args.concurrency
    if args.one:
        print(json.dumps(run_once(args, args.one == "async")))
        return 0
    results: dict[str, list[float]] = {"sync": [], "async": []}
    for _ in range(args.repeats):  # interleaved, each run in a fresh process
        for loop in results:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tandem.bench.offline_same_load",
                    *(argv or sys.argv[1:]),
                    "--one",
                    loop,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            results[loop].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for loop, values in results.items():
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"offline {loop}: median {statistics.median(values):.1f} output tok/s ({runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
