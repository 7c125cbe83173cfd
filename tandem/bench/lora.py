"""The `lora` workload: the random workload run once per count of LoRA adapters its requests
spread over (request i under adapter i mod count; 0: the base model alone), on an engine with a
slot for each. The adapters are random PEFT checkpoints of the model's shapes, written once into
the cache folder (no peft needed) and loaded before the runs, as a server loads its
--lora-modules: what the report measures is serving them, not reading them.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.lora import LoRARequest

if TYPE_CHECKING:  # the command line's parser imports this module: no torch until a run
    from tandem.config import EngineConfig
    from tandem.models.spec import LlamaSpec

LORA_PRESET = "lora"
LORA_COUNTS = "0,1,4,8"
LORA_RANK = 16
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ",".join(PROJECTIONS)  # PEFT's "all-linear"


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(f"{LORA_PRESET} workload")
    g.add_argument(
        "--lora-counts",
        default=LORA_COUNTS,
        help="the adapter counts to run the workload over, one run each (0: the base "
        "model alone); the engine gets a slot for each adapter of the largest",
    )
    g.add_argument("--lora-rank", type=int, default=LORA_RANK)
    g.add_argument("--lora-targets", default=LORA_TARGETS,
                   help="the projections the adapters adapt, PEFT's module names")  # fmt: skip


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or any(c < 0 for c in counts):
        raise ValueError(f"--lora-counts takes adapter counts (>= 0), got {text!r}")
    return counts


def parse_targets(text: str) -> list[str]:
    targets = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in targets if t not in PROJECTIONS]
    if not targets or unknown:
        raise ValueError(f"--lora-targets takes projections among {LORA_TARGETS}, "
                         f"got {text!r}")  # fmt: skip
    return targets


def lora_config(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """The engine with a slot for each adapter of the largest count."""
    parse_targets(args.lora_targets)
    if args.lora_rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {args.lora_rank}")
    most = max(parse_counts(args.lora_counts))
    return replace(config, enable_lora=True, max_loras=max(1, most), max_lora_rank=args.lora_rank)


def write_random_adapter(
    folder: Path, spec: LlamaSpec, rank: int, targets: list[str], seed: int
) -> Path:
    """A PEFT checkpoint of random A and B (each product's delta about a tenth of its input's
    scale), written once: a folder that holds one already is reused."""
    import torch
    from safetensors.torch import save_file

    from tandem.models.lora import module_shapes

    config = folder / "adapter_config.json"
    if config.is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = module_shapes(spec)
    tensors = {}
    for layer in range(spec.num_layers):
        for module in targets:
            if module in ("gate_proj", "up_proj", "down_proj") and spec.is_sparse(layer):
                continue
            out, inp = shapes[module]
            owner = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{owner}.{module}"
            a = torch.randn(rank, inp, generator=generator) / inp**0.5
            b = torch.randn(out, rank, generator=generator) * (0.1 / rank**0.5)
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config.write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
    }))  # fmt: skip
    return folder


def random_adapters(
    cache: Path, spec: LlamaSpec, model_name: str, count: int, rank: int, targets: list[str]
) -> list[LoRARequest]:
    """`count` random adapters of the model's shapes, from the cache folder."""
    tag = f"{model_name}-r{rank}-{'-'.join(sorted(targets))}"
    return [
        LoRARequest(
            f"bench-{i}", i + 1, str(write_random_adapter(cache / tag / str(i), spec, rank,
                                                          targets, seed=i))
        )
        for i in range(count)
    ]  # fmt: skip


def spread(adapters: list[LoRARequest], count: int, n: int) -> list[LoRARequest | None]:
    """Request i's adapter: the i mod count-th of the first `count`; none for count 0."""
    return [adapters[i % count] if count else None for i in range(n)]
