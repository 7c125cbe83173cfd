"""A model's own sampling defaults: what a request that sets no temperature, top_p, top_k, min_p
or repetition_penalty gets, read from the checkpoint as vLLM does (`generation_config="auto"`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tandem.models import gguf_checkpoint as gguf
from tandem.models.catalog import is_gguf
from tandem.models.errors import ModelLoadError
from tandem.request import SAMPLING_FIELDS, SamplingParams

# auto: the checkpoint's; vllm: none (Tandem's and vLLM's own defaults); else a folder path.
GENERATION_CONFIG_SOURCES = ("auto", "vllm")


@dataclass(frozen=True)
class GenerationDefaults:
    values: dict[str, float | int] = field(default_factory=dict)
    source: str = ""  # where they come from, for the log line

    def describe(self) -> str:
        """One line for logs and stderr: which defaults requests get, and from where."""
        if not self.values:
            return f"sampling defaults: none from the model ({self.source or 'none given'})"
        given = ", ".join(f"{name}={value}" for name, value in self.values.items())
        return f"sampling defaults: {given} (from {self.source}; --generation-config vllm ignores them)"


def read_generation_defaults(
    checkpoint: Path, generation_config: str = "auto"
) -> GenerationDefaults:
    """The defaults of `checkpoint` (a folder or a GGUF file), or of the folder
    `generation_config` names; none with "vllm"."""
    if generation_config == "vllm":
        return GenerationDefaults(source="--generation-config vllm")
    if generation_config != "auto":
        folder = Path(generation_config).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise ModelLoadError(
                f"--generation-config {generation_config!r}: no generation_config.json there "
                f"(give auto, vllm or a folder holding one)"
            )
        return _from_json(folder / "generation_config.json")
    if is_gguf(checkpoint):
        values = gguf.gguf_generation_defaults(gguf.open_gguf(checkpoint))
        return _checked(GenerationDefaults(values, f"the GGUF metadata of {checkpoint.name}"))
    path = checkpoint / "generation_config.json"
    return (
        _from_json(path)
        if path.is_file()
        else GenerationDefaults(source="no generation_config.json")
    )


def _from_json(path: Path) -> GenerationDefaults:
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    values = {}
    for name in SAMPLING_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"{path}: {name} must be a number, got {value!r}")
        values[name] = int(value) if name == "top_k" else float(value)
    return _checked(GenerationDefaults(values, str(path)))


def _checked(defaults: GenerationDefaults) -> GenerationDefaults:
    """Refuse, at startup, defaults that every request would be refused for."""
    try:
        SamplingParams(**defaults.values)
    except ValueError as exc:
        raise ModelLoadError(f"{defaults.source}: {exc}") from None
    return defaults
