"""Batch-1 decode with the float32 panels in one buffer against panels allocated layer by layer.

A decode step of one request streams every weight once. `LlamaModel.use_fast_path` packs all
of a model's panels back to back in one huge-paged buffer, in the order the forward reads them
(`ops/linear.py`'s `panel_arena`); the other layout gives each layer its own allocation, as
before that (buffers under 2 MiB then sit in 4 KiB pages). Two engines in one process, one per
layout, decode the same prompt in alternation, so the machine's drift reaches both alike; the
table holds each layout's median and the median of the per-round ratios.

    python benchmarks/panel_layout.py --rounds 16
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

import tandem.models.llama as llama
from tandem import LLM, SamplingParams
from tandem.ops.linear import panels_shape

DEFAULT_MODEL = Path.home() / ".cache" / "tandem" / "models" / "smollm2-135m-instruct"


def one_buffer_each(shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [torch.empty(panels_shape(*shape)) for shape in shapes]


def engine(model: Path, arena: bool) -> LLM:
    layout = llama.panel_arena
    if not arena:
        llama.panel_arena = one_buffer_each
    try:
        return LLM(str(model), async_scheduling=False, enable_prefix_caching=False,
                   max_model_len=1024)  # fmt: skip
    finally:
        llama.panel_arena = layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=72)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    engines = {"one buffer": engine(args.model, True), "layer by layer": engine(args.model, False)}
    rng = random.Random(0)
    prompt = [[rng.randrange(1000, 20000) for _ in range(args.prompt_len)]]

    def seconds(llm: LLM, tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    outputs = {
        name: llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0]
        .outputs[0]
        .token_ids
        for name, llm in engines.items()
    }
    assert len({tuple(ids) for ids in outputs.values()}) == 1, "the layouts disagree"
    ms = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            prefill = seconds(llm, 1)  # prefill and one token: taken off the run below
            whole = seconds(llm, 1 + args.output_len)
            ms[name].append((whole - prefill) / args.output_len * 1e3)
    ratios = [b / a for a, b in zip(ms["one buffer"], ms["layer by layer"], strict=True)]
    print(f"{args.model.name}, batch 1, decode ms per token, {args.rounds} rounds")
    print("| panels | median ms | range |\n| --- | ---: | ---: |")
    for name, values in ms.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.1f}-{max(values):.1f} |")
    wins = sum(r > 1 for r in ratios)
    print(f"layer by layer over one buffer: median {statistics.median(ratios):.3f}x per round "
          f"({wins} of {args.rounds} rounds above 1)")  # fmt: skip


if __name__ == "__main__":
    main()
