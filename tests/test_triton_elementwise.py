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

from tandem.models.loader import load_model
from tandem.ops import attention, elementwise, fp8, kv_quant, triton_attention, triton_elementwise
from tandem.ops.attention_metadata import AttentionMetadata, PrefillSegment

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
@pytest.mark.parametrize("dim,heads,kv_heads", [(32, 4, 2), (48, 3, 1)])
def test_rotary_and_cache_writes_the_rotated_keys_and_values(dtype, dim, heads, kv_heads) -> None:
    """One kernel rotates q and k in place and stores k and v at the tokens' slots: what the
    portable rotary and write_kv leave, with every other slot of the cache untouched."""
    g = torch.Generator().manual_seed(dim)
    tokens, blocks, block_size = 5, 6, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    cos, sin = torch.randn(64, dim, generator=g), torch.randn(64, dim, generator=g)
    positions = torch.tensor([0, 5, 63, 17, 1])
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    caches = [torch.randn(blocks, block_size, kv_heads, dim, generator=g).to(dtype) for _ in "kv"]
    results = []
    for ops in (elementwise, triton_elementwise):
        row = qkv.clone()
        q, k, v = row.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k, v = (t.view(tokens, -1, dim) for t in (q, k, v))
        k_cache, v_cache = (c.clone() for c in caches)
        q, k = ops.rotary_and_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
        results.append((q, k, k_cache, v_cache))
    (ref_q, ref_k, ref_kc, ref_vc), (q, k, k_cache, v_cache) = results
    assert torch.equal(v_cache, ref_vc)  # copied as it is
    for out, ref in ((q, ref_q), (k, ref_k), (k_cache, ref_kc)):
        if dtype == torch.bfloat16:  # the interpreter's truncating casts
            assert (out - ref).abs().max() <= 4 * _ulp(dtype) * ref.abs().max()
        else:
            assert torch.equal(out, ref)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[untouched],
                       caches[0].view(-1, kv_heads, dim)[untouched])  # fmt: skip


def _rotary_and_cache_both(qkv, heads, kv_heads, dim, positions, cos, sin, caches, slots):
    """Each ops module's rotary_and_cache on its own copies: [(q, k, k_cache, v_cache)] for the
    portable ops, then the Triton kernel."""
    results = []
    for ops in (elementwise, triton_elementwise):
        q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k, v = (t.view(len(qkv), -1, dim) for t in (q, k, v))
        k_cache, v_cache = (c.clone() for c in caches)
        q, k = ops.rotary_and_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slots)
        results.append((q, k, k_cache, v_cache))
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim,heads,kv_heads", [(32, 4, 2), (48, 3, 1)])
def test_rotary_and_cache_into_fp8_is_kv_quant_bit_for_bit(dtype, dim, heads, kv_heads) -> None:
    """Into an fp8 cache (uint8 rows: e4m3 codes, then a float32 scale) the kernel writes
    `kv_quant.quantize`'s bytes of the rotated k and of v: rows of magnitudes 1e-6 (the least
    scale: codes among e4m3's subnormals) to 1e3, an all-zero one; every other slot untouched.
    fp32 and fp16 rotate as PyTorch does, so the whole cache is the portable rotary and
    write_kv's."""
    g = torch.Generator().manual_seed(dim + 1)
    tokens, blocks, block_size = 6, 6, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    qkv = (qkv * torch.logspace(-6, 3, tokens)[:, None]).to(dtype)
    qkv[2] = 0
    cos, sin = torch.randn(64, dim, generator=g), torch.randn(64, dim, generator=g)
    positions = torch.tensor([0, 5, 63, 17, 1, 40])
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    shape = (blocks, block_size, kv_heads, dim + kv_quant.SCALE_BYTES)
    caches = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for _ in "kv"]
    portable, (_, k, k_cache, v_cache) = _rotary_and_cache_both(
        qkv, heads, kv_heads, dim, positions, cos, sin, caches, slots
    )
    written = k_cache.view(-1, kv_heads, shape[-1])[slots]
    assert torch.equal(written, kv_quant.quantize(k, torch.uint8))  # the kernel's rotated k
    assert torch.equal(v_cache, portable[3])
    if dtype != torch.bfloat16:  # the interpreter's truncating casts rotate bf16 within an ulp
        assert torch.equal(k_cache, portable[2])
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    for cache, before in zip((k_cache, v_cache), caches, strict=True):
        assert torch.equal(cache.view(-1, *shape[2:])[untouched],
                           before.view(-1, *shape[2:])[untouched])  # fmt: skip


def test_fp8_cache_rounds_ties_to_even_at_every_e4m3_value() -> None:
    """Every finite e4m3 value, the midpoints between neighbours and a hair either side of
    them, as keys and values of rows whose largest value is 448 (scale 1): the fp8 cache holds
    PyTorch's nearest-even codes, as `kv_quant.quantize` writes them."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPE).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(values[1:])])
    row = torch.cat([row, -row])
    dim = 64
    tokens = -(-len(row) // (dim - 1))
    rest = torch.zeros(tokens * (dim - 1))
    rest[: len(row)] = row
    x = torch.cat([torch.full((tokens, 1), 448.0), rest.view(tokens, dim - 1)], dim=1)
    qkv = torch.cat([x, x, x], dim=1)  # one head each of q, k and v
    cos, sin = torch.ones(1, dim), torch.zeros(1, dim)  # rotation leaves the keys
    shape = (tokens, 1, 1, dim + kv_quant.SCALE_BYTES)
    caches = [torch.zeros(shape, dtype=torch.uint8) for _ in "kv"]
    positions, slots = torch.zeros(tokens, dtype=torch.long), torch.arange(tokens)
    portable, fused = _rotary_and_cache_both(qkv, 1, 1, dim, positions, cos, sin, caches, slots)
    for mine, theirs in zip(fused[2:], portable[2:], strict=True):
        assert torch.equal(mine, theirs)
        scales = mine[..., dim:].contiguous().view(torch.float32)
        assert torch.equal(scales, torch.ones_like(scales))
    expected = x.to(fp8.FP8_DTYPE).view(torch.uint8)
    assert torch.equal(fused[3][:, 0, 0, :dim], expected)


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


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"])
def test_plain_decode_step_rotating_in_the_attention_kernel(
    tiny_checkpoints, arch, monkeypatch
) -> None:
    """A bf16 model's decode step marked plain (`distinct_decodes`): its attention kernel
    rotates and caches the step's keys itself, one launch fewer a layer (Gemma 3: windows of 7
    keys on two layers of three, q/k norms before the rotary). On a CPU the unmarked
    step attends with the portable op, so both are held to the float32 model: the fused step's
    logits as near them as the unfused step's, the same greedy token."""
    path = tiny_checkpoints[arch]
    prompt = random_prompts(random.Random(6), 1, 1024, 20, 20)[0]
    logits, rotating = {}, []
    decode_attention = triton_attention.decode_attention

    def recorded(*args, new_keys=None, **kwargs):
        rotating.append(new_keys is not None)
        return decode_attention(*args, new_keys=new_keys, **kwargs)

    monkeypatch.setattr(triton_attention, "decode_attention", recorded)
    for name in ("float32", "unfused", "fused"):
        model = load_model(path, torch.float32 if name == "float32" else torch.bfloat16,
                           torch.device("cpu")).model  # fmt: skip
        model.ops = triton_elementwise
        logits[name] = prefill_then_decode_logits(model, prompt, distinct_decodes=name == "fused")
    assert rotating == [True] * model.spec.num_layers  # the fused step's layers only
    monkeypatch.setenv("TANDEM_TRITON_ATTENTION", "0")  # the off switch keeps it off
    attention.triton_kernels.cache_clear()
    try:
        prefill_then_decode_logits(model, prompt, distinct_decodes=True)
    finally:
        attention.triton_kernels.cache_clear()
    assert rotating == [True] * model.spec.num_layers
    assert torch.equal(logits["fused"][:-1], logits["unfused"][:-1])  # the same prefill
    exact = logits["float32"][-1]
    error = {n: (logits[n][-1] - exact).abs().max().item() for n in ("unfused", "fused")}
    assert 0 < error["fused"] < 2 * error["unfused"], error
    assert logits["fused"][-1].argmax() == exact.argmax()


def _over_fp8_caches(model, prompt: list[int], distinct_decodes: bool, block_size: int = 4):
    """`prefill_then_decode_logits` over fp8 KV caches: the logits, and the caches after."""
    spec, n = model.spec, len(prompt)
    num_blocks = -(-n // block_size)
    width = kv_quant.row_width(spec.head_dim, torch.uint8)
    shape = (2, num_blocks, block_size, spec.num_kv_heads, width)
    caches = [torch.zeros(shape, dtype=torch.uint8) for _ in range(spec.num_layers)]
    tables = torch.arange(num_blocks).view(1, -1)
    ids, positions = torch.tensor(prompt), torch.arange(n)
    prefill = AttentionMetadata(
        positions[: n - 1], tables, torch.tensor([n - 1]), 0, 0,
        [PrefillSegment(0, n - 1, n - 1, 0)], block_size,
    )  # fmt: skip
    decode = AttentionMetadata(
        positions[n - 1 :], tables, torch.tensor([n]), 1, num_blocks, [], block_size,
        distinct_decodes=distinct_decodes,
    )  # fmt: skip
    with torch.inference_mode():
        first = model(ids[: n - 1], positions[: n - 1], caches, prefill)
        last = model(ids[n - 1 :], positions[n - 1 :], caches, decode)
        return model.compute_logits(torch.cat([first, last])).float(), caches


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Gemma3ForCausalLM"])
def test_plain_decode_step_over_fp8_caches(tiny_checkpoints, arch, monkeypatch) -> None:
    """A bf16 model over fp8 KV caches with the Triton ops: the prefill's keys and values
    written as codes and scales by the rotary kernel; in a decode step marked plain, the
    attention kernel rotates, caches and attends to the step's row itself. It caches the
    rotary kernel's bytes, and is held, as the unmarked step (whose attention, on a CPU, is the
    portable op over dequantized rows), to the float32 model over fp8 caches: as near, the
    same greedy token."""
    prompt = random_prompts(random.Random(8), 1, 1024, 20, 20)[0]
    rotating, decode_attention = [], triton_attention.decode_attention

    def recorded(*args, new_keys=None, **kwargs):
        rotating.append(new_keys is not None)
        return decode_attention(*args, new_keys=new_keys, **kwargs)

    monkeypatch.setattr(triton_attention, "decode_attention", recorded)
    runs = {}
    for fused in (False, True):
        model = load_model(tiny_checkpoints[arch], torch.bfloat16, torch.device("cpu")).model
        model.ops = triton_elementwise
        runs[fused] = _over_fp8_caches(model, prompt, distinct_decodes=fused)
    model = load_model(tiny_checkpoints[arch], torch.float32, torch.device("cpu")).model
    model.ops = elementwise  # the portable ops: write_kv quantizes, attention dequantizes
    exact = _over_fp8_caches(model, prompt, distinct_decodes=False)[0][-1]
    assert rotating == [True] * model.spec.num_layers  # the fused step's layers only
    (unfused, unfused_caches), (fused, fused_caches) = runs[False], runs[True]
    assert torch.equal(fused[:-1], unfused[:-1])  # the same prefill
    # The step's row of the first layer (whose input is the same in both), all layers' before
    n = len(prompt)
    assert torch.equal(fused_caches[0], unfused_caches[0])
    for mine, theirs in zip(fused_caches, unfused_caches, strict=True):
        before = [t.flatten(1, 2)[:, : n - 1] for t in (mine, theirs)]
        assert torch.equal(*before)
    error = {name: (logits[-1] - exact).abs().max().item() for name, (logits, _) in runs.items()}
    assert 0 < error[True] < 2 * error[False], error
    assert fused[-1].argmax() == unfused[-1].argmax() == exact.argmax()


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_rows_are_the_portable_bits(dtype) -> None:
    """One kernel rounds each row to e4m3 with its own scale: the bits of `fp8.quantize_rows`,
    on rows whose magnitudes span e4m3's subnormals to its largest value, and an all-zero row."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 576, generator=g) * torch.logspace(-6, 3, 9)[:, None]
    x[2] = 0
    x[3, :4] = torch.tensor([1e-30, -3e-4, 2.0**-10, 448.0])
    x = x.to(dtype)
    codes, scales = triton_elementwise.quantize_rows_fp8(x)
    expected_codes, expected_scales = fp8.quantize_rows(x)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))


def test_fp8_rounding_ties_to_even_at_every_e4m3_value() -> None:
    """Every finite e4m3 value, and the midpoints between neighbours and a hair either side of
    them, in one row whose largest value is 448 (scale 1): PyTorch's nearest-even rounding."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8.FP8_DTYPE).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(values[1:])])
    row = torch.cat([row, -row])[None, :]
    codes, scales = triton_elementwise.quantize_rows_fp8(row)
    assert scales.item() == 1.0
    expected = row.to(fp8.FP8_DTYPE)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_fp8_model_with_fused_triton_ops_matches_portable(tiny_checkpoints, arch) -> None:
    """An FP8 model with the fused ops (its rows rounded by the Triton kernel) gives the portable
    FP8 model's logits: the same roundings, so within float32 noise."""
    prompt = random_prompts(random.Random(5), 1, 1024, 20, 20)[0]
    logits = {}
    for ops in (elementwise, triton_elementwise):
        model = load_model(tiny_checkpoints[arch], torch.float32, torch.device("cpu")).model
        model.quantize_fp8()
        model.ops = ops
        if ops is triton_elementwise:
            model.use_fp8_row_quantizer(triton_elementwise.quantize_rows_fp8)
        logits[ops] = prefill_then_decode_logits(model, prompt)
    portable, fused = logits[elementwise], logits[triton_elementwise]
    assert torch.equal(fused.argmax(-1), portable.argmax(-1))
    assert (fused - portable).abs().max().item() < 1e-4


def test_kernels_launch_dependent_on_hopper_and_later_only(monkeypatch):
    """PDL on NVIDIA GPUs of compute capability 9.0 and up, unless TANDEM_PDL=0; stream order
    on older GPUs, ROCm, the CPU and Triton's interpreter."""
    from tandem.ops import triton_launch

    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability["value"])
    monkeypatch.setattr(torch.version, "hip", None)

    def options() -> dict:
        triton_launch._cuda_options.cache_clear()
        return triton_launch._cuda_options(0)

    try:
        assert options() == {"PDL": True, "launch_pdl": True}
        capability["value"] = (8, 9)
        assert options() == {"PDL": False}
        capability["value"] = (10, 0)
        assert options() == {"PDL": True, "launch_pdl": True}
        monkeypatch.setenv("TANDEM_PDL", "0")
        assert options() == {"PDL": False}
        monkeypatch.delenv("TANDEM_PDL")
        monkeypatch.setattr(torch.version, "hip", "6.2")
        assert options() == {"PDL": False}
    finally:
        triton_launch._cuda_options.cache_clear()
    assert triton_launch.pdl_options(torch.device("cpu")) == {"PDL": False}
