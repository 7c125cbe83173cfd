"""The fused Triton norms, rotary embedding and SiLU (CUDA steps) against the portable ops.

They run under Triton's interpreter on CPU tensors (conftest sets it). Elementwise arithmetic is
meant to be PyTorch's own, rounding for rounding, so the rotary embedding must be bit-identical;
the RMSNorm's sum of squares adds in another order, so it is within an ulp. The interpreter casts
to bf16 by truncating (the GPU rounds to nearest, as PyTorch): bf16 results are within an ulp
here, and benchmarks/cuda_check.py compares bf16 with transformers on the GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.models import load_model
from tandem.ops import elementwise, triton_elementwise

from conftest import random_prompts
from helpers import prefill_then_decode_logits

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: the block is padded to 128 by masking
def test_rms_norm_and_residual_add(dtype, hidden) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g).to(dtype)
    residual = torch.randn(5, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    ref_out, ref_residual = elementwise.add_rms_norm(x, residual, weight, 1e-6)
    out, new_residual = triton_elementwise.add_rms_norm(x, residual.clone(), weight, 1e-6)
    tol = {"rtol": 2 * _ulp(dtype), "atol": 1e-6}
    if dtype == torch.bfloat16:  # the interpreter's truncating casts
        tol = {"rtol": 4 * _ulp(dtype), "atol": 4 * _ulp(dtype)}
    if dtype != torch.bfloat16:
        assert torch.equal(new_residual, ref_residual)  # the add is one rounding in both
    torch.testing.assert_close(new_residual, ref_residual, **tol)
    torch.testing.assert_close(out, ref_out, **tol)
    alone = triton_elementwise.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(alone, elementwise.rms_norm(x, weight, 1e-6), **tol)


def test_rms_norm_of_strided_heads() -> None:
    """Qwen3's per-head q/k norm takes a [T, H, D] view of the fused qkv projection."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 4 * 32 + 2 * 2 * 32, generator=g)
    q = qkv[:, : 4 * 32].view(3, 4, 32)
    weight = torch.randn(32, generator=g)
    out = triton_elementwise.rms_norm(q, weight, 1e-6)
    torch.testing.assert_close(out, elementwise.rms_norm(q, weight, 1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,heads,kv_heads", [(32, 4, 2), (48, 3, 1), (64, 8, 8)])
def test_rotary_is_bit_identical_in_place(dtype, dim, heads, kv_heads) -> None:
    """q and k as the model passes them: views of one qkv row, heads apart by head_dim."""
    g = torch.Generator().manual_seed(dim + heads)
    tokens = 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.tensor([0, 5, 63, 17, 1, 40])
    ref_q, ref_k = elementwise.rotary(q, k, positions, cos, sin)
    out_q, out_k = triton_elementwise.rotary(q, k, positions, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place, in the qkv buffer
    if dtype == torch.bfloat16:  # the interpreter's truncating casts: an ulp or two per term
        for out, ref in ((out_q, ref_q), (out_k, ref_k)):
            assert (out - ref).abs().max() <= 4 * _ulp(dtype) * ref.abs().max()
    else:
        assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [2 * 40, 2 * 1500])  # 1500: two column blocks, the last masked
def test_silu_and_mul(dtype, width) -> None:
    g = torch.Generator().manual_seed(width)
    x = (3 * torch.randn(4, width, generator=g)).to(dtype)
    out = triton_elementwise.silu_and_mul(x)
    # exp is the platform's (numpy's here, libdevice's on CUDA): an ulp from torch's CPU one.
    torch.testing.assert_close(out, elementwise.silu_and_mul(x), rtol=2 * _ulp(dtype), atol=1e-6)


def test_empty_batches_launch_nothing() -> None:
    x = torch.empty(0, 64)
    assert triton_elementwise.silu_and_mul(x).shape == (0, 32)
    assert triton_elementwise.add_rms_norm(x, x.clone(), torch.ones(64), 1e-6)[0].shape == (0, 64)


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_model_with_fused_triton_ops_matches_portable(tiny_checkpoints, arch) -> None:
    """The whole forward with the Triton ops (the residual stream updated in place): the same
    greedy tokens as the portable ops at every position, logits within float32 noise."""
    path = tiny_checkpoints[arch]
    prompt = random_prompts(random.Random(4), 1, 1024, 20, 20)[0]
    logits = {}
    for ops in (elementwise, triton_elementwise):
        model = load_model(path, torch.float32, torch.device("cpu")).model
        model.ops = ops
        logits[ops] = prefill_then_decode_logits(model, prompt)
    portable, fused = logits[elementwise], logits[triton_elementwise]
    assert torch.equal(fused.argmax(-1), portable.argmax(-1))
    assert (fused - portable).abs().max().item() < 1e-5
