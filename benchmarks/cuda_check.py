"""The CUDA path's checks, for a machine with a GPU (CI has none, so these are not in tests/).

1. Greedy fp32 outputs on CUDA equal Hugging Face `generate` on CPU, sync and async, with chunked
   prefill and preemption.
2. The whole loop runs under `torch.cuda.set_sync_debug_mode("error")`: any hidden host-device
   synchronisation (`.item()`, `.cpu()`, a boolean-mask index ...) raises.
3. Penalties, logit_bias, min_tokens and logprobs (raw and prompt) on CUDA, under the same
   sync check: greedy tokens equal the CPU engine's, logprobs within 1e-3 of them, and seeded
   sampling gives the same tokens sync and async.
4. `tandem bench` on a larger random Llama (bf16), where the device step dominates.

    python benchmarks/cuda_check.py [--bench-layers 16] [--bench-hidden 2048]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def check_equivalence(path: Path) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tandem import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config = GenerationConfig()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(1, 200))] for _ in range(24)]
    refs = []
    for prompt in prompts:
        config = GenerationConfig(do_sample=False, max_new_tokens=16, pad_token_id=2)
        out = hf.generate(torch.tensor([prompt]), generation_config=config)
        refs.append(out[0, len(prompt) :].tolist())
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for async_scheduling in (False, True):
        llm = LLM(str(path), device="cuda", dtype="float32", async_scheduling=async_scheduling,
                  max_num_batched_tokens=64, block_size=8, num_kv_blocks=120)  # fmt: skip
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = llm.generate(prompts, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        equal = sum(o.token_ids == r for o, r in zip(outs, refs, strict=True))
        mode = "async" if async_scheduling else "sync"
        print(f"{mode}: {equal}/{len(refs)} requests equal HF; "
              f"preemptions {llm.engine.scheduler.num_preemptions}; no hidden sync")  # fmt: skip
        llm.close()
        assert equal == len(refs)


def check_features(path: Path) -> None:
    from tandem import LLM, SamplingParams

    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(5, 150))] for _ in range(24)]
    params = [
        SamplingParams(
            max_tokens=16, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True,
            repetition_penalty=[1.0, 1.3][i % 2], presence_penalty=[0.0, 0.8][i // 2 % 2],
            frequency_penalty=[0.0, 0.5][i // 4 % 2], logit_bias={rng.randrange(1024): 4.0},
            min_tokens=4, stop_token_ids=[rng.randrange(3, 1024) for _ in range(30)],
            logprobs=[None, 0, 5][i % 3], prompt_logprobs=[None, 2][i // 3 % 2],
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    options = dict(dtype="float32", max_num_batched_tokens=64, block_size=8, num_kv_blocks=120)
    cpu = LLM(str(path), device="cpu", **options).generate(prompts, params)
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(str(path), device="cuda", async_scheduling=async_scheduling, **options)
        torch.cuda.set_sync_debug_mode("error")
        try:
            runs[async_scheduling] = llm.generate(prompts, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        llm.close()
    assert [o.token_ids for o in runs[False]] == [o.token_ids for o in runs[True]]
    worst = 0.0
    for p, ref, out in zip(params, cpu, runs[True], strict=True):
        if p.temperature == 0:
            assert out.token_ids == ref.token_ids
        for a, b in zip(out.logprobs or [], ref.logprobs or [], strict=True):
            t = next(iter(b))
            if t in a:
                worst = max(worst, abs(a[t].logprob - b[t].logprob))
        for a, b in zip(out.prompt_logprobs or [], ref.prompt_logprobs or [], strict=True):
            if a is not None:
                t = next(iter(b))
                worst = max(worst, abs(a[t].logprob - b[t].logprob))
    print(f"features: greedy tokens equal the CPU engine's, async == sync, logprobs within "
          f"{worst:.1e} of CPU; no hidden sync")  # fmt: skip
    assert worst < 1e-3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-layers", type=int, default=16)
    parser.add_argument("--bench-hidden", type=int, default=2048)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    from tandem.cli import main as cli
    from tandem.default_model import build_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_checkpoint(Path(tmp) / "tiny")
        check_equivalence(tiny)
        check_features(tiny)
        big = build_checkpoint(
            Path(tmp) / "big", hidden_size=args.bench_hidden,
            intermediate_size=int(args.bench_hidden * 3.5), num_hidden_layers=args.bench_layers,
            num_attention_heads=args.bench_hidden // 128, num_key_value_heads=8,
            initializer_range=0.02, dtype=torch.bfloat16,
        )  # fmt: skip
        return cli(["bench", "--model", str(big), "--num-requests", "128", "--prompt-len",
                    "512", "--output-len", "256", "--repeats", "3",
                    "--trace", "cuda_trace.json", "--plot", "cuda_timeline.png"])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
