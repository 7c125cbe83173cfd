"""GEMMs of few rows (decode steps) as a Triton kernel launched dependent on the kernel before.

Why: a decode step at batch 32 on an H200 replays 128 cuBLAS GEMMs, which are launched in
stream order: the device idles about half a microsecond before each (1.1% of the step), and
cuBLAS splits two of a layer's four GEMMs over K and adds the parts in a second kernel (64 more
launches, 2.4% of the step's busy time; docs/performance.md, H200). At a few rows a GEMM only
streams its weight: each program here reads `BLOCK_N` weight rows whole, for every row of x at
once, in one pass without a split, and it is launched with programmatic dependent launch like
the step's other Triton kernels (`triton_launch.py`).

Products accumulate in fp32 on tensor cores and are rounded once to the input's dtype, as
cuBLAS does; the order of the sums differs, so results may differ from cuBLAS's in the last bit
of bf16. bf16 and fp16 only (fp32 would take TF32's rounding or run without tensor cores).

An MLP's gate/up GEMM ends in SiLU(gate) * up (`gated_few_rows`): each program streams a tile
of gate rows and the matching up rows, so the step launches no SiLU kernel after it and never
stores the [M, 2I] product; the output is the SiLU kernel's over the GEMM's, bit for bit.

FP8 weights (`fp8.py`) take the same kernel over e4m3 codes (`FP8_GEMM`: x's codes, rounded per
row, against the weight's, both scales applied to the fp32 sums: the product `_scaled_mm`
computes; Triton widens e4m3 to fp16 for the MMA at these rows, exactly) in place of
`_scaled_mm`, with which an 8B decode step on FP8 weights took longer than on bf16 ones
(docs/performance.md, H200).

Opt-in (`TANDEM_TRITON_GEMM=1`) until it is measured against cuBLAS and `_scaled_mm` on a GPU
(`benchmarks/triton_gemm_check.py`), which also picks `CONFIG` and `FP8_CONFIG`.
tests/test_triton_gemm.py runs the kernel in Triton's interpreter against torch, and
tests/triton_sm90_compile.py builds it for sm_90.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.ops.fp8 import FP8_DTYPE, Fp8Gemm, Fp8Weight
from tandem.ops.linear import FewRowsGemm
from tandem.ops.triton_launch import (
    INTERPRETED,
    let_next_kernel_launch,
    pdl_options,
    wait_for_previous_kernel,
)
from tandem.ops.triton_rounding import silu_times

MAX_ROWS = 64  # steps of more rows use the default GEMM: compute-bound, cuBLAS's ground
DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmConfig:
    block_n: int  # weight rows per program (each program writes that many output columns)
    block_k: int  # the K tile each loop iteration loads
    num_warps: int
    num_stages: int  # loads in flight: the pipeline that streams the weight


CONFIG = GemmConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
# FP8: a K tile of as many bytes as CONFIG's (one byte a weight instead of two).
FP8_CONFIG = GemmConfig(block_n=32, block_k=512, num_warps=4, num_stages=4)


@triton.jit
def _few_rows_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    x_scales_ptr,  # SCALED: x's row scales [M] and the weight's [N], fp32
    w_scales_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SCALED: tl.constexpr,  # e4m3 codes whose sums take both scales
    GATED: tl.constexpr,  # a gate/up weight [2N, K]: out = SiLU(x @ gate.T) * (x @ up.T), [M, N]
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # the interpreter, whose dot multiplies bf16's and fp8's raw bits
    LIBDEVICE: tl.constexpr,  # CUDA's accurate expf for the SiLU (the interpreter has none)
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    rows, cols = rm[:, None] < M, rn[:, None] < N
    up_ptrs = w_ptrs + N * stride_wn  # GATED: the up rows, N after the gate's
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        mask_x, mask_w = rows, cols
        if not EVEN_K:
            inside = (k * BLOCK_K + rk)[None, :] < K
            mask_x, mask_w = rows & inside, cols & inside
        x = tl.load(x_ptrs, mask=mask_x, other=0.0)
        acc = _dot(x, tl.load(w_ptrs, mask=mask_w, other=0.0), acc, UPCAST)
        if GATED:
            acc_up = _dot(x, tl.load(up_ptrs, mask=mask_w, other=0.0), acc_up, UPCAST)
            up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALED:  # (sums * x's scale) * the weight's, in fp8_product's order
        acc = acc * tl.load(x_scales_ptr + rm, mask=rm < M, other=0.0)[:, None]
        acc = acc * tl.load(w_scales_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    out = acc.to(out_ptr.dtype.element_ty)  # rounded as the GEMM's output would be
    if GATED:  # then SiLU(gate) * up as the SiLU kernel takes it from that output
        out = silu_times(out, acc_up.to(out_ptr.dtype.element_ty), LIBDEVICE)
    tl.store(out_ptrs, out, mask=rows & (rn[None, :] < N))
    let_next_kernel_launch(PDL)


@triton.jit
def _dot(x, w, acc, UPCAST: tl.constexpr):
    """acc + x @ w.T in fp32 (UPCAST: the operands' exact values, as the tensor cores take them)."""
    if UPCAST:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


def handles(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `few_rows_linear` takes this product: a 2-D input of at most MAX_ROWS rows, in
    bf16 or fp16 as its weight."""
    return x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in DTYPES and weight.dtype == x.dtype


def few_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemmConfig = CONFIG,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) for M <= MAX_ROWS, one launch."""
    if not handles(x, weight):
        raise ValueError(
            f"few_rows_linear takes 2-D {DTYPES} inputs of at most {MAX_ROWS} rows in the "
            f"weight's dtype, got {tuple(x.shape)} {x.dtype} x {weight.dtype}"
        )
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, None, out, config)
    return out


def gated_few_rows(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig = CONFIG):
    """SiLU(x @ gate.T) * (x @ up.T) for a gate/up weight [2N, K] (gate rows first), one
    launch: `silu_and_mul(few_rows_linear(x, weight))`, bit for bit, without the [M, 2N]
    product in memory or the SiLU kernel after it."""
    if not handles(x, weight) or weight.shape[0] % 2:
        raise ValueError(
            f"gated_few_rows takes 2-D {DTYPES} inputs of at most {MAX_ROWS} rows and a "
            f"gate/up weight of even rows, got {tuple(x.shape)} {x.dtype} x "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    out = torch.empty(x.shape[0], weight.shape[0] // 2, dtype=x.dtype, device=x.device)
    _launch(x, weight, None, None, out, config, gated=True)
    return out


def handles_codes(codes: torch.Tensor) -> bool:
    """Whether `scaled_few_rows` takes these e4m3 input rows: 2-D, at most MAX_ROWS."""
    return codes.dim() == 2 and codes.shape[0] <= MAX_ROWS and codes.dtype == FP8_DTYPE


def scaled_few_rows(
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight: Fp8Weight,
    out_dtype: torch.dtype,
    config: GemmConfig = FP8_CONFIG,
) -> torch.Tensor:
    """(codes [M, K] @ weight.codes.T) * scales [M, 1] * weight.scales, in `out_dtype`: what
    `torch._scaled_mm` gives with row-wise scales, for M <= MAX_ROWS, one launch."""
    if not handles_codes(codes):
        raise ValueError(f"scaled_few_rows takes 2-D e4m3 rows, at most {MAX_ROWS}, got "
                         f"{tuple(codes.shape)} {codes.dtype}")  # fmt: skip
    out = torch.empty(codes.shape[0], weight.shape[0], dtype=out_dtype, device=codes.device)
    _launch(codes, weight.codes, None, (scales.reshape(-1), weight.scales), out, config)
    return out


def _launch(x, weight, bias, scales, out, config: GemmConfig, gated: bool = False) -> None:
    """One launch of the kernel for every form of it: x's rows made contiguous if they are not
    (a view of a wider tensor keeps its row stride), the weight's rows must be."""
    if weight.stride(1) != 1:
        raise ValueError("the few-rows GEMM reads each weight row contiguously")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = out.shape[1]  # output columns: the weight's rows, or half of them (gated)
    if m == 0 or n == 0:
        return
    x_scales, w_scales = scales if scales is not None else (out, out)
    _few_rows_gemm_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else out, x_scales, w_scales, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SCALED=scales is not None, GATED=gated,
        EVEN_K=k % config.block_k == 0,
        BLOCK_M=max(16, triton.next_power_of_2(m)),  # 16: the smallest M of an MMA tile
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        UPCAST=INTERPRETED and x.dtype in (torch.bfloat16, FP8_DTYPE), LIBDEVICE=not INTERPRETED,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(x.device),
    )  # fmt: skip


GEMM = FewRowsGemm(handles, few_rows_linear, gated_few_rows)  # `LlamaModel.use_few_rows_gemm`
FP8_GEMM = Fp8Gemm(handles_codes, scaled_few_rows)  # and `use_fp8_few_rows_gemm`
