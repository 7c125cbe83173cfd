"""Choose how the model executes on this machine: fused kernels and packed GEMMs, or eager.

The choice is automatic. On a CPU in float32 the fast path runs the fused kernels (built once and
cached on disk; the build time is reported), and packs every GEMM weight for their GEMM (for
MKL's where the kernels cannot be built). On CUDA the norms, the rotary embedding and SiLU run
as fused Triton kernels (`ops/triton_elementwise.py`), and with `TANDEM_TRITON_GEMM=1` the GEMMs
of decode steps as well, FP8 layers' too (`ops/triton_gemm.py`, opt-in until measured on a
GPU). Where a piece is unavailable (no MKL, no compiler, no triton, another dtype or device)
that piece falls back to portable PyTorch. `enforce_eager=True` keeps the portable path
everywhere, whose arithmetic is Hugging Face's own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType

import torch

from tandem.execution.thread_plan import DecodeTimings, ThreadPlan
from tandem.models.llama import LlamaModel
from tandem.ops import cpu_elementwise, cpu_kernels
from tandem.ops.fp8 import supports_fp8_gemm


@dataclass
class ExecutionPlan:
    # "portable", "fused-cpu" (one call per forward), "fused-cpu op-by-op" (the CPU kernels per
    # op: models the one call does not cover) or "fused-triton" (CUDA: norms, rotary, SiLU)
    ops: str
    packed_gemm: bool
    kernels: cpu_kernels.KernelBuild | None  # None: not attempted (eager, CUDA, not float32)
    cpu_threads: int | None = None  # compute threads (of short decode steps), when Tandem chose
    thread_plan: ThreadPlan | None = None  # ... and per step, when timed
    thread_timings: list[DecodeTimings] = field(default_factory=list)  # what the plan came from
    thread_timings_kept: bool = False  # ... timed at an earlier start (thread_timings_cache.py)
    tensor_parallel_size: int = 1  # ranks, one process each; the plan is rank 0's
    pipeline_parallel_size: int = 1  # stages, each of tensor_parallel_size ranks
    backend: str | None = None  # their collectives: gloo or nccl
    cuda_graph_sizes: list[int] = field(default_factory=list)  # captured decode batch sizes
    cuda_graph_histories: tuple[int, ...] = ()  # ... and ngram verifications' history bands
    cuda_graph_verify_tokens: int = 0  # ... and the most tokens a verification graph holds
    weight_formats: dict[str, int] = field(default_factory=dict)  # linear layers by format
    weight_bytes: int | None = None  # weights one forward reads (LlamaModel.weight_bytes)
    few_rows_gemm: int = 0  # CUDA: rows up to which the Triton GEMM runs (triton_gemm.py); 0: off

    def describe_weights(self) -> str:
        """e.g. "linear layers: 120 Q4_1, 1 Q8_0" (quantized formats run by the CPU kernels)."""
        counts = sorted(self.weight_formats.items(), key=lambda item: -item[1])
        return "linear layers: " + ", ".join(f"{n} {name}" for name, n in counts)

    def describe(self) -> str:
        own = self.kernels is not None and self.kernels.available
        gemm = "default GEMMs"
        if self.few_rows_gemm:
            gemm = f"Triton GEMMs up to {self.few_rows_gemm} rows, default GEMMs above"
        if self.packed_gemm:
            gemm = "own GEMMs over packed panels" if own else "MKL pre-packed GEMMs"
        text = f"{self.ops} ops, {gemm}"
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp * pp > 1:
            threads = f" x {self.cpu_threads} compute thread(s)" if self.cpu_threads else ""
            layout = f"tensor parallel: {tp} processes"
            if pp > 1:
                layout = f"pipeline parallel: {pp} stages of {tp} process(es)"
            text = f"{layout}{threads} ({self.backend}); each rank: {text}"
        if self.thread_plan is not None and self.thread_timings:
            tried = "; ".join(
                f"at {t.positions} K/V positions "
                + ", ".join(f"{n}: {ms:.2f} ms" for n, ms in sorted(t.ms.items()))
                for t in self.thread_timings
            )
            kept = ", timed at an earlier start" if self.thread_timings_kept else ""
            text += (
                f"; compute threads for decodes: {self.thread_plan.describe()} (decode step "
                f"{tried}{kept}), {self.thread_plan.prefill} for prefills"
            )
        if self.cuda_graph_sizes:
            text += (
                f"; CUDA graphs for decode steps of up to {max(self.cuda_graph_sizes)} requests "
                f"({len(self.cuda_graph_sizes)} sizes x 3 sampler variants)"
            )
            if self.cuda_graph_histories:
                bands = ", ".join(str(h) for h in self.cuda_graph_histories)
                text += (
                    f" and ngram verifications of up to {self.cuda_graph_verify_tokens} tokens "
                    f"(histories up to {bands} tokens)"
                )
        if self.weight_formats:
            text += "; " + self.describe_weights()
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
    plan = _choose(model, device, dtype, enforce_eager)
    plan.weight_formats = model.weight_formats()
    plan.weight_bytes = model.weight_bytes()
    return plan


def _choose(
    model: LlamaModel, device: torch.device, dtype: torch.dtype, enforce_eager: bool
) -> ExecutionPlan:
    if not enforce_eager and device.type == "cuda" and (fused := _triton_elementwise()):
        model.ops = fused
        model.use_fp8_row_quantizer(fused.quantize_rows_fp8)
        plan = ExecutionPlan("fused-triton", False, None)
        if os.environ.get("TANDEM_TRITON_GEMM") == "1":  # opt-in until measured: triton_gemm.py
            from tandem.ops import triton_gemm

            took = model.use_few_rows_gemm(triton_gemm.GEMM)
            if supports_fp8_gemm(device):  # e4m3 dots: FP8 tensor cores
                took += model.use_fp8_few_rows_gemm(triton_gemm.FP8_GEMM)
            if took:
                plan.few_rows_gemm = triton_gemm.MAX_ROWS
        return plan
    if enforce_eager or device.type != "cpu" or dtype != torch.float32:
        return ExecutionPlan("portable", False, None)
    build = cpu_kernels.load()
    packed = model.use_fast_path(fused=build.available)
    if not build.available:
        return ExecutionPlan("portable", packed, build)
    if model.has_fused_forward:
        return ExecutionPlan("fused-cpu", packed, build)
    model.ops = cpu_elementwise  # the kernels op by op, where the one-call forward cannot go
    return ExecutionPlan("fused-cpu op-by-op", packed, build)


def _triton_elementwise() -> ModuleType | None:
    """The fused Triton norms, rotary and SiLU, if triton imports (CUDA runs only)."""
    try:
        from tandem.ops import triton_elementwise
    except ImportError:
        return None
    return triton_elementwise
