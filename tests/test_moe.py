"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE): the block equals transformers'
for its routing and its grouped experts; greedy output and (prompt) logprobs equal transformers'
on every schedule, in both loops, on the CPU fast path and eager; two ranks equal one; a GGUF
written like llama.cpp's loads as its safetensors; Qwen3-30B-A3B's shapes build as dummy weights.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from test_logprobs import check_against_hf

from tandem import LLM, SamplingParams
from tandem.models.default_model import build_checkpoint
from tandem.models.dummy import dummy_tensors
from tandem.models.gguf_blocks import LAYOUTS as GGUF_LAYOUTS
from tandem.models.llama import LlamaModel
from tandem.models.loader import build_model, load_model, read_config
from tandem.models.moe import PROJECTIONS, Experts, SparseMoE
from tandem.models.parallel import SINGLE, TensorParallel
from tandem.models.spec import checkpoint_shapes
from tandem.ops import elementwise
from tandem.ops.quantized import dequantize, quantize_int8
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from conftest import (
    _load_hf_model,
    follow_near_ties,
    hf_greedy_reference_allowing_near_ties,
    random_prompts,
)
from gguf_files import tiny_hf_folder, write_gguf
from helpers import assert_idle_and_balanced, greedy, make_llm, prefill_then_decode_logits

CPU = torch.device("cpu")
MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
OPTIONS = {"cpu_threads": 1, "num_kv_blocks": 256, "max_model_len": 512}
VOCAB = 500
MODELS_DIR = Path(__file__).parents[1] / "tandem" / "bench" / "models"


@pytest.fixture(scope="module")
def more_shapes(tmp_path_factory) -> dict[str, Path]:
    """Shapes beyond conftest's: Qwen3-MoE with decoder_sparse_step=2 (layers 1 and 3 sparse),
    MQA, top-3 of 7 unnormalised (more than two terms per token: their order of summation
    shows); Qwen3-MoE sparse in every layer (as llama.cpp's qwen3moe); Mixtral top-1 of 5 with
    tied embeddings."""
    root = tmp_path_factory.mktemp("moe-shapes")
    return {
        "qwen3-moe-step2-top3": build_checkpoint(
            root / "qwen3-moe-step2", "Qwen3MoeForCausalLM", num_hidden_layers=4,
            num_key_value_heads=1, tokenizer_vocab_size=VOCAB,
            extra_config={"num_experts": 7, "num_experts_per_tok": 3, "norm_topk_prob": False,
                          "moe_intermediate_size": 32, "decoder_sparse_step": 2},
        ),
        "qwen3-moe-all-sparse": build_checkpoint(
            root / "qwen3-moe-all", "Qwen3MoeForCausalLM", head_dim=32,
            tokenizer_vocab_size=VOCAB,
            extra_config={"num_experts": 5, "num_experts_per_tok": 2, "norm_topk_prob": True,
                          "moe_intermediate_size": 32},
        ),
        "mixtral-top1": build_checkpoint(
            root / "mixtral-top1", "MixtralForCausalLM", tokenizer_vocab_size=VOCAB,
            tie_word_embeddings=True,
            extra_config={"num_local_experts": 5, "num_experts_per_tok": 1},
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def moe_models(tiny_checkpoints, more_shapes) -> dict[str, Path]:
    return {arch: tiny_checkpoints[arch] for arch in MOE} | more_shapes


def _vocab(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


# ------------------------------------------------------------------------------- the block
@pytest.mark.parametrize("name", [*MOE, "qwen3-moe-step2-top3", "mixtral-top1"])
def test_sparse_layers_and_the_block_equal_transformers(moe_models, name, monkeypatch):
    """The same layers are sparse, and each sparse block's output (routing, grouped experts,
    shared expert) equals transformers' eager and default (grouped_mm) implementations; so does
    the block through the sync-free path that CUDA takes."""
    path = moe_models[name]
    ours = load_model(path, torch.float32, CPU).model
    hf = _load_hf_model(str(path))
    sparse = [i for i, layer in enumerate(ours.layers) if isinstance(layer.mlp, SparseMoE)]
    hf_sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse == hf_sparse and sparse
    x = torch.randn(37, ours.spec.hidden_size, generator=torch.Generator().manual_seed(1))
    for i in sparse:
        with torch.no_grad():
            got = ours.layers[i].mlp(x, elementwise)
            for implementation in ("eager", "grouped_mm"):
                hf.config._experts_implementation = implementation
                want = hf.model.layers[i].mlp(x[None])[0]
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    hf.config._experts_implementation = "grouped_mm"
    monkeypatch.setattr("tandem.models.moe.grouped_mm_runs", lambda x: True)
    for i in sparse:
        with torch.no_grad():
            want = hf.model.layers[i].mlp(x[None])[0]
            torch.testing.assert_close(ours.layers[i].mlp(x, elementwise), want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", [*MOE, "qwen3-moe-step2-top3", "mixtral-top1"])
def test_greedy_and_logprobs_equal_transformers(moe_models, name, async_scheduling):
    """Chunked prefill (a 32-token budget) shares steps with decodes; some requests ask for
    logprobs and prompt logprobs, which equal transformers' log_softmax within 1e-4."""
    path = moe_models[name]
    rng = random.Random(len(name))
    prompts = random_prompts(rng, 6, _vocab(path), 2, 60)
    params = [
        greedy(rng.randint(4, 12), logprobs=rng.choice([None, 3]),
               prompt_logprobs=rng.choice([None, 2]))
        for _ in prompts
    ]  # fmt: skip
    llm = make_llm(path, async_scheduling=async_scheduling, max_num_batched_tokens=32, **OPTIONS)
    assert llm.engine.execution.packed_gemm  # the fast path: packed experts
    # The one-call forward (Qwen2-MoE's shared expert in it too).
    assert llm.engine.runner.model._fused_weights is not None
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
    # The panels are the experts' weights: no stacked float copy beside them.
    assert experts and all(e.gate_up.shape[-1] == e.down.shape[-1] == 0 for e in experts)
    outputs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        tokens = out.token_ids
        assert tokens == hf_greedy_reference_allowing_near_ties(path, prompt, tokens, p.max_tokens)
        check_against_hf(path, prompt, out, p)
    assert_idle_and_balanced(llm.engine)


@pytest.mark.parametrize("arch", MOE)
def test_eager_equals_transformers_and_the_fast_path(moe_models, arch):
    path = moe_models[arch]
    prompts = random_prompts(random.Random(2), 5, _vocab(path), 2, 50)
    params = greedy(10, logprobs=2)
    runs = {}
    for eager in (True, False):
        llm = make_llm(path, enforce_eager=eager, **OPTIONS)
        assert llm.engine.execution.packed_gemm == (not eager)
        runs[eager] = llm.generate(prompts, params)
    for prompt, a, b in zip(prompts, runs[True], runs[False], strict=True):
        assert a.token_ids == hf_greedy_reference_allowing_near_ties(path, prompt, a.token_ids, 10)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            common = x.keys() & y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in common)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prefix_caching_preemption_n_and_penalties(moe_models, async_scheduling):
    """Qwen3-MoE with dense and sparse layers: prompts sharing a prefix, so few KV blocks that
    requests are preempted and recomputed, n > 1 and penalties; greedy equals transformers, and
    seeded sampling equals the other loop's."""
    path = moe_models["Qwen3MoeForCausalLM"]
    rng = random.Random(5)
    shared = random_prompts(rng, 1, _vocab(path), 40, 40)[0]
    prompts = [shared + tail for tail in random_prompts(rng, 8, _vocab(path), 1, 30)]
    params = [greedy(16)] * 4 + [
        SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, seed=2, presence_penalty=0.5,
                       repetition_penalty=1.3, logprobs=2, ignore_eos=True),
    ] + [greedy(16, frequency_penalty=0.4, logprobs=1)] * 2  # fmt: skip
    options = {"block_size": 8, "num_kv_blocks": 24, "max_num_batched_tokens": 48,
               "cpu_threads": 1, "async_scheduling": async_scheduling}  # fmt: skip
    llm = make_llm(path, **options)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.stats.hit_tokens > 0
    assert_idle_and_balanced(llm.engine)
    for prompt, out in zip(prompts[:4], outputs[:4], strict=True):
        ref = hf_greedy_reference_allowing_near_ties(path, prompt, out.token_ids, 16)
        assert out.token_ids == ref
    assert len(outputs[4].outputs) == 2
    # The same requests one at a time, with plenty of blocks: the same tokens.
    alone = make_llm(path, cpu_threads=1, async_scheduling=async_scheduling)
    for prompt, p, out in zip(prompts[4:], params[4:], outputs[4:], strict=True):
        single = alone.generate([prompt], p)[0]
        assert [o.token_ids for o in single.outputs] == [o.token_ids for o in out.outputs]


def test_two_ranks_equal_one(moe_models):
    """Qwen2-MoE (experts and a shared expert, each split by its intermediate dimension; the
    router and the shared gate replicated): the same tokens, logprobs within 1e-4."""
    path = moe_models["Qwen2MoeForCausalLM"]
    prompts = random_prompts(random.Random(8), 5, _vocab(path), 2, 40)
    params = [greedy(10, logprobs=3)] * 4 + [
        SamplingParams(max_tokens=10, temperature=0.9, seed=3, n=2, ignore_eos=True)
    ]
    results = {}
    for size in (1, 2):
        llm = make_llm(path, tensor_parallel_size=size, **OPTIONS)
        try:
            results[size] = llm.generate(prompts, params)
        finally:
            llm.close()
    for one, two in zip(results[1], results[2], strict=True):
        assert [o.token_ids for o in one.outputs] == [o.token_ids for o in two.outputs]
        for a, b in zip(one.outputs[0].logprobs or [], two.outputs[0].logprobs or [], strict=True):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a.keys() & b.keys())


# ------------------------------------------------------------------------------- GGUF
@pytest.mark.parametrize("name", ["qwen3-moe-all-sparse", "MixtralForCausalLM"])
def test_gguf_loads_as_its_safetensors(moe_models, name, tmp_path):
    """Written like llama.cpp's converter (arch qwen3moe, or llama with expert_count; experts
    stacked per layer): in F32 the very logits of the safetensors load; in Q8_0 each expert is
    the file's dequantized matrix, and the engine runs the file with its own tokenizer."""
    from gguf_files import read_gguf, write_gguf

    path = moe_models[name]
    safetensors = load_model(path, torch.float32, CPU).model
    prompt = random_prompts(random.Random(4), 1, _vocab(path), 30, 30)[0]
    want = prefill_then_decode_logits(safetensors, prompt)
    f32 = write_gguf(path, tmp_path / "f32" / "model.gguf", "F32")
    loaded = load_model(f32, torch.float32, CPU)
    assert loaded.spec.moe == safetensors.spec.moe
    torch.testing.assert_close(prefill_then_decode_logits(loaded.model, prompt), want)

    q8 = write_gguf(path, tmp_path / "q8" / "model.gguf", "Q8_0")
    _, tensors = read_gguf(q8)
    experts = load_model(q8, torch.float32, CPU).model.layers[1].mlp.experts
    kind, down = tensors["blk.1.ffn_down_exps.weight"]
    assert kind == "Q8_0" and torch.equal(experts.float_weights("down"), torch.from_numpy(down))
    assert tensors["blk.1.ffn_gate_inp.weight"][0] == "F32"  # routers stay F32, as llama.cpp's
    llm = make_llm(q8, **OPTIONS)
    out = llm.generate([prompt], greedy(8))[0]
    assert len(out.token_ids) == 8 and isinstance(llm.generate("Hello", greedy(2))[0].text, str)


@pytest.fixture(scope="module")
def gguf_moe_folders(tmp_path_factory) -> dict[str, Path]:
    """Qwen3-MoE and Mixtral whose every weight's rows fit every block type (hidden and expert
    intermediate 256: K-quants' blocks of 256; 128 per rank at two ranks, whole blocks of 32)."""
    root = tmp_path_factory.mktemp("gguf-moe")
    experts = {"num_experts_per_tok": 2, "num_hidden_layers": 2}
    return {
        "qwen3moe": tiny_hf_folder(
            root / "qwen3moe", "Qwen3MoeForCausalLM", head_dim=64, num_experts=4,
            moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[], **experts,
        ),
        "mixtral": tiny_hf_folder(
            root / "mixtral", "MixtralForCausalLM", num_local_experts=4, intermediate_size=256,
            **experts,
        ),
    }  # fmt: skip


def file_experts(path: Path, layer: int) -> dict[str, torch.Tensor]:
    """A GGUF's experts of one layer as the file's dequantized matrices, stacked per expert as
    Tandem holds them: gate_up [experts, 2 * inter, hidden] (gate rows, then up), down."""
    from gguf_files import read_gguf

    _, tensors = read_gguf(path)
    part = {p: torch.from_numpy(tensors[f"blk.{layer}.ffn_{p}_exps.weight"][1])
            for p in ("gate", "up", "down")}  # fmt: skip
    return {"gate_up": torch.cat([part["gate"], part["up"]], 1), "down": part["down"]}


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q5_K"])
def test_gguf_experts_stay_in_their_blocks(gguf_moe_folders, tmp_path, tensor_type):
    """Every natively run type keeps the experts in its blocks, stacked per projection with no
    float copy, each expert exactly the file's dequantized matrix; Q5_K, which no kernel runs,
    is dequantized (as Q5_K dense layers are). `quantization="none"` dequantizes all."""
    path = write_gguf(gguf_moe_folders["qwen3moe"], tmp_path / "m.gguf", tensor_type)
    want = file_experts(path, 1)
    model = load_model(path, torch.float32, CPU).model
    experts = model.layers[1].mlp.experts
    native = tensor_type != "Q5_K"
    layout = GGUF_LAYOUTS.get(tensor_type)
    source = tensor_type if layout == tensor_type else f"{tensor_type} as {layout}"
    for name in PROJECTIONS:
        assert (name in experts.quantized) == native
        if native:
            assert experts.quantized[name].source == source
            assert getattr(experts, name).shape[-1] == 0  # no float stack beside the blocks
        assert torch.equal(experts.float_weights(name), want[name]), name
    formats = model.weight_formats()
    assert formats[f"{source if native else 'float32'} experts"] == 2 * len(model.layers)
    dequantized = load_model(path, torch.float32, CPU, quantization="none").model
    assert not dequantized.layers[1].mlp.experts.quantized
    assert torch.equal(dequantized.layers[1].mlp.experts.down, want["down"])


def moe_reference_tokens(reference: LLM, model, prompt: list[int], tokens: list[int], n: int):
    """The dequantized model's greedy tokens that `tokens` must equal, following the kernels'
    float rounding where the reference's top two logits are that close."""

    def continuation(prefix: list[int], count: int) -> list[int]:
        out = reference.generate([prompt + prefix], greedy(count))[0]
        return list(out.token_ids)

    def logits_after(prefix: list[int]) -> torch.Tensor:
        return prefill_then_decode_logits(model, prompt + prefix)[-1]

    return follow_near_ties(tokens, n, continuation, logits_after)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch, tensor_type", [("qwen3moe", "Q4_K"), ("mixtral", "Q8_0"),
                                               ("qwen3moe", "Q4_0"), ("mixtral", "Q6_K")])  # fmt: skip
def test_quantized_experts_generate_the_dequantized_model(
    gguf_moe_folders, tmp_path, arch, tensor_type, async_scheduling
):
    """The experts run in their blocks (every expert of a projection in one kernel call): logits
    within float32 rounding of the dequantized model's, and its greedy tokens, in both loops,
    with a prefill sharing steps with decodes."""
    path = write_gguf(gguf_moe_folders[arch], tmp_path / "m.gguf", tensor_type)
    quantized = load_model(path, torch.float32, CPU).model
    quantized.use_fast_path(fused=False)
    dequantized = load_model(path, torch.float32, CPU, quantization="none").model
    prompts = random_prompts(random.Random(3), 4, 2048, 3, 40)
    got = prefill_then_decode_logits(quantized, prompts[0])
    want = prefill_then_decode_logits(dequantized, prompts[0])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    options = {**OPTIONS, "async_scheduling": async_scheduling, "max_num_batched_tokens": 32}
    llm = make_llm(path, **options)
    assert any("experts" in f and "float" not in f for f in llm.engine.execution.weight_formats)
    reference = make_llm(path, quantization="none", **OPTIONS)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(10)), strict=True):
        want = moe_reference_tokens(reference, dequantized, prompt, out.token_ids, 10)
        assert out.token_ids == want
    assert_idle_and_balanced(llm.engine)


def test_two_ranks_hold_and_run_their_slices_of_quantized_experts(gguf_moe_folders, tmp_path):
    """Each rank keeps its rows of gate/up and its blocks of columns of down in Q4_K's blocks:
    put together, the whole model's experts bit for bit; the two ranks generate the one rank's
    tokens."""
    path, spec, hf_config = read_config(
        write_gguf(gguf_moe_folders["qwen3moe"], tmp_path / "m.gguf", "Q4_K")
    )

    def experts(tp: TensorParallel):
        model = build_model(path, spec, hf_config, torch.float32, CPU, None, tp)
        return model.layers[0].mlp.experts

    full, halves = experts(SINGLE), [experts(TensorParallel(rank, 2)) for rank in range(2)]
    assert all(set(e.quantized) == set(PROJECTIONS) for e in [full, *halves])
    inter = spec.moe.intermediate_size
    gate_up = [h.float_weights("gate_up") for h in halves]
    rows = [torch.cat([g[:, : inter // 2] for g in gate_up], 1),
            torch.cat([g[:, inter // 2 :] for g in gate_up], 1)]  # fmt: skip
    assert torch.equal(torch.cat(rows, 1), full.float_weights("gate_up"))
    down = torch.cat([h.float_weights("down") for h in halves], 2)
    assert torch.equal(down, full.float_weights("down"))
    prompts = random_prompts(random.Random(9), 3, 2048, 3, 30)
    results = {}
    for size in (1, 2):
        llm = make_llm(path, tensor_parallel_size=size, **OPTIONS)
        try:
            results[size] = [o.token_ids for o in llm.generate(prompts, greedy(8))]
        finally:
            llm.close()
    assert results[1] == results[2]


def test_int8_quantizes_the_experts(moe_models):
    """`quantization="int8"` covers the experts: each expert's rows per-channel int8 of its
    loaded weights, and the model's logits within float32 rounding of those weights' product."""
    path = moe_models["qwen3-moe-all-sparse"]
    floats = load_model(path, torch.float32, CPU).model
    model = load_model(path, torch.float32, CPU, quantization="int8").model
    layer = next(i for i, x in enumerate(model.layers) if isinstance(x.mlp, SparseMoE))
    experts, original = model.layers[layer].mlp.experts, floats.layers[layer].mlp.experts
    for name in PROJECTIONS:
        assert experts.quantized[name].source == "int8"
        weights = getattr(original, name)
        want = torch.stack([dequantize(quantize_int8(w)) for w in weights])
        assert torch.equal(experts.float_weights(name), want)
        setattr(original, name, torch.nn.Parameter(want))  # floats now hold the int8 weights
    assert "int8 experts" in model.weight_formats()
    model.use_fast_path(fused=False)  # the experts' kernel, every expert in one call
    x = torch.randn(37, model.spec.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model.layers[layer].mlp(x, elementwise)
        want = floats.layers[layer].mlp(x, elementwise)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    llm = make_llm(path, quantization="int8", **OPTIONS)
    assert len(llm.generate([[5, 6, 7]], greedy(4))[0].token_ids) == 4


# Loads a model in a fresh process, generates 4 tokens, and prints its resident memory before
# loading and its peak after, in KiB (Linux's /proc/self/status).
PEAK_SCRIPT = """
import sys
from tandem import LLM, SamplingParams

def kib(key):
    return int(next(x for x in open("/proc/self/status") if x.startswith(key)).split()[1])

before = kib("VmRSS:")
llm = LLM(sys.argv[1], cpu_threads=2, num_kv_blocks=16, max_model_len=64)
params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
assert len(llm.generate([[1, 2, 3]], params)[0].token_ids) == 4
print(before, kib("VmHWM:"), llm.engine.execution.weight_formats)
"""


def random_moe_gguf(shape: dict) -> Path:
    """`write_random_gguf`'s Q8_0 file of Qwen3-30B-A3B's config with `shape` (0.77 GB, seconds
    to write), kept in Tandem's cache under a hash of everything it is made from: the writer's
    source, gguf's and numpy's versions, the config, the shape and the tokenizer's file."""
    import hashlib
    import inspect
    import os
    from importlib.metadata import version

    from tandem.bench import random_gguf
    from tandem.models.catalog import PACKAGED_MODELS, cache_root

    folder = MODELS_DIR / "qwen3-30b-a3b"
    tokenizer = PACKAGED_MODELS[random_gguf.TOKENIZER_MODEL].path()
    stat = tokenizer.stat() if tokenizer is not None else None
    key = json.dumps([
        inspect.getsource(random_gguf), version("gguf"), version("numpy"),
        (folder / "config.json").read_text(), shape, str(tokenizer),
        stat and (stat.st_size, stat.st_mtime_ns),
    ], sort_keys=True)  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    path = cache_root() / "test-models" / f"qwen3-moe-q8_0-{digest}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        random_gguf.write_random_gguf(folder, partial, "Q8_0", shape)
        os.replace(partial, path)  # never a half-written file under the final name
    return path


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_a_moe_gguf_loads_in_about_its_own_size():
    """A Qwen3-MoE GGUF with Q8_0 experts (hidden 1024, 8 layers, 64 experts of 384, top-8:
    0.77 GB, whose experts would take 2.4 GB in float32) loads and generates with a peak within
    1.5x the file's size: the experts stay in their blocks, each tensor's pages of the file are
    let go once it is copied out, and the vocabulary is read a few thousand rows at a time. (The
    embedding is held in float32 for its lookups: 0.2 GB of the peak here.)"""
    import subprocess
    import sys

    shape = {"hidden_size": 1024, "num_hidden_layers": 8, "num_experts": 64,
             "moe_intermediate_size": 384, "num_experts_per_tok": 8, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096}  # fmt: skip
    path = random_moe_gguf(shape)
    run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    before, peak, formats = run.stdout.strip().splitlines()[-1].split(" ", 2)
    assert "Q8_0 experts" in formats
    size_kib = path.stat().st_size // 1024
    assert (int(peak) - int(before)) < 1.5 * size_kib, (int(peak) - int(before), size_kib)


def test_gguf_writer_refuses_dense_layers_in_a_moe(moe_models, tmp_path):
    from gguf_files import write_gguf

    with pytest.raises(ValueError, match="every layer"):
        write_gguf(moe_models["Qwen3MoeForCausalLM"], tmp_path / "m.gguf")


# ------------------------------------------------------------------------------- dummy weights
def test_qwen3_30b_a3b_config_builds_shape_correct_dummy_weights():
    """The shipped config: Qwen3-30B-A3B's public shapes and parameter count. Built on "meta"
    (no memory), every checkpoint tensor's placement (the loader's own code) fills its
    parameter's rows exactly, at one rank and at each of two; a dummy tensor yields any slice."""
    path, spec, hf_config = read_config(MODELS_DIR / "qwen3-30b-a3b")
    assert [p.name for p in path.iterdir()] == ["config.json"]
    moe = spec.moe
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (
        48,
        2048,
        32,
        4,
    )
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and moe.sparse_layers == tuple(range(48)) and spec.qk_norm
    assert sum(math.prod(s) for s in checkpoint_shapes(spec).values()) == 30_532_122_624
    for tp in (SINGLE, TensorParallel(1, 2)):
        with torch.device("meta"):
            model = LlamaModel(spec, tp)
        filled: dict[tuple[str, int | None], int] = {}
        for name, shape in model.checkpoint_shapes().items():
            place = model._place(name)
            param = model.get_parameter(place.target)
            param = param if place.expert is None else param[place.expert]
            part = list(shape)
            for dim, index in ((0, place.rows), (1, place.cols)):
                if index is not None:
                    part[dim] = len(range(*index.indices(shape[dim])))
            if place.offset is None:
                assert list(param.shape) == part, name
            else:
                assert list(param.shape[1:]) == part[1:] and place.offset + part[0] <= len(param)
            key = (place.target, place.expert)
            filled[key] = filled.get(key, 0) + (part[0] if place.offset is not None else len(param))
        for (target, expert), rows in filled.items():
            param = model.get_parameter(target)
            assert rows == len(param if expert is None else param[expert]), target
        experts = model.layers[47].mlp.experts
        inter = 768 // tp.world_size
        assert experts.gate_up.shape == (128, 2 * inter, 2048)
        assert experts.down.shape == (128, 2048, inter)
    tensors = dummy_tensors(model, 0, hf_config.initializer_range, torch.bfloat16, CPU)
    rows = tensors["model.layers.47.mlp.experts.127.down_proj.weight"][2040:2048]
    assert rows.shape == (8, 768) and rows.isfinite().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_grouped_path_equals_the_loop(dtype):
    """The sync-free path (`torch._grouped_mm` over the sorted rows, group ends found on the
    device; CUDA's) gives the loop's sums, experts chosen by no token included."""
    from tandem.ops import elementwise
    from tandem.ops.moe import grouped_experts, grouped_experts_on_device, route

    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens = 7, 32, 48, 9
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g).to(dtype) * 0.2
    down = torch.randn(experts, hidden, inter, generator=g).to(dtype) * 0.2
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g).to(dtype)
    logits[:, 3] = -30  # expert 3 gets no row
    weights, ids = route(logits, 2, True, False)

    def expert(e, rows):
        return elementwise.silu_and_mul(rows @ gate_up[e].T) @ down[e].T

    loop = grouped_experts(x, weights, ids, experts, expert)
    grouped = grouped_experts_on_device(x, weights, ids, gate_up, down, elementwise.silu_and_mul)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grouped, loop, atol=tolerance, rtol=tolerance)
