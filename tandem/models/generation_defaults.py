"""A model's own sampling defaults: what a request that sets no temperature, top_p, top_k, min_p
or repetition_penalty gets, read from the checkpoint as vLLM does (`generation_config="auto"`),
and what `override_generation_config` puts over them (vLLM's flag: those fields, and
`max_new_tokens`, the server-wide cap on a request's output)."""

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
INTEGER_FIELDS = ("top_k", "thinking_token_budget")
# llama.cpp's sampling for a conversation (llama-cli's defaults): what a chat gets where neither
# the user nor the model sets any, since small models loop under greedy decoding.
CHAT_SAMPLING: dict[str, float | int] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                         "min_p": 0.05}  # fmt: skip
CHAT_SAMPLING_SOURCE = "llama.cpp's chat defaults, as the model sets none"


def chat_sampling(model_values: dict[str, float | int]) -> tuple[dict[str, float | int], bool]:
    """The sampling a chat starts from, and whether it is the model's: the model's where it
    sets how to sample (any sampling field but the thinking budget, which is kept either way),
    else `CHAT_SAMPLING`."""
    own = {k: v for k, v in model_values.items() if k in SAMPLING_FIELDS}
    budget = {k: own.pop(k) for k in ("thinking_token_budget",) if k in own}
    return {**(own or CHAT_SAMPLING), **budget}, bool(own)


@dataclass(frozen=True)
class GenerationDefaults:
    values: dict[str, float | int] = field(default_factory=dict)
    source: str = ""  # where they come from, for the log line
    max_tokens: int | None = None  # the server's cap on every request's output (max_new_tokens)

    def describe(self) -> str:
        """One line for logs and stderr: which defaults requests get, and from where."""
        cap = "" if self.max_tokens is None else f"; output capped at {self.max_tokens} tokens"
        if not self.values:
            source = self.source or "none given"
            return f"sampling defaults: none from the model ({source}){cap}"
        given = ", ".join(f"{name}={value}" for name, value in self.values.items())
        if self.source == CHAT_SAMPLING_SOURCE:
            return f"sampling defaults: {given} ({self.source}){cap}"
        return (
            f"sampling defaults: {given} (from {self.source}; --generation-config vllm ignores "
            f"them){cap}"
        )

    def for_chat(self) -> GenerationDefaults:
        """The defaults a chat starts from: these if the model sets any, else llama.cpp's."""
        values, own = chat_sampling(self.values)
        if own:
            return self
        return GenerationDefaults(values, CHAT_SAMPLING_SOURCE, self.max_tokens)

    def overridden(self, overrides: dict[str, float | int] | None) -> GenerationDefaults:
        """These defaults with `overrides` (vLLM's --override-generation-config) over them:
        sampling fields by their names, and `max_new_tokens`. Raises ModelLoadError naming an
        unknown key or a bad value."""
        if not overrides:
            return self
        unknown = sorted(set(overrides) - {*SAMPLING_FIELDS, "max_new_tokens"})
        if unknown:
            raise ModelLoadError(
                f"--override-generation-config: unknown key {unknown[0]!r} (known: "
                f"{', '.join([*SAMPLING_FIELDS, 'max_new_tokens'])})"
            )
        values = {k: v for k, v in overrides.items() if k != "max_new_tokens"}
        cap = overrides.get("max_new_tokens", self.max_tokens)
        try:
            SamplingParams(**({**self.values, **values} | {"max_tokens": cap}))
        except ValueError as exc:
            message = str(exc).replace("max_tokens", "max_new_tokens")
            raise ModelLoadError(f"--override-generation-config: {message}") from None
        source = self.source
        if values:
            source = f"{source} and " if self.values else ""
            source += "--override-generation-config"
        return GenerationDefaults({**self.values, **values}, source, cap)


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
        values[name] = int(value) if name in INTEGER_FIELDS else float(value)
    return _checked(GenerationDefaults(values, str(path)))


def _checked(defaults: GenerationDefaults) -> GenerationDefaults:
    """Refuse, at startup, defaults that every request would be refused for."""
    try:
        SamplingParams(**defaults.values)
    except ValueError as exc:
        raise ModelLoadError(f"{defaults.source}: {exc}") from None
    return defaults
