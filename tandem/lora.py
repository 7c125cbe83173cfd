"""LoRA adapters as a request names them (vLLM's `LoRARequest`), and the errors that refuse one.

An adapter is a PEFT checkpoint (`adapter_config.json` + `adapter_model.safetensors`) over the
engine's base model; requests of different adapters, and of the base model, share one step
(`models/lora.py` holds the weights, `ops/lora.py` computes their products).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Which adapter a request runs under: `lora_name` (what the server's `model` field names),
    `lora_int_id` (unique, > 0) and `lora_path`, the PEFT checkpoint's folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be an int >= 1")

    # vLLM's newer names for the same fields.
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


class LoraError(ValueError):
    """An adapter the engine cannot run, named with the reason."""


class LoraNotFound(LoraError):
    """A request or an unload named an adapter the engine does not hold."""
