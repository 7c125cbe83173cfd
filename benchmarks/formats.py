"""Tandem beside llama.cpp's `llama-batched-bench`, format for format, at batch 1 and batch 32.

The same GGUF file runs in both (F32, Q8_0, Q4_0, Q4_1: Tandem keeps the quantized blocks),
with B requests of the same prompt length and the same number of output tokens, greedy and EOS
ignored: the time of the whole job (prefill and decode) is what is compared, in rounds that
alternate the two engines (median of --repeats). llama.cpp runs `llama-batched-bench -npp P -ntg
N -npl B -t THREADS` and its total time `T s` is read; Tandem runs `LLM.generate` on B random
prompts with the synchronous loop (one request per core has nothing to overlap). The files and
binaries come from benchmarks/setup_llama_server.sh.

    python benchmarks/formats.py [--batches 1,32] [--repeats 3] [GGUF ...]
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

CACHE = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
BATCHED_BENCH = CACHE / "llama.cpp" / "bin" / "llama-batched-bench"
MODELS = CACHE / "models"
DEFAULT_FILES = [
    MODELS / "smollm2-135m-instruct-f32.gguf",
    MODELS / "smollm2-135m-instruct-q8_0.gguf",
    MODELS / "smollm2-135m-instruct-q4_0.gguf",
    "smollm2-135m-instruct",  # the packaged Q4_1 file
]


def llama_seconds(path: Path, batch: int, args: argparse.Namespace) -> float:
    command = [
        str(BATCHED_BENCH), "-m", str(path), "-t", str(args.threads), "-npp", str(args.prompt),
        "-ntg", str(args.output), "-npl", str(batch), "-c", str(batch * (args.prompt + args.output) + 64),
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
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{'file':34} {'Tandem formats':24} {'batch':>5} {'Tandem s':>9} {'llama.cpp s':>11} "
          f"{'ratio':>6}  (llama.cpp time / Tandem time: above 1, Tandem is faster)")  # fmt: skip
    for file in args.files:
        path = resolve_model(str(file))
        llm = LLM(str(path), async_scheduling=False, max_model_len=1024, max_num_seqs=max(batches))
        formats = llm.engine.execution.describe_weights().removeprefix("linear layers: ")
        for batch in batches:
            tandem_seconds(llm, batch, args)  # warm-up
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(tandem_seconds(llm, batch, args))
                theirs.append(llama_seconds(path, batch, args))
            t, q = statistics.median(ours), statistics.median(theirs)
            print(f"{path.name:34} {formats:24} {batch:>5} {t:>9.2f} {q:>11.2f} {q / t:>6.2f}",
                  flush=True)  # fmt: skip
        llm.close()


if __name__ == "__main__":
    main()
