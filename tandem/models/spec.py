"""A model's shapes: the few numbers of a Hugging Face config that the forward, the sharding and
the dummy weights need, and the checkpoint tensors they imply."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: which layers have one, its experts and routing, and how its
    checkpoint names them (Qwen's `mlp.experts.N.gate_proj`, Mixtral's
    `block_sparse_moe.experts.N.w1`)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    sparse_layers: tuple[int, ...]  # the others have the dense MLP of `LlamaSpec.intermediate_size`
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)
    naming: str = "qwen"  # "qwen" or "mixtral": the checkpoint's tensor names
    float32_weights: bool = False  # Mixtral keeps the routing weights in float32

    def names(self, layer: int) -> dict[str, str]:
        """Checkpoint names of one layer's block, by part: router, gate, up, down (with `{e}`
        for the expert)."""
        p = f"model.layers.{layer}."
        if self.naming == "mixtral":
            e = p + "block_sparse_moe.experts.{e}."
            return {"router": p + "block_sparse_moe.gate.weight", "gate": e + "w1.weight",
                    "up": e + "w3.weight", "down": e + "w2.weight"}  # fmt: skip
        e = p + "mlp.experts.{e}."
        return {"router": p + "mlp.gate.weight", "gate": e + "gate_proj.weight",
                "up": e + "up_proj.weight", "down": e + "down_proj.weight"}  # fmt: skip


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
    moe: MoESpec | None = field(default=None)  # Qwen3-MoE, Mixtral, Qwen2-MoE
    # Per layer, whether it attends within `sliding_window` (Qwen2/Qwen3 `layer_types`); None:
    # every layer alike.
    sliding_layers: tuple[bool, ...] | None = None

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (keys a query sees, itself included); None: all."""
        if self.sliding_layers is None:
            return [self.sliding_window] * self.num_layers
        return [self.sliding_window if s else None for s in self.sliding_layers]

    def kv_bytes_by_window(self, row_bytes: int) -> dict[int | None, int]:
        """Bytes of K and V one cached position holds in the layers of each window (None: all
        keys), at `row_bytes` a kv head's row (its scale included in a quantized cache)."""
        per_layer = 2 * self.num_kv_heads * row_bytes
        by_window: dict[int | None, int] = {}
        for window in self.layer_windows():
            by_window[window] = by_window.get(window, 0) + per_layer
        return by_window

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers


@dataclass
class Gemma3Spec(LlamaSpec):
    """Gemma 3's numbers on top of the shared ones (`sliding_window` is None: not every layer
    slides; `windows` says which do)."""

    windows: tuple[int | None, ...] = ()  # per layer: the sliding window, or None (global)
    query_pre_attn_scalar: float = 256.0  # attention scores are scaled by its inverse sqrt
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)

    def layer_windows(self) -> list[int | None]:
        return list(self.windows)


def shape_values(config) -> dict:
    """The sizes every family's spec reads alike from a Hugging Face config."""
    heads = config.num_attention_heads
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
    )


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
    dense_mlp = {k: parts.pop(k) for k in list(parts) if k.startswith("mlp.")}
    for i in range(s.num_layers):
        shapes |= {f"model.layers.{i}.{part}": shape for part, shape in parts.items()}
        if s.is_sparse(i):
            shapes |= moe_shapes(s, i)
        else:
            shapes |= {f"model.layers.{i}.{part}": shape for part, shape in dense_mlp.items()}
    return shapes


def moe_shapes(spec: LlamaSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """One sparse layer's checkpoint tensors: the router, every expert, the shared expert."""
    moe, hidden = spec.moe, spec.hidden_size
    inter, names = moe.intermediate_size, moe.names(layer)
    shapes = {names["router"]: (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        shapes[names["gate"].format(e=e)] = shapes[names["up"].format(e=e)] = (inter, hidden)
        shapes[names["down"].format(e=e)] = (hidden, inter)
    if moe.shared_intermediate_size:
        p, shared = f"model.layers.{layer}.mlp.shared_expert", moe.shared_intermediate_size
        shapes[f"{p}.gate_proj.weight"] = shapes[f"{p}.up_proj.weight"] = (shared, hidden)
        shapes[f"{p}.down_proj.weight"] = (hidden, shared)
        shapes[f"{p}_gate.weight"] = (1, hidden)
    return shapes
