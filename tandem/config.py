"""Engine configuration: one dataclass, validated once, shared by every component."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from tandem.reasoning import PARSER_CHOICES

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# auto: read the checkpoint's safetensors; dummy: build the model from config.json alone with
# seeded random weights made on the device (shapes and speed of a model without its download).
LOAD_FORMATS = ("auto", "dummy")
# auto: the model's dtype; int8 (CPU) and fp8 (e4m3, CUDA): a byte a value, and a float32 scale
# per block of 32 values (int8) or per token and kv head (fp8) (`ops/kv_quant.py`).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
KV_CACHE_DEVICES = {"int8": "cpu", "fp8": "cuda"}
QUANTIZATIONS = (None, "none", "int8", "fp8")  # EngineConfig.quantization
FP8_MIN_CAPABILITY = (8, 9)  # the first CUDA architecture with FP8 tensor cores (Ada)
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")  # SpeculativeConfig.method
MAX_SPECULATIVE_TOKENS = 16
# num_speculative_tokens unless given: suffix drafts as far as its trees are confident.
DEFAULT_SPECULATIVE_TOKENS = {"ngram": 4, "suffix": MAX_SPECULATIVE_TOKENS, "draft_model": 4}


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def nested_setting(cls: type, value, name: str, unknown_means: str):
    """A nested setting's dataclass from itself, a dict of its fields, or their JSON text (the
    command line's); None stays None. A ValueError says what is wrong, by `name`."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict (or its JSON text)")
    unknown = sorted(set(value) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"{name} has {unknown_means}: {', '.join(unknown)}")
    return cls(**value)


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): each step drafts up to
    `num_speculative_tokens` tokens per request and verifies them in one forward.

    ngram: drafts are the tokens that followed the latest earlier occurrence of the request's
    last `prompt_lookup_max` .. `prompt_lookup_min` tokens (prompt and output), found on the
    device. suffix: the host's suffix trees (arctic-inference's, vLLM's names) over the request's
    prompt and output and over the outputs of the last `suffix_decoding_max_cached_requests`
    requests; a draft is as long as its tokens' estimated chance stays at least
    `suffix_decoding_min_token_prob` and at most `suffix_decoding_max_spec_factor` times the
    matched context (`scheduling/suffix_proposer.py`). draft_model: a smaller checkpoint `model`
    with the target's vocabulary drafts them.
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None  # the cap; default per method
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: a folder or GGUF file, as EngineConfig.model
    suffix_decoding_max_tree_depth: int = 24  # the longest context matched, and each tree's depth
    suffix_decoding_max_cached_requests: int = 10000  # outputs in the global tree (0: none)
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Adaptive draft length: a request's drafts shrink while few are accepted (down to none,
    # retried now and then) and grow back while most are; False: always the full length.
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            names = ", ".join(SPECULATIVE_METHODS)
            raise ValueError(
                f"speculative_config.method must be one of {names}, got {self.method!r}"
            )
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS[self.method]
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "suffix_decoding_max_tree_depth",
        ):
            self._check(name, lambda v: v >= 1, "a positive integer")
        self._check(
            "suffix_decoding_max_cached_requests", lambda v: v >= 0, "a non-negative integer"
        )
        self._check(
            "suffix_decoding_max_spec_factor", lambda v: v > 0, "a positive number", int | float
        )
        self._check(
            "suffix_decoding_min_token_prob", lambda v: 0 <= v <= 1, "in [0, 1]", int | float
        )
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens is at most {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                "speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} > {self.prompt_lookup_max}"
            )
        if self.method == "suffix" and importlib.util.find_spec("arctic_inference") is None:
            raise ValueError(
                "speculative_config method 'suffix' needs arctic-inference's suffix trees: "
                "pip install 'tandem[suffix]'"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError(
                "speculative_config.model is given with method 'draft_model' only, and it needs one"
            )

    def _check(self, name: str, ok: Callable[[float], bool], wanted: str, kind=int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, kind) or not ok(value):
            raise ValueError(f"speculative_config.{name} must be {wanted}, got {value!r}")

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a config, a dict of its fields, or their JSON text (the command line's)."""
        return nested_setting(cls, value, "speculative_config", "unknown fields")


@dataclass
class KVEventsConfig:
    """vLLM's `kv_events_config`: the prefix cache's blocks, stored and removed, published after
    each step on a ZeroMQ PUB socket in vLLM's wire format (`engine/kv_events.py`), which
    KV-cache-aware routers (llm-d, Dynamo) subscribe to. A tcp endpoint's port is offset by the
    data-parallel rank, as vLLM's."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "zmq", or "null": nothing published
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000  # batches the socket queues for a slow subscriber before dropping
    data_parallel_rank: int = 0  # set per engine core by the server

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(
                f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}"
            )
        if self.hwm < 0:
            raise ValueError(f"kv_events_config.hwm must be >= 0, got {self.hwm}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def of(cls, value: KVEventsConfig | dict | str | None) -> KVEventsConfig | None:
        """From a config, a dict of its fields, or their JSON text (the command line's)."""
        return nested_setting(cls, value, "kv_events_config", "unknown or unsupported fields")


@dataclass
class EngineConfig:
    """Everything that shapes the engine; names follow vLLM where vLLM has one."""

    model: str | None = None
    load_format: str = "auto"  # auto: the folder's safetensors; dummy: seeded random weights
    # None: a GGUF's Q8_0/Q4_0/Q4_1/Q4_K blocks run as they are (CPU, float32; others are
    # dequantized); "none": every weight dequantized; "int8": per-channel int8 linear layers (CPU);
    # "fp8": per-channel e4m3 decoder weights, activations per token (CUDA capability 8.9+, bf16;
    # on a CPU the same numbers in float32 GEMMs, for checking, not speed).
    quantization: str | None = None
    # True: quantized layers multiply int8-quantized activations (per row and block of 32) in
    # integers, as llama.cpp does: fewer instructions per weight, outputs no longer the float
    # model's.
    int8_activations: bool = False
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    num_kv_blocks: int | None = None  # fixes the cache size exactly
    kv_cache_memory_gib: float = 1.0  # CPU: cache size (per rank) when num_kv_blocks is not given
    gpu_memory_utilization: float = 0.85  # CUDA: fraction of free memory for the cache
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    async_scheduling: bool = True
    enable_prefix_caching: bool = True  # share full KV blocks between requests with a common prefix
    cpu_threads: int | None = None  # CPU: torch's intra-op threads (per rank); None: default
    enforce_eager: bool = False  # True: portable PyTorch ops only (no fused kernels, no packing)
    tensor_parallel_size: int = 1  # ranks the model is split over, one spawned process each
    # Stages the layers are split over, each of tensor_parallel_size ranks (tensor parallel
    # within a node, pipeline across nodes); micro-batches keep every stage busy.
    pipeline_parallel_size: int = 1
    # "mp": the engine spawns its ranks on this machine; "external_launcher" (vLLM's name): a
    # launcher such as torchrun started every rank, each a whole engine (`execution/launcher.py`).
    distributed_executor_backend: str = "mp"
    # Tensor parallelism over several machines (vLLM's names): node 0 runs the engine and holds
    # ranks 0..k-1, node n ranks n*k..; every node but 0 runs `tandem serve --headless`
    # (`execution/cluster.py`). They meet at master_addr:master_port (node 0's address).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # False: outputs carry token ids only, and stop strings are not looked for (the server's
    # front end detokenizes and ends a request on a stop string itself, off the engine's loop).
    detokenize: bool = True
    # Sampling defaults for what a request leaves unset: auto, the checkpoint's
    # (generation_config.json or GGUF metadata); vllm, none; or a folder's generation_config.json.
    generation_config: str = "auto"
    # Put over those defaults, as vLLM's --override-generation-config: sampling fields by name,
    # and max_new_tokens, a cap on every request's output (the server's default output length).
    override_generation_config: dict[str, float | int] | None = None
    # Reasoning models: which block of the output is thinking (`tandem/reasoning.py`): "auto"
    # (qwen3's where the chat template writes <think>, else none), "none", "deepseek_r1", "qwen3".
    reasoning_parser: str = "auto"
    speculative_config: SpeculativeConfig | dict | str | None = None
    kv_events_config: KVEventsConfig | dict | str | None = None
    # LoRA adapters (vLLM's names): slots for max_loras adapters at once (more are loaded into
    # the least recently used free slot), each of rank up to max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)
        self.kv_events_config = KVEventsConfig.of(self.kv_events_config)
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and self.world_size > 1:
            raise ValueError(
                "speculative_config method 'draft_model' runs in one process "
                "(tensor_parallel_size 1, pipeline_parallel_size 1); 'ngram' and 'suffix' work "
                "over several ranks"
            )
        for name in (
            "block_size", "max_num_batched_tokens", "max_num_seqs", "max_loras", "max_lora_rank"
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self._check_pipeline()
        if self.distributed_executor_backend not in ("mp", "external_launcher"):
            raise ValueError(
                "distributed_executor_backend must be 'mp' or 'external_launcher', "
                f"got {self.distributed_executor_backend!r}"
            )
        self._check_nodes()
        if self.distributed_executor_backend == "external_launcher" and spec and spec.adaptive:
            raise ValueError(  # each rank would time its own steps, and schedule its own drafts
                "speculative_config under distributed_executor_backend='external_launcher' "
                'needs "adaptive": false: every rank must draft alike'
            )
        if self.reasoning_parser not in PARSER_CHOICES:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(PARSER_CHOICES)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            names = ", ".join(repr(q) for q in QUANTIZATIONS)
            raise ValueError(f"quantization must be one of {names}, got {self.quantization!r}")
        if self.quantization == "int8" and (
            self.torch_device.type != "cpu" or self.torch_dtype != torch.float32
        ):
            raise ValueError("quantization='int8' runs on the CPU in float32 (CPU kernels)")
        if self.quantization == "fp8":
            self._check_fp8()
        if self.int8_activations and (
            self.torch_device.type != "cpu"
            or self.torch_dtype != torch.float32
            or self.enforce_eager
            or self.quantization in ("none", "fp8")
        ):
            raise ValueError(
                "int8_activations runs quantized layers on the CPU kernels: float32 on the CPU, "
                "not with enforce_eager or quantization 'none' or 'fp8'"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        device = KV_CACHE_DEVICES.get(self.kv_cache_dtype)
        if device is not None and self.torch_device.type != device:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} runs on {device.upper()} only "
                f"(int8 on the CPU, fp8 on CUDA); this engine runs on {self.torch_device.type}"
            )
        if self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        self.torch_device  # noqa: B018 - validates the device name
        self.torch_dtype  # noqa: B018 - validates the dtype name

    def _check_nodes(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"nnodes must be >= 1 and node_rank in 0..nnodes-1, got nnodes {self.nnodes}, "
                f"node_rank {self.node_rank}"
            )
        if not 0 < self.master_port < 65535:  # the next port is node 0's step listener
            raise ValueError(f"master_port must be in 1..65534, got {self.master_port}")
        if self.nnodes == 1:
            return
        if self.distributed_executor_backend != "mp":
            raise ValueError(
                "nnodes > 1 is the engine's own multi-node launch; under "
                "distributed_executor_backend='external_launcher' the launcher places the ranks"
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"{self.world_size} ranks (tensor_parallel_size {self.tensor_parallel_size} x "
                f"pipeline_parallel_size {self.pipeline_parallel_size}) do not split over nnodes "
                f"{self.nnodes}: every node holds the same number of ranks"
            )

    def _check_pipeline(self) -> None:
        pp = self.pipeline_parallel_size
        if pp < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp}")
        if pp == 1:
            return
        if self.distributed_executor_backend != "mp":
            raise ValueError(
                f"pipeline_parallel_size {pp} does not run with "
                "distributed_executor_backend='external_launcher': use tensor parallelism alone "
                "for it"
            )

    @property
    def world_size(self) -> int:
        """Every rank of the engine: tensor_parallel_size in each of the pipeline's stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def _check_fp8(self) -> None:
        device = self.torch_device
        if device.type != "cuda":
            return
        if self.torch_dtype != torch.bfloat16:
            raise ValueError("quantization='fp8' on CUDA computes in bfloat16 (dtype='bfloat16')")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FP8_MIN_CAPABILITY:
            raise ValueError(
                f"quantization='fp8' needs FP8 tensor cores (CUDA compute capability 8.9 or "
                f"higher); this GPU has {major}.{minor}"
            )

    @property
    def weight_quantization(self) -> str | None:
        """What the loader does: an eager run dequantizes a GGUF (its kernels are the fast
        path's)."""
        if self.quantization is None and self.enforce_eager:
            return "none"
        return self.quantization

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but CUDA is not available")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"unsupported device {self.device!r}: use 'cpu' or 'cuda'")
        return device

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype: the model's, or int8 codes, or fp8 codes as uint8."""
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        return torch.int8 if self.kv_cache_dtype == "int8" else torch.uint8

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose from {sorted(_DTYPES)}")
        return _DTYPES[self.dtype]
