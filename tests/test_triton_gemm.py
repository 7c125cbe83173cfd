"""The few-rows Triton GEMM (decode steps on CUDA, opt-in) against torch, in Triton's interpreter.

The interpreter multiplies in float32 (a GPU's tensor cores too accumulate in fp32) and casts to
bf16 by truncating: results are compared with a float32 product of the same inputs rounded to
the dtype, within one ulp of it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.execution.fast_path import ExecutionPlan
from tandem.models.loader import load_model
from tandem.ops import triton_gemm
from tandem.ops.fp8 import Fp8Gemm, fp8_linear, fp8_product, quantize_fp8, to_fp8
from tandem.ops.linear import FewRowsGemm, Linear
from tandem.ops.triton_gemm import GemmConfig, few_rows_linear, scaled_few_rows

from conftest import random_prompts
from helpers import prefill_then_decode_logits

SMALL = GemmConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)  # tiles the tests cross


def _product(x, weight, bias=None) -> torch.Tensor:
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(1, 48, 64), (5, 40, 96), (16, 64, 80), (33, 16, 32), (64, 24, 40)],
)  # N and K off the tiles (masked columns and K tails), rows up to MAX_ROWS
def test_few_rows_gemm_matches_a_float_product(dtype, rows, n, k) -> None:
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    for b in (None, bias):
        out = few_rows_linear(x, weight, b, SMALL)
        assert out.shape == (rows, n) and out.dtype == dtype
        ref = _product(x, weight, b)
        ulp = torch.finfo(dtype).eps
        torch.testing.assert_close(out.float(), ref, rtol=2 * ulp, atol=2 * ulp)


def test_strided_input_rows_and_the_default_config() -> None:
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4, 2 * 512, generator=g).to(torch.bfloat16)
    x = wide[:, :512]  # rows 1024 apart: a view of a fused projection's output
    weight = (torch.randn(64, 512, generator=g) / 512**0.5).to(torch.bfloat16)
    out = few_rows_linear(x, weight)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(out.float(), _product(x, weight), rtol=2 * eps, atol=2 * eps)


def test_what_it_does_not_take_is_refused_by_name() -> None:
    weight = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert triton_gemm.handles(torch.zeros(64, 16, dtype=torch.bfloat16), weight)
    assert not triton_gemm.handles(torch.zeros(65, 16, dtype=torch.bfloat16), weight)
    assert not triton_gemm.handles(torch.zeros(2, 16), weight.float())  # fp32
    assert not triton_gemm.handles(torch.zeros(2, 16, dtype=torch.float16), weight)
    with pytest.raises(ValueError, match="at most 64 rows"):
        few_rows_linear(torch.zeros(65, 16, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match="weight row contiguously"):
        few_rows_linear(torch.zeros(2, 8, dtype=torch.bfloat16), weight.T)
    assert few_rows_linear(torch.zeros(0, 16, dtype=torch.bfloat16), weight).shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 24, 64), (5, 40, 96), (33, 8, 32), (64, 20, 40)])
def test_gated_gemm_is_silu_and_mul_of_the_gemm_bit_for_bit(dtype, rows, n, k) -> None:
    """The gate/up GEMM that ends in SiLU(gate) * up: the SiLU kernel's output over the
    GEMM's, bit for bit (the same roundings, without the [M, 2N] product in memory)."""
    from tandem.ops.triton_elementwise import silu_and_mul

    g = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    weight = (torch.randn(2 * n, k, generator=g) / k**0.5).to(dtype)
    out = triton_gemm.gated_few_rows(x, weight, SMALL)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert torch.equal(out, silu_and_mul(few_rows_linear(x, weight, None, SMALL)))
    with pytest.raises(ValueError, match="even rows"):
        triton_gemm.gated_few_rows(x, weight[:-1], SMALL)


def _fp8_inputs(rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 3
    codes, scales = to_fp8(x, x.abs().amax(dim=1, keepdim=True))
    return x, codes, scales, quantize_fp8(torch.randn(n, k, generator=g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 48, 64), (5, 40, 96), (33, 16, 32), (64, 24, 80)])
def test_fp8_codes_give_what_scaled_mm_gives(dtype, rows, n, k) -> None:
    """e4m3 rows against an FP8 weight (`scaled_few_rows`): the fp32 sums of code products, times
    x's row scale, times the weight's, in the output dtype: `fp8_product`'s numbers (those of
    `torch._scaled_mm`), but for the order of the sums and the final rounding."""
    _, codes, scales, q = _fp8_inputs(rows, n, k, rows + n + k)
    out = scaled_few_rows(codes, scales, q, dtype, SMALL)
    assert out.shape == (rows, n) and out.dtype == dtype
    ref = fp8_product(codes, scales, q)
    magnitude = (codes.float().abs() * scales) @ (q.codes.float().abs() * q.scales[:, None]).T
    sums = 1e-6 * magnitude  # float32 sums in another order
    rounding = 2 * torch.finfo(dtype).eps * ref.abs()  # the interpreter's casts truncate
    assert ((out.float() - ref).abs() <= sums + rounding).all()


def test_fp8_layers_take_it_at_few_rows_only() -> None:
    """An FP8 weight given the GEMM (`Fp8Weight.few_rows`) multiplies up to MAX_ROWS rows
    with it, bias after, and more rows as before (`fp8_product` on a CPU)."""
    x, _, _, q = _fp8_inputs(65, 32, 64, 1)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(2))
    before = fp8_linear(x, q, bias)
    calls = []

    def counted(codes, scales, weight, out_dtype):
        calls.append(codes.shape[0])
        return scaled_few_rows(codes, scales, weight, out_dtype, SMALL)

    q.few_rows = Fp8Gemm(triton_gemm.handles_codes, counted)
    assert torch.equal(fp8_linear(x, q, bias), before) and not calls  # 65 rows: not taken
    few = fp8_linear(x[:3].view(3, 1, 64), q, bias)
    assert calls == [3] and few.shape == (3, 1, 32)
    torch.testing.assert_close(few.view(3, 32), before[:3], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="e4m3 rows"):
        scaled_few_rows(x[:3], torch.ones(3, 1), q, torch.float32)


def test_model_with_the_few_rows_gemm_matches_the_default_gemm(tiny_checkpoints) -> None:
    """A bf16 model (Qwen2: biases on q, k, v) whose linear layers take the Triton GEMM at few
    rows: a prefill of more than MAX_ROWS tokens keeps the default GEMM (the same logits), the
    decode row goes through the kernel: its logits are as near the float32 model's as the
    default GEMM's are (the interpreter's bf16 casts truncate, so both are some way off). The
    same with the gate/up GEMM ending in SiLU(gate) * up (`FewRowsGemm.gated`): one launch per
    MLP instead of the GEMM and the SiLU."""
    path = tiny_checkpoints["Qwen2ForCausalLM"]
    logits, calls, gated_calls = {}, [], []

    def counted(x, weight, bias=None):
        calls.append(x.shape[0])
        return few_rows_linear(x, weight, bias)

    def gated(x, weight):
        gated_calls.append(x.shape[0])
        return triton_gemm.gated_few_rows(x, weight)

    for name in ("float32", "default", "few rows", "gated"):
        dtype = torch.float32 if name == "float32" else torch.bfloat16
        model = load_model(path, dtype, torch.device("cpu")).model
        prompt = random_prompts(random.Random(5), 1, model.spec.vocab_size, 80, 80)[0]
        if name in ("few rows", "gated"):
            linears = [m for m in model.modules() if isinstance(m, Linear)]
            gemm = FewRowsGemm(triton_gemm.handles, counted, gated if name == "gated" else None)
            assert model.use_few_rows_gemm(gemm) == len(linears) > 0
        logits[name] = prefill_then_decode_logits(model, prompt)
    assert calls and set(calls) == {1}  # the decode row only
    assert gated_calls == [1] * model.spec.num_layers  # each MLP's gate/up, the decode row
    for name in ("few rows", "gated"):
        assert torch.equal(logits[name][:-1], logits["default"][:-1])
    exact = logits["float32"][-1]
    error = {
        name: (logits[name][-1] - exact).abs().max().item()
        for name in ("default", "few rows", "gated")
    }
    assert 0 < error["few rows"] < 2 * error["default"], error
    assert 0 < error["gated"] < 2 * error["default"], error


def test_fp8_model_with_the_few_rows_gemm_matches_the_default_product(tiny_checkpoints) -> None:
    """An FP8 model (`quantization="fp8"`) whose FP8 layers take the kernel at few rows: the
    prefill of more than MAX_ROWS tokens keeps `fp8_product` (the same logits), the decode row's
    products are the kernel's, the same sums in another order."""
    path = tiny_checkpoints["LlamaForCausalLM"]
    logits, calls = {}, []

    def counted(codes, scales, weight, out_dtype):
        calls.append(codes.shape[0])
        return scaled_few_rows(codes, scales, weight, out_dtype)

    for name in ("default", "few rows"):
        model = load_model(path, torch.float32, torch.device("cpu"), quantization="fp8").model
        prompt = random_prompts(random.Random(5), 1, model.spec.vocab_size, 80, 80)[0]
        if name == "few rows":
            assert model.use_fp8_few_rows_gemm(Fp8Gemm(triton_gemm.handles_codes, counted)) > 0
        logits[name] = prefill_then_decode_logits(model, prompt)
    assert calls and set(calls) == {1}  # the decode row only
    assert torch.equal(logits["few rows"][:-1], logits["default"][:-1])
    torch.testing.assert_close(logits["few rows"][-1], logits["default"][-1], rtol=0, atol=1e-4)


def test_the_check_script_runs_on_a_cpu(tmp_path) -> None:
    """benchmarks/triton_gemm_check.py runs rarely, on a GPU: its --cpu-dry-run (the
    interpreter, tiny shapes) keeps it working, JSON included, bf16 and FP8; the step's pick
    names a config."""
    out = tmp_path / "gemm.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "triton_gemm_check.py"
    done = subprocess.run([sys.executable, str(script), "--cpu-dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {r["gemm"] for r in results["rows"]} == {"qkv", "down"}
    for row in results["rows"]:
        assert row["best_us"] > 0 and row["triton_max_error"] < 0.05
    assert set(results["step"]["best_config"]) == {"block_n", "block_k", "num_warps", "num_stages"}
    assert "a decode step's GEMMs at 5 rows" in done.stdout
    assert {(r["gemm"], r["rows"]) for r in results["fp8_rows"]} == {
        (gemm, rows) for gemm in ("qkv", "down") for rows in (1, 5)
    }
    for row in results["fp8_rows"]:
        assert row["best_us"] > 0 and row["triton_max_error"] < 0.05
    assert results["fp8_step"]["bf16_cublas_us"] == results["step"]["cublas_us"]


def test_the_plan_names_the_few_rows_gemm() -> None:
    plan = ExecutionPlan("fused-triton", False, None, few_rows_gemm=triton_gemm.MAX_ROWS)
    assert plan.describe().startswith("fused-triton ops, Triton GEMMs up to 64 rows, default GEMMs")
    assert "default GEMMs" in ExecutionPlan("fused-triton", False, None).describe()
