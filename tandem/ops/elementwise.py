"""The forward's non-GEMM ops in portable PyTorch, with Hugging Face's exact arithmetic.

With them greedy outputs equal transformers' token for token and logit for logit: the model runs
them op by op when `enforce_eager` is set and for other dtypes on a CPU. The CPU fast path runs
their fused twins (`csrc/cpu_kernels.cpp`) inside its one-call forward instead, and CUDA their
Triton twins (`triton_elementwise.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.ops.attention import paged_attention, rotary_then_write_kv, rotate_cache_attend


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x): the next sublayer's input and the residual stream."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].to(q.dtype)[:, None, :]
    s = sin[positions].to(q.dtype)[:, None, :]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


# rotary, then the step's K (rotated) and V written into the paged cache at the slots.
rotary_and_cache = rotary_then_write_kv(rotary)
attend = rotate_cache_attend(rotary_and_cache, paged_attention)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): transformers' `gelu_pytorch_tanh(gate) * up`."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
