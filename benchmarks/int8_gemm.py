"""Per-channel int8 linear layers: Tandem's kernel beside PyTorch's `_weight_int8pack_mm`.

Both take float32 activations and the same int8 codes with one scale per output row (Tandem's
layout repeats it per block of 32 columns), so they compute the same product; this times one
forward's worth of SmolLM2-135M's layer GEMMs (30 layers of qkv [960, 576], o [576, 576],
gate_up [3072, 576], down [576, 1536]; each layer its own weights, so they come from memory) at
M rows, the two interleaved in rounds (median), and prints their largest difference.

    python benchmarks/int8_gemm.py [--rows 1,32] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.ops import cpu_kernels
from tandem.ops.quantized import quantize_int8, quantized_linear, unpack

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,32")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    assert cpu_kernels.load().available, "the fused CPU kernels did not build"
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for n, k in SHAPES:
            w = torch.randn(n, k) * 0.02
            q = quantize_int8(w)
            layer.append((q, unpack(q)[0].contiguous(), w.abs().amax(1) / 127))
        layers.append(layer)
    kernels = {
        "tandem": lambda x, q, codes, scales: quantized_linear(x, q),
        "aten._weight_int8pack_mm": lambda x, q, codes, scales: torch.ops.aten._weight_int8pack_mm(
            x, codes, scales
        ),
    }

    def forward(name: str, rows: int) -> float:
        xs = {k: torch.randn(rows, k) for _, k in SHAPES}
        start = time.perf_counter()
        for layer in layers:
            for (_, k), weight in zip(SHAPES, layer, strict=True):
                kernels[name](xs[k], *weight)
        return time.perf_counter() - start

    for rows in (int(r) for r in args.rows.split(",")):
        times = {name: [] for name in kernels}
        for _ in range(args.rounds):
            for name in kernels:
                times[name].append(forward(name, rows))
        medians = {name: statistics.median(t) for name, t in times.items()}
        ratio = medians["aten._weight_int8pack_mm"] / medians["tandem"]
        text = ", ".join(f"{name} {1e3 * t:.1f} ms" for name, t in medians.items())
        print(f"M={rows}: {text}; aten / tandem = {ratio:.2f}", flush=True)
    x = torch.randn(4, 576)
    q, codes, scales = layers[0][0]
    difference = (
        quantized_linear(x, q) - torch.ops.aten._weight_int8pack_mm(x, codes, scales)
    ).abs()
    print(f"largest difference of the two on one layer: {difference.max().item():.2e}")


if __name__ == "__main__":
    main()
