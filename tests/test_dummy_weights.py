"""Dummy weights (`load_format="dummy"`), engines without a tokenizer, the shipped model configs.

A config-only folder (the tiny checkpoint's config.json, nothing else) loads with seeded random
weights made from the config alone; the same seed gives the same weights, a tensor-parallel
rank's slices put together are the one-rank model, and the model generates the requested tokens
in both loops and at two ranks alike. Without tokenizer files, token ids work and text is refused.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from tandem import SamplingParams
from tandem.bench.workloads import MODELS_DIR
from tandem.cli import main
from tandem.models.dummy import dummy_tensors
from tandem.models.llama import LlamaModel
from tandem.models.loader import (
    SUPPORTED_ARCHITECTURES,
    ModelLoadError,
    _inv_freq,
    build_model,
    model_class,
    read_config,
)
from tandem.models.parallel import SINGLE, TensorParallel
from tandem.models.spec import checkpoint_shapes
from tests.shared_tp import ranks_from_a_fork_server  # noqa: F401

from conftest import random_prompts
from helpers import greedy, make_llm, run_both_loops


def _config_only(source: Path, folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))
    return folder


@pytest.fixture(scope="module")
def config_only(tiny_llama, tmp_path_factory) -> Path:
    return _config_only(tiny_llama, tmp_path_factory.mktemp("config-only"))


def _build(path: Path, seed: int, tp: TensorParallel = SINGLE) -> LlamaModel:
    path, spec, hf_config = read_config(path)
    cpu = torch.device("cpu")
    return build_model(path, spec, hf_config, torch.float32, cpu, None, tp, "dummy", seed)


def test_dummy_weights_come_from_the_config_alone_and_the_seed(config_only):
    assert [p.name for p in config_only.iterdir()] == ["config.json"]
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors .*load_format='dummy'"):
        make_llm(config_only)
    first, again, other = _build(config_only, 0), _build(config_only, 0), _build(config_only, 1)
    names = [name for name, _ in first.named_parameters()]
    assert all(torch.equal(first.get_parameter(n), again.get_parameter(n)) for n in names)
    layer = first.layers[1]
    assert not torch.equal(layer.mlp.down.weight, other.layers[1].mlp.down.weight)
    assert torch.equal(layer.input_norm.weight, torch.ones(64)) and first.norm.weight.eq(1).all()
    # Uniform with the config's initializer_range (0.1) as standard deviation.
    w = layer.mlp.gate_up.weight
    assert abs(w.std().item() - 0.1) < 0.005 and abs(w.mean().item()) < 0.005
    assert w.abs().max().item() <= 0.1 * math.sqrt(3)
    assert not torch.equal(layer.mlp.gate_up.weight[:128], layer.mlp.gate_up.weight[128:])


def test_rank_slices_put_together_are_the_one_rank_model(tiny_llama, tmp_path):
    """One KV head (replicated on both ranks) and a vocabulary two ranks split unevenly."""
    path = _config_only(
        tiny_llama, tmp_path / "mqa", num_key_value_heads=1, vocab_size=1027,
        tie_word_embeddings=False,
    )  # fmt: skip
    full = _build(path, 5)
    ranks = [_build(path, 5, TensorParallel(rank, 2)) for rank in range(2)]
    embed = torch.cat([r.embed.weight for r in ranks])
    assert torch.equal(embed[:1027], full.embed.weight) and not embed[1027:].any()
    head = torch.cat([r.lm_head.weight for r in ranks])
    assert torch.equal(head[:1027], full.lm_head.weight)
    layer, halves = full.layers[0], [r.layers[0] for r in ranks]
    q = 4 * 16  # 4 query heads of 16
    assert torch.equal(torch.cat([h.attn.qkv.weight[: q // 2] for h in halves]),
                       layer.attn.qkv.weight[:q])  # fmt: skip
    assert all(torch.equal(h.attn.qkv.weight[q // 2 :], layer.attn.qkv.weight[q:]) for h in halves)
    assert torch.equal(torch.cat([h.attn.o.weight for h in halves], 1), layer.attn.o.weight)
    assert torch.equal(torch.cat([h.mlp.down.weight for h in halves], 1), layer.mlp.down.weight)
    # Any slice of a dummy tensor is that slice of the whole tensor.
    for name, tensor in dummy_tensors(full, 5, 0.1, torch.float32, torch.device("cpu")).items():
        whole = tensor[:]
        assert whole.shape == tensor.shape
        assert torch.equal(tensor[3:7], whole[3:7])
        if whole.dim() == 2:
            assert torch.equal(tensor[:, 5:9], whole[:, 5:9])
            assert torch.equal(tensor[2:6, 1:8], whole[2:6, 1:8]), name


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_dummy_load_equals_loading_its_checkpoint_at_every_rank(tiny_checkpoints, architecture):
    """Each rank's dummy parameters are what the checkpoint placement code makes of the whole
    dummy tensors: qkv bias (Qwen2), q/k norms (Qwen3), tied embeddings (Mistral), Gemma's
    extra norms included."""
    path, spec, hf_config = read_config(tiny_checkpoints[architecture])
    for tp in (SINGLE, TensorParallel(0, 2), TensorParallel(1, 2)):
        dummy = _build(path, 7, tp)
        with torch.device("meta"):
            reference = model_class(hf_config)(spec, tp)
        reference = reference.to_empty(device=torch.device("cpu"))
        std = hf_config.initializer_range
        for name, tensor in dummy_tensors(
            dummy, 7, std, torch.float32, torch.device("cpu")
        ).items():
            assert reference.load_weight(name, tensor[:])  # the whole tensor, then sliced
        for name, param in dummy.named_parameters():
            assert torch.equal(param, reference.get_parameter(name)), (tp, name)


def test_dummy_model_generates_alike_in_both_loops_and_at_two_ranks(config_only):
    prompts = random_prompts(random.Random(3), 4, 1024, 3, 30)
    params = [greedy(12), greedy(12, logprobs=2)] + [
        SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(2)
    ]
    options = {"load_format": "dummy", "num_kv_blocks": 64}
    runs = run_both_loops(config_only, prompts, params, **options)
    tokens = {mode: [o.token_ids for o in outs] for mode, (outs, llm) in runs.items()}
    for _, llm in runs.values():
        assert llm.engine.tokenizer is None
        llm.close()
    assert tokens[True] == tokens[False]
    assert all(len(t) == 12 for t in tokens[True]) and len(set(tokens[True][0])) > 1
    sync_outputs = runs[False][0]
    assert all(o.text == "" for o in sync_outputs)
    entry = sync_outputs[1].logprobs[0]
    assert len(entry) >= 2 and all(lp.decoded_token is None for lp in entry.values())

    llm = make_llm(config_only, tensor_parallel_size=2, cpu_threads=1, **options)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == tokens[True]
    finally:
        llm.close()
    llm = make_llm(config_only, seed=1, **options)  # another seed: other weights, other tokens
    try:
        assert llm.generate(prompts[0], greedy(12))[0].token_ids != tokens[True][0]
    finally:
        llm.close()


def test_without_a_tokenizer_token_ids_work_and_text_is_refused(config_only, capsys):
    llm = make_llm(config_only, load_format="dummy", num_kv_blocks=32)
    try:
        with pytest.raises(ValueError, match="prompt 0: this model has no tokenizer"):
            llm.generate("Once upon a time", greedy(4))
        with pytest.raises(ValueError, match="has no tokenizer"):
            llm.engine.add_request("text", greedy(4))
        with pytest.raises(ValueError, match="stop strings need a tokenizer.*stop_token_ids"):
            llm.generate([5, 6, 7], greedy(4, stop=["a"]))
        tokens = llm.generate([5, 6, 7], greedy(8))[0].token_ids
        stop = tokens[3]
        out = llm.generate([5, 6, 7], greedy(8, stop_token_ids=[stop]))[0]
        assert out.finish_reason == "stop" and out.token_ids == tokens[: tokens.index(stop) + 1]
        assert llm.get_tokenizer() is None
    finally:
        llm.close()
    model = ["--model", str(config_only), "--load-format", "dummy", "--device", "cpu"]
    assert main(["generate", "Hello", *model]) == 2
    assert "error: prompt 0: this model has no tokenizer" in capsys.readouterr().err
    # The benchmark sends token ids: it runs on a config-only model.
    bench = ["bench", *model, "--num-requests", "3", "--prompt-len", "6", "--output-len", "4",
             "--num-kv-blocks", "32"]  # fmt: skip
    assert main(bench) == 0
    out = capsys.readouterr().out
    assert "(dummy weights, seed 0)" in out and "yes" in out


def test_tokenizer_files_are_used_with_dummy_weights(tiny_llama, tmp_path):
    folder = tmp_path / "with-tokenizer"
    folder.mkdir()
    for file in tiny_llama.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, folder / file.name)
    llm = make_llm(folder, load_format="dummy", num_kv_blocks=32)
    try:
        tokenizer = llm.get_tokenizer()
        assert tokenizer is not None
        out = llm.generate("Once upon a time", greedy(6))[0]
        assert out.prompt_token_ids == tokenizer("Once upon a time").input_ids
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    finally:
        llm.close()


def test_unsupported_architecture_is_refused(tiny_llama, tmp_path):
    path = _config_only(tiny_llama, tmp_path / "gpt", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        make_llm(path, load_format="dummy")
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        make_llm(path, load_format="pt")


@pytest.mark.parametrize(
    ("name", "layers", "hidden", "inter", "head_dim", "tied", "params", "factor"),
    [
        ("llama-3.1-8b", 32, 4096, 14336, 128, False, 8_030_261_248, 8.0),
        ("llama-3.2-1b", 16, 2048, 8192, 64, True, 1_235_814_400, 32.0),
    ],
)
def test_shipped_configs_have_the_public_shapes(
    name, layers, hidden, inter, head_dim, tied, params, factor
):
    """Parsed, not built: the 1B alone is 5 GB in fp32. Parameter counts are Hugging Face's."""
    path, spec, hf_config = read_config(MODELS_DIR / name)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size) == (layers, hidden, inter)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (32, 8, head_dim)
    assert (spec.vocab_size, spec.tie_word_embeddings) == (128256, tied)
    assert sum(math.prod(s) for s in checkpoint_shapes(spec).values()) == params
    assert hf_config.eos_token_id == 128001 and str(hf_config.dtype).endswith("bfloat16")
    rope = json.loads((path / "config.json").read_text())["rope_scaling"]
    assert rope["rope_type"] == "llama3" and rope["factor"] == factor
    inv_freq, scaling = _inv_freq(hf_config)
    assert inv_freq.shape == (head_dim // 2,) and scaling == 1.0
    # A dummy tensor of the real shape yields any slice without the whole: the embedding's rows.
    with torch.device("meta"):
        model = LlamaModel(spec)
    tensors = dummy_tensors(model, 0, 0.02, torch.bfloat16, torch.device("cpu"))
    rows = tensors["model.embed_tokens.weight"][128000:128004]
    assert rows.shape == (4, hidden) and rows.dtype == torch.bfloat16
    assert rows.isfinite().all() and 0.015 < rows.float().std().item() < 0.025


def test_server_takes_token_ids_and_refuses_text_without_a_tokenizer(config_only):
    import openai
    from test_server import start_server

    live = start_server(config_only, {"load_format": "dummy"})
    try:
        client, model = live.client(), live.model.model_path.name
        out = client.completions.create(
            model=model, prompt=[5, 6, 7], max_tokens=5, temperature=0, logprobs=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        choice = out.choices[0]
        assert choice.text == "" and out.usage.completion_tokens == 5
        labels = choice.logprobs.tokens
        assert len(labels) == 5 and all(label.startswith("token_id:") for label in labels)
        assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)  # none collapsed
        offline = make_llm(config_only, load_format="dummy", num_kv_blocks=32)
        try:
            tokens = offline.generate([5, 6, 7], greedy(5))[0].token_ids
        finally:
            offline.close()
        assert labels == [f"token_id:{t}" for t in tokens]
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=model, prompt="Hello", max_tokens=3)
        assert "no tokenizer" in info.value.body["message"] and info.value.body["param"] == "prompt"
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
        assert "no tokenizer" in info.value.body["message"]
    finally:
        live.stop()
