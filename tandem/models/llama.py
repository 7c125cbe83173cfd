"""The Llama family (Llama 1-3, Mistral, Qwen2, Qwen3) on packed ragged batches.

One module serves the family; the differences are flags read from the Hugging Face config:
qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3), sliding window (Mistral), tied embeddings, rope
scaling. Q/K/V and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.ops.attention import AttentionMetadata, paged_attention


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The same arithmetic as Hugging Face's, so fp32 outputs match token for token.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """A cos/sin table by position, built once from the inverse frequencies."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int):
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, q, k, positions):
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.spec = spec
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.scale = spec.head_dim**-0.5

    def forward(self, x, positions, rotary, kv_cache, meta: AttentionMetadata):
        s = self.spec
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, k, positions)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, s.sliding_window)
        return self.o(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.gate_up = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, positions, rotary, kv_cache, meta):
        x = x + self.attn(self.input_norm(x), positions, rotary, kv_cache, meta)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaModel(nn.Module):
    rotary: Rotary  # set by the loader on the real device (the module is built on "meta")

    def __init__(self, spec: LlamaSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rotary, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed.weight if self.spec.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

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
