"""llama.cpp's `llama-batched-bench` on a GGUF file, as the reference beside Tandem's figures.

One process per batch size, so that its peak RSS (the kernel's high-water mark of that child,
read by `os.wait4` as it is reaped) is the memory of that batch alone. The binaries are built by
benchmarks/setup_llama_server.sh into the cache (TANDEM_CACHE_DIR, else ~/.cache/tandem).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tandem.models.catalog import cache_root

BATCHED_BENCH = "llama-batched-bench"
WARMUP_TOKENS = 16  # llama-batched-bench's warm-up batch, which its context must hold too


def default_bin_dir() -> Path:
    return cache_root() / "llama.cpp" / "bin"


def find_llama_cpp(option: str) -> Path | None:
    """--llama-cpp: "none" is None; "auto" the cache's binaries where they are, else None; any
    other value a folder that must hold llama-batched-bench."""
    if option == "none":
        return None
    folder = default_bin_dir() if option == "auto" else Path(option).expanduser()
    if (folder / BATCHED_BENCH).is_file():
        return folder
    if option == "auto":
        return None
    raise ValueError(f"--llama-cpp {option}: no {BATCHED_BENCH} in {folder}")


@dataclass(frozen=True)
class BatchedBench:
    """One `llama-batched-bench` run of B sequences: T_PP (all B prompts), S_TG (decode tokens
    per second over the B sequences) and the process's peak RSS."""

    command: list[str]
    prefill_s: float
    decode_tokens_per_s: float
    peak_rss: int  # bytes


def batched_bench_command(
    bin_dir: Path, model: Path, batch: int, prompt_len: int, output_len: int, threads: int
) -> list[str]:
    """A context of the B sequences' tokens (as the engine's cache is sized), or of the warm-up's
    where that is more."""
    return [
        str(bin_dir / BATCHED_BENCH), "-m", str(model), "-t", str(threads),
        "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", str(batch),
        "-c", str(max(batch * (prompt_len + output_len), WARMUP_TOKENS)),
        "--output-format", "jsonl",
    ]  # fmt: skip


def run_batched_bench(
    bin_dir: Path, model: Path, batch: int, prompt_len: int, output_len: int, threads: int
) -> BatchedBench:
    command = batched_bench_command(bin_dir, model, batch, prompt_len, output_len, threads)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)  # reaps it: its own rusage, not all children's
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        tail = "\n".join(stderr.splitlines()[-10:])
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}:\n{tail}")
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    row = next((r for r in rows if r.get("pl") == batch and "speed_tg" in r), None)
    if row is None:
        raise RuntimeError(f"{' '.join(command)} printed no result for batch {batch}:\n{stdout}")
    return BatchedBench(command, row["t_pp"], row["speed_tg"], usage.ru_maxrss * 1024)  # KiB
