"""The Llama family (Llama 1-3, Mistral, Qwen2, Qwen3) on packed ragged batches.

One module serves the family; the differences are flags read from the Hugging Face config:
qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3), sliding window (Mistral), tied embeddings, rope
scaling. Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.ops import elementwise as ops
from tandem.ops.attention import AttentionMetadata, paged_attention
from tandem.ops.linear import Linear, can_prepack, linear, prepack


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class Rotary(nn.Module):
    """A cos/sin table by position, built once from the inverse frequencies."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)


@dataclass
class ForwardContext:
    """What every layer of one forward reads besides its input."""

    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    rotary: Rotary


class Attention(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.spec = spec
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o = Linear(self.q_size, spec.hidden_size)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.scale = spec.head_dim**-0.5

    def forward(self, x, kv_cache, ctx: ForwardContext):
        s = self.spec
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = ops.rotary(q, k, ctx.positions, ctx.rotary.cos, ctx.rotary.sin)
        out = paged_attention(
            q, k, v, kv_cache[0], kv_cache[1], ctx.meta, self.scale, s.sliding_window
        )
        return self.o(out.view(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.gate_up = Linear(spec.hidden_size, 2 * spec.intermediate_size)
        self.down = Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x):
        return self.down(ops.silu_and_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def flat_weights(self) -> list[torch.Tensor]:
        """This layer's weights in the order `tandem::llama_forward` reads them (csrc)."""
        none = torch.empty(0)
        a, m = self.attn, self.mlp
        q_norm = a.q_norm.weight if a.spec.qk_norm else none
        k_norm = a.k_norm.weight if a.spec.qk_norm else none
        return [
            self.input_norm.weight, a.qkv.weight, _or(a.qkv.packed, none), _or(a.qkv.bias, none),
            q_norm, k_norm, a.o.weight, _or(a.o.packed, none), self.post_attn_norm.weight,
            m.gate_up.weight, _or(m.gate_up.packed, none), m.down.weight, _or(m.down.packed, none),
        ]  # fmt: skip

    def forward(self, x, residual, kv_cache, ctx: ForwardContext):
        """x: the previous sublayer's output (the embeddings for the first layer, where
        residual is None). Returns this layer's MLP output and the residual stream before it."""
        if residual is None:
            residual, h = x, ops.rms_norm(x, self.input_norm.weight, self.input_norm.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, self.input_norm.weight, self.input_norm.eps)
        a = self.attn(h, kv_cache, ctx)
        norm = self.post_attn_norm
        h, residual = ops.add_rms_norm(a, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    rotary: Rotary  # set by the loader on the real device (the module is built on "meta")

    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if not spec.tie_word_embeddings:
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size)
        self._packed_logits_weight: torch.Tensor | None = None
        self._fused_weights: list[torch.Tensor] | None = None  # for the one-call forward

    def use_fast_path(self, fused: bool) -> bool:
        """Pre-pack every GEMM weight where MKL's packed path exists and, if `fused` (the CPU
        kernels are loaded), run the whole forward as one kernel call (`tandem::llama_forward`),
        which needs the GIL once per step instead of once per op.

        Returns whether the GEMMs were packed. Call once, after the weights are loaded."""
        packed = [m.prepack() for m in self.modules() if isinstance(m, Linear)]
        if self.spec.tie_word_embeddings and can_prepack(self.embed.weight):
            self._packed_logits_weight = prepack(self.embed.weight)
        if fused:
            self._fused_weights = [w for layer in self.layers for w in layer.flat_weights()]
        return all(packed)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self._fused_weights is not None:
            return self._fused_forward(input_ids, positions, kv_caches, meta)
        ctx = ForwardContext(positions, meta, self.rotary)
        x, residual = self.embed(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, kv_cache, ctx)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def _fused_forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        s = self.spec
        segments = [(p.token_start, p.num_tokens, p.context_len, p.row) for p in meta.prefills]
        prefills = torch.tensor(segments, dtype=torch.int64).view(-1, 4)
        return torch.ops.tandem.llama_forward(
            input_ids, positions, self.embed.weight, self._fused_weights, kv_caches,
            self.norm.weight, self.rotary.cos, self.rotary.sin, meta.slot_mapping,
            meta.block_tables, meta.context_lens, meta.num_decodes, prefills, meta.block_size,
            s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, s.head_dim**-0.5,
            s.sliding_window or 0,
        )  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.spec.tie_word_embeddings:
            logits = linear(hidden, self.embed.weight, None, self._packed_logits_weight)
        else:
            logits = self.lm_head(hidden)
        return logits.float()

    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Copy one HF checkpoint tensor into place; returns the parameter it filled, or None."""
        target, offset, size = self._map_name(name)
        if target is None:
            return None
        param = self.get_parameter(target)
        if offset is None:
            param.data.copy_(tensor)
        else:
            param.data.narrow(0, offset, size).copy_(tensor)
        return f"{target}@{offset}" if offset is not None else target

    def expected_weights(self) -> set[str]:
        names = set()
        for i in range(self.spec.num_layers):
            p = f"layers.{i}"
            for part in ("q", "k", "v"):
                names.add(f"{p}.attn.qkv.weight@{self._qkv_offset(part)}")
                if self.spec.qkv_bias:
                    names.add(f"{p}.attn.qkv.bias@{self._qkv_offset(part)}")
            names |= {f"{p}.mlp.gate_up.weight@0", f"{p}.mlp.gate_up.weight@{self._inter}"}
            names |= {f"{p}.attn.o.weight", f"{p}.mlp.down.weight"}
            names |= {f"{p}.input_norm.weight", f"{p}.post_attn_norm.weight"}
            if self.spec.qk_norm:
                names |= {f"{p}.attn.q_norm.weight", f"{p}.attn.k_norm.weight"}
        names |= {"embed.weight", "norm.weight"}
        if not self.spec.tie_word_embeddings:
            names.add("lm_head.weight")
        return names

    @property
    def _inter(self) -> int:
        return self.spec.intermediate_size

    def _qkv_offset(self, part: str) -> int:
        q_size = self.spec.num_heads * self.spec.head_dim
        kv_size = self.spec.num_kv_heads * self.spec.head_dim
        return {"q": 0, "k": q_size, "v": q_size + kv_size}[part]

    def _map_name(self, name: str) -> tuple[str | None, int | None, int | None]:
        if name == "model.embed_tokens.weight":
            return "embed.weight", None, None
        if name == "model.norm.weight":
            return "norm.weight", None, None
        if name == "lm_head.weight":
            return ("lm_head.weight" if not self.spec.tie_word_embeddings else None), None, None
        if not name.startswith("model.layers."):
            return None, None, None
        index, rest = name[len("model.layers.") :].split(".", 1)
        p = f"layers.{index}"
        s = self.spec
        kv_size = s.num_kv_heads * s.head_dim
        for part in ("q", "k", "v"):
            for kind in ("weight", "bias"):
                if rest == f"self_attn.{part}_proj.{kind}":
                    size = s.num_heads * s.head_dim if part == "q" else kv_size
                    return f"{p}.attn.qkv.{kind}", self._qkv_offset(part), size
        simple = {
            "self_attn.o_proj.weight": "attn.o.weight",
            "self_attn.q_norm.weight": "attn.q_norm.weight",
            "self_attn.k_norm.weight": "attn.k_norm.weight",
            "mlp.down_proj.weight": "mlp.down.weight",
            "input_layernorm.weight": "input_norm.weight",
            "post_attention_layernorm.weight": "post_attn_norm.weight",
        }
        if rest in simple:
            return f"{p}.{simple[rest]}", None, None
        if rest == "mlp.gate_proj.weight":
            return f"{p}.mlp.gate_up.weight", 0, self._inter
        if rest == "mlp.up_proj.weight":
            return f"{p}.mlp.gate_up.weight", self._inter, self._inter
        return None, None, None


def _or(tensor: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if tensor is None else tensor
