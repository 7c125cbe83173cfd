"""Gemma 3 (text): the Llama family's pieces with Gemma's differences on top.

What differs from Llama, and where it is handled:
- RMSNorm scales by (1 + w): the 1 is added to every norm weight as it is loaded (in float32, as
  transformers adds it, then multiplied as Llama's norm multiplies: the same bits in float32), so
  the forward runs Llama's norm ops unchanged;
- four norms per layer: the attention's and the MLP's outputs are normed before they join the
  residual stream; q/k norms per head as Qwen3;
- the embedding is scaled by sqrt(hidden) in the weights' dtype, the MLP is GeGLU (tanh GELU),
  attention scores are scaled by `query_pre_attn_scalar ** -0.5`, and the logits may be
  soft-capped (`cap * tanh(logits / cap)`);
- layers are sliding (a window of keys and the local rope base) or global (every key, the global
  rope base and its scaling), per `layer_types`.
On a CPU in float32 the whole forward is one kernel call, as the Llama family's
(`tandem::llama_forward`: the extra norms, GeGLU, and each layer's window and rope table).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
from transformers import PretrainedConfig

from tandem.models.errors import ModelLoadError
from tandem.models.llama import (
    MLP,
    Attention,
    ForwardContext,
    LlamaModel,
    RMSNorm,
    Rotary,
    add_to_residual_and_norm,
    flat_layer_weights,
)
from tandem.models.parallel import Placement, TensorParallel
from tandem.models.spec import Gemma3Spec, checkpoint_shapes, shape_values
from tandem.ops import elementwise

SLIDING, FULL = "sliding_attention", "full_attention"
# Checkpoint tensors Gemma has beyond the Llama family's, by their name inside a layer.
_EXTRA_NORMS = {
    "pre_feedforward_layernorm.weight": "pre_ff_norm.weight",
    "post_feedforward_layernorm.weight": "post_ff_norm.weight",
}


def gemma3_spec(config: PretrainedConfig) -> Gemma3Spec:
    """A Gemma3TextConfig's numbers; what Tandem does not run is refused by name."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ModelLoadError(
            "Gemma3ForCausalLM with attn_logit_softcapping is not supported (Gemma 3 checkpoints "
            "leave it unset)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ModelLoadError("Gemma3ForCausalLM with use_bidirectional_attention is not supported")
    unknown = set(config.layer_types) - {SLIDING, FULL}
    if unknown:
        raise ModelLoadError(f"Gemma3ForCausalLM with layer types {sorted(unknown)}")
    if getattr(config, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelLoadError(f"Gemma3ForCausalLM with activation {config.hidden_activation!r}")
    bias = bool(getattr(config, "attention_bias", False))
    return Gemma3Spec(
        **shape_values(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        qkv_bias=bias,
        qk_norm=True,
        sliding_window=None,
        o_bias=bias,
        windows=tuple(config.sliding_window if t == SLIDING else None for t in config.layer_types),
        query_pre_attn_scalar=float(config.query_pre_attn_scalar),
        final_logit_softcapping=config.final_logit_softcapping,
    )


class GeGLU(MLP):
    def forward(self, x, ops: ModuleType):
        # The portable op on every device (the Triton ops have SiLU's only).
        return self.tp.all_reduce(self.down(elementwise.gelu_tanh_and_mul(self.gate_up(x))))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: Gemma3Spec, tp: TensorParallel, window: int | None):
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_norm = RMSNorm(hidden, eps)
        self.attn = Attention(spec, tp, window, spec.query_pre_attn_scalar**-0.5)
        self.post_attn_norm = RMSNorm(hidden, eps)
        self.pre_ff_norm = RMSNorm(hidden, eps)
        self.mlp = GeGLU(spec, tp)
        self.post_ff_norm = RMSNorm(hidden, eps)

    def flat_weights(self) -> list[torch.Tensor]:
        """This layer's weights in the order `tandem::llama_forward` reads them (csrc)."""
        return flat_layer_weights(
            self.input_norm, self.attn, self.pre_ff_norm, self.mlp, self.post_attn_norm,
            self.post_ff_norm,
        )  # fmt: skip

    def forward(self, x, residual, kv_cache, ctx: ForwardContext):
        """x: the previous layer's normed MLP output (the embeddings for the first layer, where
        residual is None); the residual stream is residual + x. Returns the same pair."""
        ops = ctx.ops
        h, residual = add_to_residual_and_norm(ops, x, residual, self.input_norm)
        a = self.attn(h, kv_cache, ctx)
        a = ops.rms_norm(a, self.post_attn_norm.weight, self.post_attn_norm.eps)
        h, residual = ops.add_rms_norm(a, residual, self.pre_ff_norm.weight, self.pre_ff_norm.eps)
        m = self.mlp(h, ops)
        return ops.rms_norm(m, self.post_ff_norm.weight, self.post_ff_norm.eps), residual


class Gemma3Model(LlamaModel):
    spec: Gemma3Spec
    local_rotary: Rotary  # the sliding layers' rope (`rotary` is the global layers')
    rope_layer_types = (FULL, SLIDING)
    geglu = True
    embedding_is_lookup = False  # scaled by sqrt(hidden)

    def _make_layer(self, index: int) -> nn.Module:
        return Gemma3DecoderLayer(self.local_spec, self.tp, self.spec.windows[index])

    def set_rotary(self, tables: dict[str | None, Rotary]) -> None:
        self.rotary, self.local_rotary = tables[FULL], tables[SLIDING]

    def layer_rotary(self, layer: nn.Module) -> Rotary:
        return self.rotary if layer.attn.window is None else self.local_rotary

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super()._embed(input_ids)
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype; a Python number
        # of that value gives the same products and no device copy (CUDA graphs capture this).
        return x * float(torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.spec.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap

    def load_weight(self, name: str, source) -> bool:
        if name.endswith("norm.weight"):  # (1 + w), added as transformers adds it
            source = source[:].float() + 1.0
        return super().load_weight(name, source)

    def whole_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = checkpoint_shapes(self.spec)
        for i in range(self.spec.num_layers):
            for part in _EXTRA_NORMS:
                shapes[f"model.layers.{i}.{part}"] = (self.spec.hidden_size,)
        return shapes

    def _place(self, name: str) -> Placement | None:
        place = super()._place(name)
        if place is None and name.startswith("model.layers."):
            index, rest = name[len("model.layers.") :].split(".", 1)
            if rest in _EXTRA_NORMS:
                return Placement(f"layers.{index}.{_EXTRA_NORMS[rest]}")
        return place
