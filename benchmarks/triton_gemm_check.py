"""The few-rows Triton GEMM (ops/triton_gemm.py) against cuBLAS on a GPU: time, bandwidth, error.

For each GEMM of a Llama-3.1-8B decode step (and its logits), at 1 to 64 rows: cuBLAS's time
(`F.linear`) and the Triton kernel's under every config of a small grid, each as 50 launches
back to back in one CUDA graph (as a decode step replays them), the weight's bytes over the time,
and the kernel's largest error against a float32 product beside cuBLAS's. Then the config that
is fastest over a whole step's GEMMs at 32 rows, the step's GEMM time under it against cuBLAS's,
and whether it is the kernel's `CONFIG`. Then the same for FP8 weights (`--formats fp8`): the
kernel over e4m3 codes (`scaled_few_rows`) against `torch._scaled_mm` with row-wise scales, at 1
and 32 rows, beside the bf16 step's cuBLAS time. Writes the figures as JSON too.

    python benchmarks/triton_gemm_check.py --json gemm.json [--formats bf16,fp8]
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
FP8_ROWS = (1, 32)
STEP_ROWS = 32
REPS = 50
FORMATS = ("bf16", "fp8")


def configs(dry: bool):
    from tandem.ops.triton_gemm import GemmConfig

    if dry:
        return [GemmConfig(16, 32, 4, 2), GemmConfig(32, 64, 4, 2)]
    grid = itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4, 6))
    return [GemmConfig(*c) for c in grid]


def fp8_configs(dry: bool):
    """Tiles of e4m3 codes: K tiles of as many bytes as bf16's and twice as many."""
    from tandem.ops.triton_gemm import GemmConfig

    if dry:
        return [GemmConfig(16, 64, 4, 2)]
    grid = itertools.product((32, 64), (256, 512, 1024), (4,), (4, 6))
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
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="tiny shapes in Triton's interpreter: checks the script, not speed",
    )
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help=f"weight formats to measure, of {', '.join(FORMATS)}")  # fmt: skip
    args = parser.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats or set(formats) - set(FORMATS):
        parser.error(f"--formats takes {', '.join(FORMATS)}, got {args.formats!r}")
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

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
    if "bf16" in formats:
        measure_bf16(results, shapes, rows_list, configs(dry), device, dtype, g)
    if "fp8" in formats:
        measure_fp8(results, shapes, FP8_ROWS if not dry else (1, 5), fp8_configs(dry), device, g)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def sweep(run, grid, device, label: str) -> dict:
    """Microseconds per call of `run(config)` under each config of `grid` that compiles and
    fits (one that does not is reported and left out)."""
    timings = {}
    for config in grid:
        try:
            timings[config] = timed_us(lambda c=config: run(c), device)
        except Exception as exc:  # a config that does not fit (shared memory, say)
            print(f"{label} {config}: {type(exc).__name__}", file=sys.stderr)
    return timings


def step_totals(rows: list[dict], baseline: str) -> tuple[float, dict[str, float]]:
    """A decode step's GEMM time from the rows at one row count: the baseline's (`baseline`:
    its key in each row), and each config's that every row has, each GEMM by its launches."""
    total = sum(r[baseline] * r["launches_per_step"] for r in rows)
    keys = set.intersection(*(set(r["us_by_config"]) for r in rows))
    by_config = {
        key: sum(r["us_by_config"][key] * r["launches_per_step"] for r in rows) for key in keys
    }
    return total, by_config


def measure_bf16(results, shapes, rows_list, grid, device, dtype, g) -> None:
    import torch
    import torch.nn.functional as F

    from tandem.ops import triton_gemm

    for name, n, k, launches in shapes:
        weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g).to(dtype).to(device)
            exact = x.float() @ weight.float().T
            cublas_us = timed_us(lambda x=x, w=weight: F.linear(x, w), device)
            cublas_error = (F.linear(x, weight).float() - exact).abs().max().item()
            timings = sweep(
                lambda c, x=x, w=weight: triton_gemm.few_rows_linear(x, w, None, c),
                grid, device, f"{name} {rows} rows",
            )  # fmt: skip
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
    cublas_step, step_by_config = step_totals(at_step, "cublas_us")
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


def measure_fp8(results, shapes, rows_list, grid, device, g) -> None:
    """FP8 weights at a decode step's rows: `_scaled_mm` against the kernel over e4m3 codes,
    both given the same rounded rows (what `fp8_linear` multiplies)."""
    import torch

    from tandem.ops import triton_gemm
    from tandem.ops.fp8 import fp8_product, quantize_fp8, quantize_rows

    out_dtype = torch.bfloat16
    rows_out = results.setdefault("fp8_rows", [])
    for name, n, k, launches in shapes:
        q = quantize_fp8((torch.randn(n, k, generator=g) / k**0.5).to(device))
        for rows in rows_list:
            codes, scales = quantize_rows(torch.randn(rows, k, generator=g).to(device))
            exact = fp8_product(codes, scales, q)

            def scaled_mm(codes=codes, scales=scales, q=q):
                return torch._scaled_mm(codes, q.codes.t(), scale_a=scales,
                                        scale_b=q.scales.view(1, -1), out_dtype=out_dtype)  # fmt: skip

            mm_us = timed_us(scaled_mm, device)
            timings = sweep(
                lambda cfg, c=codes, s=scales, q=q: triton_gemm.scaled_few_rows(
                    c, s, q, out_dtype, cfg
                ),
                grid, device, f"fp8 {name} {rows} rows",
            )  # fmt: skip
            best = min(timings, key=timings.get)
            out = triton_gemm.scaled_few_rows(codes, scales, q, out_dtype, best)
            size = q.nbytes
            row = {
                "gemm": name, "n": n, "k": k, "rows": rows, "launches_per_step": launches,
                "scaled_mm_us": mm_us,
                "scaled_mm_max_error": (scaled_mm().float() - exact).abs().max().item(),
                "triton_max_error": (out.float() - exact).abs().max().item(),
                "weight_bytes": size, "best_config": best.__dict__, "best_us": timings[best],
                "default_us": timings.get(triton_gemm.FP8_CONFIG),
                "us_by_config": {json.dumps(c.__dict__): t for c, t in timings.items()},
            }  # fmt: skip
            rows_out.append(row)
            print(f"fp8 {name:8s} {rows:3d} rows: _scaled_mm {mm_us:8.2f} us "
                  f"{size / mm_us / 1e3:6.0f} GB/s; Triton best {timings[best]:8.2f} us "
                  f"{size / timings[best] / 1e3:6.0f} GB/s {best.__dict__}; max error "
                  f"{row['triton_max_error']:.2e} (_scaled_mm {row['scaled_mm_max_error']:.2e})",
                  flush=True)  # fmt: skip
    step_rows = max(r["rows"] for r in rows_out)
    at_step = [r for r in rows_out if r["rows"] == step_rows]
    mm_step, by_config = step_totals(at_step, "scaled_mm_us")
    best_key = min(by_config, key=by_config.get)
    bf16 = results.get("step", {}).get("cublas_us")
    results["fp8_step"] = {
        "rows": step_rows, "scaled_mm_us": mm_step, "best_config": json.loads(best_key),
        "best_us": by_config[best_key], "bf16_cublas_us": bf16,
        "default_us": by_config.get(json.dumps(triton_gemm.FP8_CONFIG.__dict__)),
    }  # fmt: skip
    beside = f"; bf16 cuBLAS {bf16:.0f} us" if bf16 else ""
    print(f"FP8: a decode step's GEMMs at {step_rows} rows: _scaled_mm {mm_step:.0f} us; Triton "
          f"best {by_config[best_key]:.0f} us with {best_key} "
          f"({mm_step / by_config[best_key]:.2f}x){beside}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
