"""GGUF checkpoints (llama.cpp's one-file format): config, tokenizer and weights from one file.

The file is read with the `gguf` package and memory-mapped. Each tensor is dequantized as it is
copied into its parameter, so besides the model at most one tensor is ever held in full
precision; a tensor-parallel rank dequantizes only the rows (or the blocks of columns) it holds.
The config is rebuilt as a transformers config, so the rest of the loader treats a GGUF like a
checkpoint folder.

Mixture-of-experts files store each layer's experts stacked in one 3-D tensor per projection
(`blk.N.ffn_gate_exps.weight`: [experts, rows, columns]); each expert is read as the Hugging Face
checkpoint's own tensor of that expert, so loading, sharding and the shape checks see the names
a safetensors checkpoint has. llama.cpp stores Mixtral as "llama" with `llama.expert_count`.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerFast

from tandem.models import gguf_blocks
from tandem.models.errors import ModelLoadError
from tandem.ops.quantized import QuantizedWeight, pack

# A GGUF's `general.architecture` -> the transformers architecture Tandem runs it as. llama.cpp
# stores Mistral's dense models as "llama", and Mixtral as "llama" with experts.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Stacked experts -> one expert's Hugging Face names: the block's prefix and each projection's.
_EXPERT_TENSORS = {"ffn_gate_exps.weight": "gate", "ffn_up_exps.weight": "up",
                   "ffn_down_exps.weight": "down"}  # fmt: skip
_EXPERT_NAMES = {
    "llama": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
    "qwen3moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
# The transformers model type of a GGUF architecture, where the two names differ (a gemma3
# file holds the text model only).
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
# Architectures whose norm weights llama.cpp's converter stores as 1 + w (Gemma's norms scale by
# 1 + w); loading subtracts the 1 again, as transformers' GGUF loader does.
PLUS_ONE_NORMS = {"gemma3"}
# Gemma 3's chat template (text turns; a system message joins the first user turn), for a file
# that carries none: llama.cpp's converter writes the one of the checkpoint's tokenizer, which
# base models lack.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA3_END_OF_TURN = "<end_of_turn>"
# Architectures whose Q and K rows llama.cpp's converter interleaves per head (rotary pairs
# side by side); loading puts them back in Hugging Face's half-split order.
PERMUTED_QK = {"llama"}
DEQUANTIZED_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip  # the types the tests write; others are refused by name
# GGUF metadata -> generation default, as in `general.sampling.*` of llama.cpp's converter.
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",  # Gemma's: _GEMMA3_LAYER_TENSORS
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
} | {
    f"attn_{gguf}.{kind}": f"self_attn.{hf}_proj.{kind}"
    for gguf, hf in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
    for kind in ("weight", "bias")
}
# Gemma 3 norms the attention's and the MLP's outputs too; its ffn_norm is the MLP's input norm.
_GEMMA3_LAYER_TENSORS = _LAYER_TENSORS | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_MODEL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PERMUTED_SUFFIXES = tuple(
    f"self_attn.{p}_proj.{kind}" for p in "qk" for kind in ("weight", "bias")
)
ROPE_FREQS = "rope_freqs.weight"  # Llama 3's per-frequency rope divisors, when present


@dataclass
class GGUFFile:
    """One parsed GGUF file: its metadata fields and its (memory-mapped) tensors by name."""

    path: Path
    reader: GGUFReader
    architecture: str
    tensors: dict[str, ReaderTensor]  # by GGUF name

    def field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.architecture}.{key}", default)

    def release_pages(self) -> None:
        """Drop the file's pages from this process's memory once its weights are copied out (the
        model holds its own copies): a mapping read through stays resident, as large as the
        file, for as long as the file is cached here. Later reads fault pages back in."""
        self.reader.release_pages()

    def release_tensor_pages(self, tensor: ReaderTensor) -> None:
        """`release_pages` for one tensor's bytes, once they are copied out: so that a load's
        peak holds the model and the tensor being read, not the model and the file."""
        self.reader.release_pages(int(tensor.data_offset), int(tensor.n_bytes))

    @property
    def tensor_types(self) -> str:
        """The file's storage types, most common first, e.g. "Q4_1, F32, Q8_0"."""
        counts: dict[str, int] = {}
        for tensor in self.tensors.values():
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return ", ".join(sorted(counts, key=lambda name: -counts[name]))


def open_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file once per process (it is read for its config, tokenizer and weights)."""
    stat = path.stat()
    return _open_gguf(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    try:
        reader = _Reader(path)
    except Exception as exc:  # bad magic, a header or tensor table cut short, a bad type id
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}"
        ) from exc
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    for tensor in reader.tensors:  # the reader maps what is there: a short file shows here
        if tensor.data_offset + tensor.n_bytes > size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {tensor.name} ends at byte "
                f"{tensor.data_offset + tensor.n_bytes}, the file has {size}"
            )
    arch_field = reader.fields.get("general.architecture")
    file = GGUFFile(path, reader, str(arch_field.contents()) if arch_field else "", tensors)
    if file.architecture not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: architecture {file.architecture or 'none given'!r} ({file.tensor_types}) "
            f"is not supported; Tandem runs GGUF architectures {', '.join(ARCHITECTURES)}"
        )
    unsupported = {t.tensor_type.name for t in reader.tensors} - set(DEQUANTIZED_TYPES)
    if unsupported:
        raise ModelLoadError(
            f"{path}: {file.architecture} with tensor type(s) {', '.join(sorted(unsupported))} "
            f"is not supported; Tandem dequantizes {', '.join(DEQUANTIZED_TYPES)}"
        )
    return file


class _Reader(GGUFReader):
    """gguf's reader over a plain-array view of its memory map: parsing a vocabulary's ~100k
    strings through np.memmap's subclass hooks costs seconds, through a plain view a second."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)
        self._map = value.base if isinstance(value.base, mmap.mmap) else None

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
        """A metadata array in one pass: its scalars as one view, its strings as memoryview
        slices (the parent makes numpy views per element: 5 s for a 262k-token vocabulary)."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        kind, n, offs = GGUFValueType(item_type[0]), int(count[0]), orig_offs + 12
        scalar = self.gguf_scalar_to_np.get(kind)
        if n == 0 or (scalar is None and kind != GGUFValueType.STRING):  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        types = [GGUFValueType.ARRAY, kind]
        if scalar is not None:
            values = self._get(offs, scalar, n)
            if len(values) < n:
                raise ValueError(f"an array of {n} values runs past the end of the file")
            return 12 + int(values.nbytes), [item_type, count, values], [2], types
        data, parts = memoryview(self._plain), [item_type, count]
        for _ in range(n):
            length = int.from_bytes(data[offs : offs + 8], "little")
            if offs + 8 + length > len(data):
                raise ValueError("a string runs past the end of the file")
            parts.append(data[offs + 8 : offs + 8 + length])
            offs += 8 + length
        return offs - orig_offs, parts, list(range(2, 2 + n)), types

    def release_pages(self, start: int = 0, length: int | None = None) -> None:
        """Drop the mapping's pages over [start, start + length) (the whole file by default)."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        if length is None:
            self._map.madvise(mmap.MADV_DONTNEED)
            return
        first = start - start % mmap.PAGESIZE  # madvise takes whole pages
        end = min(start + length, len(self._map))
        if end > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)


def gguf_config(file: GGUFFile) -> PretrainedConfig:
    """The file's metadata as the transformers config of the architecture Tandem runs it as."""
    arch, f = file.architecture, file.arch_field
    try:
        hidden, heads = int(f("embedding_length")), int(f("attention.head_count"))
        values = {
            "architectures": [ARCHITECTURES[arch]],
            "hidden_size": hidden,
            "intermediate_size": int(f("feed_forward_length")),
            "num_hidden_layers": int(f("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(f("attention.head_count_kv", heads)),
            "head_dim": int(f("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(f("context_length")),
            "rms_norm_eps": float(f("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(f("rope.freq_base", 10000.0)),
            "vocab_size": int(f("vocab_size", 0)) or len(file.field("tokenizer.ggml.tokens", [])),
            "tie_word_embeddings": "output.weight" not in file.tensors,
            "attention_bias": "blk.0.attn_q.bias" in file.tensors,
        }
        model_type = MODEL_TYPES.get(arch, arch)
        if int(f("expert_count", 0) or 0):
            model_type = _moe_values(file, values)
    except (TypeError, ValueError) as exc:  # a field missing (None) or of the wrong kind
        raise ModelLoadError(f"{file.path}: incomplete {arch} metadata: {exc}") from exc
    scaling = str(f("rope.scaling.type", "none"))
    if scaling == "linear":
        values["rope_scaling"] = {"rope_type": "linear", "factor": float(f("rope.scaling.factor"))}
    elif scaling == "yarn":
        values["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(f("rope.scaling.factor")),
            "original_max_position_embeddings": int(f("rope.scaling.original_context_length")),
        }
    elif scaling != "none":
        raise ModelLoadError(f"{file.path}: rope scaling {scaling!r} is not supported")
    if arch == "gemma3":
        values |= _gemma3_values(file, values)
    eos = [file.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if arch == "gemma3":
        eos.append(_token_id(file, GEMMA3_END_OF_TURN))  # ends a turn; the file names only <eos>
    eos = [int(i) for i in dict.fromkeys(eos) if i is not None]
    values["eos_token_id"] = eos[0] if len(eos) == 1 else eos or None
    for name, key in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        token = file.field(f"tokenizer.ggml.{key}_token_id")
        values[name] = None if token is None else int(token)
    return AutoConfig.for_model(model_type, **values)


def _moe_values(file: GGUFFile, values: dict) -> str:
    """Add the experts' config values (llama.cpp's Qwen3-MoE always renormalises the top-k);
    returns the transformers model type."""
    f = file.arch_field
    experts, used = int(f("expert_count")), int(f("expert_used_count"))
    if file.architecture == "llama":
        values |= {"architectures": ["MixtralForCausalLM"], "num_local_experts": experts,
                   "num_experts_per_tok": used}  # fmt: skip
        return "mixtral"
    if file.architecture != "qwen3moe":
        raise ModelLoadError(f"{file.path}: {file.architecture} with experts is not supported")
    values |= {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": True,
               "moe_intermediate_size": int(f("expert_feed_forward_length"))}  # fmt: skip
    return "qwen3_moe"


def _gemma3_values(file: GGUFFile, values: dict) -> dict:
    """Gemma 3's numbers that are not the Llama family's. The layer pattern (five sliding layers,
    then a global one) and the local rope base (10000) are Gemma 3's constants in llama.cpp and
    transformers alike, so the file does not store them; `rope.freq_base` is the global base."""
    window = file.arch_field("attention.sliding_window")
    if window is None:
        raise ModelLoadError(f"{file.path}: gemma3 metadata without attention.sliding_window")
    # llama.cpp scales queries by head_dim ** -0.5, but by (hidden / heads) ** -0.5 for the 27B
    # (62 layers), whose query_pre_attn_scalar is that.
    big = values["num_hidden_layers"] == 62
    scalar = values["hidden_size"] // values["num_attention_heads"] if big else values["head_dim"]
    return {
        "sliding_window": int(window),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": scalar,
    }


def _token_id(file: GGUFFile, token: str) -> int | None:
    tokens = file.field("tokenizer.ggml.tokens", [])
    return tokens.index(token) if token in tokens else None


def gguf_tokenizer(file: GGUFFile) -> PreTrainedTokenizerFast:
    """The tokenizer the file describes (vocabulary, merges, special tokens, chat template), as
    transformers rebuilds it from a GGUF."""
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            file.path.parent, gguf_file=file.path.name, local_files_only=True
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot build the tokenizer of {file.path}: {exc}") from exc
    if file.architecture == "gemma3" and not tokenizer.chat_template:
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    return tokenizer


def gguf_generation_defaults(file: GGUFFile) -> dict[str, float | int]:
    """The sampling defaults the file's metadata carries (`general.sampling.*`), if any."""
    defaults: dict[str, float | int] = {}
    for key, name in SAMPLING_KEYS.items():
        value = file.field(key)
        if value is not None:
            defaults[name] = int(value) if name == "top_k" else float(value)
    return defaults


def rope_freq_factors(file: GGUFFile) -> torch.Tensor | None:
    """Llama 3's rope divisors, one per frequency, if the file has them."""
    tensor = file.tensors.get(ROPE_FREQS)
    return None if tensor is None else GGUFTensor(file, tensor, None)[:]


def gguf_tensors(file: GGUFFile, head_dim: int) -> Iterator[tuple[str, GGUFTensor]]:
    """Every weight under its Hugging Face name, as a lazily dequantized tensor."""
    arch = file.architecture
    for name, tensor in file.tensors.items():
        experts = _expert_names(file.architecture, name)
        if experts is not None:
            for e, hf_name in enumerate(experts(int(tensor.shape[-1]))):
                yield hf_name, GGUFTensor(file, tensor, None, expert=e)
            continue
        hf_name = hf_tensor_name(name, arch) or hf_router_name(arch, name)
        if hf_name is None:
            continue
        permuted = arch in PERMUTED_QK and hf_name.endswith(_PERMUTED_SUFFIXES)
        minus_one = arch in PLUS_ONE_NORMS and hf_name.endswith("norm.weight")
        yield hf_name, GGUFTensor(file, tensor, head_dim if permuted else None, minus_one)


def _expert_names(arch: str, name: str):
    """For a stacked experts tensor: a function of the expert count giving each expert's HF
    name; for the router, its HF name is `hf_tensor_name`'s. None for any other tensor."""
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _EXPERT_TENSORS:
        return None
    block, names = _EXPERT_NAMES.get(arch, _EXPERT_NAMES["qwen3moe"])
    part = names[_EXPERT_TENSORS[parts[2]]]
    return lambda n: [
        f"model.layers.{parts[1]}.{block}.experts.{e}.{part}.weight" for e in range(n)
    ]


def hf_tensor_name(name: str, architecture: str = "llama") -> str | None:
    """llama.cpp's tensor name -> the Hugging Face checkpoint's (None: not a weight Tandem reads)."""
    if name in _MODEL_TENSORS:
        return _MODEL_TENSORS[name]
    layer = _GEMMA3_LAYER_TENSORS if architecture == "gemma3" else _LAYER_TENSORS
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}"
    return None


def hf_router_name(arch: str, name: str) -> str | None:
    """llama.cpp's `blk.N.ffn_gate_inp.weight` -> the router's HF name (Mixtral's or Qwen's)."""
    parts = name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] != "ffn_gate_inp.weight":
        return None
    block = _EXPERT_NAMES.get(arch, _EXPERT_NAMES["qwen3moe"])[0]
    return f"model.layers.{parts[1]}.{block}.gate.weight"


class GGUFTensor:
    """One tensor, indexed as a safetensors slice is (`[:]`, `[rows]`, `[:, cols]`), dequantized
    to float32 on read. Rows are whole blocks, so a row slice reads only its rows; a column slice
    reads only its blocks when its ends fall on block boundaries."""

    def __init__(
        self,
        file: GGUFFile,
        tensor,
        unpermute_head_dim: int | None,
        minus_one: bool = False,
        expert: int | None = None,
    ):
        self.file = file
        self.tensor = tensor
        self.unpermute_head_dim = unpermute_head_dim
        self.minus_one = minus_one  # a norm stored as 1 + w (Gemma): read back as w
        self.shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # torch order
        self.expert = expert  # one expert of a stacked experts tensor
        if expert is not None:
            self.shape = self.shape[1:]

    @property
    def data(self) -> np.ndarray:
        """The raw rows (of this expert's matrix, for a stacked experts tensor)."""
        return self.tensor.data if self.expert is None else self.tensor.data[self.expert]

    def __getitem__(self, key) -> torch.Tensor:
        rows, cols = key if isinstance(key, tuple) else (key, slice(None))
        data = self.data[rows]
        if cols != slice(None):
            data, cols = self._column_blocks(data, cols)
        values = self._dequantize(data)[..., cols]
        if self.unpermute_head_dim is not None:
            values = _unpermute_rows(values, self.unpermute_head_dim)
        if self.minus_one:
            values = values - np.float32(1.0)
        if not np.isfinite(values).all():  # a corrupt scale shows here, once per tensor
            raise ModelLoadError(f"{self.file.path}: tensor {self.tensor.name} holds NaN or Inf")
        return torch.from_numpy(np.ascontiguousarray(values))

    @property
    def native_format(self) -> str | None:
        """The layout the CPU kernels run the tensor's blocks in (`quantized`;
        `gguf_blocks.LAYOUTS`), else None."""
        return gguf_blocks.LAYOUTS.get(self.tensor.tensor_type.name)

    def quantized(
        self, rows: slice | None, cols: slice | None, layout: str | None = None
    ) -> QuantizedWeight:
        """Rows and columns of the tensor in the kernels' layout (its own, or a wider one that
        holds it exactly: a fused layer's), its blocks' values as they are (the columns on
        block boundaries)."""
        kind = self.tensor.tensor_type.name
        layout = layout or self.native_format
        data = self.data if rows is None else self.data[rows]
        codes, scales, offsets = gguf_blocks.split_blocks(data, kind, self.shape[-1], layout)
        if cols is not None:
            start, stop, _ = cols.indices(self.shape[-1])
            width = self.shape[-1] // scales.shape[1]  # columns per scale: 32, or Q6_K's 16
            per_block = slice(start // width, stop // width)
            codes = codes[:, start:stop]
            scales, offsets = (None if t is None else t[:, per_block] for t in (scales, offsets))
        parts = [codes, scales, offsets]
        if self.unpermute_head_dim is not None:
            parts = [
                None if t is None else _unpermute_rows(t, self.unpermute_head_dim) for t in parts
            ]
        if not all(t is None or np.isfinite(t).all() for t in parts[1:]):  # scales and offsets
            raise ModelLoadError(f"{self.file.path}: tensor {self.tensor.name} holds NaN or Inf")
        tensors = [None if t is None else torch.from_numpy(np.array(t)) for t in parts]
        source = kind if kind == layout else f"{kind} as {layout}"
        return pack(*tensors, source, keep_offsets=layout != "Q4_0")

    def _column_blocks(self, data: np.ndarray, cols: slice) -> tuple[np.ndarray, slice]:
        """Narrow quantized rows to the blocks that hold `cols`, where the ends allow it."""
        block, type_size = GGML_QUANT_SIZES[self.tensor.tensor_type]
        if data.dtype != np.uint8 or data.ndim != 2:  # stored as values: slice after
            return data, cols
        start, stop, _ = cols.indices(self.shape[-1])
        if start % block or (stop % block and stop != self.shape[-1]):
            return data, cols
        first, last = start // block * type_size, -(-stop // block) * type_size
        return data[:, first:last], slice(None)

    def _dequantize(self, data: np.ndarray) -> np.ndarray:
        kind = self.tensor.tensor_type
        if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return data.astype(np.float32)
        try:
            return dequantize(data, kind)
        except Exception as exc:
            raise ModelLoadError(
                f"{self.file.path}: cannot dequantize {self.tensor.name} ({kind.name}): {exc}"
            ) from exc


def _unpermute_rows(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: within each head its converter interleaves the two
    halves of the rotary dimensions (row 2i+j holds Hugging Face's row j*head_dim/2 + i)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(rows // head_dim, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
