"""Tandem beside llama.cpp's `llama-batched-bench`, format for format, at batch 1 and batch 32.

The same GGUF file runs in both (F32, Q8_0, Q4_0, Q4_1: Tandem keeps the quantized blocks),
with B requests of the same prompt length and the same number of output tokens, greedy and EOS
ignored: the time of the whole job (prefill and decode) is what is compared, in rounds that
alternate the engines (median of --repeats). Tandem runs each quantized file twice: with float32
activations (the dequantized model's outputs exactly) and with `int8_activations` (activations
rounded to int8 per block of 32 and multiplied in integers, which is what llama.cpp does).
llama.cpp runs `llama-batched-bench -npp P -ntg N -npl B -t THREADS` and its total time `T s` is
read; Tandem runs `LLM.generate` on B random prompts with the synchronous loop (one request per
core has nothing to overlap). The files and binaries come from benchmarks/setup_llama_server.sh.

    python benchmarks/formats.py [--batches 1,32] [--repeats 3] [GGUF ...]

Both engines' AVX2 paths on an AVX-512 machine (an AMD Zen 3's instructions, on this machine's
memory): `LLAMA_CPP_ISA=avx2 bash benchmarks/setup_llama_server.sh build`, then
`TANDEM_CPU_ISA=avx2 python benchmarks/formats.py --llama-bin ~/.cache/tandem/llama.cpp/bin-avx2`.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import time
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.models.catalog import resolve_model
from tandem.models.gguf_blocks import NATIVE_TYPES

CACHE = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
LLAMA_BIN = CACHE / "llama.cpp" / "bin"
MODELS = CACHE / "models"
DEFAULT_FILES = [
    MODELS / "smollm2-135m-instruct-f32.gguf",
    MODELS / "smollm2-135m-instruct-q8_0.gguf",
    MODELS / "smollm2-135m-instruct-q4_0.gguf",
    "smollm2-135m-instruct",  # the packaged Q4_1 file
]


def llama_seconds(path: Path, batch: int, args: argparse.Namespace) -> float:
    command = [
        str(Path(args.llama_bin) / "llama-batched-bench"), "-m", str(path),
        "-t", str(args.threads), "-npp", str(args.prompt), "-ntg", str(args.output),
        "-npl", str(batch), "-c", str(batch * (args.prompt + args.output) + 64),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    row = next(line for line in out.splitlines() if re.match(rf"\|\s*{args.prompt}\s*\|", line))
    return float(row.split("|")[9])  # | PP | TG | B | N_KV | T_PP | S_PP | T_TG | S_TG | T | S |


def tandem_seconds(llm: LLM, batch: int, args: argparse.Namespace) -> float:
    rng = random.Random(batch)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt)] for _ in range(batch)]
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.output for o in outputs)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", default=DEFAULT_FILES)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt", type=int, default=72)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--llama-bin", default=str(LLAMA_BIN), help="llama.cpp's binaries")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    isa = os.environ.get("TANDEM_CPU_ISA") or "native"
    print(f"Tandem's kernels: TANDEM_CPU_ISA={isa}; llama.cpp: {args.llama_bin}")
    print(f"{'file':34} {'Tandem formats':18} {'batch':>5} {'Tandem s':>9} {'int8-act s':>10} "
          f"{'llama.cpp s':>11} {'ratio':>6} {'int8-act':>8}  (ratios: llama.cpp time / Tandem "
          "time; above 1, Tandem is faster)")  # fmt: skip
    for file in args.files:
        path = resolve_model(str(file))
        # No prefix cache: every round's prompts are the same, and llama.cpp prefills each time.
        options = dict(
            async_scheduling=False,
            max_model_len=1024,
            max_num_seqs=max(batches),
            enable_prefix_caching=False,
        )
        llm = LLM(str(path), **options)
        formats = llm.engine.execution.describe_weights().removeprefix("linear layers: ")
        quantized = any(kind in formats for kind in NATIVE_TYPES)
        engines = [llm, LLM(str(path), int8_activations=True, **options) if quantized else None]
        for batch in batches:
            times: list[list[float]] = [[], [], []]
            for _ in range(args.repeats + 1):  # the first round warms up and is dropped
                for i, engine in enumerate(engines):
                    if engine is not None:
                        times[i].append(tandem_seconds(engine, batch, args))
                times[2].append(llama_seconds(path, batch, args))
            t, a, q = (statistics.median(ts[1:]) if ts else float("nan") for ts in times)
            print(f"{path.name:34} {formats[:18]:18} {batch:>5} {t:>9.2f} {a:>10.2f} {q:>11.2f} "
                  f"{q / t:>6.2f} {q / a:>8.2f}", flush=True)  # fmt: skip
        for engine in engines:
            if engine is not None:
                engine.close()


if __name__ == "__main__":
    main()
