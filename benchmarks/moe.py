"""A small mixture-of-experts model beside dense models of its active and of its total size.

Three config-only Qwen3 models with dummy weights, the same attention and the same workload:
- `moe`: Qwen3-MoE, `--experts` experts of intermediate `--expert-inter`, top `--top-k`;
- `dense-active`: Qwen3 whose MLP has top_k * expert_inter columns (the MoE's active parameters);
- `dense-total`: Qwen3 whose MLP has experts * expert_inter columns (the MoE's total parameters).
Each (model, loop) pair generates `--requests` greedy requests of `--prompt-len` random ids and
`--output-len` tokens through `tandem.LLM`; pairs are interleaved over `--repeats` rounds, and the
table shows each pair's median output tokens per second and its ratio to `dense-active`'s.
`--expert-gemm` also times one MoE layer's experts per path (F.linear, MKL packed, Tandem's own
GEMM over panels) at several token counts.

    python benchmarks/moe.py
    python benchmarks/moe.py --repeats 5 --requests 32 --output-len 64 --expert-gemm
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-inter", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-threads", type=int, default=None)
    p.add_argument("--expert-gemm", action="store_true", help="also time the expert GEMM paths")
    return p.parse_args(argv)


def write_configs(root: Path, a: argparse.Namespace) -> dict[str, Path]:
    common = {
        "hidden_size": a.hidden, "num_hidden_layers": a.layers, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": a.hidden // 8, "vocab_size": a.vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }  # fmt: skip
    configs = {
        "moe": common | {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": a.experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": True,
            "moe_intermediate_size": a.expert_inter, "intermediate_size": a.expert_inter,
        },
        "dense-active": common | {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "intermediate_size": a.top_k * a.expert_inter,
        },
        "dense-total": common | {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "intermediate_size": a.experts * a.expert_inter,
        },
    }  # fmt: skip
    paths = {}
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        paths[name] = root / name
    return paths


def mlp_params(name: str, a: argparse.Namespace) -> tuple[int, int]:
    """(total, active per token) MLP parameters of one layer."""
    per_expert = 3 * a.hidden * a.expert_inter
    if name == "moe":
        router = a.experts * a.hidden
        return a.experts * per_expert + router, a.top_k * per_expert + router
    inter = a.top_k * a.expert_inter if name == "dense-active" else a.experts * a.expert_inter
    return 3 * a.hidden * inter, 3 * a.hidden * inter


def throughput(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / elapsed


def expert_gemm_table(a: argparse.Namespace) -> None:
    """One layer's active experts per path, each expert's rows as the grouped path gives them."""
    from tandem.models.moe import Experts
    from tandem.ops import cpu_kernels, elementwise
    from tandem.ops.linear import PACK_BATCH_HINT

    build = cpu_kernels.load()
    if not build.available:
        raise SystemExit(f"--expert-gemm needs the CPU kernels: {build.error}")
    experts = Experts(a.experts, a.hidden, a.expert_inter)
    torch.nn.init.normal_(experts.gate_up, std=0.02)
    torch.nn.init.normal_(experts.down, std=0.02)
    experts.prepack()  # the fast path's panels
    mkl = lambda w: torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_BATCH_HINT)  # noqa: E731
    packings = {
        "plain": None,
        "packed": [(mkl(g), mkl(d)) for g, d in zip(experts.gate_up, experts.down, strict=True)],
        "own": experts.packed,
    }
    print(f"\nexperts of one layer, {a.top_k} of {a.experts} per token, ms per call (median of 20)")
    print(f"{'tokens':>7} {'rows/expert':>12} {'F.linear':>9} {'MKL packed':>11} {'own GEMM':>9}")
    for tokens in (1, 4, 16, 64, 256):
        rows = max(1, tokens * a.top_k // a.experts)
        x = torch.randn(rows, a.hidden)
        times = {}
        for path, packed in packings.items():
            experts.packed = packed
            runs = []
            for _ in range(20):
                start = time.perf_counter()
                for e in range(min(a.experts, tokens * a.top_k)):
                    experts(e, x, elementwise)
                runs.append(time.perf_counter() - start)
            times[path] = statistics.median(runs) * 1e3
        print(f"{tokens:>7} {rows:>12} {times['plain']:>9.3f} {times['packed']:>11.3f} "
              f"{times['own']:>9.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, a.vocab) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_configs(Path(tmp), a)
        llms = {
            name: LLM(
                str(path),
                load_format="dummy",
                dtype="float32",
                device="cpu",
                cpu_threads=a.cpu_threads,
            )  # fmt: skip
            for name, path in paths.items()
        }
        for llm in llms.values():  # warm up both loops
            for mode in (False, True):
                llm.engine.configure(async_scheduling=mode)
                throughput(llm, prompts[:2], params)
        results: dict[tuple[str, bool], list[float]] = {}
        for _ in range(a.repeats):
            for name, llm in llms.items():
                for mode in (False, True):
                    llm.engine.configure(async_scheduling=mode)
                    results.setdefault((name, mode), []).append(throughput(llm, prompts, params))
        for llm in llms.values():
            llm.close()
    med = {key: statistics.median(values) for key, values in results.items()}
    print(f"{a.requests} requests x {a.prompt_len} prompt + {a.output_len} output tokens, "
          f"hidden {a.hidden}, {a.layers} layers, median of {a.repeats} interleaved runs")  # fmt: skip
    header = f"{'model':<13} {'MLP params/layer':>17} {'active':>9} {'sync tok/s':>11} "
    print(header + f"{'async tok/s':>12} {'sync ratio':>11} {'async ratio':>12}")
    for name in ("moe", "dense-active", "dense-total"):
        total, active = mlp_params(name, a)
        s, y = med[(name, False)], med[(name, True)]
        rs, ry = s / med[("dense-active", False)], y / med[("dense-active", True)]
        print(f"{name:<13} {total / 1e6:>16.2f}M {active / 1e6:>8.2f}M {s:>11.1f} {y:>12.1f} "
              f"{rs:>11.2f} {ry:>12.2f}")  # fmt: skip
    if a.expert_gemm:
        expert_gemm_table(a)


if __name__ == "__main__":
    main()
