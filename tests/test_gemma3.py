"""Gemma 3 (text) on tiny random checkpoints, against transformers' Gemma3ForCausalLM.

Two shapes: conftest's GEMMA3_TINY (GQA 4:2, sliding window 7 on layers 0 and 2, a global
layer 1, query_pre_attn_scalar 24 with head_dim 32, soft-capped logits, tied embeddings), and
an MQA one (one KV head: replicated under tensor parallelism; a global layer first, window 16,
linear rope scaling on the global layer, untied embeddings). Prompts run past the windows, so
the masks of both layer kinds count. The real Gemma 3 270M is in test_real_gemma3.py.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from tandem import SamplingParams
from tandem.execution import fast_path
from tandem.models.default_model import build_checkpoint
from tandem.models.errors import ModelLoadError
from tandem.models.loader import load_model, read_config
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from conftest import (
    FAST_PATH_LOGITS_ATOL,
    _load_hf_model,
    hf_greedy_reference_allowing_near_ties,
    random_prompts,
)
from gguf_files import tiny_hf_folder, write_gguf
from helpers import assert_idle_and_balanced, greedy, make_llm, prefill_then_decode_logits

LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def gemma(tiny_checkpoints):
    return tiny_checkpoints["Gemma3ForCausalLM"]


@pytest.fixture(scope="module")
def gemma_mqa(tmp_path_factory):
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    return build_checkpoint(
        tmp_path_factory.mktemp("gemma3-mqa"), "Gemma3ForCausalLM", num_key_value_heads=1,
        head_dim=16, max_position_embeddings=512,
        extra_config={"layer_types": ["full_attention", "sliding_attention"],
                      "sliding_window": 16, "query_pre_attn_scalar": 16, "rope_parameters": rope},
    )  # fmt: skip


@pytest.fixture(params=["gqa", "mqa"])
def checkpoint(request, gemma, gemma_mqa):
    return {"gqa": gemma, "mqa": gemma_mqa}[request.param]


def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probability of each prompt token after the ones before it."""
    with torch.no_grad():
        logits = _load_hf_model(str(path))(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[:-1]
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def test_spec_windows_and_layer_windows(gemma, gemma_mqa, tiny_llama):
    spec = read_config(gemma)[1]
    assert spec.windows == (7, None, 7) and spec.sliding_window is None
    assert spec.query_pre_attn_scalar == 24 and spec.final_logit_softcapping == 5.0
    assert load_model(gemma, torch.float32, torch.device("cpu")).model.spec.layer_windows() == [
        7, None, 7,
    ]  # fmt: skip
    assert load_model(gemma_mqa, torch.float32, torch.device("cpu")).model.spec.layer_windows() == [
        None, 16,
    ]  # fmt: skip
    llama = load_model(tiny_llama, torch.float32, torch.device("cpu")).model
    assert llama.spec.layer_windows() == [None] * llama.spec.num_layers


def test_logits_equal_transformers_eager_and_fast_path(checkpoint):
    """The portable path is transformers' arithmetic (norm weights folded as 1 + w in float32);
    the fast path packs the GEMMs and runs the whole forward as one kernel call (each layer's
    window and rope table; the prompt is longer than the sliding windows)."""
    prompt = random_prompts(random.Random(3), 1, 1000, 40, 40)[0]
    with torch.no_grad():
        reference = _load_hf_model(str(checkpoint))(torch.tensor([prompt])).logits[0]
    for eager in (True, False):
        loaded = load_model(checkpoint, torch.float32, torch.device("cpu"))
        plan = fast_path.prepare(loaded.model, torch.device("cpu"), torch.float32, eager)
        assert plan.ops == ("portable" if eager else "fused-cpu")
        assert plan.packed_gemm == (not eager)
        assert (loaded.model._fused_weights is None) == eager
        logits = prefill_then_decode_logits(loaded.model, prompt)
        diff = (logits - reference).abs().max().item()
        assert diff < (2e-5 if eager else FAST_PATH_LOGITS_ATOL), (eager, diff)


def test_greedy_and_logprobs_equal_transformers_in_both_loops_and_paths(checkpoint):
    """Chunked prefill (32-token steps, prompts up to 70), both loops on the fast path and the
    async loop eager; tokens, prompt logprobs and sampled logprobs against transformers."""
    prompts = random_prompts(random.Random(5), 5, 1000, 3, 70)
    params = greedy(10, prompt_logprobs=1, logprobs=2)
    outputs = {}
    for mode, eager in ((False, False), (True, False), (True, True)):
        llm = make_llm(
            checkpoint, async_scheduling=mode, enforce_eager=eager,
            max_num_batched_tokens=32, num_kv_blocks=64, block_size=8,
        )  # fmt: skip
        outputs[mode, eager] = llm.generate(prompts, params)
        assert_idle_and_balanced(llm.engine)
        llm.close()
    fast = [[o.token_ids for o in outputs[mode, False]] for mode in (False, True)]
    assert fast[0] == fast[1]
    for prompt, out in zip(prompts * 2, outputs[True, False] + outputs[True, True], strict=True):
        assert out.token_ids == hf_greedy_reference_allowing_near_ties(
            checkpoint, prompt, out.token_ids, 10
        )
        expected = hf_prompt_logprobs(checkpoint, prompt)
        pairs = zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
        got = torch.tensor([entry[token].logprob for entry, token in pairs])
        assert (got - expected).abs().max().item() < LOGPROB_ATOL
        expected = hf_prompt_logprobs(checkpoint, prompt + out.token_ids)[len(prompt) - 1 :]
        pairs = zip(out.logprobs, out.token_ids, strict=True)
        sampled = torch.tensor([entry[token].logprob for entry, token in pairs])
        assert (sampled - expected).abs().max().item() < LOGPROB_ATOL


def test_prefix_caching_n_samples_and_penalties(gemma):
    """Shared prefixes longer than the window, n > 1 seeded samples, penalties: the same tokens
    with the cache off and on, and on in the async loop; penalized greedy equals transformers'
    with its processors."""
    from test_penalties import hf_processed_greedy_allowing_near_ties

    rng = random.Random(9)
    prefixes = random_prompts(rng, 2, 1000, 24, 24)
    prompts = [prefixes[i % 2] + s for i, s in enumerate(random_prompts(rng, 6, 1000, 1, 12))]
    penalized = SamplingParams(
        max_tokens=10, temperature=0, repetition_penalty=1.5, presence_penalty=0.5,
        frequency_penalty=0.3, ignore_eos=True,
    )  # fmt: skip
    params = [
        SamplingParams(n=2, max_tokens=10, temperature=0.9, seed=i, ignore_eos=True, logprobs=1)
        for i in range(4)
    ] + [penalized, greedy(10)]
    results = []
    for mode, caching in ((False, False), (False, True), (True, True)):
        llm = make_llm(
            gemma, async_scheduling=mode, enable_prefix_caching=caching, block_size=4,
            max_num_batched_tokens=48, num_kv_blocks=96,
        )  # fmt: skip
        outs = llm.generate(prompts, params)
        assert llm.engine.scheduler.stats.hit_tokens > 0 or not caching
        results.append([[s.token_ids for s in o.outputs] for o in outs])
        assert_idle_and_balanced(llm.engine)
        llm.close()
    assert all(r == results[0] for r in results)
    assert all(len({tuple(s) for s in samples}) == 2 for samples in results[0][:4])
    tokens = results[0][4][0]
    assert tokens == hf_processed_greedy_allowing_near_ties(gemma, prompts[4], penalized, tokens)
    tokens = results[0][5][0]
    assert tokens == hf_greedy_reference_allowing_near_ties(gemma, prompts[5], tokens, 10)


def test_two_ranks_equal_transformers(gemma_mqa):
    """TP=2 with the one KV head replicated on both ranks (test_dummy_weights checks every
    Gemma tensor's placement at two ranks, GQA heads split)."""
    checkpoint = gemma_mqa
    prompts = random_prompts(random.Random(6), 4, 1000, 3, 50)
    llm = make_llm(checkpoint, tensor_parallel_size=2, cpu_threads=1, num_kv_blocks=64)
    try:
        outs = llm.generate(prompts, greedy(10))
        assert_idle_and_balanced(llm.engine)
    finally:
        llm.close()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy_reference_allowing_near_ties(
            checkpoint, prompt, out.token_ids, 10
        )


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    """A Gemma 3 whose every weight suits the GGUF block types, with Gemma 3's own layer
    pattern (5 sliding layers, then a global one: what a GGUF implies) and numbers a GGUF
    keeps exactly (query_pre_attn_scalar = head_dim, a float32 eps)."""
    return tiny_hf_folder(
        tmp_path_factory.mktemp("gemma3-hf"), "Gemma3ForCausalLM", tie_word_embeddings=True,
        num_hidden_layers=6, sliding_window=6, query_pre_attn_scalar=64, rms_norm_eps=2**-20,
        max_position_embeddings=512,
    )  # fmt: skip


def test_f32_gguf_equals_the_safetensors_load(gemma_folder, tmp_path):
    path = write_gguf(gemma_folder, tmp_path / "gemma3-f32.gguf", "F32")
    from_folder = load_model(gemma_folder, torch.float32, torch.device("cpu"))
    from_gguf = load_model(path, torch.float32, torch.device("cpu"))
    assert from_gguf.spec == from_folder.spec and from_gguf.spec.windows[-2:] == (6, None)
    assert from_gguf.hf_config.rope_parameters == from_folder.hf_config.rope_parameters
    prompt = random_prompts(random.Random(1), 1, 2000, 30, 30)[0]
    assert torch.equal(
        prefill_then_decode_logits(from_gguf.model, prompt),
        prefill_then_decode_logits(from_folder.model, prompt),
    )


def test_q8_0_gguf_greedy_equals_transformers_on_the_same_file(gemma_folder, tmp_path):
    """Q8_0 blocks kept native on the fast path (dequantized when eager), against transformers'
    GGUF loading of the same file."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(gemma_folder, tmp_path / "gemma3-q8_0.gguf", "Q8_0")
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompts = random_prompts(random.Random(2), 3, 2000, 4, 30)
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    for async_scheduling, eager in ((True, False), (False, True)):
        llm = make_llm(
            path, enforce_eager=eager, async_scheduling=async_scheduling, num_kv_blocks=64
        )
        if not eager:
            assert llm.engine.execution.weight_formats.get("Q8_0", 0) > 0
        got = [o.token_ids for o in llm.generate(prompts, greedy(10))]
        llm.close()
        assert got == expected, (async_scheduling, eager)


def test_attention_softcapping_is_refused_by_name(tmp_path):
    path = build_checkpoint(
        tmp_path / "capped", "Gemma3ForCausalLM", num_hidden_layers=1,
        extra_config={"attn_logit_softcapping": 50.0},
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        read_config(path)


def test_a_packaged_model_whose_package_assembles_its_file(tmp_path, monkeypatch):
    """A catalog entry without a file name calls its package's `assemble()` for the path; an
    absent package gives the install command, a failing one its error."""
    from tandem.models.catalog import PACKAGED_MODELS, PackagedModel, resolve_model

    package = tmp_path / "fake_assembled_model"
    package.mkdir()
    target = tmp_path / "assembled.gguf"
    (package / "__init__.py").write_text(
        "from pathlib import Path\n"
        f"def assemble():\n    Path({str(target)!r}).write_bytes(b'GGUF')\n"
        f"    return Path({str(target)!r})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = PackagedModel("fake_assembled_model", "", "pip install fake-assembled-model")
    monkeypatch.setitem(PACKAGED_MODELS, "fake-model", entry)
    assert resolve_model("fake-model") == target and target.is_file()
    missing = PackagedModel("no_such_assembled_package", "", "pip install no-such")
    monkeypatch.setitem(PACKAGED_MODELS, "fake-model", missing)
    with pytest.raises(ModelLoadError, match="pip install no-such"):
        resolve_model("fake-model")
    (package / "__init__.py").write_text("def assemble():\n    raise ValueError('bad sha256')\n")
    monkeypatch.delitem(sys.modules, "fake_assembled_model")  # import it afresh
    monkeypatch.setitem(PACKAGED_MODELS, "fake-model", entry)
    with pytest.raises(ModelLoadError, match="bad sha256"):
        resolve_model("fake-model")
