"""Quantized weights: the layouts, the CPU kernels against a float64 product of the dequantized
weights (and, with int8 activations, against the integer reference), GGUF's blocks against gguf's
own dequantization, per-channel int8 end to end, and int8 activations against transformers with
its activations rounded the same way."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM
from tandem.config import usable_cores
from tandem.models.gguf_blocks import LAYOUTS as GGUF_LAYOUTS
from tandem.models.gguf_blocks import NATIVE_TYPES, common_layout, split_blocks
from tandem.models.loader import load_model
from tandem.ops import cpu_kernels
from tandem.ops.linear import Linear
from tandem.ops.quantized import (
    QuantizedExperts,
    dequantize,
    dequantize_rows,
    for_int8_activations,
    int8_activation_linear,
    pack,
    quantize_activations,
    quantize_int8,
    quantized_linear,
    quantized_rows,
    unpack,
)
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from conftest import follow_near_ties
from gguf_files import quantize, tiny_hf_folder, write_gguf
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
    if kind == "8-bit per 16":  # as Q6_K's: a float16 times an int8 per 16 columns, in float32
        codes = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
        halves = (n, k // 16)
        scales = (torch.rand(halves, generator=g) * 0.001).half().float()
        return pack(codes, scales * torch.randint(-128, 128, halves, generator=g), None, kind)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    if kind == "4-bit symmetric":  # Q4_0: weight = (code - 8) * scale
        scales = (torch.rand(blocks, generator=g) * 0.02).half()
        return pack(codes, scales, scales * -8, kind)
    # As Q4_K's: a float16 times a 6-bit integer, so code * scale is exact and + offset rounds
    # once (the layouts' formats all are so).
    scales = (torch.rand(blocks, generator=g) * 0.001).half().float()
    scales *= torch.randint(1, 64, blocks, generator=g)
    offsets = torch.randn(blocks, generator=g) * 0.1
    if kind == "4-bit f16":
        scales, offsets = scales.half(), offsets.half()
    return pack(codes, scales, offsets, kind)


LAYOUTS = ["8-bit", "8-bit per 16", "4-bit f16", "4-bit f32", "4-bit symmetric"]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_pack_and_unpack_are_inverse(kind):
    q = random_weight(kind, 48, 96)
    codes, scales, offsets = unpack(q)
    assert torch.equal(pack(codes, scales, offsets, kind).values, q.values)
    quads = for_int8_activations(q)
    assert quads.int8_activations and not q.int8_activations and quads.shape == q.shape
    # Symmetric 4-bit codes keep no offsets in either layout (-8 * scale, implied).
    eight_bit = kind.startswith("8-bit")
    assert (quads.offsets is None) == (q.offsets is None) == (eight_bit or "symmetric" in kind)
    for mine, theirs in zip(unpack(quads), (codes, scales, offsets), strict=True):
        assert (mine is None and theirs is None) or torch.equal(mine, theirs)
    # One 32-bit lane is a row's run of 4 columns: row 17 (group 1, row 1), columns 36-39.
    lane = quads.values[1, 1, 1, 4:8]
    if quads.bits == 8:
        assert torch.equal(lane, codes[17, 36:40])
    else:  # the high nibbles hold the block's second half: columns 52-55
        assert torch.equal(lane & 15, codes[17, 36:40]) and torch.equal(lane >> 4, codes[17, 52:56])
    # Float activations: the same bytes as words, row 17's run 1 of block 1 as one word.
    assert q.values.dtype == torch.int32 and quads.values.data_ptr() == q.values.data_ptr()
    word = int(q.values[1, 1, 1, 1]) & 0xFFFFFFFF
    if q.bits == 4:  # 8 codes
        assert q.values.shape == (3, 3, 4, 16)
        columns = [32 + 16 * (k % 2) + 4 + k // 2 for k in range(8)]  # 36, 52, 37, 53, ...
        assert [word >> (4 * k) & 15 for k in range(8)] == codes[17, columns].tolist()
    else:  # 4 codes, signed bytes
        assert q.values.shape == (3, 3, 8, 16)
        signed = [(word >> (8 * k) & 255) - 256 * (word >> (8 * k + 7) & 1) for k in range(4)]
        assert signed == codes[17, 36:40].tolist()
    w = dequantize(q)
    width = 16 if kind == "8-bit per 16" else 32  # columns per scale
    assert q.scale_cols == width and scales.shape == (48, 96 // width)
    expected = codes.float() * scales.float().repeat_interleave(width, 1)
    if offsets is not None:
        expected += offsets.float().repeat_interleave(32, 1)
    assert torch.equal(w, expected)


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (160, 576)])
def test_the_kernel_is_the_dequantized_product(kind, n, k):
    """Every row count the kernel treats apart (in registers up to a tile, through a buffered
    block above it, chunks of 128 rows; on VNNI as digits, and on AMX tiles from 4 rows of 8-bit
    codes and 8 of 4-bit ones, where the CPU has them), with a bias and a strided x: within
    float32 rounding of the float64 product, and each row the same bits alone as in any batch."""
    q = random_weight(kind, n, k)
    w = dequantize(q).double()
    bias = torch.randn(n)
    for tiles in tile_settings():
        for rows in (1, 2, 3, 4, 5, 6, 7, 12, 13, 31, 130, 300):
            x = torch.randn(rows, k + 8)[:, 4 : 4 + k]  # a row stride that is not k
            with cpu_kernels.using_amx_tiles(tiles):
                out = quantized_linear(x, q, bias)
                alone = [quantized_linear(x[r : r + 1], q, bias)[0] for r in (0, rows - 1)]
            reference = x.double() @ w.T + bias.double()
            scale = reference.abs().max().item()
            assert (out.double() - reference).abs().max().item() <= 1e-5 * scale, (tiles, rows)
            assert torch.equal(alone[0], out[0]) and torch.equal(alone[1], out[-1]), (tiles, rows)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_rows_looked_up_in_the_blocks_are_the_dequantized_rows(kind):
    """An embedding kept in its blocks: the kernel's rows and the reference's are the table's
    rows bit for bit (a product, then the offset: no FMA), in both layouts, repeated and in any
    order; a row past the table is refused."""
    q = random_weight(kind, 160, 576)
    ids = torch.tensor([159, 0, 17, 17, 100, 15, 16, 3])
    for weight in (q, for_int8_activations(q)):
        table = dequantize(weight)
        assert torch.equal(dequantize_rows(weight, ids), table[ids])
        assert torch.equal(quantized_rows(weight, ids), table[ids])
        assert quantized_rows(weight, ids[:0]).shape == (0, 576)
    with pytest.raises(RuntimeError, match="row 160 outside the weight's 160"):
        quantized_rows(q, torch.tensor([1, 160]))


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("int8", [False, True], ids=["float-x", "int8-x"])
def test_experts_in_one_call_are_each_expert_s_own_product(kind, int8):
    """A layer's experts in one kernel call (rows sorted by expert; experts with no rows, one row,
    a tile, more): every expert's rows the same bits as its own `quantized_linear`, so a row's
    result does not depend on which other experts ran beside it."""
    n, k, counts = 48, 96, [3, 0, 1, 13, 0, 130, 2, 0]
    one = [random_weight(kind, n, k, seed=e) for e in range(len(counts))]
    if int8:
        one = [for_int8_activations(q) for q in one]
    stack = QuantizedExperts.stack(one)
    ends = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(ends[-1]), k)
    for tiles in tile_settings():
        with cpu_kernels.using_amx_tiles(tiles):
            out = torch.ops.tandem.quantized_experts(x, ends, *stack.flat())
            start = 0
            for e, end in enumerate(ends.tolist()):
                if end > start:
                    assert torch.equal(out[start:end], quantized_linear(x[start:end], one[e]))
                start = end
    with pytest.raises(RuntimeError, match="row_ends must rise"):
        torch.ops.tandem.quantized_experts(x, ends - 1, *stack.flat())


def tile_settings() -> list[bool]:
    """With AMX tiles, then without (the VNNI kernel at every row count, and 8-bit codes widened:
    they meet the digits only where tiles run them), where the build and the CPU have them; else
    without only."""
    return [True, False] if cpu_kernels.amx_tiles() else [False]


def test_codes_meet_float_activations_on_amx_tiles_where_the_cpu_has_them():
    """The native build on a CPU with AMX (Intel Sapphire Rapids and later) multiplies on its
    tiles (the tests above then check them against the VNNI kernel, bit for bit); elsewhere, and
    in the AVX2 build, it does not."""
    has_amx = {"amx_tile", "amx_int8", "avx512_vnni"} <= set(cpu_kernels.cpu_flags().split())
    native = os.environ.get("TANDEM_CPU_ISA", "native") == "native"
    assert cpu_kernels.amx_tiles() == (has_amx and native)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_float_activations_keep_float_precision_at_every_magnitude(kind):
    """Rows from 1e-35 to 1e30 and one spanning 1e-30..1e30 (on AVX-512 VNNI the codes meet
    the activations as integer digits scaled per block, on AVX2 a row of one as powers of two
    per column: a scale must not lose them), each within float32 rounding of its own float64
    product and the same bits alone as in the batch; a block of zeros; an inf or a NaN spoils
    its own row only."""
    q = random_weight(kind, 48, 96)
    w = dequantize(q).double()
    magnitudes = torch.tensor([1e-35, 1e-30, 1e-3, 1.0, 1e3, 1e30], dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    x64 = torch.randn(len(magnitudes) + 1, 96, generator=g, dtype=torch.float64)
    x64[:-1] *= magnitudes[:, None]
    x64[-1] *= 10.0 ** (torch.rand(96, generator=g, dtype=torch.float64) * 60 - 30)
    x64[3, 32:64] = 0
    x = x64.float()
    reference = x.double() @ w.T
    scale = reference.abs().amax(dim=1, keepdim=True)
    spoiled = torch.cat([x, x[:2]])
    spoiled[-2, 40], spoiled[-1, 7] = float("inf"), float("nan")
    for tiles in tile_settings():
        with cpu_kernels.using_amx_tiles(tiles):
            out = quantized_linear(x, q)
            assert ((out.double() - reference).abs() <= 1e-5 * scale).all(), tiles
            for r in range(len(x)):
                assert torch.equal(quantized_linear(x[r : r + 1], q)[0], out[r]), (tiles, r)
            out = quantized_linear(spoiled, q)
        assert not out[-2:].isfinite().any(dim=1).any() and out[:-2].isfinite().all(), tiles


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("n, k", [(16, 32), (48, 96), (160, 576)])
def test_int8_activations_kernel_is_the_integer_reference(kind, n, k):
    """Every row count (tiles, chunks of 128 rows), a bias and a strided x: the kernel's integer
    product within float32 rounding of the reference's, each row the same bits alone as in any
    batch; and the product is the dequantized weights times the rounded activations."""
    q = for_int8_activations(random_weight(kind, n, k))
    w = dequantize(q).double()
    bias = torch.randn(n)
    g = torch.Generator().manual_seed(n * k)
    for rows in (1, 2, 3, 7, 8, 9, 31, 130, 300):
        x = (
            torch.randn(rows, k + 8, generator=g)[:, 4 : 4 + k]
            * torch.logspace(-3, 2, rows)[:, None]
        )
        x[0, :32] = 0  # a block of zeros: step 0, codes 0
        out = quantized_linear(x, q, bias)
        reference = int8_activation_linear(x, q, bias).double()
        scale = reference.abs().amax(dim=1, keepdim=True)
        assert ((out.double() - reference).abs() <= 1e-5 * scale).all(), rows
        codes, steps, _ = quantize_activations(x)
        rounded = codes.double().view(rows, -1, 32) * steps.double()[..., None]
        exact = rounded.view(rows, k) @ w.T + bias.double()
        assert ((reference.double() - exact).abs() <= 1e-5 * scale).all(), rows
        for r in (0, rows - 1):
            alone = quantized_linear(x[r : r + 1], q, bias)
            assert torch.equal(alone[0], out[r]), (rows, r)


def test_activations_round_per_block_as_llama_cpp_q8_0():
    x = torch.randn(3, 96) * torch.tensor([1e-4, 1.0, 300.0])[:, None]
    x[1, 32:64] = 0
    codes, steps, sums = quantize_activations(x)
    blocks = x.view(3, 3, 32)
    assert torch.equal(steps, blocks.abs().amax(-1) / 127)
    assert codes.abs().max() == 127 and codes.view(3, 3, 32)[1, 1].eq(0).all()
    error = (codes.view(3, 3, 32).float() * steps[..., None] - blocks).abs()
    assert (error <= steps[..., None] * 0.5 * (1 + 1e-5)).all()
    assert torch.equal(sums, steps * codes.view(3, 3, 32).sum(-1).float())
    # The kernels' arithmetic, in numpy's float32: one division for 127 / max|x|, one product,
    # nearest-even. Enough rows that a rounding of the division's own shows (torch's 127.0 / t
    # is 127 * (1 / t): it changed 4 of these 6.4M codes).
    x = torch.randn(100_000, 64, generator=torch.Generator().manual_seed(0))
    blocks = x.numpy().reshape(-1, 2, 32)
    inverse = np.float32(127) / np.abs(blocks).max(axis=-1, keepdims=True)
    expected = np.rint(blocks * inverse).reshape(x.shape)
    assert np.array_equal(quantize_activations(x)[0].numpy(), expected)


def test_a_fused_layer_takes_its_parts_rows_and_refuses_a_part_in_another_format():
    """Q4_0 parts keep no offsets, Q4_1 parts do: a layer fused from both would be neither; Q8_0
    parts keep none either, and their words are as wide."""
    layer = Linear(64, 48)
    symmetric = [random_weight("4-bit symmetric", 16, 64, seed=s) for s in (1, 2)]
    layer.load_quantized_rows(0, symmetric[0])
    layer.load_quantized_rows(16, symmetric[1])
    rows = dequantize(layer.quantized)
    assert torch.equal(rows[:16], dequantize(symmetric[0]))
    assert torch.equal(rows[16:32], dequantize(symmetric[1]))
    with pytest.raises(ValueError, match="two formats"):
        layer.load_quantized_rows(32, random_weight("4-bit f16", 16, 64))
    with pytest.raises(ValueError, match="two formats"):
        layer.load_quantized_rows(32, random_weight("8-bit", 16, 64))
    # 8-bit codes with a scale per 16 columns and with one per 32 are two formats too.
    eight_bit = Linear(64, 32)
    eight_bit.load_quantized_rows(0, random_weight("8-bit per 16", 16, 64))
    with pytest.raises(ValueError, match="two formats"):
        eight_bit.load_quantized_rows(16, random_weight("8-bit", 16, 64))


def test_bad_operands_are_refused():
    q = random_weight("8-bit", 16, 64)
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.tandem.quantized_linear(torch.randn(2, 32), *q.flat(), torch.empty(0))
    with pytest.raises(RuntimeError, match="8-bit ones none"):
        torch.ops.tandem.quantized_linear(torch.randn(2, 64), q.values, q.scales, q.scales,
                                          torch.empty(0))  # fmt: skip
    with pytest.raises(ValueError, match="rows in 16s"):
        pack(torch.zeros(10, 32, dtype=torch.int8), torch.ones(10, 1), None, "int8")
    four_bit = random_weight("4-bit f16", 16, 64)
    bytes_in_rows = four_bit.values.view(torch.uint8).reshape(1, 2, 16, 16)
    with pytest.raises(RuntimeError, match=r"values must be \[groups, blocks, 4 or 8, 64\]"):
        torch.ops.tandem.quantized_linear(torch.randn(2, 64), bytes_in_rows,
                                          *four_bit.flat()[1:], torch.empty(0))  # fmt: skip
    quads = for_int8_activations(four_bit)
    with pytest.raises(RuntimeError, match=r"values must be \[groups, blocks, 4 or 8, 64\]"):
        torch.ops.tandem.quantized_linear(torch.randn(2, 64), quads.values[:, :, :3].contiguous(),
                                          *quads.flat()[1:], torch.empty(0))  # fmt: skip
    eight_bit_as_uint8 = for_int8_activations(q).values.view(torch.uint8)
    with pytest.raises(RuntimeError, match="quads are int8 for 8-bit codes, uint8 for 4-bit"):
        torch.ops.tandem.quantized_linear(torch.randn(2, 64), eight_bit_as_uint8, *q.flat()[1:],
                                          torch.empty(0))  # fmt: skip


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


# Each type and the wider layouts that hold it (a fused layer's parts in several formats).
WIDER = [("Q8_0", "Q6_K"), ("Q5_0", "Q6_K"), ("Q4_0", "Q4_1"), ("Q4_0", "Q4_K"), ("Q4_1", "Q4_K")]


@pytest.mark.parametrize("tensor_type, layout", WIDER)
def test_gguf_blocks_in_a_wider_layout_are_gguf_s_own_weights(tensor_type, layout):
    """Split into a layout that holds it, a type's blocks still give gguf's weights exactly
    (Q4_0's offsets then stored), and the kernel multiplies them as the dequantized weight."""
    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((32, 512)) * rng.uniform(0.01, 2, (32, 1))).astype(np.float32)
    data = quantize(weight, tensor_type)
    parts = split_blocks(data, tensor_type, weight.shape[1], layout)
    as_torch = [None if t is None else torch.from_numpy(np.array(t)) for t in parts]
    q = pack(*as_torch, f"{tensor_type} as {layout}", keep_offsets=True)
    assert q.scale_cols == (16 if layout == "Q6_K" else 32)
    assert (q.offsets is None) == (layout == "Q6_K")
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[tensor_type])
    assert torch.equal(dequantize(q), torch.from_numpy(expected.astype(np.float32)))
    x = torch.randn(3, 512)
    reference = x.double() @ dequantize(q).double().T
    scale = reference.abs().max().item()
    assert (quantized_linear(x, q).double() - reference).abs().max().item() <= 1e-5 * scale


def test_a_fused_layer_s_parts_run_in_the_widest_of_their_layouts():
    assert common_layout(["Q8_0", "Q6_K", "Q8_0"]) == "Q6_K"
    assert common_layout(["Q4_0", "Q4_1"]) == "Q4_1"
    assert common_layout(["Q4_1", "Q4_K", "Q4_0"]) == "Q4_K"
    assert common_layout(["Q8_0"]) == "Q8_0"
    # 4-bit and 8-bit codes, or a part run as float: none.
    assert common_layout(["Q8_0", "Q4_K"]) is None and common_layout(["Q6_K", None]) is None
    assert GGUF_LAYOUTS["Q5_0"] == "Q8_0"  # its codes q - 16 are int8 codes with Q8_0's scale
    data = quantize(np.ones((16, 256), np.float32), "Q6_K")
    with pytest.raises(ValueError, match="does not run in Q8_0's layout"):
        split_blocks(data, "Q6_K", 256, "Q8_0")
    with pytest.raises(ValueError, match="not one of the natively run types"):
        split_blocks(data, "Q5_1", 256)


# A GGUF whose fused layers have parts in several formats: layer 0's q, k, v (Q5_0, Q8_0, Q6_K)
# run in Q6_K's layout, layer 1's (Q4_K beside 8-bit codes) as float32; gate and up (Q4_0, Q4_1)
# in Q4_1's.
MIXED_TYPES = {
    "blk.1.attn_v.weight": "Q4_K", "blk.*.attn_q.weight": "Q5_0", "blk.*.attn_v.weight": "Q6_K",
    "blk.*.ffn_gate.weight": "Q4_0", "blk.*.ffn_up.weight": "Q4_1",
    "blk.*.attn_output.weight": "Q5_0", "blk.*.ffn_down.weight": "Q6_K",
}  # fmt: skip


def test_layers_fused_from_parts_in_several_formats_are_the_dequantized_model(
    untied_folder, tmp_path
):
    """Each quantized layer's weights are the dequantized load's bit for bit, and greedy tokens
    are the dequantized model's."""
    path = write_gguf(untied_folder, tmp_path / "mixed.gguf", "Q8_0", types=MIXED_TYPES)
    cpu = torch.device("cpu")
    native = load_model(path, torch.float32, cpu).model
    dequantized = load_model(path, torch.float32, cpu, quantization="none").model
    sources = {}
    for name, module in native.named_modules():
        if isinstance(module, Linear) and module.quantized is not None:
            sources[name] = set(module.quantized.source.split(" + "))
            expected = dequantized.get_submodule(name).weight
            assert torch.equal(dequantize(module.quantized), expected), name
    assert sources["layers.0.attn.qkv"] == {"Q5_0 as Q6_K", "Q8_0 as Q6_K", "Q6_K"}
    assert "layers.1.attn.qkv" not in sources  # float32
    assert sources["layers.1.mlp.gate_up"] == {"Q4_0 as Q4_1", "Q4_1"}
    assert sources["layers.1.attn.o"] == {"Q5_0 as Q8_0"}
    assert sources["layers.1.mlp.down"] == {"Q6_K"}
    options = {"max_model_len": 128, "num_kv_blocks": 64, "cpu_threads": 1}
    tokens = []
    for quantization in (None, "none"):
        llm = LLM(str(path), quantization=quantization, **options)
        tokens.append([o.token_ids for o in llm.generate(PROMPTS, greedy(12))])
        llm.close()
    assert tokens[0] == tokens[1]


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
    options = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 128,
               "cpu_threads": usable_cores()}  # fmt: skip
    reference = LLM(str(rounded), **options)
    expected = [o.token_ids for o in reference.generate(PROMPTS, greedy(16))]
    reference.close()
    for async_scheduling in (True, False):
        llm = LLM(str(untied_folder), quantization="int8", async_scheduling=async_scheduling,
                  **options)  # fmt: skip
        layers = llm.engine.runner.model.layers
        assert all(layer.attn.qkv.quantized.source == "int8" for layer in layers)
        assert layers[0].mlp.down.weight.numel() == 0  # no float copy kept
        assert layers[0].mlp.down.quantized.scales.grad_fn is None  # nor a graph holding one
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy(16))]
        llm.close()
        assert got == expected, async_scheduling


def test_int8_quantizes_tied_logits_and_keeps_the_lookup(tmp_path):
    folder = tiny_hf_folder(tmp_path / "tied", "LlamaForCausalLM", tie_word_embeddings=True)
    llm = LLM(str(folder), quantization="int8", device="cpu", num_kv_blocks=64, max_model_len=64,
              cpu_threads=usable_cores())  # fmt: skip
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


@pytest.mark.parametrize(
    "quantization, int8_activations", [(None, False), ("int8", False), (None, True)]
)
def test_two_ranks_run_their_quantized_shards_as_one(tmp_path, quantization, int8_activations):
    """Q4_K blocks from a GGUF (each rank its rows and blocks of columns), int8 (a row-parallel
    rank rounds with its rows' whole largest value), and Q4_K with int8 activations (a rank
    rounds its columns' blocks of x as one rank does): two ranks give one rank's tokens."""
    folder = tiny_hf_folder(tmp_path / "hf", "LlamaForCausalLM", tie_word_embeddings=True)
    path = folder if quantization else write_gguf(folder, tmp_path / "m.gguf", "Q4_K")
    tokens = {}
    for size in (1, 2):
        llm = LLM(str(path), quantization=quantization, int8_activations=int8_activations,
                  device="cpu", num_kv_blocks=64, max_model_len=128, tensor_parallel_size=size,
                  cpu_threads=1)  # fmt: skip
        described = llm.engine.execution.describe()
        assert ("int8" if quantization else "Q4_K") in described
        assert ("with int8 activations" in described) == int8_activations
        tokens[size] = [o.token_ids for o in llm.generate(PROMPTS, greedy(12))]
        llm.close()
    assert tokens[1] == tokens[2]


def round_linear_inputs(model: torch.nn.Module) -> None:
    """Every nn.Linear of a transformers model takes its input rounded as the kernels round
    activations (per row and block of 32, to int8 steps): the float model whose products equal
    int8 activations' integer ones."""

    def rounded(module, inputs):
        x = inputs[0]
        flat = x.reshape(-1, x.shape[-1]).float()
        codes, steps, _ = quantize_activations(flat)
        blocks = codes.float().view(flat.shape[0], -1, 32) * steps[..., None]
        return (blocks.view(x.shape).to(x.dtype),)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(rounded)


@pytest.mark.parametrize(
    "tensor_type, tied", [("Q8_0", False), ("Q4_0", True), ("Q4_1", False), ("Q6_K", True)]
)
def test_int8_activations_generate_the_rounded_activations_model(tmp_path, tensor_type, tied):
    """int8_activations on a GGUF's blocks: greedy tokens are transformers' on the same file with
    every linear layer's input rounded to int8 per block of 32, in both loops (following the
    engine where the reference's top two logits are closer than a rounding flip moves them)."""
    from transformers import AutoModelForCausalLM

    folder = tiny_hf_folder(tmp_path / "hf", "LlamaForCausalLM", tie_word_embeddings=tied)
    path = write_gguf(folder, tmp_path / "model.gguf", tensor_type)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    round_linear_inputs(reference)

    def continuation(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)  # fmt: skip
        return out[0, len(prompt) :].tolist()

    def logits_after(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return reference(torch.tensor([prompt])).logits[0, -1]

    for async_scheduling in (True, False):
        llm = LLM(str(path), int8_activations=True, async_scheduling=async_scheduling,
                  max_model_len=128, num_kv_blocks=64, cpu_threads=1)  # fmt: skip
        formats = llm.engine.execution.describe()
        assert f"{tensor_type} with int8 activations" in formats and "float32" not in formats
        got = [o.token_ids for o in llm.generate(PROMPTS, greedy(16))]
        llm.close()
        for prompt, tokens in zip(PROMPTS, got, strict=True):
            expected = follow_near_ties(
                tokens, 16, lambda prefix, n, p=prompt: continuation(p + prefix, n),
                lambda prefix, p=prompt: logits_after(p + prefix), bound=1e-3,
            )  # fmt: skip
            assert tokens == expected, (async_scheduling, prompt)


def test_int8_activations_run_int8_weights_and_are_refused_without_quantized_layers(
    untied_folder,
):
    options = {"device": "cpu", "num_kv_blocks": 64, "max_model_len": 64,
               "cpu_threads": usable_cores()}  # fmt: skip
    llm = LLM(str(untied_folder), quantization="int8", int8_activations=True, **options)
    assert "int8 with int8 activations" in llm.engine.execution.describe()
    assert len(llm.generate(PROMPTS, greedy(4))[0].token_ids) == 4
    llm.close()
    with pytest.raises(ValueError, match="int8_activations needs quantized linear layers"):
        LLM(str(untied_folder), int8_activations=True, **options)
    for bad in ({"enforce_eager": True}, {"quantization": "none"}, {"dtype": "bfloat16"}):
        with pytest.raises(ValueError, match="int8_activations runs quantized layers"):
            LLM(str(untied_folder), int8_activations=True, **options, **bad)
