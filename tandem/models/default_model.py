"""Tiny Hugging Face checkpoints built offline, deterministically.

Tandem must run and be tested without downloading anything, so instead of fetching weights we
train a small byte-level BPE tokenizer on a shipped corpus and save a randomly initialised model
next to it. Everything is seeded, so the same arguments always give the same files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

CORPUS_PATH = Path(__file__).with_name("data") / "corpus.txt"

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
# Trained first, so their ids are 0, 1, 2 in every tokenizer built here.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

# ChatML-style layout with plain-text markers (they are not special tokens). The template emits
# the BOS itself, as Llama 3's does, so render-and-tokenize callers should pass
# add_special_tokens=False to avoid a second <s>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A reasoning model's: Hermes tool calls, and a thinking block that the generation prompt opens
# (Qwen3's layout), or writes empty and closed when `enable_thinking` is false.
THINKING_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
THINKING_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system\\nTools:\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    '{{ \'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\' }}'
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>' }}{{ call['function'] | tojson }}{{ '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Gemma3ForCausalLM",
)

DEFAULT_MODEL_NAME = "default-llama-v1"
DEFAULT_THINKING_MODEL_NAME = "default-llama-thinking-v1"
DEFAULT_MODEL_KWARGS: dict[str, Any] = {
    "architecture": "LlamaForCausalLM",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "tokenizer_vocab_size": 2048,
    "max_position_embeddings": 4096,
    "seed": 0,
    "initializer_range": 0.1,
}


def build_tokenizer(save_dir: Path, vocab_size: int = 1024, thinking: bool = False) -> None:
    """Train a byte-level BPE tokenizer on the shipped corpus and save it in HF format.

    Byte-level BPE can encode any string (unknown bytes fall back to single-byte tokens), and the
    ByteLevel decoder makes decode(encode(text)) give the text back exactly. Encoding prepends
    <s>, as Llama tokenizers do. `thinking`: a reasoning model's tokenizer, its tags one token
    each (added, not special: their text is kept, as Qwen3's are) and its chat template
    (`THINKING_CHAT_TEMPLATE`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(CORPUS_PATH)], trainer)

    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # The default cleanup would turn " ." into "." and break round-tripping.
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    if thinking:
        hf_tokenizer.add_tokens(list(THINKING_TOKENS))
        hf_tokenizer.chat_template = THINKING_CHAT_TEMPLATE
    save_dir = Path(save_dir)
    hf_tokenizer.save_pretrained(save_dir)
    _use_portable_tokenizer_class(save_dir)


def _use_portable_tokenizer_class(save_dir: Path) -> None:
    """Name the tokenizer class "PreTrainedTokenizerFast" in tokenizer_config.json.

    transformers 5 writes its internal "TokenizersBackend", which transformers 4 cannot load;
    the old name loads under both.
    """
    config_path = save_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _config_class(architecture: str) -> type:
    """Map an architecture name to its transformers config class."""
    import transformers

    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; expected one of {SUPPORTED_ARCHITECTURES}"
        )
    if architecture == "Gemma3ForCausalLM":  # Gemma3Config is the multimodal model's
        return transformers.Gemma3TextConfig
    return getattr(transformers, architecture.replace("ForCausalLM", "Config"))


def build_checkpoint(
    path: Path,
    architecture: str = "LlamaForCausalLM",
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    vocab_size: int | None = None,
    tokenizer_vocab_size: int = 1024,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shard_size: str | None = None,
    extra_config: dict[str, Any] | None = None,
    thinking: bool = False,
) -> Path:
    """Write a tokenizer and a randomly initialised model to ``path`` and return it.

    ``vocab_size`` defaults to the tokenizer's size; a larger value gives padded embedding rows
    that no token maps to, as many real checkpoints have. ``initializer_range`` defaults to 0.1
    because the usual 0.02 makes greedy decoding collapse into one repeated token, which hides
    bugs in tests that compare outputs. ``shard_size`` (e.g. "100KB") splits the weights into
    several safetensors files with an index. ``extra_config`` is merged into the config kwargs,
    e.g. ``rope_scaling`` or ``sliding_window``. ``thinking``: a reasoning model's tokenizer
    and chat template (`build_tokenizer`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, vocab_size=tokenizer_vocab_size, thinking=thinking)
    tokenizer = AutoTokenizer.from_pretrained(path)

    config_kwargs: dict[str, Any] = {
        "vocab_size": len(tokenizer) if vocab_size is None else vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "initializer_range": initializer_range,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if head_dim is not None:
        config_kwargs["head_dim"] = head_dim
    config_kwargs.update(extra_config or {})
    config = _config_class(architecture)(**config_kwargs)

    # Initialise in fp32 and cast afterwards, so a given seed gives the same weights (up to
    # rounding) whatever the saved dtype.
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_vectors(model, initializer_range)
    model = model.to(dtype).eval()
    model.config.dtype = dtype
    save_kwargs: dict[str, Any] = {}
    if shard_size is not None:
        save_kwargs["max_shard_size"] = shard_size
    with _quiet_progress_bars():
        model.save_pretrained(path, **save_kwargs)
    return path


@torch.no_grad()
def _perturb_vectors(model: torch.nn.Module, scale: float) -> None:
    """Add seeded noise to every 1-D parameter (norm weights and biases).

    transformers initialises norm weights to exactly 1 and biases to exactly 0, so an engine
    that forgot to apply them would still match the reference. Noise makes such bugs visible.
    """
    for name, param in model.named_parameters():
        if param.dim() == 1:
            param.add_(torch.randn_like(param) * (scale if name.endswith("bias") else 0.1))


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' per-shard progress bars while saving, then restore the setting."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def default_model_path(thinking: bool = False) -> Path:
    """Return the built-in default model, building it on first use (`thinking`: its reasoning
    twin, `DEFAULT_THINKING_MODEL_NAME`: the same shape with a thinking tokenizer and template).

    The model lives in ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``). It is built in a
    temporary folder beside its final place and renamed into place, so a reader never sees a
    half-written checkpoint and two processes building at once are both fine.
    """
    name = DEFAULT_THINKING_MODEL_NAME if thinking else DEFAULT_MODEL_NAME
    cache_root = Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")
    target = cache_root / name
    if target.is_dir():
        return target

    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_root))
    try:
        build_checkpoint(staging, **DEFAULT_MODEL_KWARGS, thinking=thinking)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared.
        os.replace(staging, target)
    except OSError:
        # Renaming onto a non-empty folder fails: another process finished first.
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
