"""FP8 weights (`quantization="fp8"`): e4m3 codes with one float32 scale per output row, and
activations rounded to e4m3 per row (per token) as each GEMM runs, both scales applied to the
product: the scheme vLLM calls FP8 dynamic per-token, per-channel.

On a CUDA device with FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper) the GEMM is
`torch._scaled_mm` with row-wise scales, reading half the bytes of a bf16 weight. Elsewhere the
same codes and scales are multiplied in float32 (`fp8_product`): PyTorch's CPU `_scaled_mm`
gives those numbers too, but ran 40x slower than a float32 GEMM of the same shape (AMD Zen 5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from tandem.config import FP8_MIN_CAPABILITY

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: the largest e4m3 magnitude (no infinities)
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # floor for an all-zero row's scale: its codes stay zero
SIZE_MULTIPLE = 16  # _scaled_mm wants in and out features in 16s (CUDA)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] in e4m3, each row with its own scale (a GEMM's input, per token)."""
    return to_fp8(x, x.abs().amax(dim=1, keepdim=True))


RowQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Fp8Gemm:
    """Another product of e4m3 codes than `_scaled_mm`, for the input rows it `handles` (a
    decode step's few): run(codes, scales, weight, out_dtype)."""

    handles: Callable[[torch.Tensor], bool]
    run: Callable[[torch.Tensor, torch.Tensor, Fp8Weight, torch.dtype], torch.Tensor]


@dataclass
class Fp8Weight:
    """One [out_features, in_features] weight as e4m3 codes and per-row scales."""

    codes: torch.Tensor  # [N, K] float8_e4m3fn
    scales: torch.Tensor  # [N] float32: weight ~= codes * scales[:, None]
    source: str = "fp8"
    # How the GEMM's input is rounded: PyTorch's ops (about 8 kernels on CUDA), or the same bits
    # in one Triton kernel (`triton_elementwise.quantize_rows_fp8`, set with the fused ops).
    quantize_rows: RowQuantizer = quantize_rows
    # The product at few rows on CUDA, where set (`triton_gemm.FP8_GEMM`); else `_scaled_mm`.
    few_rows: Fp8Gemm | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()


def can_quantize_fp8(out_features: int, in_features: int) -> bool:
    return out_features % SIZE_MULTIPLE == 0 and in_features % SIZE_MULTIPLE == 0


def supports_fp8_gemm(device: torch.device) -> bool:
    """Whether `device` runs _scaled_mm on FP8 tensor cores (CUDA capability 8.9 and up)."""
    return device.type == "cuda" and _capability(device.index) >= FP8_MIN_CAPABILITY


@cache
def _capability(index: int | None) -> tuple[int, int]:
    """Asked once per device: every GEMM checks, and the answer never changes."""
    return torch.cuda.get_device_capability(index)


def to_fp8(x: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] in e4m3 per row: (codes, scales [R, 1] float32) with x ~= codes * scales.
    `absmax` [R, 1] is each row's largest magnitude (of the whole row, for a shard of it)."""
    scales = (absmax.float() / FP8_MAX).clamp_(min=MIN_SCALE)
    codes = (x.float() / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


def quantize_fp8(weight: torch.Tensor, row_absmax: torch.Tensor | None = None) -> Fp8Weight:
    """Per-channel e4m3 of a float weight [N, K]. `row_absmax` [N] gives max|w| of whole rows
    this is a slice of (a row-parallel shard), so every rank rounds as the unsharded weight."""
    w = weight.detach()
    absmax = w.abs().amax(dim=1) if row_absmax is None else row_absmax
    codes, scales = to_fp8(w, absmax[:, None])
    return Fp8Weight(codes, scales.view(-1))


def dequantize_fp8(q: Fp8Weight) -> torch.Tensor:
    """The float32 weight [N, K] the codes stand for."""
    return q.codes.float() * q.scales[:, None]


def fp8_linear(x: torch.Tensor, q: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) in x's dtype, x rounded to e4m3 per row first."""
    rows = x.reshape(-1, x.shape[-1])
    codes, scales = q.quantize_rows(rows)
    if q.few_rows is not None and q.few_rows.handles(codes):
        out = q.few_rows.run(codes, scales, q, x.dtype)
    elif supports_fp8_gemm(x.device):
        out = torch._scaled_mm(
            codes, q.codes.t(), scale_a=scales, scale_b=q.scales.view(1, -1), out_dtype=x.dtype
        )
    else:
        out = fp8_product(codes, scales, q).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], q.shape[0])


def fp8_product(codes: torch.Tensor, scales: torch.Tensor, q: Fp8Weight) -> torch.Tensor:
    """_scaled_mm's value in float32: (codes_x @ codes_w.T) * scale_x * scale_w. Products of
    two e4m3 values are exact in float32, so only the sums' order can differ."""
    return (codes.float() @ q.codes.float().t()) * scales * q.scales.view(1, -1)
