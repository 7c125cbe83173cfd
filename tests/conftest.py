"""Shared fixtures and helpers: tiny offline checkpoints and Hugging Face reference outputs.

The checkpoints are built once per test session from the shipped corpus, so the suite never
touches the network. The engine is judged against transformers' own greedy ``generate``.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path

# Set before transformers is imported anywhere, so nothing tries to reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The Triton kernels' tests run them on CPU tensors under Triton's interpreter. Triton picks the
# interpreter or its compiler once, when first imported, so this holds for the whole session
# (tests/triton_sm90_compile.py compiles for real in a subprocess without it).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.models.default_model import SPECIAL_TOKENS, build_checkpoint  # noqa: E402

# Small models gain nothing from many threads, and parallel test workers would oversubscribe.
torch.set_num_threads(2)

# Special tokens are trained first, so they take ids 0 .. NUM_SPECIAL_TOKENS - 1.
NUM_SPECIAL_TOKENS = len(SPECIAL_TOKENS)

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


# A tiny Gemma 3: both layer kinds (a window shorter than most prompts), GQA, a head_dim unequal
# to hidden / heads and a query_pre_attn_scalar unequal to head_dim, soft-capped logits.
GEMMA3_TINY = {
    "num_hidden_layers": 3,
    "head_dim": 32,
    "tie_word_embeddings": True,
    "extra_config": {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 7,
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 5.0,
    },
}


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama checkpoint with build_checkpoint's defaults (vocab 1024, 2 layers, GQA 4:2)."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One checkpoint per supported architecture, each exercising a different loader path.

    Llama uses Llama 3 rope scaling, Mistral ties its embeddings, Qwen2 (with qkv bias) is
    sharded into several safetensors files, Qwen3 (with q/k norms) has a head_dim unequal
    to hidden_size / heads, Gemma 3 is GEMMA3_TINY, and the mixture-of-experts models are
    `moe_checkpoints`'.
    """
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    checkpoints = {
        "LlamaForCausalLM": build_checkpoint(
            root / "llama3",
            "LlamaForCausalLM",
            max_position_embeddings=2048,
            extra_config={"rope_scaling": dict(LLAMA3_ROPE_SCALING)},
        ),
        # With tied embeddings, 0.1 still makes greedy output repeat the same token a lot.
        "MistralForCausalLM": build_checkpoint(
            root / "mistral", "MistralForCausalLM", tie_word_embeddings=True, initializer_range=0.2
        ),
        "Qwen2ForCausalLM": build_checkpoint(
            root / "qwen2", "Qwen2ForCausalLM", shard_size="200KB"
        ),
        "Qwen3ForCausalLM": build_checkpoint(root / "qwen3", "Qwen3ForCausalLM", head_dim=32),
        **moe_checkpoints(root),
        "Gemma3ForCausalLM": build_checkpoint(root / "gemma3", "Gemma3ForCausalLM", **GEMMA3_TINY),
    }
    shards = list(checkpoints["Qwen2ForCausalLM"].glob("model-*.safetensors"))
    assert len(shards) >= 2, "the Qwen2 checkpoint is meant to be sharded"
    return checkpoints


SLIDING_WINDOW = 7


@pytest.fixture(scope="session")
def thinking_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reasoning model: Qwen3 whose tokenizer has <think>, </think>, <tool_call> and
    </tool_call> as tokens and whose chat template opens the thinking block in the generation
    prompt (an empty, closed one with `enable_thinking` false). Random weights: the block is
    closed by the budget, not the model."""
    return build_checkpoint(
        tmp_path_factory.mktemp("qwen3-thinking"), "Qwen3ForCausalLM", head_dim=32,
        thinking=True,
    )  # fmt: skip


@pytest.fixture(scope="session")
def sliding_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 with `layer_types` mixing attention kinds: layer 0 full, layers 1-3 within a
    window of SLIDING_WINDOW keys (so the KV cache has several block tables)."""
    return build_checkpoint(
        tmp_path_factory.mktemp("qwen3-sliding"), "Qwen3ForCausalLM", num_hidden_layers=4,
        head_dim=32,
        extra_config={
            "use_sliding_window": True, "max_window_layers": 1, "sliding_window": SLIDING_WINDOW,
        },
    )  # fmt: skip


def moe_checkpoints(root: Path) -> dict[str, Path]:
    """Qwen3-MoE with sparse and dense layers mixed (5 experts, top-2, renormalised), Mixtral
    (7 experts, top-2), Qwen2-MoE (4 experts, top-1, a shared expert, qkv bias)."""
    return {
        "Qwen3MoeForCausalLM": build_checkpoint(
            root / "qwen3-moe", "Qwen3MoeForCausalLM", num_hidden_layers=3, head_dim=32,
            extra_config={"num_experts": 5, "num_experts_per_tok": 2, "norm_topk_prob": True,
                          "moe_intermediate_size": 32, "mlp_only_layers": [1]},
        ),
        "MixtralForCausalLM": build_checkpoint(
            root / "mixtral", "MixtralForCausalLM",
            extra_config={"num_local_experts": 7, "num_experts_per_tok": 2},
        ),
        "Qwen2MoeForCausalLM": build_checkpoint(
            root / "qwen2-moe", "Qwen2MoeForCausalLM",
            extra_config={"num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
                          "shared_expert_intermediate_size": 48},
        ),
    }  # fmt: skip


@pytest.fixture(scope="session")
def llama_with_biases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama with attention_bias=True: q/k/v *and* o_proj carry biases. transformers
    initialises biases to zero, which would hide a dropped one, so they are made random."""
    from safetensors.torch import load_file, save_file

    path = build_checkpoint(
        tmp_path_factory.mktemp("llama-bias"), extra_config={"attention_bias": True}
    )
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    for name, tensor in tensors.items():
        if name.endswith("_proj.bias"):
            tensors[name] = torch.randn(tensor.shape, generator=g) * 0.5
    assert any(n.endswith("o_proj.bias") for n in tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def cycling_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose greedy output mostly walks fixed cycles of 7 tokens (its logits favour a
    permutation of the last token, while attention still moves them): drafts of its own history
    are often right, so speculative decoding accepts long runs, and wrong positions or KV would
    still change its tokens."""
    from safetensors.torch import load_file, save_file

    path = build_checkpoint(tmp_path_factory.mktemp("cycling-llama"))
    weights = load_file(path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    order = torch.randperm(len(embed), generator=torch.Generator().manual_seed(0))
    successor = torch.empty(len(embed), dtype=torch.long)
    for i in range(0, len(embed), 7):
        cycle = order[i : i + 7]
        successor[cycle] = cycle.roll(-1)
    head = weights["lm_head.weight"] * 0.2
    head[successor] += 2 * embed / embed.norm(dim=1, keepdim=True).clamp(min=1e-6)
    weights["lm_head.weight"] = head
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.2
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@functools.cache
def _load_hf_model(path: str) -> torch.nn.Module:
    """Load a checkpoint with transformers once per path, in fp32 eval mode.

    The model's own generation_config is replaced by a blank one: ``generate`` fills every unset
    field of the config it is given from ``model.generation_config``, so its eos_token_id would
    otherwise come back and stop generation early.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config = GenerationConfig()
    return model.eval()


# (path, prompt) -> the longest greedy continuation computed so far.
_reference_cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def hf_greedy_reference(path: Path, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Return exactly ``max_new_tokens`` greedy tokens that transformers generates after the prompt.

    The request runs alone (batch of one, no padding) and never stops at EOS, so it can be
    compared token for token with the engine run with ignore_eos. Greedy decoding of n tokens
    starts with greedy decoding of fewer, so a cached longer run answers shorter requests.
    """
    from transformers import GenerationConfig

    key = (str(Path(path).resolve()), tuple(prompt_token_ids))
    cached = _reference_cache.get(key)
    if cached is not None and len(cached) >= max_new_tokens:
        return cached[:max_new_tokens]
    if max_new_tokens == 0:
        return []

    model = _load_hf_model(key[0])
    input_ids = torch.tensor([prompt_token_ids], dtype=torch.long)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=model.config.pad_token_id,
    )
    with torch.no_grad():
        output = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
        )
    new_tokens = output[0, len(prompt_token_ids) :].tolist()
    assert len(new_tokens) == max_new_tokens, "transformers stopped before max_new_tokens"
    _reference_cache[key] = new_tokens
    return list(new_tokens)


# The fast path's logits (fused kernels, tandem::llama_forward) stay within this of transformers'.
# Why 1e-4: measured at most 2.6e-5 (Mistral test model; the others <= 5.5e-6) on an AVX2 Zen 3 at
# 1 and 2 threads, prompts of 2-330 tokens; a greedy flip can take twice that, plus other ISAs'.
FAST_PATH_LOGITS_ATOL = 1e-4


def follow_near_ties(
    token_ids: Sequence[int],
    num_tokens: int,
    continuation: Callable[[list[int], int], list[int]],
    logits_after: Callable[[list[int]], torch.Tensor],
    bound: float = FAST_PATH_LOGITS_ATOL,
) -> list[int]:
    """The reference that ``token_ids`` must equal: ``num_tokens`` greedy reference tokens, except
    where the engine's token is within ``bound`` of the reference's top logit.

    Two greedy decoders whose logits differ by float rounding may pick different ids wherever the
    top two logits are closer than that rounding, and which one wins then depends on the CPU's
    instruction set and thread count. So at each difference the reference's top logit is compared
    with its logit for the engine's token: closer than ``bound``, the reference takes the engine's
    token and continues from there; any other difference is kept (and fails the caller's ``==``).
    ``continuation(prefix, n)`` gives the reference's next ``n`` tokens (fewer if it stops) after
    the prompt and ``prefix``; ``logits_after(prefix)`` its logits for the token after them.
    """
    accepted: list[int] = []
    while True:
        reference = accepted + continuation(accepted, num_tokens - len(accepted))
        end = min(len(token_ids), len(reference))
        i = next((k for k in range(len(accepted), end) if token_ids[k] != reference[k]), None)
        if i is None:
            return reference
        row = logits_after(reference[:i])
        if not row.max() - row[token_ids[i]] < bound:  # NaN fails too
            return reference
        accepted = list(token_ids[: i + 1])


def hf_greedy_reference_allowing_near_ties(
    path: Path, prompt_token_ids: list[int], token_ids: list[int], num_tokens: int | None = None
) -> list[int]:
    """transformers' greedy tokens to compare the engine's ``token_ids`` with, following the
    engine where the two are within FAST_PATH_LOGITS_ATOL (`follow_near_ties`).

    ``num_tokens`` tokens, ``len(token_ids)`` by default (an aborted request's prefix).
    """
    model = _load_hf_model(str(Path(path).resolve()))

    def logits_after(prefix: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt_token_ids + prefix])).logits[0, -1].float()

    return follow_near_ties(
        token_ids,
        len(token_ids) if num_tokens is None else num_tokens,
        lambda prefix, n: hf_greedy_reference(path, prompt_token_ids + prefix, n),
        logits_after,
    )


def random_prompts(
    rng: random.Random, n: int, vocab_size: int, min_len: int = 1, max_len: int = 300
) -> list[list[int]]:
    """Make ``n`` prompts of random ordinary token ids, with lengths in [min_len, max_len].

    Special token ids are left out so that no prompt contains a stray BOS, EOS or pad.
    """
    return [
        [
            rng.randrange(NUM_SPECIAL_TOKENS, vocab_size)
            for _ in range(rng.randint(min_len, max_len))
        ]
        for _ in range(n)
    ]
