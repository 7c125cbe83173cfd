"""Random-weight GGUF files of a Hugging Face config's shape: a model too large for this machine in
float32 runs quantized, in Tandem and in llama.cpp alike, without its weights ever existing.

The file is named and described as llama.cpp's convert_hf_to_gguf.py writes the architecture
(qwen3moe, qwen3 or llama: experts stacked per layer as `blk.N.ffn_{gate,up,down}_exps.weight`),
but its weights are random blocks made directly in their storage type (random codes under a
float16 scale that keeps every value within about `WEIGHT_SCALE`): quantizing float weights of
billions of parameters would take far longer than the benchmark. Every 2-D and 3-D weight is of
one block type; 1-D tensors (norms, all ones) and the routers stay F32, as llama.cpp keeps them.
The file is streamed: the header and tensor table first, then one tensor at a time, so that at
most one tensor is ever held in memory.

The vocabulary is SmolLM2-135M's (the `tokenizer.*` metadata of the packaged GGUF,
`smollm2-135m-instruct`, 49152 tokens), which both llama.cpp and transformers' GGUF tokenizer
load: the file has the config's shape except for its vocabulary size, which is 49152.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tandem.bench.workloads import MODELS_DIR
from tandem.models.catalog import PACKAGED_MODELS, cache_root
from tandem.models.errors import ModelLoadError

BLOCK_TYPES = ("Q4_0", "Q8_0", "Q4_K")
FILE_TYPES = {
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,  # every weight Q4_K: llama-quantize's Q4_K_S
}
# As convert_hf_to_gguf.py registers them.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
TOKENIZER_MODEL = "smollm2-135m-instruct"
# About the largest |value| of a weight: a matrix over a unit-RMS input of a few thousand values
# gives outputs of RMS well under 1, so activations stay finite through any depth.
WEIGHT_SCALE = 0.02
FORMAT_VERSION = 1  # part of the cache key: a change to what is written makes a new file


def cache_dir() -> Path:
    """Tandem's cache (TANDEM_CACHE_DIR, else ~/.cache/tandem)/models."""
    return cache_root() / "models"


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file: its GGUF name, shape (PyTorch's order: rows last) and type."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "F32" or one of BLOCK_TYPES

    @property
    def nbytes(self) -> int:
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.kind]]
        return math.prod(self.shape[:-1]) * self.shape[-1] // block * size


def load_config(folder: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of `folder`, `overrides` put over it (e.g. {"num_hidden_layers": 12})."""
    config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    return config | (overrides or {})


def tensors_of(config: dict[str, Any], vocab_size: int, block_type: str) -> list[Tensor]:
    """Every tensor llama.cpp's converter writes for the config, in a file of `block_type`."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    arch = gguf_architecture(config)
    experts = config.get("num_experts") or 0
    inter = config["moe_intermediate_size"] if experts else config["intermediate_size"]
    for name, size in (("hidden_size", hidden), ("intermediate size", inter),
                       ("heads x head_dim", heads * head_dim)):  # fmt: skip
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[block_type]][0]
        if size % block:
            raise ValueError(f"{block_type} needs rows of a multiple of {block}: {name} is {size}")

    def weight(name: str, *shape: int) -> Tensor:
        return Tensor(name, shape, block_type)

    def vector(name: str, size: int) -> Tensor:
        return Tensor(name, (size,), "F32")

    out = [weight("token_embd.weight", vocab_size, hidden)]
    if _rope_type(config) == "llama3":
        out.append(vector("rope_freqs.weight", head_dim // 2))
    for i in range(config["num_hidden_layers"]):
        blk = f"blk.{i}"
        out += [
            vector(f"{blk}.attn_norm.weight", hidden),
            weight(f"{blk}.attn_q.weight", heads * head_dim, hidden),
            weight(f"{blk}.attn_k.weight", kv_heads * head_dim, hidden),
            weight(f"{blk}.attn_v.weight", kv_heads * head_dim, hidden),
            weight(f"{blk}.attn_output.weight", hidden, heads * head_dim),
            vector(f"{blk}.ffn_norm.weight", hidden),
        ]
        if arch != "llama":
            out += [vector(f"{blk}.attn_q_norm.weight", head_dim),
                    vector(f"{blk}.attn_k_norm.weight", head_dim)]  # fmt: skip
        if experts:
            out += [
                Tensor(f"{blk}.ffn_gate_inp.weight", (experts, hidden), "F32"),
                weight(f"{blk}.ffn_gate_exps.weight", experts, inter, hidden),
                weight(f"{blk}.ffn_up_exps.weight", experts, inter, hidden),
                weight(f"{blk}.ffn_down_exps.weight", experts, hidden, inter),
            ]
        else:
            out += [
                weight(f"{blk}.ffn_gate.weight", inter, hidden),
                weight(f"{blk}.ffn_up.weight", inter, hidden),
                weight(f"{blk}.ffn_down.weight", hidden, inter),
            ]
    out.append(vector("output_norm.weight", hidden))
    if not config.get("tie_word_embeddings"):
        out.append(weight("output.weight", vocab_size, hidden))
    return out


def gguf_architecture(config: dict[str, Any]) -> str:
    hf_arch = config["architectures"][0]
    if hf_arch not in ARCHITECTURES:
        raise ValueError(f"random GGUF files of {', '.join(ARCHITECTURES)} only, got {hf_arch}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("random GGUF files have no biases: the config asks for some")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError("llama.cpp's qwen3moe has experts in every layer")
    return ARCHITECTURES[hf_arch]


def _rope_type(config: dict[str, Any]) -> str:
    scaling = config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope scaling {rope_type!r} is not written (default or llama3 only)")
    return rope_type


def llama3_rope_factors(config: dict[str, Any], head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores for Llama 3's rope scaling."""
    scaling = config["rope_scaling"]
    factor, old_context = scaling["factor"], scaling.get("original_max_position_embeddings", 8192)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    wavelength = 2 * np.pi * config.get("rope_theta", 10000.0) ** exponents
    # The middle band's blend (clipped: the other bands take 1 or `factor`).
    smooth = np.clip((old_context / wavelength - low) / (high - low), 0.0, 1.0)
    factors = np.where(wavelength > old_context / low, factor, 1 / ((1 - smooth) / factor + smooth))
    return np.where(wavelength < old_context / high, 1.0, factors).astype(np.float32)


# --- random blocks -------------------------------------------------------------------------------


def random_blocks(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Random `kind` blocks for a weight of `shape`, as GGUF stores them: uint8 rows of blocks.
    Codes are random bytes; each block's float16 scale is drawn so that |value| <= WEIGHT_SCALE
    and the values centre on zero."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    count = math.prod(shape) // block
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    spread = rng.uniform(0.5, 1.0, size=count).astype(np.float32)  # each block its own scale
    if kind == "Q4_0":  # d (f16), 32 x 4-bit q: d * (q - 8)
        blocks[:, :2] = _f16_bytes(spread * WEIGHT_SCALE / 8)
    elif kind == "Q8_0":  # d (f16), 32 x int8 q: d * q
        blocks[:, :2] = _f16_bytes(spread * WEIGHT_SCALE / 128)
    elif kind == "Q4_K":
        blocks[:, :16] = _q4_k_header(rng, spread)
    else:
        raise ValueError(f"random blocks of {', '.join(BLOCK_TYPES)} only, got {kind}")
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def _q4_k_header(rng: np.random.Generator, spread: np.ndarray) -> np.ndarray:
    """Q4_K's d, dmin (f16) and 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32: value
    = d * sc * q - dmin * m. With m = sc and dmin = 7.5 d, that is d * sc * (q - 7.5)."""
    d = (spread * WEIGHT_SCALE / (63 * 8)).astype(np.float16)
    dmin = (d.astype(np.float32) * 7.5).astype(np.float16)
    sc = rng.integers(16, 64, size=(len(spread), 8), dtype=np.uint8)  # 6 bits, never tiny
    low, high = sc[:, :4], sc[:, 4:]
    # ggml's packing: bytes 0-3 scales and 4-7 mins of sub-blocks 0-3, with the top two bits of
    # sub-blocks 4-7's in their top bits; bytes 8-11 the low nibbles of 4-7's scales and mins.
    top = (high >> 4) << 6
    packed = np.concatenate([low | top, low | top, (high & 15) | (high & 15) << 4], axis=1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed], axis=1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _values(rng: np.random.Generator, tensor: Tensor, config: dict[str, Any]) -> np.ndarray:
    """An F32 tensor: norms are ones, the router random, rope_freqs Llama 3's own."""
    if tensor.name == "rope_freqs.weight":
        return llama3_rope_factors(config, tensor.shape[0] * 2)
    if tensor.name.endswith("ffn_gate_inp.weight"):
        return rng.normal(0.0, WEIGHT_SCALE, size=tensor.shape).astype(np.float32)
    return np.ones(tensor.shape, dtype=np.float32)


# --- the file ------------------------------------------------------------------------------------


def tokenizer_fields() -> list[gguf.ReaderField]:
    """The packaged SmolLM2 GGUF's `tokenizer.*` metadata (vocabulary, merges, special ids, chat
    template)."""
    from tandem.models.gguf_checkpoint import open_gguf  # transformers: not to parse the flags

    path = PACKAGED_MODELS[TOKENIZER_MODEL].path()
    if path is None:
        raise ModelLoadError(
            f"a random GGUF takes its tokenizer from {TOKENIZER_MODEL}, which is not installed: "
            f"{PACKAGED_MODELS[TOKENIZER_MODEL].install}"
        )
    fields = open_gguf(path).reader.fields.values()
    return [f for f in fields if f.name.startswith("tokenizer.")]


def write_random_gguf(
    config_folder: Path,
    out: Path,
    block_type: str,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
) -> Path:
    """Write a random-weight GGUF of `config_folder`'s config.json (with `overrides`) in
    `block_type` to `out`, one tensor at a time, and return `out`."""
    if block_type not in BLOCK_TYPES:
        raise ValueError(f"random GGUF files are {', '.join(BLOCK_TYPES)}, got {block_type!r}")
    config = load_config(config_folder, overrides)
    arch = gguf_architecture(config)
    vocab = tokenizer_fields()
    vocab_size = len(next(f for f in vocab if f.name == "tokenizer.ggml.tokens").data)
    tensors = tensors_of(config, vocab_size, block_type)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads

    writer = gguf.GGUFWriter(out, arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"random {Path(config_folder).name}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("num_experts"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(vocab_size)
        writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(FILE_TYPES[block_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for field in vocab:
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    for t in tensors:
        quantized = t.kind != "F32"
        dtype = np.dtype(np.uint8 if quantized else np.float32)
        shape = (*t.shape[:-1], t.nbytes // math.prod(t.shape[:-1]) // dtype.itemsize)
        raw = gguf.GGMLQuantizationType[t.kind] if quantized else None
        writer.add_tensor_info(t.name, shape, dtype, t.nbytes, raw_dtype=raw)

    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:  # in the table's order, one at a time
            data = (
                _values(rng, t, config) if t.kind == "F32" else random_blocks(rng, t.shape, t.kind)
            )
            writer.write_tensor_data(data)
    finally:
        writer.close()
    return out


def random_gguf_path(
    config_folder: Path, block_type: str, overrides: dict[str, Any] | None = None, seed: int = 0
) -> Path:
    """Where the cache keeps the file: its name says the config, layers and type; a hash of the
    whole config (overrides included), the seed and FORMAT_VERSION tells files apart."""
    config = load_config(config_folder, overrides)
    key = json.dumps([config, block_type, seed, FORMAT_VERSION], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    layers = config["num_hidden_layers"]
    name = f"random-{Path(config_folder).resolve().name}-{layers}layers-{block_type.lower()}"
    return cache_dir() / f"{name}-{digest}.gguf"


def cached_random_gguf(
    config_folder: Path,
    block_type: str,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Path:
    """The cached random GGUF, written first if absent (`log` says which). It is written under
    a temporary name and renamed, so an interrupted write is never reused."""
    path = random_gguf_path(config_folder, block_type, overrides, seed)
    if path.is_file():
        log(f"random GGUF: {path} (cached)")
        return path
    log(f"random GGUF: writing {path}")
    partial = path.with_name(path.name + ".partial")
    write_random_gguf(config_folder, partial, block_type, overrides, seed)
    os.replace(partial, path)
    return path


def config_folder(model: str | None) -> Path:
    """--random-gguf's --model: a folder with config.json, or the name of a config shipped in
    tandem/bench/models (e.g. qwen3-30b-a3b)."""
    for folder in [Path(model).expanduser(), MODELS_DIR / model] if model else []:
        if (folder / "config.json").is_file():
            return folder
    shipped = ", ".join(sorted(p.name for p in MODELS_DIR.iterdir() if p.is_dir()))
    raise ValueError(
        f"--random-gguf writes the shape of --model, a folder with config.json or a shipped "
        f"config ({shipped}); got {model!r}"
    )
