"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Randomness comes from a counter-based hash of (request seed, output index, vocabulary id), so a
request's tokens are a pure function of its seed and its logits: the same whatever else shares the
batch, in whatever order requests arrived, sync or async. Sampling uses the exponential race
(argmax of p / E with E ~ Exp(1)), which draws exactly from the categorical distribution p.
"""

from __future__ import annotations

import torch

from tandem.ops import cpu_kernels
from tandem.ops.hashing import MASK32, mix32
from tandem.sampler.inputs import SamplingRows


def seed_key(seed: int) -> int:
    """Fold a Python int seed (any size, any sign) into the 32-bit key the device hash uses."""
    seed %= 2**64
    x = torch.tensor([seed & MASK32, seed >> 32], dtype=torch.int64)
    return int(mix32(mix32(x[:1]) ^ x[1:])[0])


def uniform_noise(seed_keys: torch.Tensor, output_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0, 1) noise [S, V] that depends only on (seed, output index, vocab id).

    On a CPU with the fused kernels loaded, `tandem::uniform_noise` computes the same bits in
    native 32-bit arithmetic (this function is its reference, and the path everywhere else)."""
    if seed_keys.device.type == "cpu" and cpu_kernels.loaded():
        return torch.ops.tandem.uniform_noise(seed_keys, output_index, vocab)
    return portable_uniform_noise(seed_keys, output_index, vocab)


def portable_uniform_noise(
    seed_keys: torch.Tensor, output_index: torch.Tensor, vocab: int
) -> torch.Tensor:
    row = mix32(seed_keys ^ mix32(output_index & MASK32))
    col = mix32(torch.arange(vocab, device=seed_keys.device, dtype=torch.int64) + 0x9E3779B9)
    bits = mix32(mix32(row[:, None] ^ col[None, :]) ^ row[:, None])
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _fused_rows(x: torch.Tensor) -> bool:
    """Whether the fused CPU kernels take this [S, V] matrix."""
    cpu_float = x.device.type == "cpu" and x.dtype == torch.float32
    return (
        cpu_float and x.dim() == 2 and x.shape[1] > 0 and x.stride(-1) == 1 and cpu_kernels.loaded()
    )


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a [S, V] matrix; on a CPU in float32 with the fused kernels loaded,
    `tandem::argmax_rows` gives the same indices in one vectorized pass per row."""
    return torch.ops.tandem.argmax_rows(x) if _fused_rows(x) else x.argmax(dim=-1)


def sample(logits: torch.Tensor, t: SamplingRows) -> torch.Tensor:
    """logits [S, V] float32 -> token ids [S] int64.

    This is the reference. On a CPU with the fused kernels loaded, a step without top-k or
    top-p runs as `tandem::sample_rows`: the same draws in one pass per row, equal to this up
    to rounding (tests/test_kernels.py)."""
    if not (t.flags.all_greedy or t.flags.use_top_k or t.flags.use_top_p) and _fused_rows(logits):
        return torch.ops.tandem.sample_rows(
            logits, t.temperature, t.min_p, t.seed_keys, t.output_index
        )
    greedy = argmax_rows(logits)
    if t.flags.all_greedy:
        return greedy
    temperature = torch.where(t.temperature > 0, t.temperature, 1.0)
    logits = logits / temperature[:, None]
    if t.flags.use_top_k or t.flags.use_top_p:
        logits = _top_k_top_p(logits, t)
    probs = logits.softmax(dim=-1)
    if t.flags.use_min_p:
        threshold = t.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    exponential = -uniform_noise(t.seed_keys, t.output_index, logits.shape[-1]).log()
    sampled = argmax_rows(probs / exponential)
    return torch.where(t.temperature > 0, sampled, greedy)


def _top_k_top_p(logits: torch.Tensor, t: SamplingRows) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus (the best token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if t.flags.use_top_k:
        k = torch.where(t.top_k > 0, t.top_k, vocab)
        drop |= ranks >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    if t.flags.use_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p = 1 keep everything exactly: their cumulative sum may round past 1.
        drop |= (mass_before >= t.top_p[:, None]) & (ranks > 0) & (t.top_p < 1)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
