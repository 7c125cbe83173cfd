"""Choose how the model executes on this machine: fused kernels and packed GEMMs, or eager.

The choice is automatic. On a CPU in float32 the fast path pre-packs every GEMM weight for MKL
and runs the fused kernels (built once and cached on disk; the build time is reported). On CUDA
the norms, the rotary embedding and SiLU run as fused Triton kernels
(`ops/triton_elementwise.py`). Where a piece is unavailable (no MKL, no compiler, no triton,
another dtype or device) that piece falls back to portable PyTorch. `enforce_eager=True` keeps the portable path everywhere, whose arithmetic is
Hugging Face's own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import ModuleType

import torch

from tandem.config import usable_cores
from tandem.models.llama import LlamaModel
from tandem.ops import cpu_kernels
from tandem.ops.attention import AttentionMetadata


@dataclass
class ExecutionPlan:
    ops: str  # "portable", "fused-cpu" or "fused-triton" (CUDA: norms, rotary, SiLU)
    packed_gemm: bool
    kernels: cpu_kernels.KernelBuild | None  # None: not attempted (eager, CUDA, not float32)
    cpu_threads: int | None = None  # compute threads, when Tandem chose them
    thread_timings_ms: dict[int, float] = field(default_factory=dict)  # decode step ms by threads
    tensor_parallel_size: int = 1  # ranks, one process each; the plan is rank 0's
    backend: str | None = None  # their collectives: gloo or nccl
    cuda_graph_sizes: list[int] = field(default_factory=list)  # captured decode batch sizes

    def describe(self) -> str:
        gemm = "MKL pre-packed GEMMs" if self.packed_gemm else "default GEMMs"
        text = f"{self.ops} ops, {gemm}"
        if self.tensor_parallel_size > 1:
            threads = f" x {self.cpu_threads} compute thread(s)" if self.cpu_threads else ""
            text = (
                f"tensor parallel: {self.tensor_parallel_size} processes{threads} ({self.backend}); "
                f"each rank: {text}"
            )
        if self.thread_timings_ms:
            tried = ", ".join(
                f"{n}: {ms:.2f} ms" for n, ms in sorted(self.thread_timings_ms.items())
            )
            text += (
                f"; {self.cpu_threads} compute thread(s) for decodes (decode step {tried}), "
                f"{max(self.thread_timings_ms)} for prefills"
            )
        if self.cuda_graph_sizes:
            text += (
                f"; CUDA graphs for decode steps of up to {max(self.cuda_graph_sizes)} requests "
                f"({len(self.cuda_graph_sizes)} sizes x 3 sampler variants)"
            )
        k = self.kernels
        if k is not None and k.available:
            how = "loaded from the disk cache" if k.cached else "built and cached on disk"
            text += f"; fused kernels {how} in {k.seconds:.1f} s"
        elif k is not None:
            text += "; fused kernels unavailable (see the log)"
        return text


def prepare(
    model: LlamaModel, device: torch.device, dtype: torch.dtype, enforce_eager: bool
) -> ExecutionPlan:
    if not enforce_eager and device.type == "cuda" and (fused := _triton_elementwise()):
        model.ops = fused
        return ExecutionPlan("fused-triton", False, None)
    if enforce_eager or device.type != "cpu" or dtype != torch.float32:
        return ExecutionPlan("portable", False, None)
    build = cpu_kernels.load()
    packed = model.use_fast_path(fused=build.available)
    return ExecutionPlan("fused-cpu" if build.available else "portable", packed, build)


def _triton_elementwise() -> ModuleType | None:
    """The fused Triton norms, rotary and SiLU, if triton imports (CUDA runs only)."""
    try:
        from tandem.ops import triton_elementwise
    except ImportError:
        return None
    return triton_elementwise


def tune_cpu_threads(model: LlamaModel, batch: int, block_size: int = 16) -> dict[int, float]:
    """Best-of-8 decode-step time (ms) of `model` at `batch` requests, for each candidate count.

    Why: a second compute thread speeds the step up, but takes the core the asynchronous host
    would schedule on; on a model small enough, one thread is as fast. Timing one synthetic
    step per count settles it for this machine (on the development VM two threads won on every
    model: 1.66 against 2.73 ms on the default model, once the device thread's OpenMP team
    stopped being throttled, see `CPUStream.submit`).
    Results are the same whatever the count (each output is computed by one thread), so the
    choice changes speed only. Candidates go up to the cores this process may run on; torch's
    thread count is left as it was found.
    """
    spec = model.spec
    before = torch.get_num_threads()
    most = usable_cores()
    candidates = sorted({1, max(1, most - 1), most})
    blocks_each, context = 2, block_size + 1
    caches = [
        torch.zeros(2, batch * blocks_each, block_size, spec.num_kv_heads, spec.head_dim)
        for _ in range(spec.num_layers)
    ]
    tables = torch.arange(batch * blocks_each).view(batch, blocks_each)
    meta = AttentionMetadata(
        slot_mapping=tables[:, 1] * block_size,
        block_tables=tables,
        context_lens=torch.full((batch,), context),
        num_decodes=batch,
        decode_max_blocks=blocks_each,
        prefills=[],
        block_size=block_size,
    )
    ids = torch.randint(0, spec.vocab_size, (batch,))
    positions = torch.full((batch,), context - 1)
    timings = {}
    try:
        with torch.inference_mode():
            for n in candidates:
                torch.set_num_threads(n)
                runs = []
                for i in range(10):
                    start = time.perf_counter()
                    model.compute_logits(model(ids, positions, caches, meta)).argmax(-1)
                    if i >= 2:  # the first runs warm caches and thread pools
                        runs.append(time.perf_counter() - start)
                timings[n] = min(runs) * 1e3  # the least disturbed run: others share the cores
    finally:
        torch.set_num_threads(before)
    return timings


def pick_cpu_threads(timings_ms: dict[int, float], batch: int) -> int:
    """The count with the shortest step once the host's share is charged where it lands.

    With every core computing, the host's scheduling of the next step (about 0.2 ms plus 15 us
    per request, measured by benchmarks/host_cost.py) takes a core from the compute team, which
    then waits for it at its next barrier; with a core left free the host runs beside the step.
    """
    cores = max(timings_ms)
    host_ms = 0.2 + 0.015 * batch
    cost = {n: ms + (host_ms if n == cores and cores > 1 else 0.0) for n, ms in timings_ms.items()}
    return min(cost, key=cost.get)
