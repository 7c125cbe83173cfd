"""Decode attention alone: the rate at which Tandem's CPU kernel reads K/V, beside streaming.

At long contexts a decode step's time goes into attention reading every request's whole K/V
cache, so the kernel can be no faster than the memory streams. This times
`torch.ops.tandem.paged_decode_attention` on its own: one decode query per request against
`--requests` contexts of each length, for the head shapes of real models, over as many layers'
caches as make at least 256 MiB (far beyond the CPU's caches, as in a step). Blocks lie in one
run per request, as the engine's block pool lays them out (`--random-blocks`: in random order).
`--queries N` gives each request N rows at consecutive positions, as a verification of N - 1
drafts lays them out (its block table row repeated, contexts up to the given length). `--cache
int8` times the int8 KV cache (`ops/kv_quant.py`: codes and a scale per 32 values) instead of
float32.

    python benchmarks/decode_attention.py [--shapes default,smollm2,llama8b]
        [--contexts 1024,3072] [--requests 32] [--queries 1] [--rounds 15] [--cache int8]
        [--baseline DIR]

Per shape and context: ms per layer (median of --rounds), GB/s of K/V read (each request's
once, whatever its queries, as the cache holds it), and that rate over the machine's streaming
rate (x.sum() over 256
MiB on torch's threads, measured before each shape and context). `--baseline DIR` builds another
checkout's kernels beside these (benchmarks/baseline_kernels.py) and times both in alternation,
each round once each, with the median of the rounds' ratios (baseline time / current time) and
whether the two gave the same bits.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
from baseline_kernels import load_baseline

from tandem.bench.roofline import streaming_bandwidth
from tandem.ops import cpu_kernels, kv_quant

SHAPES = {  # query heads, KV heads, head size
    "default": (8, 2, 32),  # Tandem's built-in model
    "smollm2": (9, 3, 64),  # SmolLM2-135M
    "llama8b": (32, 8, 128),  # Llama 3 8B
}
BLOCK_SIZE = 16
MIN_CACHE_BYTES = 256 * 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="default,smollm2,llama8b", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--contexts", default="1024,3072", help="comma-separated context lengths")
    p.add_argument("--requests", type=int, default=32, help="requests, each its own context")
    p.add_argument("--queries", type=int, default=1, help="decode rows per request (1 + drafts)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--random-blocks", action="store_true", help="blocks in random order")
    p.add_argument("--cache", choices=("float32", "int8"), default="float32", help="KV dtype")
    p.add_argument("--baseline", metavar="DIR", help="a checkout whose kernels to time beside")
    args = p.parse_args(argv)
    if args.baseline and args.cache == "int8":
        p.error("--baseline times float32 caches: another checkout may lay int8 rows out otherwise")
    return args


class Problem:
    """Caches, block tables and queries for one shape and context; enough layers to stream."""

    def __init__(self, shape: tuple[int, int, int], context: int, args: argparse.Namespace):
        heads, self.kv_heads, self.dim = shape
        requests, blocks_each = args.requests, math.ceil(context / BLOCK_SIZE)
        blocks = requests * blocks_each
        dtype = getattr(torch, args.cache)
        row_bytes = kv_quant.row_width(self.dim, dtype) * dtype.itemsize
        layer_bytes = 2 * blocks * BLOCK_SIZE * self.kv_heads * row_bytes
        self.layers = max(1, math.ceil(MIN_CACHE_BYTES / layer_bytes))
        g = torch.Generator().manual_seed(context)
        cache = (blocks, BLOCK_SIZE, self.kv_heads, self.dim)

        def values() -> torch.Tensor:
            x = torch.randn(cache, generator=g)
            return kv_quant.quantize(x, dtype) if dtype in kv_quant.QUANTIZED else x

        self.caches = [(values(), values()) for _ in range(self.layers)]
        order = torch.randperm(blocks, generator=g) if args.random_blocks else torch.arange(blocks)
        rows = args.queries  # a request's rows: its table row repeated, one position apart
        tables = order.view(requests, 1, blocks_each).expand(-1, rows, -1)
        self.block_tables = tables.reshape(requests * rows, blocks_each).contiguous()
        self.context_lens = torch.arange(context - rows + 1, context + 1).repeat(requests)
        self.q = torch.randn(requests * rows, heads, self.dim, generator=g)
        self.bytes_per_layer = 2 * requests * context * self.kv_heads * row_bytes

    def run(self, op, out: torch.Tensor) -> float:
        """Seconds per layer of one pass over every layer's cache."""
        start = time.perf_counter()
        for k, v in self.caches:
            op(out, self.q, k, v, self.block_tables, self.context_lens, self.dim**-0.5, 0)
        return (time.perf_counter() - start) / self.layers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    build = cpu_kernels.load()
    if not build.available:
        raise SystemExit(f"the CPU kernels did not build: {build.error}")
    kernels = {"current": torch.ops.tandem.paged_decode_attention}
    if args.baseline:
        kernels["baseline"] = load_baseline(args.baseline).paged_decode_attention
    isa = os.environ.get("TANDEM_CPU_ISA", "native")
    layout = "random order" if args.random_blocks else "one run per request"
    print(
        f"TANDEM_CPU_ISA={isa}, {torch.get_num_threads()} torch threads, {args.requests} requests "
        f"x {args.queries} queries, {args.cache} cache, blocks of {BLOCK_SIZE} in {layout}, median "
        f"of {args.rounds} rounds"
    )
    print(
        f"{'shape':<9} {'context':>7} {'layers':>6} {'kernel':<9} {'ms/layer':>8} {'GB/s':>6} "
        f"{'stream':>6} {'of stream':>9}"
    )
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: {name!r} is not one of {', '.join(SHAPES)}")
        for context in (int(c) for c in args.contexts.split(",")):
            problem = Problem(SHAPES[name], context, args)
            outs = {kernel: torch.empty_like(problem.q) for kernel in kernels}
            for kernel, op in kernels.items():
                problem.run(op, outs[kernel])  # warm-up: pages touched, threads started
            stream = streaming_bandwidth(torch.device("cpu"), repeats=5) / 1e9
            times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
            for _ in range(args.rounds):
                for kernel, op in kernels.items():
                    times[kernel].append(problem.run(op, outs[kernel]))
            for kernel, seconds in times.items():
                t = statistics.median(seconds)
                gbs = problem.bytes_per_layer / t / 1e9
                print(
                    f"{name:<9} {context:>7} {problem.layers:>6} {kernel:<9} {t * 1e3:>8.3f} "
                    f"{gbs:>6.1f} {stream:>6.1f} {gbs / stream:>9.0%}"
                )
            if "baseline" in times:
                ratio = statistics.median(
                    b / c for b, c in zip(times["baseline"], times["current"], strict=True)
                )
                same = torch.equal(outs["baseline"], outs["current"])
                print(f"{'':<17} baseline / current {ratio:.2f}; same bits: {same}")
            del problem
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
