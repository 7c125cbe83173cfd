"""FP8 weights (`quantization="fp8"`): the rounding of weights and activations, the CPU's product
against PyTorch's own `_scaled_mm` (the op CUDA runs), the engine against transformers with the
same rounding, tensor-parallel shards, and the refusals."""

from __future__ import annotations

import functools

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.ops.fp8 import FP8_MAX, dequantize_fp8, fp8_linear, fp8_product, quantize_fp8, to_fp8

from gguf_files import tiny_hf_folder
from helpers import greedy

PROMPTS = [[1, 523, 88, 901, 17], [1, 40, 41, 42], [1, 1500, 3, 3, 3, 3, 9]]
E4M3_HALF_STEP = 2.0**-4  # relative rounding of a normal e4m3 value (3 mantissa bits)
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # absolute, below 2^-6, in units of the scale


def test_weights_round_per_row_to_e4m3():
    w = torch.randn(32, 64) * torch.linspace(0.01, 3, 32)[:, None]
    w[3] = 0  # an all-zero row stays zero
    q = quantize_fp8(w)
    assert q.codes.dtype == torch.float8_e4m3fn and q.scales.shape == (32,)
    assert (q.codes.float().abs().amax(dim=1)[w.abs().amax(dim=1) > 0] == FP8_MAX).all()
    error = (dequantize_fp8(q) - w).abs()
    bound = torch.maximum(w.abs() * E4M3_HALF_STEP, q.scales[:, None] * E4M3_SUBNORMAL_HALF_STEP)
    assert (error <= bound * (1 + 1e-6)).all()
    assert dequantize_fp8(q)[3].eq(0).all()


def test_a_row_parallel_shard_rounds_as_the_whole_row():
    w = torch.randn(48, 128)
    whole = quantize_fp8(w)
    shard = quantize_fp8(w[:, 64:], row_absmax=w.abs().amax(dim=1))
    assert torch.equal(shard.scales, whole.scales)
    assert torch.equal(shard.codes.float(), whole.codes[:, 64:].float())


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_the_cpu_product_is_pytorch_s_scaled_mm(rows):
    """fp8_linear on a CPU multiplies the e4m3 codes in float32: the numbers torch._scaled_mm gives
    (its CPU implementation, the op CUDA runs on tensor cores), but for the order of the sums."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g) * 3
    q = quantize_fp8(torch.randn(64, 96, generator=g))
    bias = torch.randn(64, generator=g)
    codes, scales = to_fp8(x, x.abs().amax(dim=1, keepdim=True))
    expected = torch._scaled_mm(codes, q.codes.t(), scale_a=scales, scale_b=q.scales.view(1, -1),
                                out_dtype=torch.float32)  # fmt: skip
    # float32 sums in another order: within a few units of the last place of the sum of |terms|
    magnitude = (codes.float().abs() * scales) @ (q.codes.float().abs() * q.scales[:, None]).T
    tolerance = 1e-6 * magnitude.max()
    assert (fp8_product(codes, scales, q) - expected).abs().max() <= tolerance
    got = fp8_linear(x.view(rows, 1, 96), q, bias)
    assert got.shape == (rows, 1, 64)
    assert (got.view(rows, 64) - (expected + bias)).abs().max() <= tolerance
    exact = x.double() @ dequantize_fp8(q).double().T + bias.double()
    assert (got.view(rows, 64).double() - exact).abs().max() < 0.1 * exact.abs().max()


def reference_logprobs(
    folder, prompts, round_weights: bool, round_inputs: bool, ranks: int = 1
) -> torch.Tensor:
    """transformers' prompt logprobs, with the decoder's nn.Linear weights rounded per row to
    e4m3 and their inputs rounded per row to e4m3 (each on request): with both, the float model
    whose products are the FP8 GEMMs' (the logits' weight stays float32, as in the engine).
    Under tensor parallelism (`ranks`) a row-parallel layer's input (o_proj's, down_proj's) is
    rounded per rank's share of each row, as each rank rounds the columns it holds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def rounded(module, inputs, shares=1):
        x = inputs[0]
        flat = x.reshape(-1, shares, x.shape[-1] // shares).float()
        codes, scales = to_fp8(flat, flat.abs().amax(dim=-1, keepdim=True))
        return ((codes.float() * scales).view(x.shape).to(x.dtype),)

    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            if round_weights:
                module.weight.data = dequantize_fp8(quantize_fp8(module.weight.data))
            if round_inputs:
                shares = ranks if name.endswith(("o_proj", "down_proj")) else 1
                module.register_forward_pre_hook(functools.partial(rounded, shares=shares))
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], dim=-1)
            rows.append(logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0])
    return torch.cat(rows)


def engine_logprobs(llm: LLM, prompts) -> torch.Tensor:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return torch.tensor([lp[t].logprob for o in outputs
                         for t, lp in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)])  # fmt: skip


# The median |difference| of two models' prompt logprobs on `long_prompts`. An input a float32
# rounding away from the midpoint of two e4m3 values rounds either way, so the same model in two
# implementations differs after such a flip (by 0.08 at most, median 0.00-0.014 on this tiny
# model); leaving out a rounding, or rounding other shares of a row, moves the median to 0.11-0.2.
SAME_MODEL, OTHER_MODEL = 0.03, 0.08


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().median().item()


def long_prompts(count: int = 4, length: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1, *torch.randint(3, 2000, (length,), generator=g).tolist()] for _ in range(count)]


def test_fp8_runs_the_model_rounded_to_e4m3(tmp_path):
    """quantization="fp8": prompt logprobs are transformers' with the decoder's weights and
    inputs rounded per row to e4m3 (but for rounding flips), not those with either left out."""
    folder = tiny_hf_folder(tmp_path / "hf", "LlamaForCausalLM")
    prompts = long_prompts()
    llm = LLM(str(folder), quantization="fp8", max_model_len=128, num_kv_blocks=64,
              cpu_threads=1)  # fmt: skip
    model = llm.engine.runner.model
    assert llm.engine.execution.weight_formats == {"fp8": 8, "float32": 1}
    assert not model.has_fused_forward  # the one-call CPU forward has no FP8 GEMM
    assert model.layers[0].mlp.down.weight.numel() == 0  # no float copy kept
    assert model.layers[0].mlp.down.quantized.scales.grad_fn is None  # nor a graph holding one
    got = engine_logprobs(llm, prompts)
    async_tokens = [o.token_ids for o in llm.generate(PROMPTS, greedy(16))]
    llm.close()
    assert distance(got, reference_logprobs(folder, prompts, True, True)) < SAME_MODEL
    for partial in ((True, False), (False, True), (False, False)):
        assert distance(got, reference_logprobs(folder, prompts, *partial)) > OTHER_MODEL, partial
    sync = LLM(str(folder), quantization="fp8", async_scheduling=False, max_model_len=128,
               num_kv_blocks=64, cpu_threads=1)  # fmt: skip
    assert [o.token_ids for o in sync.generate(PROMPTS, greedy(16))] == async_tokens
    sync.close()


def test_two_ranks_round_their_shards_of_the_rows(tmp_path):
    """Two ranks: each rounds its shard of a weight with the whole rows' scales (a row-parallel
    rank's columns included), so the weights are one rank's, and its share of a row-parallel
    layer's input with that share's own scale (no collective per GEMM, as in vLLM)."""
    folder = tiny_hf_folder(tmp_path / "hf", "LlamaForCausalLM", tie_word_embeddings=True)
    prompts = long_prompts()
    llm = LLM(str(folder), quantization="fp8", device="cpu", num_kv_blocks=64, max_model_len=128,
              tensor_parallel_size=2, cpu_threads=1)  # fmt: skip
    assert "fp8" in llm.engine.execution.describe()
    got = engine_logprobs(llm, prompts)
    llm.close()
    assert distance(got, reference_logprobs(folder, prompts, True, True, ranks=2)) < SAME_MODEL
    assert distance(got, reference_logprobs(folder, prompts, True, True, ranks=1)) > OTHER_MODEL


def test_fp8_is_refused_where_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="int8_activations runs quantized layers"):
        EngineConfig(device="cpu", quantization="fp8", int8_activations=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="computes in bfloat16"):
        EngineConfig(device="cuda", quantization="fp8", dtype="float16")
    with pytest.raises(ValueError, match=r"capability 8\.9 or higher\); this GPU has 8\.0"):
        EngineConfig(device="cuda", quantization="fp8", dtype="bfloat16")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert EngineConfig(device="cuda", quantization="fp8").quantization == "fp8"
