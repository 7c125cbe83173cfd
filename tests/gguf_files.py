"""Small GGUF files for the tests, written offline the way llama.cpp's convert_hf_to_gguf.py does.

``write_gguf`` turns a Hugging Face Llama-family folder (Llama, Mistral, Qwen2, Qwen3, and the
mixture-of-experts Qwen3-MoE and Mixtral) or a Gemma 3 folder into one GGUF file: llama.cpp's
metadata keys, tokenizer and tensor names, Q/K rows permuted for the llama architecture, Gemma's
norms stored as 1 + w, 1-D tensors and the routers in F32, 2-D weights and the experts (stacked
per layer and projection into one 3-D tensor, `blk.N.ffn_gate_exps.weight`, as
convert_hf_to_gguf.py does) in the asked type. gguf-py quantizes the legacy
types itself; Q4_K, Q5_K and Q6_K, which it can only dequantize, are encoded here with a simple
min-max (max-abs for Q6_K) per sub-block, not llama.cpp's rounding search, so their values differ
from llama-quantize's but the blocks are valid. Like ggml, every block type needs rows (a weight's
last, input dimension) whose length is a multiple of the block size: 32 for Q4_0 .. Q8_0, 256
for the K-quants; other lengths raise ValueError (llama.cpp would fall back to another type).
``tiny_hf_folder`` builds a checkpoint whose every weight suits every type; ``read_gguf`` reads
a file back, dequantized.

To load a file with transformers (``gguf_file=``), keep it out of the HF folder: next to a
tokenizer.json, transformers builds the tokenizer from that file instead of from the GGUF.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", *K_QUANTS)

# As convert_hf_to_gguf.py registers them (Mistral converts to the llama architecture).
GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
}
# One expert's tensor in a Hugging Face checkpoint: layer, block, expert, projection.
EXPERT_NAME = re.compile(
    r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight"
)

# general.file_type for a file whose 2-D weights are all of one type ("Q4_K" is llama-quantize's
# alias for Q4_K_M, "Q5_K" for Q5_K_M).
FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
}

TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.1,
}


# --- tensors -------------------------------------------------------------------------------------


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder each head's rows from HF's rotate-half layout to llama.cpp's interleaved one, as
    convert_hf_to_gguf.py's LlamaModel.permute does. ``n_head``: the tensor's own head count
    (attention heads for Q, KV heads for K). Works on weights and biases."""
    heads = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
    return heads.swapaxes(1, 2).reshape(weight.shape)


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo ``permute_qk``: llama.cpp's row order back to Hugging Face's."""
    heads = weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
    return heads.swapaxes(1, 2).reshape(weight.shape)


def quantize(weight: np.ndarray, tensor_type: str) -> np.ndarray:
    """``weight`` (float, rows last) encoded as GGUF stores it: float32/float16 arrays for F32/F16,
    else uint8 with one row of blocks per row of ``weight``."""
    if tensor_type not in TENSOR_TYPES:
        raise ValueError(f"unsupported tensor type {tensor_type!r}; expected one of {TENSOR_TYPES}")
    qtype = gguf.GGMLQuantizationType[tensor_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if weight.shape[-1] % block_size:
        raise ValueError(
            f"{tensor_type} needs rows whose length is a multiple of {block_size}, "
            f"got shape {tuple(weight.shape)}"
        )
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if tensor_type not in K_QUANTS:
        return gguf.quants.quantize(weight, qtype)
    blocks = weight.reshape(-1, gguf.QK_K)
    encoded = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[tensor_type](blocks)
    assert encoded.shape == (len(blocks), type_size)
    return encoded.reshape(*weight.shape[:-1], -1)


def dequantize(data: np.ndarray, tensor_type: str) -> np.ndarray:
    """The float32 values that ``data`` (as ``quantize`` returns it) encodes."""
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[tensor_type])


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _divide(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x / scale, with 0 wherever the scale is 0."""
    return np.divide(x, scale, out=np.zeros_like(x), where=scale != 0)


def _scales_and_mins(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K: per sub-block of 32, value = d * sc * q - dmin * m with 6-bit sc and m, q < 2**bits.
    Returns the header bytes (d, dmin, 12 packed scale bytes) and q as (blocks, 8, 32)."""
    x = blocks.reshape(len(blocks), 8, 32)
    low = np.minimum(x.min(axis=-1), 0.0)  # the offset is subtracted, so it is never positive
    step = (x.max(axis=-1) - low) / (2**bits - 1)
    d = (step.max(axis=-1) / 63).astype(np.float16)
    dmin = (-low.min(axis=-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(_divide(step, d32)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_divide(-low, dmin32)), 0, 63).astype(np.uint8)
    # Encode with the scales as stored, so that their own rounding is compensated.
    offset, scale = (dmin32 * m)[..., None], (d32 * sc)[..., None]
    q = np.clip(np.rint(_divide(x + offset, scale)), 0, 2**bits - 1).astype(np.uint8)
    # ggml's 12 bytes: bytes 0-3 and 4-7 hold sub-blocks 0-3's scales and mins, and in their top
    # two bits the top bits of sub-blocks 4-7's, whose low four bits fill bytes 8-11 (mins high).
    hi_sc, hi_m = sc[:, 4:], m[:, 4:]
    packed = np.concatenate(
        [
            sc[:, :4] | (hi_sc >> 4) << 6,
            m[:, :4] | (hi_m >> 4) << 6,
            (hi_sc & 15) | (hi_m & 15) << 4,
        ],
        axis=1,
    )
    return _f16_bytes(d), _f16_bytes(dmin), packed, q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Sub-blocks 2i and 2i+1 of (blocks, 8, 32) share 32 bytes: low and high nibble."""
    pairs = q.reshape(len(q), 4, 2, 32)
    return (pairs[:, :, 0] & 15 | (pairs[:, :, 1] & 15) << 4).reshape(len(q), 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """block_q4_K: d, dmin (f16), 12 scale bytes, 128 bytes of 4-bit q."""
    d, dmin, scales, q = _scales_and_mins(blocks, 4)
    return np.concatenate([d, dmin, scales, _nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    """block_q5_K: as Q4_K, plus 32 bytes whose bit j is the fifth bit of sub-block j's q."""
    d, dmin, scales, q = _scales_and_mins(blocks, 5)
    high = ((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]
    return np.concatenate([d, dmin, scales, high.sum(axis=1, dtype=np.uint8), _nibbles(q)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """block_q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d (f16);
    value = d * scale * (q - 32) per sub-block of 16."""
    n = len(blocks)
    x = blocks.reshape(n, 16, 16)
    step = np.abs(x).max(axis=-1) / 31
    d = (step.max(axis=-1) / 127).astype(np.float16)
    sc = np.clip(np.rint(_divide(step, d[:, None].astype(np.float32))), 0, 127)
    d_sc = d[:, None].astype(np.float32) * sc
    q = np.clip(np.rint(_divide(x, d_sc[..., None])), -32, 31).reshape(n, 256)
    q = (q + 32).astype(np.uint8)
    # Each half of 128 values: values i and 64 + i share low-nibble byte i; values i, 32 + i,
    # 64 + i and 96 + i share high-bits byte i, two bits each.
    halves = q.reshape(n, 2, 2, 64)
    low = (halves[:, :, 0] & 15 | (halves[:, :, 1] & 15) << 4).reshape(n, 128)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    high = ((q.reshape(n, 2, 4, 32) >> 4) << shifts).sum(axis=2, dtype=np.uint8)
    return np.concatenate(
        [low, high.reshape(n, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1
    )


# --- the file ------------------------------------------------------------------------------------


def _hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors files (file by file, as convert_hf_to_gguf.py
    reads them), as float32."""
    from safetensors import safe_open

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensors[name] = f.get_tensor(name).to(torch.float32).numpy()
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return tensors


def _rope_parameters(config: dict) -> dict:
    """transformers 5's rope_parameters, or the older rope_scaling + rope_theta (Gemma 3: its
    global layers'; llama.cpp takes the local layers' base as 10000)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params = dict(params.get("full_attention", params))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _llama3_rope_factors(params: dict, head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp writes for Llama 3 rope scaling (a divisor per frequency)."""
    freqs = params["rope_theta"] ** -(np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * np.pi / freqs
    old_ctx = params.get("original_max_position_embeddings", 8192)
    low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
    factor = params["factor"]
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_ctx / low, factor, 1 / ((1 - smooth) / factor + smooth))
    return np.where(wavelen < old_ctx / high, 1.0, scaled).astype(np.float32)


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's guess for added tokens not flagged special."""
    return token in ("<pad>", "<mask>") or (token.startswith("<|") and token.endswith("|>"))


def _add_vocab(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    """The byte-level BPE tokenizer in llama.cpp's keys; the special ids, add_bos/eos, merges and
    chat template through gguf-py's SpecialVocab, as convert_hf_to_gguf.py does."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    if spec["model"]["type"] != "BPE":
        raise NotImplementedError(f"only BPE tokenizers, got {spec['model']['type']}")
    by_id = {i: (token, gguf.TokenType.NORMAL) for token, i in spec["model"]["vocab"].items()}
    for added in spec.get("added_tokens", []):
        kind = "CONTROL" if added["special"] or _looks_special(added["content"]) else "USER_DEFINED"
        by_id[added["id"]] = (added["content"], gguf.TokenType[kind])
    if max(by_id) >= vocab_size:
        raise ValueError(f"token id {max(by_id)} is past the model's vocab_size {vocab_size}")
    unused = (None, gguf.TokenType.UNUSED)
    entries = [by_id.get(i, unused) for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    # llama.cpp picks the pre-tokenizer by hashing how a known text encodes and knows no hash for
    # the tiny tokenizers built here; their ByteLevel split is GPT-2's, which is "gpt-2" there.
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([token or f"[PAD{i}]" for i, (token, _) in enumerate(entries)])
    writer.add_token_types([int(kind) for _, kind in entries])
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def _tensor_type(name: str, data: np.ndarray, default: str, types: dict[str, str]) -> str:
    """F32 for 1-D tensors, norms and routers (as llama.cpp), else the first matching ``types``
    pattern."""
    if data.ndim <= 1 or name.endswith(("_norm.weight", "ffn_gate_inp.weight")):
        return "F32"
    return next((t for pattern, t in types.items() if fnmatch.fnmatchcase(name, pattern)), default)


def write_gguf(
    hf_folder: Path,
    out: Path,
    tensor_type: str = "F32",
    *,
    types: dict[str, str] | None = None,
    arch: str | None = None,
    metadata_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write the Hugging Face checkpoint in ``hf_folder`` as the GGUF file ``out`` and return it.

    2-D weights are stored as ``tensor_type`` unless a ``types`` pattern (fnmatch, on GGUF names
    such as "token_embd.weight" or "blk.*.ffn_down.weight"; the first match wins) says otherwise;
    1-D tensors and norms are always F32. ``arch`` replaces the GGUF architecture derived from
    config.json (llama / qwen2 / qwen3; only llama permutes Q and K). ``metadata_overrides`` is
    applied last: a value replaces the key's (keeping its GGUF type if the key was written, else
    the type gguf-py infers: str, bool, int as INT32, float as FLOAT32, list as ARRAY; pass a
    ``gguf.GGUFValue`` to choose), None removes the key.

    As convert_hf_to_gguf.py: {arch}.vocab_size and rope.dimension_count only for llama,
    attention.key_length/value_length whenever config.json names head_dim, general.name from the
    folder's name, tokenizer.ggml.add_bos_token from tokenizer.json's post-processor.
    """
    if tensor_type not in FILE_TYPES:
        raise ValueError(f"unsupported tensor type {tensor_type!r}; expected one of {TENSOR_TYPES}")
    hf_folder, out = Path(hf_folder), Path(out)
    config = json.loads((hf_folder / "config.json").read_text(encoding="utf-8"))
    hf_arch = config["architectures"][0]
    if arch is None:
        if hf_arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {hf_arch!r}; expected one of {list(GGUF_ARCHITECTURES)}"
            )
        arch = GGUF_ARCHITECTURES[hf_arch]
    model_arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
    if model_arch is None:
        raise ValueError(f"gguf-py knows no architecture {arch!r}")
    n_layers, n_head = config["num_hidden_layers"], config["num_attention_heads"]
    n_kv_head = config.get("num_key_value_heads") or n_head
    head_dim = config.get("head_dim") or config["hidden_size"] // n_head
    rope = _rope_parameters(config)
    if rope["rope_type"] not in ("default", "linear", "llama3"):
        raise NotImplementedError(f"rope_type {rope['rope_type']!r}")

    experts = config.get("num_experts") or config.get("num_local_experts")
    if experts and (config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
        raise ValueError("llama.cpp's MoE architectures have experts in every layer")
    writer = gguf.GGUFWriter(out, arch)
    name_map = gguf.get_tensor_name_map(model_arch, n_layers)
    hf_tensors = _hf_tensors(hf_folder)
    if config.get("tie_word_embeddings"):
        hf_tensors.pop("lm_head.weight", None)
    if rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim))
    hf_tensors = _stack_experts(hf_tensors)
    for hf_name, data in hf_tensors.items():
        if hf_name.endswith(".rotary_emb.inv_freq"):
            continue
        name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for tensor {hf_name!r}")
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # Gemma3Model.norm_shift: llama.cpp's norms are 1 + w
        if arch == "llama" and ".attn_q." in name:
            data = permute_qk(data, n_head)
        elif arch == "llama" and ".attn_k." in name:
            data = permute_qk(data, n_kv_head)
        qtype = _tensor_type(name, data, tensor_type, types or {})
        try:
            encoded = quantize(data, qtype)
        except ValueError as error:
            raise ValueError(f"tensor {name} ({hf_name}): {error}") from None
        writer.add_tensor(name, encoded, raw_dtype=gguf.GGMLQuantizationType[qtype])

    writer.add_type(gguf.GGUFType.MODEL)
    counts = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, hf_folder, None, counts[0])
    metadata.size_label = metadata.size_label or gguf.size_label(*counts)
    metadata.set_gguf_meta_model(writer)
    writer.add_block_count(n_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_head_count_kv(n_kv_head)
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(FILE_TYPES[tensor_type])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocab(writer, hf_folder, config["vocab_size"])

    kv = writer.kv_data[0]
    for key, value in (metadata_overrides or {}).items():
        if value is None:
            kv.pop(key, None)
        elif isinstance(value, gguf.GGUFValue):
            kv[key] = value
        elif key in kv:
            kv[key] = gguf.GGUFValue(value, kv[key].type, kv[key].sub_type)
        else:
            kv[key] = gguf.GGUFValue(value, gguf.GGUFValueType.get_type(value))

    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's experts of one projection as one [experts, rows, columns] tensor, named as
    convert_hf_to_gguf.py's merged tensor (`model.layers.N.mlp.experts.gate_proj.weight`)."""
    out, stacks = {}, {}
    for name, data in tensors.items():
        match = EXPERT_NAME.fullmatch(name)
        if match is None:
            out[name] = data
            continue
        layer, block, expert, part = match.groups()
        stacks.setdefault(f"model.layers.{layer}.{block}.experts.{part}.weight", {})[
            int(expert)
        ] = data
    for name, parts in stacks.items():
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, np.ndarray]]]:
    """A GGUF file's metadata (key -> Python value) and tensors (name -> (type name, float32
    values in PyTorch's shape order, still in llama.cpp's Q/K row order))."""
    reader = gguf.GGUFReader(path)
    metadata = {
        field.name: field.contents()
        for field in reader.fields.values()
        if not field.name.startswith("GGUF.")
    }
    tensors = {}
    for t in reader.tensors:
        values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)  # a copy
        tensors[t.name] = (t.tensor_type.name, values.reshape(tuple(reversed(t.shape.tolist()))))
    return metadata, tensors


# --- tiny checkpoints ----------------------------------------------------------------------------


def tiny_hf_folder(
    path: Path,
    architecture: str = "LlamaForCausalLM",
    *,
    tie_word_embeddings: bool = False,
    head_dim: int | None = None,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a random tiny checkpoint to ``path`` and return it: hidden 256, intermediate 512,
    2 layers, 4 heads, 2 KV heads, so every 2-D weight's rows fit every block type, and the
    built-in default model's tokenizer (vocabulary 2048) and chat template.

    head_dim defaults to 64 = hidden / heads, and to 128 for Qwen3 (Qwen3Config's default, as in
    the real models; transformers' GGUF loader ignores qwen3.attention.key_length and assumes it).
    Qwen2 gets its qkv biases and Qwen3 its q/k norms from transformers; like build_checkpoint,
    every 1-D tensor gets seeded noise, so a dropped norm or bias shows. ``config_overrides`` go
    into the config (e.g. rope_scaling, attention_bias)."""
    import transformers

    from tandem.models.default_model import default_model_path

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    source = default_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, path / name)
    default_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    kwargs = {
        **TINY_CONFIG,
        "head_dim": head_dim or (128 if architecture == "Qwen3ForCausalLM" else 64),
        "vocab_size": default_config["vocab_size"],
        "tie_word_embeddings": tie_word_embeddings,
        **{k: default_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        **config_overrides,
    }
    name = "Gemma3TextConfig" if architecture == "Gemma3ForCausalLM" else architecture
    config = getattr(transformers, name.replace("ForCausalLM", "Config"))(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return path
