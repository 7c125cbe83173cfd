"""transformers' own loading of the packaged real models' GGUF files, kept on disk between runs.

transformers turns a GGUF file into its tokenizer and an fp32 model in tens of seconds (Python
parses the vocabulary, dequantizes every tensor). What it builds is a pure function of the file
and of the libraries' versions, so it is kept under the Tandem cache folder, named by a hash of
those: the tokenizer as the object itself, the model as transformers saves it. A new entry is
loaded back and compared with what transformers built (same class, config, generation config
and weights, bit for bit) before it is kept, so a cached model is the one GGUF loading gives.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import inspect
import pickle
import shutil
import tempfile
from pathlib import Path

import torch

from tandem.ops.cpu_kernels import cache_root

import helpers

LIBRARIES = ("transformers", "tokenizers", "gguf", "torch", "safetensors", "numpy")
# Fields of the config that name where the model came from, not what it computes.
PROVENANCE = ("_name_or_path", "quantization_config")


def _key(path: Path) -> str:
    """A hash of the file's bytes, the libraries' versions and the code that converts."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        digest.update(hashlib.file_digest(file, "sha256").digest())
    for name in LIBRARIES:
        digest.update(f"{name}=={importlib.metadata.version(name)};".encode())
    for code in (helpers.transformers_gguf.__wrapped__, _convert, _load):
        digest.update(inspect.getsource(code).encode())
    return digest.hexdigest()[:20]


def _config(model: torch.nn.Module) -> dict:
    config = model.config.to_dict()
    for name in PROVENANCE:
        config.pop(name, None)
    return config


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    tokenizer = pickle.loads((folder / "tokenizer.pickle").read_bytes())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return tokenizer, model.eval()


def _convert(path: Path, folder: Path):
    """transformers' GGUF loading of `path`, saved into `folder` (kept only if it loads back as
    the same model)."""
    tokenizer, model = helpers.transformers_gguf(path)
    staging = Path(tempfile.mkdtemp(prefix=folder.name, dir=folder.parent))
    try:
        (staging / "tokenizer.pickle").write_bytes(pickle.dumps(tokenizer))
        quantizer = model.hf_quantizer  # GGUF's: it refuses to save what it has dequantized
        model.hf_quantizer = None
        try:
            model.save_pretrained(staging)
        finally:
            model.hf_quantizer = quantizer
        _, loaded = _load(staging)
        ours, theirs = loaded.state_dict(), model.state_dict()
        same = (
            type(loaded) is type(model)
            and _config(loaded) == _config(model)
            and loaded.generation_config.to_dict() == model.generation_config.to_dict()
            and ours.keys() == theirs.keys()
            and all(torch.equal(ours[name], theirs[name]) for name in ours)
        )
        if same:
            with contextlib.suppress(OSError):  # another run kept the same conversion first
                staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer, model


@functools.cache
def transformers_gguf(path: Path):
    """transformers' tokenizer and fp32 model of a GGUF file (helpers.transformers_gguf), from
    the cache folder where an earlier run kept them."""
    path = Path(path).resolve()
    folder = cache_root() / "transformers-gguf" / f"{path.stem}-{_key(path)}"
    if folder.is_dir():
        return _load(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    return _convert(path, folder)
