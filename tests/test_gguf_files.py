"""The GGUF writer the loader tests rely on: its blocks decode to the weights, its metadata is
llama.cpp's, and transformers' own GGUF loader reads its files back to the original model.

The files were also checked once by hand against llama.cpp's llama-server (not part of the
suite): it tokenizes like the original and its next-token log-probabilities agree with the
original model's (with the same rounding) for every type and architecture here.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_files import (
    K_QUANTS,
    TENSOR_TYPES,
    dequantize,
    quantize,
    read_gguf,
    tiny_hf_folder,
    unpermute_qk,
    write_gguf,
)

# Largest |dequantize(quantize(w)) - w| allowed, as a fraction of the largest |w| in the same run
# of 256 values. Each is just above the type's worst case for round-to-nearest (half a step; a
# full step for Q4_0 and Q5_0, whose top value can be clipped; plus 6-bit scale rounding for the
# K-quants). Measured on the tiny model's weights: F16 4.8e-4, BF16 3.9e-3, Q8_0 4.3e-3,
# Q4_0 0.125, Q4_1 0.067, Q5_0 0.063, Q5_1 0.033, Q4_K 0.067, Q5_K 0.032, Q6_K 0.016.
TOLERANCE = {
    "F32": 0.0,
    "F16": 5e-4,
    "BF16": 4e-3,
    "Q8_0": 5e-3,
    "Q4_0": 0.13,
    "Q4_1": 0.08,
    "Q5_0": 0.07,
    "Q5_1": 0.04,
    "Q4_K": 0.1,
    "Q5_K": 0.05,
    "Q6_K": 0.02,
}

SENTENCE = "The quick brown fox jumps over the lazy dog, twice."


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-hf")
    return {
        "llama": tiny_hf_folder(root / "llama"),
        "llama-tied": tiny_hf_folder(root / "llama-tied", tie_word_embeddings=True, seed=1),
        "qwen2": tiny_hf_folder(root / "qwen2", "Qwen2ForCausalLM", seed=2),
        "qwen3": tiny_hf_folder(root / "qwen3", "Qwen3ForCausalLM", seed=3),
    }


def _hf_weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(folder / "model.safetensors")


def _assert_close_per_block(actual: np.ndarray, expected: np.ndarray, tolerance: float) -> None:
    rows = expected.reshape(-1, 256) if expected.size % 256 == 0 else expected.reshape(1, -1)
    error = np.abs(actual.reshape(rows.shape) - rows).max(axis=1)
    bound = tolerance * np.abs(rows).max(axis=1)
    assert (error <= bound).all(), f"worst error {(error / np.abs(rows).max(axis=1)).max():.3g}"


@pytest.mark.parametrize("tensor_type", TENSOR_TYPES)
def test_every_tensor_decodes_to_the_hf_weight(folders, tmp_path, tensor_type):
    folder = folders["llama"]
    config = json.loads((folder / "config.json").read_text())
    metadata, tensors = read_gguf(write_gguf(folder, tmp_path / "m.gguf", tensor_type))
    file_type = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}
    expected_file_type = gguf.LlamaFileType[file_type.get(tensor_type, f"MOSTLY_{tensor_type}")]
    assert metadata["general.file_type"] == expected_file_type
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    weights = _hf_weights(folder)
    assert len(tensors) == len(weights)
    for hf_name, weight in weights.items():
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        stored_type, values = tensors[name]
        assert values.shape == weight.shape, name
        if ".attn_q." in name:
            values = unpermute_qk(values, config["num_attention_heads"])
        elif ".attn_k." in name:
            values = unpermute_qk(values, config["num_key_value_heads"])
        if weight.ndim == 1:  # norms stay F32, as llama.cpp keeps them
            assert stored_type == "F32" and np.array_equal(values, weight), name
        else:
            assert stored_type == tensor_type, name
            _assert_close_per_block(values, weight, TOLERANCE[tensor_type])


def test_llama_q_and_k_are_permuted_and_unpermute_exactly(folders, tmp_path):
    folder = folders["llama"]
    _, tensors = read_gguf(write_gguf(folder, tmp_path / "m.gguf"))
    weights = _hf_weights(folder)
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    k = weights["model.layers.1.self_attn.k_proj.weight"]
    stored_q, stored_k = tensors["blk.1.attn_q.weight"][1], tensors["blk.1.attn_k.weight"][1]
    assert not np.array_equal(stored_q, q) and not np.array_equal(stored_k, k)
    assert np.array_equal(unpermute_qk(stored_q, 4), q)
    assert np.array_equal(unpermute_qk(stored_k, 2), k)
    # Within a head, llama.cpp interleaves the two rotary halves: row 2i is HF's row i, 2i+1 is
    # HF's row i + head_dim / 2.
    assert np.array_equal(stored_q[0:64:2], q[0:32]) and np.array_equal(stored_q[1:64:2], q[32:64])


def test_llama3_rope_factors_and_permuted_biases(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope["original_max_position_embeddings"] = 256
    folder = tiny_hf_folder(tmp_path / "llama3", rope_scaling=rope, attention_bias=True)
    _, tensors = read_gguf(write_gguf(folder, tmp_path / "m.gguf"))
    # llama.cpp divides the plain frequencies by rope_freqs.
    config = LlamaConfig.from_pretrained(folder)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 10000.0 ** -(torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    factors = torch.from_numpy(tensors["rope_freqs.weight"][1])
    torch.testing.assert_close(factors, plain / scaled, rtol=1e-5, atol=0)
    weights = _hf_weights(folder)
    q_bias = tensors["blk.0.attn_q.bias"][1]  # permuted like the rows they add to
    assert np.array_equal(unpermute_qk(q_bias, 4), weights["model.layers.0.self_attn.q_proj.bias"])
    k_bias = tensors["blk.0.attn_k.bias"][1]
    assert np.array_equal(unpermute_qk(k_bias, 2), weights["model.layers.0.self_attn.k_proj.bias"])
    assert not np.array_equal(k_bias, weights["model.layers.0.self_attn.k_proj.bias"])


@pytest.mark.parametrize("tensor_type", K_QUANTS)
def test_k_quants_round_trip_awkward_blocks(tensor_type):
    rng = np.random.default_rng(0)
    blocks = [
        rng.standard_normal(256),
        np.zeros(256),
        np.full(256, 0.7),  # constant and positive: Q4_K/Q5_K's offset must not go negative
        rng.uniform(0.5, 1.0, 256),
        -rng.uniform(0.5, 1.0, 256),
        rng.standard_normal(256) * np.repeat(10.0 ** rng.integers(-3, 2, 16), 16),
        rng.standard_normal(256) + 30.0,
    ]
    weight = np.stack(blocks).astype(np.float32)
    data = quantize(weight, tensor_type)
    _, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor_type]]
    assert data.dtype == np.uint8 and data.shape == (len(blocks), block_bytes)
    _assert_close_per_block(dequantize(data, tensor_type), weight, TOLERANCE[tensor_type])
    assert np.array_equal(dequantize(data, tensor_type)[1], np.zeros(256, np.float32))


def test_rows_that_do_not_fit_the_block_are_refused(tmp_path):
    with pytest.raises(ValueError, match="Q4_K needs rows whose length is a multiple of 256"):
        quantize(np.zeros((4, 128), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(np.zeros((4, 48), np.float32), "Q8_0")
    narrow = tiny_hf_folder(tmp_path / "narrow", hidden_size=128, head_dim=32)
    with pytest.raises(ValueError, match=r"tensor \S+ \(\S+\): Q6_K needs rows .* multiple of 256"):
        write_gguf(narrow, tmp_path / "narrow.gguf", "Q6_K")
    write_gguf(narrow, tmp_path / "narrow.gguf", "Q8_0")  # 128 fits Q8_0's blocks of 32


def _hf_tokenizer(folder: Path) -> dict:
    return json.loads((folder / "tokenizer.json").read_text())


def test_llama_metadata_is_llama_cpps(folders, tmp_path):
    folder = folders["llama"]
    metadata, tensors = read_gguf(write_gguf(folder, tmp_path / "m.gguf"))
    spec = _hf_tokenizer(folder)
    expected = {
        "general.architecture": "llama",
        "general.type": "model",
        "general.name": "Llama",  # from the folder's name, as gguf.Metadata derives it
        "general.file_type": 0,
        "general.quantization_version": 2,
        "llama.block_count": 2,
        "llama.context_length": 1024,
        "llama.embedding_length": 256,
        "llama.feed_forward_length": 512,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.key_length": 64,
        "llama.attention.value_length": 64,
        "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": 64,
        "llama.vocab_size": 2048,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": (folder / "chat_template.jinja").read_text(),
    }
    assert {key: metadata.get(key) for key in expected} == expected
    assert metadata["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    tokens = metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 2048 and tokens[:3] == ["<s>", "</s>", "<pad>"]
    vocab = spec["model"]["vocab"]
    assert all(tokens[i] == token for token, i in vocab.items())
    control, normal = int(gguf.TokenType.CONTROL), int(gguf.TokenType.NORMAL)
    assert metadata["tokenizer.ggml.token_type"] == [control] * 3 + [normal] * 2045
    assert metadata["tokenizer.ggml.merges"] == [" ".join(pair) for pair in spec["model"]["merges"]]
    assert "output.weight" in tensors and "rope_freqs.weight" not in tensors


def test_qwen_metadata_and_tensors(folders, tmp_path):
    metadata, tensors = read_gguf(write_gguf(folders["qwen2"], tmp_path / "q2.gguf", "Q8_0"))
    assert metadata["general.architecture"] == "qwen2"
    # convert_hf_to_gguf.py writes these two for llama only.
    assert "qwen2.vocab_size" not in metadata and "qwen2.rope.dimension_count" not in metadata
    for part in ("q", "k", "v"):
        assert tensors[f"blk.0.attn_{part}.bias"][0] == "F32"
    assert tensors["blk.0.attn_q.weight"][0] == "Q8_0"

    metadata, tensors = read_gguf(write_gguf(folders["qwen3"], tmp_path / "q3.gguf"))
    assert metadata["general.architecture"] == "qwen3"
    assert metadata["qwen3.attention.key_length"] == metadata["qwen3.attention.value_length"] == 128
    assert tensors["blk.1.attn_q_norm.weight"][1].shape == (128,)
    assert tensors["blk.1.attn_q.weight"][1].shape == (512, 256)
    q = _hf_weights(folders["qwen3"])["model.layers.1.self_attn.q_proj.weight"]
    assert np.array_equal(tensors["blk.1.attn_q.weight"][1], q)  # qwen3 is not permuted

    _, tensors = read_gguf(write_gguf(folders["llama-tied"], tmp_path / "tied.gguf"))
    assert "output.weight" not in tensors and "token_embd.weight" in tensors


def test_per_tensor_types_arch_and_metadata_overrides(folders, tmp_path):
    path = write_gguf(
        folders["llama"],
        tmp_path / "mixed.gguf",
        "Q4_K",
        types={"token_embd.weight": "Q8_0", "blk.*.ffn_down.weight": "Q6_K", "output.*": "F16"},
        metadata_overrides={
            "llama.context_length": 4096,
            "tokenizer.chat_template": None,
            "test.note": "written by the tests",
            "test.flag": gguf.GGUFValue(7, gguf.GGUFValueType.UINT8),
        },
    )
    metadata, tensors = read_gguf(path)
    assert tensors["token_embd.weight"][0] == "Q8_0"
    assert tensors["output.weight"][0] == "F16"
    assert tensors["blk.0.ffn_down.weight"][0] == tensors["blk.1.ffn_down.weight"][0] == "Q6_K"
    assert tensors["blk.0.ffn_up.weight"][0] == "Q4_K"
    assert tensors["blk.0.attn_norm.weight"][0] == "F32"
    assert metadata["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert metadata["llama.context_length"] == 4096
    assert "tokenizer.chat_template" not in metadata
    assert metadata["test.note"] == "written by the tests" and metadata["test.flag"] == 7
    field = gguf.GGUFReader(path).fields["llama.context_length"]
    assert field.types == [gguf.GGUFValueType.UINT32]  # an override keeps the key's type

    # Written as qwen2 instead: same tensors, not permuted, under qwen2's keys.
    metadata, tensors = read_gguf(write_gguf(folders["llama"], tmp_path / "q.gguf", arch="qwen2"))
    q = _hf_weights(folders["llama"])["model.layers.0.self_attn.q_proj.weight"]
    assert metadata["qwen2.block_count"] == 2 and "llama.block_count" not in metadata
    assert np.array_equal(tensors["blk.0.attn_q.weight"][1], q)


# --- transformers reads the files back -----------------------------------------------------------


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _rounded_like(model: torch.nn.Module, tensor_type: str) -> torch.nn.Module:
    """``model`` with every 2-D weight replaced by what ``tensor_type`` stores for it."""
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                w = param.numpy()
                param.copy_(torch.from_numpy(dequantize(quantize(w, tensor_type), tensor_type)))
    return model


@pytest.mark.parametrize(
    "name, tensor_type",
    [
        ("llama", "F32"),
        ("llama", "Q8_0"),
        ("llama-tied", "F32"),
        ("qwen2", "F32"),
        ("qwen3", "Q8_0"),
    ],
)
def test_transformers_loads_the_file_as_the_original(folders, tmp_path, name, tensor_type):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = folders[name]
    # Keep the file away from the folder's tokenizer.json: transformers would build the tokenizer
    # from that instead, and with no special tokens or chat template at all.
    path = write_gguf(folder, tmp_path / "only" / "model.gguf", tensor_type)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    from_gguf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tokenizer(SENTENCE).input_ids
    assert from_gguf(SENTENCE).input_ids == ids and ids[0] == tokenizer.bos_token_id
    assert from_gguf.eos_token_id == tokenizer.eos_token_id == 1
    assert from_gguf.chat_template == tokenizer.chat_template

    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    logits, expected = _logits(model, ids), _logits(original, ids)
    if tensor_type == "F32":
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    else:
        # The file's values exactly; the original's within what 8-bit rounding moves this random
        # model's logits (measured at most 0.34 on logits up to 7).
        torch.testing.assert_close(
            logits, _logits(_rounded_like(original, tensor_type), ids), atol=1e-4, rtol=0
        )
        torch.testing.assert_close(logits, expected, atol=0.5, rtol=0)
