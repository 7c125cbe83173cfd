"""The CUDA path's checks and the blog's experiment, for a machine with a GPU (CI has none).

One prepared script; it prints one table last (every section with `--skip-hf`: about 5 minutes on
one H200 at the default lengths).
1. Greedy fp32 outputs on CUDA equal Hugging Face `generate` on CPU, sync and async, CUDA graphs
   on and off (`enforce_eager`), with chunked prefill and preemption, the whole loop under
   `torch.cuda.set_sync_debug_mode("error")` (any hidden host-device sync raises).
2. bf16 against transformers in bf16 on the same GPU: prompt logprobs within a tolerance, and
   greedy tokens equal up to the first position where transformers' own top two are closer than
   that tolerance (a bf16 near-tie, which either order of summation may break either way).
3. Penalties, logit_bias, min_tokens and logprobs on CUDA under the same sync check.
4. The blog's experiment (`tandem bench --workload llama8b-32x8k`: 32 requests at once, short prompts,
   long generations) on the 8B-shaped dummy model (`tandem/bench/models/llama-3.1-8b`): sync and
   async, CUDA graphs on and off; tokens/s, step-level device idle, and kernel-level device idle
   over a profiled window (torch.profiler), with the kernels that end the most idle.
   Beside each: what a decode step must read (weights + KV) and the share of the device's
   bandwidth its decode steps reached (`tandem.bench.roofline`), and kernels per step.
5. FP8 weights (`quantization="fp8"`) against bf16 on the dummy 8B model, async with graphs:
   tokens/s, the decode step and its bandwidth, and how far FP8's prompt logprobs and greedy tokens
   stay from bf16's (random weights: the accuracy on a real model is measured on a CPU with the
   same rounding, `benchmarks/perplexity.py --tandem-quantization default,fp8`).
6. Speculative decoding: ngram and draft-model outputs equal decoding without drafts (greedy
   and seeded, sync and async) under the same sync check; then on the dummy 8B model at 1 and 4
   requests, tokens/s without drafts, with adaptive drafts and with 4 at every step.
7. `tandem serve` on the dummy 8B model, async and sync, 32 streams of token-id prompts: output
   tokens/s, the device's idle per 1 s window and the steps launched late, from the cores' traces.
8. transformers' `generate_batch` with async batching (and its CUDA graphs) on the same dummy
   8B model and prompts, if this transformers has it, with shorter outputs (`--hf-output-len`:
   on an H200 it had not finished 32 x 1024 tokens in 190 s), against Tandem async at that length.

`--gemms default,triton` runs the blog (graphs on) and FP8 sections once more with the decode
steps' GEMMs in Triton (`TANDEM_TRITON_GEMM=1`: the few-rows GEMM, its gate/up form ending in
SiLU, and FP8's over e4m3 codes), beside cuBLAS and `_scaled_mm`, with bf16's outputs compared.
`--json PATH` writes every figure as JSON beside the table (with the GPU and the software
versions), after every section; a device run's file is committed under docs/results/.
`--sections` picks sections. A GPU machine whose image lacks the engine's dependencies (gguf,
xgrammar, msgspec, pyzmq, fastapi, ...) takes them as wheels: docs/performance.md, H200.

    python benchmarks/cuda_check.py [--blog-output-len 1024] [--hf-output-len 128] [--skip-hf]
    python benchmarks/cuda_check.py --sections blog,fp8 --blog-output-len 8192 --blog-graphs on \
        --json docs/results/h200-blog-8192.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
MODEL_8B = Path(__file__).resolve().parents[1] / "tandem" / "bench" / "models" / "llama-3.1-8b"
BF16_TOLERANCE = 0.1  # logprob difference allowed between two bf16 implementations
SECTIONS = ("equivalence", "bf16", "features", "blog", "fp8", "speculative", "serve", "hf")
# A decode step's GEMMs: cuBLAS's (and `_scaled_mm` for FP8), or the Triton few-rows GEMM's.
GEMMS = ("default", "triton")
TABLE: list[tuple[str, str, str]] = []  # (section, what, result): printed last
RESULTS: dict = {"runs": [], "checks": []}  # --json: the figures, beside the table
FP8_PROMPTS, FP8_PROMPT_LEN, FP8_GREEDY_TOKENS = 8, 128, 32
DEVICE = "cuda"  # --cpu-dry-run: "cpu", tiny shapes, to catch a broken script before a GPU run
BLOG_MODEL = MODEL_8B  # --cpu-dry-run: a config-only copy of the tiny checkpoint
# --cpu-dry-run: one compute thread for the CPU engines (tiny shapes gain nothing from more), in
# place of the start-up timing of thread counts (a CPU engine's own: the GPU's engines never run it)
CPU_THREADS: int | None = None


def sync_checked() -> str:
    return "no hidden sync" if DEVICE == "cuda" else "hidden syncs not checked (CPU)"


@contextlib.contextmanager
def no_hidden_sync():
    """CUDA: any hidden host-device sync inside raises (start-up, which syncs, stays outside)."""
    if DEVICE != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def record(section: str, what: str, result: str) -> None:
    TABLE.append((section, what, result))
    RESULTS["checks"].append({"section": section, "what": what, "result": result})
    print(f"[{section}] {what}: {result}", flush=True)


def versions() -> dict[str, str | None]:
    import transformers
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def run_figures(name: str, engine, run, kernels, bandwidth: tuple[float, float | None]) -> dict:
    """One run's figures for the table and the JSON: throughput, idle at both levels, kernels
    per step, and the decode steps' bytes and share of bandwidth."""
    from tandem.bench.kernel_profile import shares_per_step
    from tandem.bench.roofline import decode_roofline

    summary = run.summary
    roofline = decode_roofline(run.records, engine.execution.weight_bytes)
    figures = {
        "name": name,
        "requests": len(run.outputs),
        "output_tokens": summary.output_tokens,
        "output_len": max(len(o) for o in run.outputs),
        "wall_s": summary.wall_s,
        "tokens_per_s": summary.tokens_per_s,
        "step_idle_pct": 100 * summary.device_idle_fraction,
        "kernel_idle_pct": kernels.idle_pct if kernels and kernels.kernels else None,
        # ... less the gaps of 100 us and more (the host late), and those gaps
        "boundary_idle_pct": kernels.boundary_idle_pct if kernels and kernels.kernels else None,
        "long_gaps": kernels.long_gaps if kernels else 0,
        "long_gap_ms": kernels.long_gap_s * 1e3 if kernels else 0.0,
        "kernels_per_step": kernels.kernels / kernels.steps if kernels and kernels.steps else None,
        "profiled_steps": kernels.steps if kernels else 0,
        "decode_step_ms": roofline.device_s * 1e3 if roofline else None,
        "weight_bytes": roofline.weight_bytes if roofline else None,
        "kv_bytes_per_step": roofline.kv_bytes if roofline else None,
        "bandwidth_reached_gbs": roofline.reached_bytes_per_s / 1e9 if roofline else None,
        "streaming_gbs": bandwidth[0] / 1e9,
        "fraction_of_streaming": roofline.fraction_of(bandwidth[0]) if roofline else None,
        "nominal_gbs": bandwidth[1] / 1e9 if bandwidth[1] else None,
        "fraction_of_nominal": roofline.fraction_of(bandwidth[1]) if roofline else None,
        "kernels_by_idle_before": shares_per_step(kernels, 16) if kernels else [],
    }
    RESULTS["runs"].append(figures)
    return figures


def describe_figures(f: dict) -> str:
    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}%"

    text = (
        f"{f['tokens_per_s']:.0f} tok/s, {f['wall_s']:.1f} s; step-level idle "
        f"{pct(f['step_idle_pct'])}; kernel-level idle {pct(f['kernel_idle_pct'])}"
    )
    if f["long_gaps"]:
        text += (f" ({pct(f['boundary_idle_pct'])} less {f['long_gaps']} gaps of 100 us or "
                 f"more, {f['long_gap_ms']:.1f} ms)")  # fmt: skip
    if f["kernels_per_step"]:
        text += f", {f['kernels_per_step']:.0f} kernels/step"
    if f["decode_step_ms"] is not None:
        nominal = f["fraction_of_nominal"]
        text += (
            f"; decode step {f['decode_step_ms']:.2f} ms reading "
            f"{(f['weight_bytes'] + f['kv_bytes_per_step']) / 1e9:.2f} GB: "
            f"{f['bandwidth_reached_gbs']:.0f} GB/s, {100 * f['fraction_of_streaming']:.0f}% of "
            f"streaming ({f['streaming_gbs']:.0f} GB/s)"
            + (f", {100 * nominal:.0f}% of nominal" if nominal is not None else "")
        )
    return text


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
    outputs = {}
    for graphs in (True, False):
        for async_scheduling in (False, True):
            llm = LLM(str(path), device=DEVICE, dtype="float32", async_scheduling=async_scheduling,
                      max_num_batched_tokens=64, block_size=8, num_kv_blocks=120,
                      enforce_eager=not graphs, cpu_threads=CPU_THREADS)  # fmt: skip
            with no_hidden_sync():  # after start-up: capturing graphs syncs by design
                outs = llm.generate(prompts, params)
            equal = sum(o.token_ids == r for o, r in zip(outs, refs, strict=True))
            label = f"fp32 {'async' if async_scheduling else 'sync'}, graphs {'on' if graphs else 'off'}"
            record("equivalence", label, f"{equal}/{len(refs)} equal HF; preemptions "
                   f"{llm.engine.stats().num_preemptions}; {sync_checked()}")  # fmt: skip
            outputs[graphs, async_scheduling] = [o.token_ids for o in outs]
            llm.close()
            assert equal == len(refs)
    assert len({str(v) for v in outputs.values()}) == 1


def check_bf16(path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tandem import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(8, 120))] for _ in range(16)]
    llm = LLM(
        str(path), device=DEVICE, dtype="bfloat16", num_kv_blocks=256, cpu_threads=CPU_THREADS
    )
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    llm.close()
    worst, equal, ties = 0.0, 0, 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt + out.token_ids], device=DEVICE)
        with torch.no_grad():
            logprobs = hf(ids).logits[0].float().log_softmax(-1)
        for i, entry in enumerate(out.prompt_logprobs[1:], start=1):  # position i's token
            token = prompt[i]
            worst = max(worst, abs(entry[token].logprob - logprobs[i - 1, token].item()))
        # Teacher-forced on Tandem's own tokens: at every position its token must be
        # transformers' argmax, or within a near-tie of it.
        n = len(prompt)
        reference = logprobs[n - 1 : n - 1 + len(out.token_ids)]
        chosen = reference.gather(1, torch.tensor(out.token_ids, device=DEVICE)[:, None])[:, 0]
        margin = (reference.max(-1).values - chosen).max().item()
        assert margin < BF16_TOLERANCE, f"a greedy token is {margin:.3f} below transformers' best"
        if margin == 0:
            equal += 1
        else:
            ties += 1
    record("equivalence", "bf16 vs transformers bf16 (prompt logprobs)",
           f"max |diff| {worst:.3f} (tolerance {BF16_TOLERANCE})")  # fmt: skip
    record("equivalence", "bf16 greedy tokens", f"{equal}/{len(prompts)} requests are "
           f"transformers' argmax at every position; {ties} take a bf16 near-tie "
           f"(within {BF16_TOLERANCE})")  # fmt: skip
    assert worst < BF16_TOLERANCE


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
    options = dict(dtype="float32", max_num_batched_tokens=64, block_size=8, num_kv_blocks=120,
                   cpu_threads=CPU_THREADS)  # fmt: skip
    # The portable ops are the reference (and the GPU machine need not build the CPU kernels).
    cpu = LLM(str(path), device="cpu", enforce_eager=True, **options).generate(prompts, params)
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(str(path), device=DEVICE, async_scheduling=async_scheduling, **options)
        with no_hidden_sync():
            runs[async_scheduling] = llm.generate(prompts, params)
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
    record("features", "penalties, bias, min_tokens, logprobs", f"greedy tokens equal the CPU "
           f"engine's, async == sync, logprobs within {worst:.1e} of CPU; {sync_checked()}")  # fmt: skip
    assert worst < 1e-3


def check_speculative(path: Path) -> None:
    """Speculative decoding on CUDA: ngram and draft-model drafts verified in one forward give
    the tokens decoding without drafts gives, greedy and seeded sampling, sync and async, with
    no hidden sync (ngram verifications replay their CUDA graphs; a draft model's run eagerly)."""
    from tandem import LLM, SamplingParams

    rng = random.Random(4)
    spans = [[rng.randrange(3, 1024) for _ in range(rng.randint(4, 40))] for _ in range(12)]
    prompts = [span * 3 for span in spans]  # text the answer may repeat: drafts found
    params = [SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    options = dict(dtype="float32", max_num_batched_tokens=64, block_size=8, num_kv_blocks=200,
                   cpu_threads=CPU_THREADS)  # fmt: skip
    methods = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "draft model": {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3},
    }
    runs = {}
    for name, spec in methods.items():
        for async_scheduling in (False, True):
            llm = LLM(str(path), device=DEVICE, async_scheduling=async_scheduling,
                      speculative_config=spec, **options)  # fmt: skip
            with no_hidden_sync():
                outs = llm.generate(prompts, params)
            stats = llm.engine.stats().speculative
            runs[name, async_scheduling] = [o.token_ids for o in outs]
            llm.close()
            same = sum(a == b for a, b in zip(runs[name, async_scheduling], runs["off", False],
                                              strict=True))  # fmt: skip
            record("speculative", f"{name}, {'async' if async_scheduling else 'sync'}",
                   f"{same}/{len(prompts)} equal decoding without drafts (greedy and seeded); "
                   f"{stats.accepted_tokens}/{stats.drafted_tokens} drafts accepted; "
                   f"{sync_checked()}")  # fmt: skip
            assert same == len(prompts)


def speculative_speed(output_len: int) -> dict[str, float]:
    """One and four requests on the 8B-shaped dummy model (bf16), each loop: tokens/s without
    drafts, with adaptive ngram drafts, and with 4 drafts at every step. Random weights accept
    almost no draft, so the fixed run prices a verification step against a decode step (what a
    real model's accepted drafts must beat)."""
    from tandem import Engine, EngineConfig
    from tandem.bench.workloads import Workload, repeated_span_ids

    max_model_len = 1024 + output_len
    # Loaded with ngram speculation, so its verification graphs are captured (the engine's
    # `configure` then switches drafts off and on; steps without drafts replay decode graphs).
    engine = Engine(EngineConfig(
        model=str(BLOG_MODEL), load_format="dummy", device=DEVICE, dtype="bfloat16",
        max_model_len=max_model_len, max_num_seqs=4, num_kv_blocks=4 * (max_model_len // 16 + 2),
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
        cpu_threads=CPU_THREADS,
    ))  # fmt: skip
    record("speculative", "8B dummy engine", engine.execution.describe())
    shape = SimpleNamespace(num_requests=4, prompt_len=512, len_spread=0.0, workload_seed=5)
    prompts = repeated_span_ids(shape, engine.spec.vocab_size, max_model_len)
    variants = {
        "off": None,
        "ngram": {"method": "ngram"},
        "ngram, 4 every step": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    }
    rates = {}
    for batch in (1, 4):
        work = Workload(prompts[:batch], [output_len] * batch, [0.0] * batch)
        for mode in ("async", "sync"):
            for name, spec in variants.items():
                engine.configure(async_scheduling=mode == "async", speculative_config=spec)
                rates[f"{name}, {mode}, batch {batch}"] = speculative_run(
                    engine, work, spec, f"{name}, {mode}", output_len
                )
            off = rates[f"off, {mode}, batch {batch}"]
            record("speculative", f"batch {batch}, {mode}: vs drafts off",
                   ", ".join(f"{name} {rates[f'{name}, {mode}, batch {batch}'] / off:.2f}x"
                             for name in variants if name != "off"))  # fmt: skip
        ratios = {name: rates[f"{name}, async, batch {batch}"] / rates[f"{name}, sync, batch {batch}"]
                  for name in variants}  # fmt: skip
        record(
            "speculative",
            f"batch {batch}: async vs sync",
            ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items()),
        )
    engine.close()
    return rates


def speculative_run(engine, work, spec: dict | None, name: str, output_len: int) -> float:
    """One configured run after a warm-up on the same workload (a step of a new row count
    compiles Triton kernels once); its figures recorded, its tokens/s returned."""
    from tandem.bench.run import run_workload

    batch = len(work.prompts)
    run_workload(engine, work, 0.0, None, "warmup")
    engine.configure(speculative_config=spec)  # the draft policy learns afresh
    before = engine.stats().speculative
    replayed_before, eager_before = verification_steps(engine)
    run = run_workload(engine, work, 0.0, None, f"{name}-{batch}")
    after = engine.stats().speculative
    drafted = after.drafted_tokens - before.drafted_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    step_ms = 1e3 * run.summary.wall_s / max(1, len(run.records))
    replayed, eager = verification_steps(engine)
    replayed, eager = replayed - replayed_before, eager - eager_before
    RESULTS["runs"].append({
        "name": f"speculative {name}, batch {batch}", "requests": batch,
        "output_len": output_len, "tokens_per_s": run.summary.tokens_per_s,
        "wall_s": run.summary.wall_s, "steps": len(run.records), "step_ms": step_ms,
        "drafted": drafted, "accepted": accepted,
        "step_idle_pct": 100 * run.summary.device_idle_fraction,
        "verifications": replayed + eager, "verifications_replayed": replayed,
    })  # fmt: skip
    record("speculative", f"8B dummy, batch {batch}, drafts {name}",
           f"{run.summary.tokens_per_s:.0f} tok/s, {step_ms:.2f} ms a step; "
           f"{accepted}/{drafted} drafts accepted; {replayed} of {replayed + eager} "
           "verification steps through their graphs; step-level idle "
           f"{100 * run.summary.device_idle_fraction:.2f}%")  # fmt: skip
    return run.summary.tokens_per_s


def verification_steps(engine) -> tuple[int, int]:
    """The engine's verification steps so far: (replayed from graphs, run eagerly). A step that
    verified no draft (its ngram found no match, or its request had just finished) counts too."""
    runner = engine.runner
    graphs = getattr(runner, "graphs", None)
    replayed = sum(n for (_, _, history), n in graphs.replays.items() if history) if graphs else 0
    return replayed, runner.eager_verifications


def served_split(output_len: int, tmp: Path) -> dict[str, float]:
    """`tandem serve` on the 8B-shaped dummy model, async and sync, under 32 streams of token-id
    prompts (`tandem bench serve --token-prompts`): output tokens/s, and from each engine core's step
    trace the device's idle per 1 s window with 16+ requests running, and how many steps the
    core launched only after the device had finished the one before (host work on the device's
    critical path)."""
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import serve_timeline

    from tandem.bench import launch
    from tandem.bench.serve import LoadConfig, random_prompts, run_load
    from tandem.bench.serve_client import Sampling

    rates = {}
    for mode in ("async", "sync"):
        trace = tmp / f"serve-{mode}.json"
        command = [sys.executable, "-m", "tandem", "serve", "--model", str(BLOG_MODEL),
                   "--load-format", "dummy", "--dtype", "bfloat16", "--device", DEVICE,
                   "--max-num-seqs", "32", "--max-model-len", str(128 + output_len),
                   "--port", "{port}", "--trace", str(trace)]  # fmt: skip
        if mode == "sync":
            command.append("--no-async")
        if CPU_THREADS:
            command += ["--cpu-threads", str(CPU_THREADS)]
        server = launch.Server(f"tandem-{mode}", f"Tandem {mode}", command)
        began = time.perf_counter()
        try:
            asyncio.run(launch.start(server, 300.0, tmp))
            record("serve", f"{mode} server start", f"{time.perf_counter() - began:.1f} s")

            def load(requests: int, url: str = server.url) -> dict:
                prompts = random_prompts(0, requests, 32, token_ids=True)
                config = LoadConfig(max_concurrency=32, sampling=Sampling(max_tokens=output_len))
                return asyncio.run(run_load(url, prompts, config)).summary()

            load(8)  # warm-up
            summary = load(128)
        finally:
            launch.stop(server)  # SIGTERM first: the core writes its trace on the way out
        steps = serve_timeline.read_trace(str(trace))
        idle = serve_timeline.windows(steps, 1.0, 16)
        late = sum(1 for _, wait, launched_late in serve_timeline.gaps(steps)
                   if launched_late and wait > 0)  # fmt: skip
        figures = {
            "name": f"serve {mode}", "requests": summary["completed"] + summary["failed"],
            "errors": summary["failed"], "output_len": output_len,
            "tokens_per_s": summary["output_throughput"], "wall_s": summary["duration"],
            "steps": len(steps), "steps_launched_late": late, "idle_windows": len(idle),
            "step_idle_pct_median": 100 * statistics.median(idle) if idle else None,
            "step_idle_pct_max": 100 * max(idle) if idle else None,
        }  # fmt: skip
        RESULTS["runs"].append(figures)
        rates[mode] = summary["output_throughput"]
        median = "n/a" if not idle else f"{figures['step_idle_pct_median']:.2f}%"
        worst = "n/a" if not idle else f"{figures['step_idle_pct_max']:.2f}%"
        record("serve", f"{mode}, 128 requests x {output_len} tokens, 32 streams",
               f"{summary['output_throughput']:.0f} tok/s, {summary['failed']} errors; device "
               f"idle per 1 s window (16+ running, {len(idle)} windows) median {median}, max "
               f"{worst}; {late} of {len(steps)} steps launched after the device had "
               "finished the one before")  # fmt: skip
        assert summary["failed"] == 0
    record("serve", "async vs sync through the server", f"{rates['async'] / rates['sync']:.2f}x")
    return rates


@contextlib.contextmanager
def gemms_of(gemm: str):
    """Engines started inside take `gemm`'s decode GEMMs (TANDEM_TRITON_GEMM, read at start)."""
    before = os.environ.get("TANDEM_TRITON_GEMM")
    os.environ["TANDEM_TRITON_GEMM"] = "1" if gemm == "triton" else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TANDEM_TRITON_GEMM")
        else:
            os.environ["TANDEM_TRITON_GEMM"] = before


def gemm_suffix(gemm: str) -> str:
    """What a run's name adds for its GEMMs: nothing for the default."""
    return "" if gemm == "default" else f", {gemm} GEMMs"


def blog_workload(output_len: int, vocab_size: int, max_model_len: int):
    from tandem.bench.workloads import make_workload

    shape = SimpleNamespace(
        workload="llama8b-32x8k", num_requests=32, prompt_len=32, output_len=output_len, len_spread=0.5,
        arrivals="offline", rate=0.0, workload_seed=0, num_prefixes=1, prefix_len=0,
    )  # fmt: skip
    return make_workload(shape, vocab_size, max_model_len)


def blog_experiment(
    output_len: int,
    hf_len: int | None,
    graph_modes: tuple[bool, ...],
    gemms: tuple[str, ...] = ("default",),
) -> dict[str, float]:
    """Sync and async, graphs on and/or off, on the 8B-shaped dummy model; returns tokens/s.
    With `hf_len`, async with graphs also runs the shorter workload transformers runs. Other
    `gemms` than the default run with graphs on only."""
    from tandem import Engine, EngineConfig
    from tandem.bench.roofline import ceilings
    from tandem.bench.run import run_workload
    from tandem.bench.workloads import profile_window

    rates = {}
    bandwidth = ceilings(torch.device(DEVICE))
    max_model_len = 64 + output_len + 16
    variants = [(g, gemm) for g in graph_modes for gemm in gemms if g or gemm == "default"]
    for graphs, gemm in variants:
        start = time.perf_counter()
        with gemms_of(gemm):
            engine = Engine(EngineConfig(
                model=str(BLOG_MODEL), load_format="dummy", device=DEVICE, dtype="bfloat16",
                enforce_eager=not graphs, max_model_len=max_model_len, max_num_seqs=32,
                num_kv_blocks=32 * (max_model_len // 16 + 2), cpu_threads=CPU_THREADS,
            ))  # fmt: skip
        label = f"graphs {'on' if graphs else 'off'}{gemm_suffix(gemm)}"
        record("blog", f"engine start ({label})", f"{time.perf_counter() - start:.1f} s; "
               f"{engine.execution.describe()}")  # fmt: skip
        work = blog_workload(output_len, engine.spec.vocab_size, engine.max_model_len)
        short = blog_workload(min(256, output_len), engine.spec.vocab_size, engine.max_model_len)
        warm = type(work)(work.prompts[:4], [4] * 4, [0.0] * 4)
        for mode in ("sync", "async"):
            engine.configure(async_scheduling=mode == "async")
            run_workload(engine, warm, 0.0, None, "warmup")
            run = run_workload(engine, work, 0.0, None, f"{mode}-{label}")
            window = profile_window(short) if DEVICE == "cuda" else None
            profiled = run_workload(engine, short, 0.0, None, "profiled", profile=window)
            name = f"{mode}, {label}"
            figures = run_figures(f"blog {name}", engine, run, profiled.kernels, bandwidth)
            rates[name] = figures["tokens_per_s"]
            if graphs and gemm == "default" and mode == "async" and hf_len and hf_len != output_len:
                same = blog_workload(hf_len, engine.spec.vocab_size, engine.max_model_len)
                rate = run_workload(engine, same, 0.0, None, "as-hf").summary.tokens_per_s
                rates[f"{name}, {hf_len} tokens"] = rate
                record("blog", f"{name}, {hf_len} tokens (transformers' workload)",
                       f"{rate:.0f} tok/s")  # fmt: skip
            record("blog", f"{name}, 32 x {output_len} tokens", describe_figures(figures))
            for share in figures["kernels_by_idle_before"][:6]:
                record("blog", f"  idle before {share['kernel'][:60]}",
                       f"{share['idle_before_us']:.2f} us a step over {share['launches']:.0f} "
                       f"launches ({share['busy_us']:.0f} us busy)")  # fmt: skip
        engine.close()
        del engine
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    base = rates.get("sync, graphs off")
    if base:
        for name in ("sync, graphs on", "async, graphs on", "async, graphs off"):
            if name in rates:
                record("blog", f"{name} vs sync, graphs off", f"{rates[name] / base:.2f}x")
    return rates


def fp8_experiment(output_len: int, gemms: tuple[str, ...] = ("default",)) -> dict[str, float]:
    """bf16 against FP8 weights on the dummy 8B model (async, graphs on): tokens/s and the decode
    step's bandwidth, then FP8's distance from bf16: teacher-forced prompt logprobs and greedy
    tokens; under each of `gemms`, whose bf16 outputs are compared with the default's too.
    Returns tokens/s by weights (and GEMMs)."""
    from tandem import Engine, EngineConfig, SamplingParams
    from tandem.bench.roofline import ceilings
    from tandem.bench.run import run_workload

    bandwidth = ceilings(torch.device(DEVICE))
    max_model_len = 64 + max(output_len, FP8_PROMPT_LEN + FP8_GREEDY_TOKENS) + 16
    params = SamplingParams(max_tokens=FP8_GREEDY_TOKENS, temperature=0, ignore_eos=True,
                            prompt_logprobs=0)  # fmt: skip
    rates, answers = {}, {}
    for gemm, quantization in [(gemm, q) for gemm in gemms for q in (None, "fp8")]:
        weights = (quantization or "bf16") + gemm_suffix(gemm)
        with gemms_of(gemm):
            engine = Engine(EngineConfig(
                model=str(BLOG_MODEL), load_format="dummy", device=DEVICE, dtype="bfloat16",
                quantization=quantization, max_model_len=max_model_len, max_num_seqs=32,
                num_kv_blocks=32 * (max_model_len // 16 + 2), cpu_threads=CPU_THREADS,
            ))  # fmt: skip
        record("fp8", f"engine ({weights})", engine.execution.describe())
        rng, vocab = random.Random(3), engine.spec.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(FP8_PROMPT_LEN)]
                   for _ in range(FP8_PROMPTS)]  # fmt: skip
        work = blog_workload(output_len, engine.spec.vocab_size, engine.max_model_len)
        warm = type(work)(work.prompts[:4], [4] * 4, [0.0] * 4)
        run_workload(engine, warm, 0.0, None, "warmup")
        with no_hidden_sync():
            run = run_workload(engine, work, 0.0, None, weights)
        figures = run_figures(f"fp8 check: {weights}", engine, run, None, bandwidth)
        rates[weights] = figures["tokens_per_s"]
        record("fp8", f"{weights}, async, graphs on, 32 x {output_len} tokens",
               describe_figures(figures))  # fmt: skip
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        answers[weights] = [done[i] for i in ids]
        engine.close()
        del engine
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    for gemm in gemms:
        suffix = gemm_suffix(gemm)
        pairs = [(f"fp8{suffix}", f"bf16{suffix}")]
        if gemm != "default":
            pairs.append((f"bf16{suffix}", "bf16"))  # the same weights, the GEMMs differ
        for name, reference in pairs:
            agreement = distance_of(answers[name], answers[reference], prompts)
            agreement["speedup"] = rates[name] / rates[reference]
            RESULTS[f"{name} vs {reference}"] = agreement
            if name == "fp8":
                RESULTS["fp8"] = agreement | {"speedup_vs_bf16": agreement["speedup"]}
            record("fp8", f"{name} vs {reference}", f"{agreement['speedup']:.2f}x tokens/s; "
                   f"prompt logprobs max |diff| {agreement['prompt_logprob_max_abs_diff']:.3f}, "
                   f"mean {agreement['prompt_logprob_mean_abs_diff']:.4f}; greedy tokens before "
                   f"the first difference {100 * agreement['greedy_same_token_share']:.0f}% "
                   "(random weights)")  # fmt: skip
    return rates


def distance_of(outputs, references, prompts) -> dict[str, float]:
    """How far one engine's outputs are from another's on the same prompts: teacher-forced
    prompt logprobs (max and mean |difference|) and the share of greedy tokens before each
    request's first difference."""
    diffs, same = [], 0
    for ref, out, prompt in zip(references, outputs, prompts, strict=True):
        for i in range(1, len(prompt)):
            token = prompt[i]
            diffs.append(abs(out.prompt_logprobs[i][token].logprob
                             - ref.prompt_logprobs[i][token].logprob))  # fmt: skip
        same += next((k for k, (a, b) in enumerate(zip(out.token_ids, ref.token_ids, strict=True))
                      if a != b), len(ref.token_ids))  # fmt: skip
    return {
        "prompt_logprob_max_abs_diff": max(diffs),
        "prompt_logprob_mean_abs_diff": sum(diffs) / len(diffs),
        "greedy_same_token_share": same / (len(prompts) * FP8_GREEDY_TOKENS),
    }


def hf_async_batching(output_len: int) -> float | None:
    """transformers' continuous batching with async batching on the dummy 8B; tokens/s."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        record("hf", "generate_batch", f"transformers {transformers.__version__} has none")
        return None
    config = AutoConfig.from_pretrained(BLOG_MODEL)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # random weights: generate every token
    work = blog_workload(output_len, config.vocab_size, 64 + output_len + 16)
    on_gpu = DEVICE == "cuda"  # transformers' async batching and graphs need a GPU
    wanted = {"use_async_batching": on_gpu, "use_cuda_graph": on_gpu, "page_size": 16,
              "num_blocks": 32 * ((64 + output_len) // 16 + 2), "max_requests_per_batch": 32,
              "allow_block_sharing": False}  # fmt: skip
    # Sizes its flash decode path's block table (left unset, the warm-up call's would be used).
    blocks = (64 + output_len) // 16 + 2
    wanted["max_blocks_per_request"] = blocks + blocks % 2
    accepted = inspect.signature(ContinuousBatchingConfig).parameters
    cb = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in accepted})
    dropped = sorted(set(wanted) - set(accepted))
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None)
    # One persistent manager (as `tandem bench compare`): the warm-up call builds it and
    # captures its graphs, so the timed call measures generation only.
    keep = {"persistent_manager": True}
    if "persistent_manager" not in inspect.signature(model.generate_batch).parameters:
        keep = {}
    model.generate_batch(inputs=work.prompts[:4], generation_config=gen,
                         continuous_batching_config=cb, max_new_tokens=4, **keep)  # fmt: skip
    synchronize()
    start = time.perf_counter()
    results = model.generate_batch(inputs=work.prompts, generation_config=gen,
                                   continuous_batching_config=cb, **keep)  # fmt: skip
    synchronize()
    wall = time.perf_counter() - start
    if keep and hasattr(model, "destroy_cached_continuous_batching_manager"):
        model.destroy_cached_continuous_batching_manager()
    tokens = sum(len(o.generated_tokens) for o in results.values())
    kind = "async" if on_gpu else "sync (dry run)"
    record("hf", f"generate_batch {kind} (transformers {transformers.__version__})",
           f"{tokens / wall:.0f} tok/s ({tokens} tokens in {wall:.1f} s)"
           + (f"; options it lacks: {', '.join(dropped)}" if dropped else ""))  # fmt: skip
    return tokens / wall


def write_json(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(RESULTS | {"table": TABLE}, indent=1) + "\n")


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blog-output-len", type=int, default=1024,
                        help="tokens per request in the blog runs (the blog used 8192)")  # fmt: skip
    parser.add_argument(
        "--hf-output-len",
        type=int,
        default=128,
        help="tokens per request in transformers' run (on an H200 it took 88 s to "
        "warm up and over 190 s for 1024; Tandem async also runs this length)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="leave out transformers' run")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"which sections run, of {', '.join(SECTIONS)}")  # fmt: skip
    parser.add_argument("--blog-graphs", default="on,off",
                        help="the blog runs with CUDA graphs on, off or both")  # fmt: skip
    parser.add_argument(
        "--gemms",
        default="default",
        help=f"the decode GEMMs of the blog and FP8 runs, of {', '.join(GEMMS)}",
    )
    parser.add_argument("--fp8-output-len", type=int, default=256,
                        help="tokens per request in the FP8 section's runs")  # fmt: skip
    parser.add_argument("--spec-output-len", type=int, default=256,
                        help="tokens per request in the speculative section's speed runs")  # fmt: skip
    parser.add_argument("--serve-output-len", type=int, default=256,
                        help="tokens per request in the serve section's load")  # fmt: skip
    parser.add_argument("--json", type=Path,
                        help="also write the figures to this JSON file (after every section)")  # fmt: skip
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run every section on the CPU at tiny sizes (the blog runs on the "
                        "tiny model's config with dummy weights, no profiler): checks the "
                        "script itself before a GPU run")  # fmt: skip
    args = parser.parse_args()
    global DEVICE, BLOG_MODEL, CPU_THREADS
    if args.cpu_dry_run:
        DEVICE = "cpu"
        CPU_THREADS = 1
        args.blog_output_len = min(args.blog_output_len, 24)
        args.hf_output_len = min(args.hf_output_len, 16)
        args.fp8_output_len = min(args.fp8_output_len, 8)
        args.spec_output_len = min(args.spec_output_len, 8)
        args.serve_output_len = min(args.serve_output_len, 8)
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to check (--cpu-dry-run checks the script)", file=sys.stderr)
        return 2
    from tandem.models.default_model import build_checkpoint

    chosen = [x.strip() for x in args.sections.split(",") if x.strip()]
    graph_modes = tuple({"on": True, "off": False}[g.strip()] for g in args.blog_graphs.split(","))
    if set(chosen) - set(SECTIONS):
        parser.error(f"--sections takes {', '.join(SECTIONS)}, got {args.sections!r}")
    gemms = tuple(g.strip() for g in args.gemms.split(",") if g.strip())
    if not gemms or set(gemms) - set(GEMMS):
        parser.error(f"--gemms takes {', '.join(GEMMS)}, got {args.gemms!r}")
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    record("machine", name, f"torch {torch.__version__}")
    RESULTS["machine"] = versions()
    RESULTS["arguments"] = vars(args) | {"json": str(args.json) if args.json else None}
    failures = 0
    hf_len = None if args.skip_hf else args.hf_output_len
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_checkpoint(Path(tmp) / "tiny")
        if args.cpu_dry_run:
            BLOG_MODEL = Path(tmp) / "config-only"
            BLOG_MODEL.mkdir()
            (BLOG_MODEL / "config.json").write_text((tiny / "config.json").read_text())
        sections = [
            ("equivalence", lambda: check_equivalence(tiny)),
            ("bf16", lambda: check_bf16(tiny)),
            ("features", lambda: check_features(tiny)),
            ("blog", lambda: blog_experiment(args.blog_output_len, hf_len, graph_modes, gemms)),
            ("fp8", lambda: fp8_experiment(args.fp8_output_len, gemms)),
            (
                "speculative",
                lambda: (check_speculative(tiny), speculative_speed(args.spec_output_len)),
            ),
            ("serve", lambda: served_split(args.serve_output_len, Path(tmp))),
            ("hf", lambda: hf_async_batching(args.hf_output_len)),
        ]
        skipped = {"hf"} if args.skip_hf else set()
        sections = [(n, run) for n, run in sections if n in chosen and n not in skipped]
        results = {}
        for name, run in sections:  # each section runs even if an earlier one failed
            start = time.perf_counter()
            try:
                results[name] = run()
            except Exception as exc:
                failures += 1
                traceback.print_exc()
                record(name, "FAILED", f"{type(exc).__name__}: {exc}"[:300])
            record(name, "section time", f"{time.perf_counter() - start:.0f} s")
            if args.json:  # after every section: a run cut short keeps what it measured
                write_json(args.json)
    rates, hf = results.get("blog") or {}, results.get("hf")
    if rates and hf:
        same = rates.get(f"async, graphs on, {hf_len} tokens", rates.get("async, graphs on", 0))
        record("targets", f"async graphs on vs transformers async ({hf_len} tokens each)",
               f"{same / hf:.2f}x (target >= 1)")  # fmt: skip
    if rates.get("sync, graphs off"):
        record("targets", "async graphs on vs sync graphs off",
               f"{rates.get('async, graphs on', 0) / rates['sync, graphs off']:.2f}x "
               "(target >= 1.25)")  # fmt: skip
    if args.json:
        write_json(args.json)
        print(f"figures written to {args.json}", flush=True)
    width = max(len(w) for _, w, _ in TABLE)
    print("\n" + "-" * 100)
    for section, what, result in TABLE:
        print(f"{section:<12} {what:<{width}}  {result}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
