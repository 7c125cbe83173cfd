"""Small LoRA adapters for the tests, made offline with peft, and peft's greedy reference outputs.

``make_adapter`` wraps a tiny base checkpoint (conftest's ``tiny_llama``, ``tiny_checkpoints``)
with ``peft.get_peft_model`` and saves what ``PeftModel.save_pretrained`` writes for a real
adapter: ``adapter_config.json``, ``adapter_model.safetensors`` (and a README.md model card).
peft initialises every lora_B to zero, which would make the adapter a no-op, so A and B are
filled with seeded random values instead.

What peft 0.21 saves (metadata {"format": "pt"}; names without the adapter name "default"):
``base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_A.weight`` [r, in_features]
and ``...lora_B.weight`` [out_features, r], and likewise ``mlp.{gate,up,down}_proj``; the
delta is ``y += scaling * B @ (A @ x)`` with ``scaling = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora`` (per module, ``rank_pattern`` and ``alpha_pattern``
override r and lora_alpha for the module names they match). The config keys that matter: "r",
"lora_alpha", "use_rslora", "target_modules" (a list, saved in set order, or a regex string),
"layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "modules_to_save",
"bias" ("none"), "lora_bias", "fan_in_fan_out" (false), "use_dora" (false), "peft_type"
("LORA"), "task_type" ("CAUSAL_LM"), "base_model_name_or_path" (the base folder).

Bad adapters for the error tests: ``make_wrong_shape_adapter`` (tensors made on a base of another
hidden size) and ``remove_adapter_weights`` (adapter_config.json without adapter_model.safetensors:
delete the file, the missing-file case).

``PeftModel.from_pretrained`` injects the LoRA layers into the base model it is given, in place,
so the references here load their own copy of the base and never touch conftest's
``_load_hf_model`` cache (whose models ``hf_greedy_reference`` uses for the base outputs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tandem.models.default_model import build_checkpoint

from conftest import FAST_PATH_LOGITS_ATOL, follow_near_ties

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# With std=None, the delta of each adapted projection is about this fraction of the base
# projection's output (see `make_adapter`): greedy outputs change clearly, logits stay sane.
DEFAULT_RELATIVE_DELTA = 0.5


def make_adapter(
    base: Path,
    out: Path,
    *,
    rank: int,
    targets: Sequence[str],
    alpha: float | None = None,
    rslora: bool = False,
    seed: int = 0,
    std: float | None = None,
    dtype: torch.dtype = torch.float32,
    **lora_config: Any,
) -> Path:
    """Write a peft LoRA adapter for the checkpoint ``base`` to ``out`` and return ``out``.

    ``LoraConfig(r=rank, lora_alpha=alpha (default 2 * rank), target_modules=targets,
    use_rslora=rslora, lora_dropout=0, bias="none", task_type="CAUSAL_LM")``, updated with
    ``lora_config`` (e.g. ``layers_to_transform=[1]``, ``rank_pattern={"q_proj": 2}``,
    ``alpha_pattern``). Every lora_A and lora_B entry is drawn from N(0, std²) with a generator
    seeded by ``seed``, in module order. ``std=None`` picks it per module so that the delta is
    about DEFAULT_RELATIVE_DELTA of the base projection's output whatever the rank and scaling:
    with base weights of std ``initializer_range`` and the same input, |scaling * B A x| /
    |W x| ~ scaling * sqrt(r) * std² / initializer_range. ``dtype``: the saved tensors' dtype
    (peft upcasts them to the base's fp32 when loading, so the reference sees the rounded values).
    """
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    base, out = Path(base), Path(out)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    init_range = float(getattr(model.config, "initializer_range", 0.1))
    kwargs: dict[str, Any] = {
        "r": rank,
        "lora_alpha": 2 * rank if alpha is None else alpha,
        "target_modules": list(targets),
        "use_rslora": rslora,
        "lora_dropout": 0.0,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }
    kwargs.update(lora_config)
    peft_model = get_peft_model(model, LoraConfig(**kwargs))

    generator = torch.Generator().manual_seed(seed)
    filled = 0
    with torch.no_grad():
        for module in peft_model.modules():
            if not isinstance(module, LoraLayer):
                continue
            for adapter_name, r in module.r.items():
                scaling = module.scaling[adapter_name]
                module_std = std
                if module_std is None:
                    module_std = math.sqrt(
                        DEFAULT_RELATIVE_DELTA * init_range / (scaling * math.sqrt(r))
                    )
                weights = [
                    *(m[adapter_name].weight for m in (module.lora_A, module.lora_B)
                      if adapter_name in m),
                    *(p[adapter_name] for p in (module.lora_embedding_A, module.lora_embedding_B)
                      if adapter_name in p),
                ]  # fmt: skip
                for weight in weights:
                    noise = torch.randn(weight.shape, generator=generator) * module_std
                    # Round as the saved dtype will, so the file and this model agree exactly.
                    weight.copy_(noise.to(dtype).to(weight.dtype))
                    filled += 1
    assert filled, f"no LoRA layer matched target_modules={targets}"

    if dtype != torch.float32:
        peft_model = peft_model.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out)
    assert (out / "adapter_config.json").is_file()
    assert (out / "adapter_model.safetensors").is_file()
    return out


def make_wrong_shape_adapter(
    out: Path,
    architecture: str = "LlamaForCausalLM",
    *,
    rank: int = 4,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    **checkpoint_kwargs: Any,
) -> Path:
    """An adapter whose tensors do not fit the tiny models: made on a base of hidden size 96 (not
    build_checkpoint's 64), so e.g. q_proj.lora_A is [rank, 96]; same names, layers and config
    keys otherwise. ``checkpoint_kwargs`` go to build_checkpoint (hidden_size=96 by default; e.g.
    ``num_hidden_layers=4`` for an adapter naming layers the 2-layer models lack). That base is
    built next to ``out``, in ``<out>-base``."""
    out = Path(out)
    checkpoint_kwargs.setdefault("hidden_size", 96)
    other_base = build_checkpoint(out.with_name(out.name + "-base"), architecture,
                                  **checkpoint_kwargs)  # fmt: skip
    return make_adapter(other_base, out, rank=rank, targets=list(targets))


def remove_adapter_weights(adapter: Path) -> Path:
    """Delete ``adapter_model.safetensors`` from an adapter folder (the missing-file case: the
    folder keeps its adapter_config.json); returns the folder. Copy the adapter first
    (``shutil.copytree``) if the complete one is needed too."""
    (Path(adapter) / "adapter_model.safetensors").unlink()
    return Path(adapter)


@functools.cache
def _load_peft_model(base: str, adapter: str) -> torch.nn.Module:
    """transformers' fp32 ``base`` with the peft ``adapter`` applied (not merged), eval mode,
    once per (base, adapter). A fresh copy of the base: peft modifies the model it wraps. Its
    generation_config is blank, as in conftest's ``_load_hf_model``, so EOS never stops it.
    Cached by path: a test that rewrites an adapter folder must use a new one."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.generation_config = GenerationConfig()
    peft_model = PeftModel.from_pretrained(model, adapter)
    return peft_model.eval()


def _key(path: Path) -> str:
    return str(Path(path).resolve())


# (base, adapter, prompt) -> the longest greedy continuation computed so far.
_peft_reference_cache: dict[tuple[str, str, tuple[int, ...]], list[int]] = {}


def peft_greedy_reference(
    base: Path, adapter: Path, prompt_token_ids: list[int], max_new_tokens: int
) -> list[int]:
    """Exactly ``max_new_tokens`` greedy tokens that transformers + peft generate after the
    prompt with ``adapter`` on ``base``: batch of one, no padding, never stopping at EOS (as
    conftest's ``hf_greedy_reference``); a cached longer run answers shorter requests."""
    from transformers import GenerationConfig

    key = (_key(base), _key(adapter), tuple(prompt_token_ids))
    cached = _peft_reference_cache.get(key)
    if cached is not None and len(cached) >= max_new_tokens:
        return cached[:max_new_tokens]
    if max_new_tokens == 0:
        return []

    model = _load_peft_model(key[0], key[1])
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.long)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.config.pad_token_id,
    )
    with torch.no_grad():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
        )
    new_tokens = output[0, len(prompt_token_ids) :].tolist()
    assert len(new_tokens) == max_new_tokens, "peft stopped before max_new_tokens"
    _peft_reference_cache[key] = new_tokens
    return list(new_tokens)


def peft_logits(base: Path, adapter: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers + peft's fp32 logits [len(token_ids), vocab] for one sequence."""
    model = _load_peft_model(_key(base), _key(adapter))
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float()


def peft_greedy_allowing_near_ties(
    base: Path,
    adapter: Path,
    prompt_token_ids: list[int],
    max_new_tokens: int | None,
    candidate: list[int],
    bound: float = FAST_PATH_LOGITS_ATOL,
) -> list[int]:
    """peft's greedy tokens to compare the engine's ``candidate`` with, following the engine
    where peft's top logit and its logit for the engine's token are within ``bound``
    (conftest's ``follow_near_ties``), so a near tie in a random model does not fail a test.

    ``max_new_tokens`` tokens, ``len(candidate)`` if None (an aborted request's prefix)."""

    def logits_after(prefix: list[int]) -> torch.Tensor:
        return peft_logits(base, adapter, list(prompt_token_ids) + prefix)[-1]

    return follow_near_ties(
        candidate,
        len(candidate) if max_new_tokens is None else max_new_tokens,
        lambda prefix, n: peft_greedy_reference(base, adapter, list(prompt_token_ids) + prefix, n),
        logits_after,
        bound,
    )
