"""Load a checkpoint from disk: a Hugging Face folder (config.json, safetensors, tokenizer
files) or a GGUF file (`gguf_checkpoint.py`), or a folder holding one.

With `load_format="dummy"` the weights are made up from the config alone (`models/dummy.py`),
and a folder without tokenizer files gives a model without a tokenizer (token ids only).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tandem.models import gguf_blocks
from tandem.models import gguf_checkpoint as gguf
from tandem.models.catalog import checkpoint_path, is_gguf
from tandem.models.dummy import load_dummy_weights
from tandem.models.errors import ModelLoadError
from tandem.models.gemma3 import Gemma3Model, gemma3_spec
from tandem.models.llama import LlamaModel, Rotary
from tandem.models.moe import moe_spec
from tandem.models.parallel import SINGLE, WHOLE_MODEL, PipelineStage, TensorParallel
from tandem.models.spec import LlamaSpec, shape_values

# Any of these makes a folder's tokenizer loadable (fast tokenizer, its config, sentencepiece, BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DEFAULT_INITIALIZER_RANGE = 0.02  # dummy weights' standard deviation when the config names none

# Architectures outside the Llama family: their model class and the spec read from the config.
MODELS: dict[str, tuple[type[LlamaModel], Callable[[PretrainedConfig], LlamaSpec]]] = {
    "Gemma3ForCausalLM": (Gemma3Model, gemma3_spec),
}
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    *MODELS,
)


@dataclass
class LoadedModel:
    model: LlamaModel
    spec: LlamaSpec
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None: the folder has no tokenizer files
    path: Path


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    tp: TensorParallel = SINGLE,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    int8_activations: bool = False,
) -> LoadedModel:
    path, spec, hf_config = read_config(path)
    model = build_model(
        path, spec, hf_config, dtype, device, max_model_len, tp, load_format, seed, quantization,
        int8_activations,
    )  # fmt: skip
    return LoadedModel(model, spec, hf_config, find_tokenizer(path), path)


def read_config(path: str | Path) -> tuple[Path, LlamaSpec, PretrainedConfig]:
    """Validate a checkpoint's config: what the host needs without any weights. Returns the
    checkpoint's path (a folder, or the GGUF file a folder holds), its spec and its config."""
    path = checkpoint_path(path)
    if is_gguf(path):
        hf_config = gguf.gguf_config(gguf.open_gguf(path))
        return path, _spec_from_config(hf_config), hf_config
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # malformed JSON, unknown model_type ...
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {exc}") from exc
    return path, _spec_from_config(hf_config), hf_config


def find_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None if a folder has no tokenizer files at all (a
    config-only folder for dummy weights: the engine then takes token ids only). Files that fail
    to load raise."""
    if is_gguf(path):
        return gguf.gguf_tokenizer(gguf.open_gguf(path))
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return load_tokenizer(path)


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer files in {path}: {exc}") from exc


def build_model(
    path: Path,
    spec: LlamaSpec,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    tp: TensorParallel = SINGLE,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    int8_activations: bool = False,
    stage: PipelineStage = WHOLE_MODEL,
) -> LlamaModel:
    """This rank's model (its pipeline `stage`'s layers) with its shard of the weights, read
    straight from the safetensors, or made up on the device (`load_format="dummy"`, seeded by
    `seed`). The parameters are allocated once, in `dtype`, on `device`; the linear layers a
    GGUF's blocks fill (`quantization` None, float32 on a CPU) get no float copy at all.
    `int8_activations` lays every quantized layer out for the kernels' integer products."""
    positions = max_model_len or spec.max_position_embeddings
    with torch.device("meta"):
        model = model_class(hf_config)(spec, tp, stage)
    native = quantization is None and device.type == "cpu" and dtype == torch.float32
    if native and load_format == "auto" and is_gguf(path):
        tensors = dict(gguf.gguf_tensors(gguf.open_gguf(path), spec.head_dim))
        model.plan_quantized_weights(
            lambda name: tensors[name].native_format if name in tensors else None,
            gguf_blocks.common_layout,  # a fused layer's parts in several formats
        )
    model = model.to(dtype).to_empty(device=device)
    factors = gguf.rope_freq_factors(gguf.open_gguf(path)) if is_gguf(path) else None
    tables = {}
    for layer_type in model.rope_layer_types:
        inv_freq, scaling = _inv_freq(hf_config, layer_type)
        if factors is not None:
            inv_freq = inv_freq / factors  # Llama 3's rope scaling, as llama.cpp stores it
        tables[layer_type] = Rotary(inv_freq, scaling, positions).to(device)
    model.set_rotary(tables)
    if load_format == "dummy":
        std = getattr(hf_config, "initializer_range", None) or DEFAULT_INITIALIZER_RANGE
        load_dummy_weights(model, seed, std)
    elif load_format == "auto" and is_gguf(path):
        _load_gguf_weights(model, path)
    elif load_format == "auto":
        _load_weights(model, path)
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if quantization == "int8":
        model.quantize_int8()
    elif quantization == "fp8":
        model.quantize_fp8()
    if int8_activations and not model.use_int8_activations():
        raise ModelLoadError(
            "int8_activations needs quantized linear layers: a GGUF's Q8_0/Q4_0/Q4_1/Q4_K "
            "blocks, or quantization='int8'"
        )
    return model.eval().requires_grad_(False)


def model_class(config: PretrainedConfig) -> type[LlamaModel]:
    """The class that runs a (supported) config's architecture."""
    arch = _architecture(config)
    return MODELS[arch][0] if arch in MODELS else LlamaModel


def _architecture(config: PretrainedConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or 'none given'}; "
            f"Tandem supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _spec_from_config(config: PretrainedConfig) -> LlamaSpec:
    arch = _architecture(config)
    if arch in MODELS:
        return MODELS[arch][1](config)
    sliding_window, sliding_layers = None, None
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        sliding_window = getattr(config, "sliding_window", None)
    elif getattr(config, "use_sliding_window", False):  # Qwen2/Qwen3: some layers windowed
        sliding_window = config.sliding_window
        sliding_layers = tuple(t == "sliding_attention" for t in config.layer_types)
    return LlamaSpec(
        **shape_values(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM"
        or bool(getattr(config, "qkv_bias", False))  # Qwen2-MoE
        or bool(getattr(config, "attention_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_window=sliding_window,
        sliding_layers=sliding_layers,
        o_bias=arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        and bool(getattr(config, "attention_bias", False)),
        moe=moe_spec(arch, config),
    )


def _inv_freq(
    config: PretrainedConfig, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse rope frequencies and attention scaling, computed by transformers' own functions
    (for the layers of `layer_type`, in a config with rope parameters per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv, float(scaling)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index} is malformed: {exc}") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors weights found in {path} (load_format='dummy' builds the model "
            "from config.json alone, with random weights)"
        )
    return files


def _load_weights(model: LlamaModel, path: Path) -> None:
    loaded: set[str] = set()
    for file in _weight_files(path):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if model.load_weight(name, f.get_slice(name)):
                        loaded.add(name)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"cannot read weights from {file}: {exc}") from exc
    _check_complete(model, loaded, path)


def _load_gguf_weights(model: LlamaModel, path: Path) -> None:
    """Each tensor dequantized as it is copied into place; its shape checked against the
    config, so a file whose metadata and tensors disagree never loads as a wrong model."""
    file, loaded = gguf.open_gguf(path), set()
    shapes = model.checkpoint_shapes()
    previous = None  # the file's tensor read last (a stacked experts tensor: one per expert)
    for name, tensor in gguf.gguf_tensors(file, model.spec.head_dim):
        if previous is not None and tensor.tensor is not previous:
            file.release_tensor_pages(previous)  # copied out: its pages need not stay
        previous = tensor.tensor
        if name in shapes and tensor.shape != shapes[name]:
            raise ModelLoadError(
                f"{path}: tensor {tensor.tensor.name} has shape {tensor.shape}, the metadata "
                f"implies {shapes[name]} for {name}"
            )
        if model.load_weight(name, tensor):
            loaded.add(name)
    _check_complete(model, loaded, path)
    file.release_pages()


def _check_complete(model: LlamaModel, loaded: set[str], path: Path) -> None:
    missing = model.checkpoint_names() - loaded
    if missing:
        raise ModelLoadError(f"weights missing from {path}: {', '.join(sorted(missing)[:8])}")
