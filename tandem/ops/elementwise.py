"""The forward's non-GEMM ops in two interchangeable sets.

`PortableOps` is plain PyTorch with Hugging Face's exact arithmetic: it runs anywhere, and with
it greedy outputs equal transformers' token for token and logit for logit (`enforce_eager`).
`FusedCPUOps` calls the kernels of `csrc/cpu_kernels.cpp`: one pass over memory per op, and a
decode attention that reads the paged cache in place. Its sums run in another order, so logits
differ in the last bits (the tests bound by how much).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PortableOps:
    name = "portable"
    fused_decode_attention = False

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    @classmethod
    def add_rms_norm(
        cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual stream and the next sublayer's input."""
        residual = residual + x
        return cls.rms_norm(residual, weight, eps), residual

    @staticmethod
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

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedCPUOps(PortableOps):
    """float32 on CPU, once `cpu_kernels.load()` has succeeded."""

    name = "fused-cpu"
    fused_decode_attention = True

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.ops.tandem.rms_norm(x, weight, eps)

    @classmethod
    def add_rms_norm(
        cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.tandem.add_rms_norm(x, residual, weight, eps), residual  # in place

    @staticmethod
    def rotary(q, k, positions, cos, sin):
        torch.ops.tandem.rotary_(q, positions, cos, sin)  # in place on the qkv output
        torch.ops.tandem.rotary_(k, positions, cos, sin)
        return q, k

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tandem.silu_and_mul(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
