"""The few-rows Triton GEMM (ops/triton_gemm.py) against cuBLAS on a GPU: time, bandwidth, error.

For each GEMM of a Llama-3.1-8B decode step (and its logits), at 1 to 64 rows: cuBLAS's time
(`F.linear`) and the Triton kernel's under every config of a small grid, each as 50 launches
back to back in one CUDA graph (as a decode step replays them), the weight's bytes over the time,
and the kernel's largest error against a float32 product beside cuBLAS's. Then the config that
is fastest over a whole step's GEMMs at 32 rows, the step's GEMM time under it against cuBLAS's,
and whether it is the kernel's `CONFIG`. Writes the figures as JSON too.

    python benchmarks/triton_gemm_check.py --json gemm.json
    python benchmarks/triton_gemm_check.py --cpu-dry-run   # the interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

# name, out features, in features, launches in a decode step (32 layers; the logits once)
SHAPES_8B = [("qkv", 6144, 4096, 32), ("o", 4096, 4096, 32), ("gate_up", 28672, 4096, 32),
             ("down", 4096, 14336, 32), ("logits", 128256, 4096, 1)]  # fmt: skip
SHAPES_DRY = [("qkv", 96, 64, 2), ("down", 64, 160, 2)]
ROWS = (1, 16, 32, 64)
STEP_ROWS = 32
REPS = 50


def configs(dry: bool):
    from tandem.ops.triton_gemm import GemmConfig

    if dry:
        return [GemmConfig(16, 32, 4, 2), GemmConfig(32, 64, 4, 2)]
    grid = itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4, 6))
    return [GemmConfig(*c) for c in grid]


def timed_us(fn, device) -> float:
    """Microseconds per call: REPS calls captured in one graph (CUDA), or timed eagerly."""
    import torch

    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - t0)
    fn()  # compile, warm the allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, 1e3 * start.elapsed_time(end) / REPS)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures here as well")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="tiny shapes in Triton's interpreter: checks the script, not speed")  # fmt: skip
    args = parser.parse_args(argv)
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch
    import torch.nn.functional as F

    from tandem.ops import triton_gemm

    dry = args.cpu_dry_run
    if not dry and not torch.cuda.is_available():
        print(
            "no CUDA device: nothing to measure (--cpu-dry-run checks the script)", file=sys.stderr
        )
        return 2
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.bfloat16
    shapes, rows_list = (SHAPES_DRY, (1, 5)) if dry else (SHAPES_8B, ROWS)
    machine = {"torch": torch.__version__, "device": "cpu (interpreter)" if dry else
               torch.cuda.get_device_name(), "default_config": triton_gemm.CONFIG.__dict__}  # fmt: skip
    results = {"machine": machine, "rows": []}
    g = torch.Generator(device="cpu").manual_seed(0)
    grid = configs(dry)
    for name, n, k, launches in shapes:
        weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g).to(dtype).to(device)
            exact = x.float() @ weight.float().T
            cublas_us = timed_us(lambda x=x, w=weight: F.linear(x, w), device)
            cublas_error = (F.linear(x, weight).float() - exact).abs().max().item()
            timings = {}
            for config in grid:
                try:
                    us = timed_us(
                        lambda x=x, w=weight, c=config: triton_gemm.few_rows_linear(x, w, None, c),
                        device,
                    )
                except Exception as exc:  # a config that does not fit (shared memory, say)
                    print(f"{name} {rows} rows {config}: {type(exc).__name__}", file=sys.stderr)
                    continue
                timings[config] = us
            best = min(timings, key=timings.get)
            out = triton_gemm.few_rows_linear(x, weight, None, best)
            row = {
                "gemm": name, "n": n, "k": k, "rows": rows, "launches_per_step": launches,
                "cublas_us": cublas_us, "cublas_max_error": cublas_error,
                "triton_max_error": (out.float() - exact).abs().max().item(),
                "weight_bytes": weight.numel() * weight.element_size(),
                "best_config": best.__dict__, "best_us": timings[best],
                "default_us": timings.get(triton_gemm.CONFIG),
                "us_by_config": {json.dumps(c.__dict__): t for c, t in timings.items()},
            }  # fmt: skip
            results["rows"].append(row)
            size = row["weight_bytes"]
            print(f"{name:8s} {rows:3d} rows: cuBLAS {cublas_us:8.2f} us "
                  f"{size / cublas_us / 1e3:6.0f} GB/s; Triton best {timings[best]:8.2f} us "
                  f"{size / timings[best] / 1e3:6.0f} GB/s "
                  f"{best.__dict__}; max error {row['triton_max_error']:.2e} "
                  f"(cuBLAS {cublas_error:.2e})", flush=True)  # fmt: skip
    step_rows = min(STEP_ROWS, max(rows_list))
    at_step = [r for r in results["rows"] if r["rows"] == step_rows]
    cublas_step = sum(r["cublas_us"] * r["launches_per_step"] for r in at_step)
    keys = set.intersection(*(set(r["us_by_config"]) for r in at_step))
    step_by_config = {
        key: sum(r["us_by_config"][key] * r["launches_per_step"] for r in at_step) for key in keys
    }
    best_key = min(step_by_config, key=step_by_config.get)
    results["step"] = {
        "rows": step_rows, "cublas_us": cublas_step, "best_config": json.loads(best_key),
        "best_us": step_by_config[best_key],
        "default_us": step_by_config.get(json.dumps(triton_gemm.CONFIG.__dict__)),
    }  # fmt: skip
    print(f"a decode step's GEMMs at {step_rows} rows: cuBLAS {cublas_step:.0f} us; Triton, one "
          f"config for all, best {step_by_config[best_key]:.0f} us with {best_key} "
          f"({cublas_step / step_by_config[best_key]:.2f}x); the kernel's CONFIG "
          f"{results['step']['default_us'] or float('nan'):.0f} us")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
