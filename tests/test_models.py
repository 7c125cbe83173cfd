"""Checkpoint loading: what is refused, and with which message."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tandem.models.loader import SUPPORTED_ARCHITECTURES, ModelLoadError, load_model

CPU = torch.device("cpu")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_lists_the_supported_ones(tiny_llama, tmp_path):
    path = _copy(tiny_llama, tmp_path / "gpt")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="LlamaForSequenceClassification") as info:
        load_model(path, torch.float32, CPU)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_and_malformed_files_are_named(tiny_llama, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere", torch.float32, CPU)

    no_weights = _copy(tiny_llama, tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model(no_weights, torch.float32, CPU)

    broken = _copy(tiny_llama, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(broken, torch.float32, CPU)

    bad_json = _copy(tiny_llama, tmp_path / "bad-json")
    (bad_json / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(bad_json, torch.float32, CPU)

    no_config = _copy(tiny_llama, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_model(no_config, torch.float32, CPU)


def test_missing_tensor_and_missing_shard_are_named(tiny_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_checkpoints["LlamaForCausalLM"], tmp_path / "partial")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(path, torch.float32, CPU)

    sharded = _copy(tiny_checkpoints["Qwen2ForCausalLM"], tmp_path / "sharded")
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(sharded, torch.float32, CPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_generates(tiny_llama, dtype):
    from helpers import greedy, make_llm

    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    llm = make_llm(tiny_llama, dtype=name)
    assert llm.engine.runner.model.embed.weight.dtype == dtype
    assert llm.engine.runner.kv_caches[0].dtype == dtype
    out = llm.generate([[5, 6, 7, 8]], greedy(8))[0]
    assert len(out.token_ids) == 8


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_llama_attention_bias_reaches_o_proj(llama_with_biases, enforce_eager):
    """attention_bias=True gives o_proj a bias in Llama (and Qwen3): loaded, and used."""
    import random

    from conftest import hf_greedy_reference_allowing_near_ties, random_prompts
    from helpers import greedy, make_llm

    llm = make_llm(llama_with_biases, enforce_eager=enforce_eager, num_kv_blocks=64)
    assert llm.engine.spec.o_bias and llm.engine.runner.model.layers[0].attn.o.bias.any()
    prompts = random_prompts(random.Random(3), 4, 1024, 3, 30)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy(10)), strict=True):
        ref = hf_greedy_reference_allowing_near_ties(llama_with_biases, prompt, out.token_ids, 10)
        assert out.token_ids == ref
