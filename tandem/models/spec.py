"""A model's shapes: the few numbers of a Hugging Face config that the forward, the sharding and
the dummy weights need, and the checkpoint tensors they imply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LlamaSpec:
    """The few numbers of a HF config that the forward needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    o_bias: bool = False  # Llama / Qwen3 with attention_bias: o_proj has a bias too


@dataclass
class Gemma3Spec(LlamaSpec):
    """Gemma 3's numbers on top of the shared ones (`sliding_window` is None: not every layer
    slides; `windows` says which do)."""

    windows: tuple[int | None, ...] = ()  # per layer: the sliding window, or None (global)
    query_pre_attn_scalar: float = 256.0  # attention scores are scaled by its inverse sqrt
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)


def checkpoint_shapes(spec: LlamaSpec) -> dict[str, tuple[int, ...]]:
    """The HF checkpoint tensors of a model of this spec, by name, with their shapes."""
    s = spec
    hidden, inter = s.hidden_size, s.intermediate_size
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (s.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not s.tie_word_embeddings:
        shapes["lm_head.weight"] = (s.vocab_size, hidden)
    parts: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if s.qkv_bias:
        parts |= {f"self_attn.{p}_proj.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))}
    if s.o_bias:
        parts["self_attn.o_proj.bias"] = (hidden,)
    if s.qk_norm:
        parts["self_attn.q_norm.weight"] = parts["self_attn.k_norm.weight"] = (s.head_dim,)
    for i in range(s.num_layers):
        shapes |= {f"model.layers.{i}.{part}": shape for part, shape in parts.items()}
    return shapes
