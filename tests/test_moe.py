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

from tandem import SamplingParams
from tandem.models.default_model import build_checkpoint
from tandem.models.dummy import dummy_tensors
from tandem.models.llama import LlamaModel
from tandem.models.loader import load_model, read_config
from tandem.models.moe import Experts, SparseMoE
from tandem.models.parallel import SINGLE, TensorParallel
from tandem.models.spec import checkpoint_shapes
from tandem.ops import elementwise

from conftest import _load_hf_model, hf_greedy_reference_allowing_near_ties, random_prompts
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
    assert llm.engine.execution.packed_gemm  # the fast path: packed experts, per-op forward
    assert llm.engine.runner.model._fused_weights is None
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
    assert kind == "Q8_0" and torch.equal(experts.down, torch.from_numpy(down))
    assert tensors["blk.1.ffn_gate_inp.weight"][0] == "F32"  # routers stay F32, as llama.cpp's
    llm = make_llm(q8, **OPTIONS)
    out = llm.generate([prompt], greedy(8))[0]
    assert len(out.token_ids) == 8 and isinstance(llm.generate("Hello", greedy(2))[0].text, str)


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
