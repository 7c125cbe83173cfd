"""Quantized weights: the layout, the CPU kernels against a float64 product of the dequantized
weights, GGUF's blocks against gguf's own dequantization, and per-channel int8 end to end."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM
from tandem.models.gguf_blocks import NATIVE_TYPES, split_blocks
from tandem.ops import cpu_kernels
from tandem.ops.quantized import dequantize, pack, quantize_int8, quantized_linear, unpack

from gguf_files import quantize, tiny_hf_folder
from helpers import greedy

PROMPTS = [[1, 523, 88, 901, 17], [1, 40, 41, 42], [1, 1500, 3, 3, 3, 3, 9]]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    build = cpu_kernels.load()
    assert build.available, build.error


def random_weight(kind: str, n: int, k: int, seed: int = 0):
    """A packed weight of one of the layouts, with random codes, scales and offsets."""
    g = torch.Generator().manual_seed(seed)
    blocks = (n, k // 32)
    if kind == "8-bit":
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        return pack(codes, (torch.rand(blocks, generator=g) * 0.02).half(), None, kind)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    # As Q4_K's: a float16 times a 6-bit integer, so code * scale is exact and + offset rounds
    # once (the layouts' formats all are so).
    scales = (torch.rand(blocks, generator=g) * 0.001).half().float()
    scales *= torch.randint(1, 64, blocks, generator=g)
    offsets = torch.randn(blocks, generator=g) * 0.1
    if kind == "4-bit f16":
        scales, offsets = scales.half(), offsets.half()
    return pack(codes, scales, offsets, kind)


LAYOUTS = ["8-bit", "4-bit f16", "4-bit f32"]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_pack_and_unpack_are_inverse(kind):
    q = random_weight(kind, 48, 96)
    codes, scales, offsets = unpack(q)
    assert torch.equal(pack(codes, scales, offsets, kind).values, q.values)
    w = dequantize(q)
    expected = codes.float() * scales.float().repeat_interleave(32, 1)
    if offsets is not None:
        expected += offsets.float().repeat_interleave(32, 1)
    assert torch.equal(w, expected)


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (160, 576)])
def test_the_kernel_is_the_dequantized_product(kind, n, k):
    """Every row count the kernel treats apart (in registers up to a tile, through a buffered
    block above it, chunks of 128 rows), with a bias and a strided x: within float32 rounding
    of the float64 product, and each row the same bits alone as in any batch."""
    q = random_weight(kind, n, k)
    w = dequantize(q).double()
    bias = torch.randn(n)
    for rows in (1, 2, 3, 4, 5, 6, 7, 12, 13, 31, 130, 300):
        x = torch.randn(rows, k + 8)[:, 4 : 4 + k]  # a row stride that is not k
        out = quantized_linear(x, q, bias)
        reference = x.double() @ w.T + bias.double()
        scale = reference.abs().max().item()
        assert (out.double() - reference).abs().max().item() <= 1e-5 * scale, rows
        for r in (0, rows - 1):
            alone = quantized_linear(x[r : r + 1], q, bias)
            assert torch.equal(alone[0], out[r]), (rows, r)


def test_bad_operands_are_refused():
    q = random_weight("8-bit", 16, 64)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.tandem.quantized_linear(torch.randn(2, 32), *q.flat(), torch.empty(0))
    with pytest.raises(RuntimeError, match="8-bit ones none"):
        torch.ops.tandem.quantized_linear(torch.randn(2, 64), q.values, q.scales, q.scales,
                                          torch.empty(0))  # fmt: skip
    with pytest.raises(ValueError, match="rows in 16s"):
        pack(torch.zeros(10, 32, dtype=torch.int8), torch.ones(10, 1), None, "int8")


@pytest.mark.parametrize("tensor_type", NATIVE_TYPES)
def test_gguf_blocks_are_gguf_s_own_weights(tensor_type):
    """Codes, scales and offsets from a GGUF type's blocks give gguf's dequantization exactly."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((32, 512)) * rng.uniform(0.01, 2, (32, 1))).astype(np.float32)
    data = quantize(weight, tensor_type)
    codes, scales, offsets = split_blocks(data, tensor_type, weight.shape[1])
    as_torch = [
        None if t is None else torch.from_numpy(np.array(t)) for t in (codes, scales, offsets)
    ]
    q = pack(*as_torch, tensor_type)
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[tensor_type])
    assert torch.equal(dequantize(q), torch.from_numpy(expected.astype(np.float32)))


def test_int8_rounds_each_weight_to_its_row_s_step():
    w = torch.randn(32, 64) * torch.linspace(0.01, 3, 32)[:, None]
    w[3] = 0  # an all-zero row stays zero
    q = quantize_int8(w)
    step = w.abs().amax(1, keepdim=True) / 127
    error = (dequantize(q) - w).abs()
    assert (error <= step / 2 + 1e-7).all() and dequantize(q)[3].eq(0).all()


@pytest.fixture(scope="module")
def untied_folder(tmp_path_factory):
    return tiny_hf_folder(tmp_path_factory.mktemp("untied"), "LlamaForCausalLM")


def test_int8_generates_exactly_the_int8_weights(untied_folder, tmp_path):
    """quantization="int8" runs the model whose linear layers are their int8 rounding: the same
    greedy tokens as that model written out in float32 and run unquantized, in both loops."""
    rounded = tmp_path / "rounded"
    rounded.mkdir()
    for f in untied_folder.iterdir():
        if f.name != "model.safetensors":
            (rounded / f.name).write_bytes(f.read_bytes())
    state = load_file(untied_folder / "model.safetensors")
    for name, tensor in state.items():
        if tensor.dim() == 2 and "embed_tokens" not in name:
            state[name] = dequantize(quantize_int8(tensor)).contiguous()
    save_file(state, rounded / "model.safetensors")
    options = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128}
    reference = LLM(str(rounded), **options)
    expected = [o.token_ids for o in reference.generate(PROMPTS, greedy(16))]
    reference.close()
    for async_scheduling in (True, False):
        llm = LLM(str(untied_folder), quantization="int8", async_scheduling=async_scheduling,
                  **options)  # fmt: skip
        layers = llm.engine.runner.model.layers
        assert all(layer.attn.qkv.quantized.source == "int8" for layer in layers)
        assert layers[0].mlp.down.weight.numel() == 0  # no float copy kept
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy(16))]
        llm.close()
        assert got == expected, async_scheduling


def test_int8_quantizes_tied_logits_and_keeps_the_lookup(tmp_path):
    folder = tiny_hf_folder(tmp_path / "tied", "LlamaForCausalLM", tie_word_embeddings=True)
    llm = LLM(str(folder), quantization="int8", device="cpu", num_kv_blocks=64, max_model_len=64)
    model = llm.engine.runner.model
    assert model.tied_logits.quantized.source == "int8"
    assert model.embed.weight.numel() > 0
    assert len(llm.generate(PROMPTS, greedy(4))[0].token_ids) == 4
    llm.close()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"quantization": "int4"}, "quantization must be one of"),
        ({"quantization": "int8", "dtype": "bfloat16"}, "runs on the CPU in float32"),
    ],
)
def test_unknown_or_unsupported_quantization_is_refused(untied_folder, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(untied_folder), device="cpu", **options)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_two_ranks_run_their_quantized_shards_as_one(tmp_path, quantization):
    """Q4_K blocks from a GGUF (each rank its rows and blocks of columns) and int8 (a row-parallel
    rank rounds with its rows' whole largest value): two ranks give one rank's tokens."""
    from gguf_files import write_gguf

    folder = tiny_hf_folder(tmp_path / "hf", "LlamaForCausalLM", tie_word_embeddings=True)
    path = folder if quantization else write_gguf(folder, tmp_path / "m.gguf", "Q4_K")
    tokens = {}
    for size in (1, 2):
        llm = LLM(str(path), quantization=quantization, device="cpu", num_kv_blocks=64,
                  max_model_len=128, tensor_parallel_size=size, cpu_threads=1)  # fmt: skip
        assert ("int8" if quantization else "Q4_K") in llm.engine.execution.describe()
        tokens[size] = [o.token_ids for o in llm.generate(PROMPTS, greedy(12))]
        llm.close()
    assert tokens[1] == tokens[2]
