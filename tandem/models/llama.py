"""The Llama family (Llama 1-3, Mistral, Qwen2, Qwen3) on packed ragged batches.

One module serves the family; the differences are flags read from the Hugging Face config:
qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3), sliding window (Mistral), tied embeddings, rope
scaling. Q/K/V and gate/up projections are fused into one matmul each. The mixture-of-experts
models (Qwen3-MoE, Mixtral, Qwen2-MoE) are this layer with a sparse block (`moe.py`) in place of
the MLP in some or all layers.

Under tensor parallelism (`parallel.py`) each rank builds the layers with its share of
the heads and of the intermediate size, adds an all-reduce after O and after down, and holds a
slice of the vocabulary for the embedding and the LM head. A pipeline stage holds its layers
only: the first embeds, a later one resumes from the stream its predecessor hands on (`carried`:
the last layer's output and the residual, so the sum is the one a single process computes), and
only the last normalises and computes the logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from tandem.models import moe
from tandem.models.lora import AdapterSlots
from tandem.models.parallel import (
    SINGLE,
    WHOLE_MODEL,
    PipelineStage,
    Placement,
    Shard,
    TensorParallel,
    heads_to_rows,
)
from tandem.models.spec import LlamaSpec, checkpoint_shapes
from tandem.ops import elementwise
from tandem.ops.attention_metadata import AttentionMetadata
from tandem.ops.fp8 import Fp8Gemm, Fp8Weight, RowQuantizer, can_quantize_fp8, quantize_fp8
from tandem.ops.linear import (
    FewRowsGemm,
    Linear,
    can_pack_panels,
    can_prepack,
    linear,
    pack_panels,
    panel_arena,
    prepack,
    rows_from_panels,
    shape_only,
    tensor_bytes,
)
from tandem.ops.quantized import (
    BLOCK_COLS,
    GROUP_ROWS,
    QuantizedWeight,
    can_quantize,
    copy_rows,
    for_int8_activations,
    quantize_int8,
    quantized_rows,
    zero_rows,
)


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


@dataclass(frozen=True)
class FusedLayers:
    """What the one-call forward takes per layer and no step changes: each layer's rope table
    and window, and the attention's scale. Gathered once: the module lookups cost a step a
    tenth of a millisecond."""

    cos: list[torch.Tensor]
    sin: list[torch.Tensor]
    windows: list[int]  # 0: none
    scale: float


@dataclass
class ForwardContext:
    """What every layer of one forward reads besides its input."""

    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    rotary: Rotary
    ops: ModuleType  # the non-GEMM ops: ops/elementwise.py, or their fused Triton twins


class Attention(nn.Module):
    def __init__(
        self, spec: LlamaSpec, tp: TensorParallel, window: int | None, scale: float
    ) -> None:
        super().__init__()
        self.spec = spec  # this rank's heads
        self.tp = tp
        self.window = window  # keys a query sees, itself included; None: all before it
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.scale = scale

    def forward(self, x, kv_cache, ctx: ForwardContext):
        s = self.spec
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        ops = ctx.ops
        if s.qk_norm:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)
        out = ops.attend(
            q, k, v, ctx.positions, ctx.rotary.cos, ctx.rotary.sin, kv_cache[0], kv_cache[1],
            ctx.meta, self.scale, self.window,
        )  # fmt: skip
        out = out.view(-1, self.q_size)
        o = self.o
        if not self.tp.enabled or o.bias is None:
            return self.tp.all_reduce(o(out))
        # Row-parallel: each rank holds part of the sum; the bias is added once, to the total.
        return self.tp.all_reduce(o.product(out, None)).add_(o.bias)


class MLP(nn.Module):
    def __init__(self, spec: LlamaSpec, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.gate_up = Linear(spec.hidden_size, 2 * spec.intermediate_size)
        self.down = Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x, ops: ModuleType):
        return self.tp.all_reduce(self.down(self.gate_up.silu_and_mul(x, ops)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, tp: TensorParallel, index: int, window: int | None):
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec, tp, window, spec.head_dim**-0.5)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = moe.SparseMoE(spec, tp) if spec.is_sparse(index) else MLP(spec, tp)

    def flat_weights(self) -> list[torch.Tensor]:
        """This layer's weights in the order `tandem::llama_forward` reads them (csrc)."""
        return flat_layer_weights(self.input_norm, self.attn, self.post_attn_norm, self.mlp)

    def forward(self, x, residual, kv_cache, ctx: ForwardContext):
        """x: the previous sublayer's output (the embeddings for the first layer, where
        residual is None). Returns this layer's MLP output and the residual stream before it."""
        ops = ctx.ops
        h, residual = add_to_residual_and_norm(ops, x, residual, self.input_norm)
        a = self.attn(h, kv_cache, ctx)
        norm = self.post_attn_norm
        h, residual = ops.add_rms_norm(a, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


def flat_layer_weights(
    input_norm: RMSNorm,
    attn: Attention,
    pre_mlp_norm: RMSNorm,
    mlp: nn.Module,
    attn_out_norm: RMSNorm | None = None,
    mlp_out_norm: RMSNorm | None = None,
) -> list[torch.Tensor]:
    """A layer's weights in the order `tandem::llama_forward` reads them (csrc: LayerWeight);
    the out norms are Gemma's, of the attention's and the MLP's outputs."""
    none = torch.empty(0)
    q_norm = attn.q_norm.weight if attn.spec.qk_norm else none
    k_norm = attn.k_norm.weight if attn.spec.qk_norm else none
    norms = [input_norm.weight, q_norm, k_norm, pre_mlp_norm.weight]
    no_shared = [none] * 11  # the shared expert's two linear layers and its gate
    if not isinstance(mlp, moe.SparseMoE):
        mlp_weights = mlp.gate_up.flat() + mlp.down.flat() + [none] + no_shared
    else:
        e, shared = mlp.experts, mlp.shared
        mlp_weights = e.flat("gate_up") + e.flat("down") + [mlp.router.weight]
        mlp_weights += no_shared if shared is None else (
            shared.gate_up.flat() + shared.down.flat() + [mlp.shared_gate.weight]
        )  # fmt: skip
    out_norms = [none if n is None else n.weight for n in (attn_out_norm, mlp_out_norm)]
    return norms + attn.qkv.flat() + attn.o.flat() + mlp_weights + out_norms


def add_to_residual_and_norm(ops: ModuleType, x, residual, norm: RMSNorm):
    """(norm(residual + x), residual + x): a layer's input from the previous layer's output x
    and the residual stream before it (None for the first layer, whose x is the embeddings)."""
    if residual is None:
        return ops.rms_norm(x, norm.weight, norm.eps), x
    return ops.add_rms_norm(x, residual, norm.weight, norm.eps)


_NO_SLOTS = torch.empty(0, dtype=torch.int64)
_NO_NORM = torch.empty(0)
VOCAB_ROWS_PER_READ = 4096  # rows of the embedding or the LM head read from a checkpoint at once


class MissingLayer(nn.Module):
    """A layer another pipeline stage computes: no weights here."""


class LlamaModel(nn.Module):
    rotary: Rotary  # set by the loader on the real device (the module is built on "meta")
    ops: ModuleType = elementwise  # fast_path.prepare may choose the fused Triton ops (CUDA)
    # The rope tables the loader builds, by the config's layer type (None: one for every layer).
    rope_layer_types: tuple[str | None, ...] = (None,)
    # The MLP's activation in the one-call forward: SiLU (SwiGLU), or tanh GELU (GeGLU).
    geglu = False
    # Whether an embedding is a plain lookup, which the one-call forward makes itself (Gemma's
    # is scaled: its rows come from `_embed`).
    embedding_is_lookup = True

    def __init__(
        self, spec: LlamaSpec, tp: TensorParallel = SINGLE, stage: PipelineStage = WHOLE_MODEL
    ):
        super().__init__()
        self.spec = spec  # the whole model's
        self.tp = tp
        self.stage = stage
        self.shard = Shard(spec, tp)
        self.local_spec = self.shard.local_spec  # the heads and sizes this rank computes
        rows = self.shard.vocab_per_rank
        embeds = stage.holds("model.embed_tokens.weight", spec.tie_word_embeddings)
        held = rows if embeds else 0
        # Its weight given, not initialised: the loader fills it, and nn.init's random fill on
        # the meta device would import torch._dynamo (0.6 s of every start-up).
        self.embed = nn.Embedding(
            held, spec.hidden_size, _weight=torch.empty(held, spec.hidden_size)
        )
        self.layers = nn.ModuleList(
            self._make_layer(i) if stage.holds_layer(i) else MissingLayer()
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if not spec.tie_word_embeddings and stage.is_last:
            self.lm_head = Linear(spec.hidden_size, rows)
        self._packed_logits_weight: torch.Tensor | None = None
        # Tied embeddings with quantized weights: the logits' own quantized copy of the embedding.
        self.tied_logits: Linear | None = None
        # A GGUF's embedding kept in its blocks: lookups dequantize a step's rows, and no float
        # table is held (a large vocabulary's is several times its blocks' size).
        self.lookups_in_blocks = False
        self._embed_blocks: QuantizedWeight | None = None  # unless the tied logits' serve
        # The format each planned quantized layer is loaded in (`plan_quantized_weights`).
        self._quantized_layouts: dict[str, str] = {}
        self._fused_weights: list[torch.Tensor] | None = None  # for the one-call forward
        self._fused_layers: FusedLayers | None = None
        self.lora: AdapterSlots | None = None  # with LoRA: every adapter slot's weights
        self._lora_weights: list[torch.Tensor] = []  # theirs, as the one-call forward reads them

    def enable_lora(self, num_slots: int, max_rank: int, device: torch.device) -> None:
        """Slots for `num_slots` adapters of rank up to `max_rank` (zero: no adapter)."""
        self.lora = AdapterSlots(self, self.shard, num_slots, max_rank, device)
        self._lora_weights = self.lora.flat()

    @property
    def stage_layers(self) -> list[tuple[int, nn.Module]]:
        """This stage's layers (every layer in one process), with their model indices."""
        return [(i, self.layers[i]) for i in self.stage.layers(self.spec.num_layers)]

    def _make_layer(self, index: int) -> nn.Module:
        return DecoderLayer(self.local_spec, self.tp, index, self.spec.layer_windows()[index])

    def set_rotary(self, tables: dict[str | None, Rotary]) -> None:
        """Take the loader's rope tables, one per entry of `rope_layer_types`."""
        self.rotary = tables[None]

    def use_fast_path(self, fused: bool) -> bool:
        """Pack every float32 GEMM weight for the CPU GEMMs (`ops/linear.py`) and, if `fused` (the
        CPU kernels are loaded), run the whole forward as one kernel call (`tandem::llama_forward`),
        which needs the GIL once per step instead of once per op. A mixture of experts runs
        there too where its experts are packed or quantized.

        Returns whether the GEMMs were packed. Call once, after the weights are loaded."""
        modules = [m for m in self.modules() if isinstance(m, Linear | moe.Experts)]
        panelled = [m for m in modules if isinstance(m, Linear) and m.will_pack_panels()]
        tied = self.spec.tie_word_embeddings and self.tied_logits is None and self.stage.is_last
        tied_in_panels = tied and can_pack_panels(self.embed.weight)
        weights = [m.weight for m in panelled] + [self.embed.weight] * tied_in_panels
        arena = panel_arena([tuple(w.shape) for w in weights])  # in the order a forward reads
        for m, panels in zip(panelled, arena, strict=False):
            m.prepack(panels)
        packed = [m in panelled or m.prepack() for m in modules]
        if tied and can_prepack(self.embed.weight):
            self._packed_logits_weight = (
                pack_panels(self.embed.weight, arena[-1])
                if tied_in_panels
                else prepack(self.embed.weight)
            )
            if self._packed_logits_weight.dim() == 3:  # the panels serve the lookups too
                self.embed.weight = shape_only(self.embed.weight.shape[0])
        if fused and self.has_fused_forward:
            layers = [layer for _, layer in self.stage_layers]
            self._fused_weights = [w for layer in layers for w in layer.flat_weights()]
            rotaries = [self.layer_rotary(layer) for layer in layers]
            self._fused_layers = FusedLayers(
                [r.cos for r in rotaries], [r.sin for r in rotaries],
                [layer.attn.window or 0 for layer in layers], layers[0].attn.scale,
            )  # fmt: skip
        return all(packed)

    def weight_bytes(self) -> int | None:
        """Bytes of weights one forward reads, each once (a decode step's least traffic beside
        the KV cache): the linear layers as they are held, the norms, the logits' matrix. None
        for a mixture of experts, whose step reads only the experts its tokens chose."""
        return None if self._experts() else self.token_weight_bytes()

    def token_weight_bytes(self) -> int:
        """Bytes of weights one token's forward reads: `weight_bytes`, and of a mixture of
        experts the routers and the top-k experts a token chooses in each sparse layer (what a
        decode step of one request reads)."""
        total = sum(m.nbytes for m in self.modules() if isinstance(m, Linear))
        total += sum(tensor_bytes(m.weight) for m in self.modules() if isinstance(m, RMSNorm))
        if self.spec.tie_word_embeddings and self.tied_logits is None:
            packed = self._packed_logits_weight
            total += tensor_bytes(packed if packed is not None else self.embed.weight)
        for block in self.modules():
            if isinstance(block, moe.SparseMoE):
                chosen = block.experts.nbytes * block.moe.top_k // len(block.experts)
                total += tensor_bytes(block.router.weight) + chosen
        return total

    @property
    def has_fused_forward(self) -> bool:
        """Whether `tandem::llama_forward` (csrc) can compute this model: every family's layers,
        unless a layer is FP8 or experts are neither packed nor quantized."""
        fp8 = any(self._fp8_layers())  # the one-call forward has no FP8 GEMM
        return not fp8 and self._fused_experts

    @property
    def _fused_experts(self) -> bool:
        """Whether the one-call forward computes this model's sparse layers: every projection
        of the experts packed or quantized."""
        return all(e.packed_or_quantized for e in self._experts())

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        lora_slots: torch.Tensor | None = None,  # [T]: each token's adapter slot, -1: none
        carried: torch.Tensor | None = None,  # [2, T, hidden]: a later pipeline stage's input
    ) -> torch.Tensor:
        """The final hidden states [T, hidden]; a pipeline stage before the last returns the
        stream it stopped at, [2, T, hidden] (the last layer's output, the residual)."""
        if lora_slots is None:
            return self._forward(input_ids, positions, kv_caches, meta, carried)
        self.lora.active.tokens = lora_slots
        try:
            return self._forward(input_ids, positions, kv_caches, meta, carried)
        finally:
            self.lora.active.tokens = None

    def _forward(
        self, input_ids, positions, kv_caches, meta: AttentionMetadata, carried
    ) -> torch.Tensor:
        if self._fused_weights is not None:
            return self._fused_forward(input_ids, positions, kv_caches, meta, carried)
        ctx = ForwardContext(positions, meta, self.rotary, self.ops)
        x, residual = (self._embed(input_ids), None) if carried is None else carried.unbind()
        for i, layer in self.stage_layers:
            ctx.meta, ctx.rotary = meta.for_layer(i), self.layer_rotary(layer)
            x, residual = layer(x, residual, kv_caches[i], ctx)
        if not self.stage.is_last:
            return torch.stack((x, residual))
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def layer_rotary(self, layer: nn.Module) -> Rotary:
        """The rope table of a layer (one for all in the Llama family)."""
        return self.rotary

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self._lookup(input_ids)
        local = input_ids - self.shard.vocab.start
        outside = (local < 0) | (local >= self.shard.vocab_per_rank)
        x = self._lookup(local.masked_fill(outside, 0)).masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(x)  # each id's row comes from the one rank that holds it

    @property
    def embedding_table(self) -> torch.Tensor:
        """What lookups read: the embedding, or the tied logits' panels once they replace it."""
        packed = self._packed_logits_weight
        return (
            packed if packed is not None and self.embed.weight.shape[1] == 0 else self.embed.weight
        )

    @property
    def embedding_blocks(self) -> QuantizedWeight | None:
        """The blocks lookups read where the embedding is kept in them, else None."""
        if not self.lookups_in_blocks:
            return None
        return self.tied_logits.quantized if self.tied_logits is not None else self._embed_blocks

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        blocks = self.embedding_blocks
        if blocks is not None:
            return quantized_rows(blocks, ids)
        table = self.embedding_table
        return rows_from_panels(table, ids) if table.dim() == 3 else self.embed(ids)

    def _fused_forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, carried):
        s = self.local_spec
        layers = self.stage.layers(self.spec.num_layers)
        segments = [
            (p.token_start, p.num_tokens, p.context_len, p.row, p.attends_as_decodes)
            for p in meta.prefills
        ]
        prefills = torch.tensor(segments, dtype=torch.int64).view(-1, 5)
        lora_slots = self.lora.active.tokens if self.lora is not None else None
        lora = self._lora_weights if lora_slots is not None else []
        final_norm = self.norm.weight if self.stage.is_last else _NO_NORM  # none: hand on
        looked_up = self.lookups_in_blocks or not self.embedding_is_lookup
        if carried is None and looked_up:  # the first layer's input, no residual
            carried = self._embed(input_ids).unsqueeze(0)
        f = self._fused_layers
        metas = [meta.for_layer(i) for i in layers]
        return torch.ops.tandem.llama_forward(
            input_ids, positions, self.embedding_table, self._fused_weights,
            kv_caches[layers.start : layers.stop], final_norm, f.cos, f.sin,
            [m.slot_mapping for m in metas], [m.block_tables for m in metas], f.windows,
            meta.context_lens, meta.num_decodes, prefills, meta.block_size,
            s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps, f.scale, self.geglu,
            self.tp.group_name, self.shard.vocab.start, s.moe.top_k if s.moe else 0,
            bool(s.moe and s.moe.norm_topk_prob), lora,
            lora_slots if lora_slots is not None else _NO_SLOTS, carried,
        )  # fmt: skip

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tied_logits is not None:
            logits = self.tied_logits(hidden)
        elif self.spec.tie_word_embeddings:
            logits = linear(hidden, self.embed.weight, None, self._packed_logits_weight)
        else:
            logits = self.lm_head(hidden)
        if self.tp.enabled:  # every rank samples, so every rank needs the whole vocabulary
            gathered = self.tp.all_gather_columns(logits)
            logits = gathered[:, : self.spec.vocab_size].contiguous()  # drops the last padding
        return logits.float()

    def load_weight(self, name: str, source) -> bool:
        """Copy this rank's part of one HF checkpoint tensor into place; True if it was used.

        `source` is a safetensors slice (or a tensor): only the rows or columns this rank holds
        are read, so no rank materialises the whole model (nor another pipeline stage's part)."""
        if not self.stage.holds(name, self.spec.tie_word_embeddings):
            return False
        place = self._place(name)
        if place is None:
            return False
        experts = self._quantized_experts(place)
        if experts is not None:  # one expert of a planned stack: its blocks as they are
            module, projection = experts
            layout = self._quantized_layouts[place.target]
            part = source.quantized(place.rows, place.cols, layout)
            module.load_quantized(projection, place.expert, place.offset or 0, part)
            return True
        quantized = self._quantized_target(place.target)
        if quantized is not None:  # a planned layer: the checkpoint's blocks as they are
            layout = self._quantized_layouts.get(place.target)
            for rows, offset in _row_reads(place):
                quantized.load_quantized_rows(offset, source.quantized(rows, place.cols, layout))
            return True
        if name == "model.embed_tokens.weight" and self.tied_logits is not None:
            self.tied_logits.load_quantized_rows(0, source.quantized(place.rows, None))
        if name == "model.embed_tokens.weight" and self.lookups_in_blocks:
            if self.tied_logits is None:
                part = source.quantized(place.rows, None)
                self._embed_blocks = zero_rows(self.shard.vocab_per_rank, part)
                copy_rows(self._embed_blocks, 0, part)
            return True
        if place.target in ("embed.weight", "lm_head.weight"):
            param = self.get_parameter(place.target).data
            param.zero_()  # the last rank's padding rows past the vocabulary
            for rows, offset in _row_reads(place):
                param[offset : offset + rows.stop - rows.start].copy_(source[rows])
            return True
        if place.cols is not None:
            tensor = source[:, place.cols]
        elif place.rows is not None:
            tensor = source[place.rows]
        else:
            tensor = source[:]
        param = self.get_parameter(place.target).data
        if place.expert is not None:
            param = param[place.expert]
        if place.offset is None:
            param.copy_(tensor)
            return True
        param.narrow(0, place.offset, tensor.shape[0]).copy_(tensor)
        return True

    def plan_quantized_weights(
        self,
        format_of: Callable[[str], str | None],
        common: Callable[[set[str | None]], str | None] | None = None,
    ) -> None:
        """Before the weights are allocated (on "meta"): every linear layer whose checkpoint
        tensors all run in one format the kernels take (`format_of(hf_name)`, None: none; parts
        in several: `common(formats)`, the one that holds them all exactly, or None) and whose
        shapes and shard fit the quantized layout gets no float weight; `load_weight` then
        copies its blocks, in that format."""
        sources: dict[str, list[Placement]] = {}
        formats: dict[str, set[str | None]] = {}
        for name in self.checkpoint_names():
            place = self._place(name)
            if place is not None and (place.target.endswith(".weight") or place.expert is not None):
                sources.setdefault(place.target, []).append(place)
                formats.setdefault(place.target, set()).add(format_of(name))
        for target, places in sources.items():
            found = formats[target]
            one = next(iter(found)) if len(found) == 1 else common and common(found)
            if not one or not all(map(_fits, places)):
                continue
            owner, _, projection = target.rpartition(".")
            module = self.get_submodule(owner)
            if isinstance(module, moe.Experts):  # a projection of every expert, stacked
                shape = module.out_features[projection], module.in_features[projection]
                if can_quantize(*shape):
                    module.plan_quantized(projection)
                    self._quantized_layouts[target] = one
                continue
            module = self.get_submodule(target.removesuffix(".weight"))
            if isinstance(module, Linear) and can_quantize(module.out_features, module.in_features):
                module.drop_dense_weight()
                self._quantized_layouts[target] = one
        rows, hidden = self.shard.vocab_per_rank, self.spec.hidden_size
        embed = "model.embed_tokens.weight"
        if not (format_of(embed) and can_quantize(rows, hidden) and _fits(self._place(embed))):
            return
        if self.spec.tie_word_embeddings and self.stage.is_last:
            self.tied_logits = Linear(hidden, rows)
            self.tied_logits.drop_dense_weight()
        if self.stage.is_first:
            self.lookups_in_blocks = True
            self.embed.weight = shape_only(rows)

    def use_few_rows_gemm(self, gemm: FewRowsGemm) -> int:
        """`gemm` for the products of few rows it takes, in every float linear layer (not the
        quantized ones, nor tied logits, which multiply by the embedding); how many took it."""
        layers = [m for m in self.modules() if isinstance(m, Linear) and m.quantized is None]
        for module in layers:
            module.few_rows_gemm = gemm
        return len(layers)

    def use_fp8_few_rows_gemm(self, gemm: Fp8Gemm) -> int:
        """`gemm` for the few-row products of every FP8 layer; how many took it."""
        layers = list(self._fp8_layers())
        for module in layers:
            module.quantized.few_rows = gemm
        return len(layers)

    def use_fp8_row_quantizer(self, quantize_rows: RowQuantizer) -> None:
        """How every FP8 layer rounds its input rows (the fused ops' one kernel on CUDA)."""
        for module in self._fp8_layers():
            module.quantized.quantize_rows = quantize_rows

    def _fp8_layers(self) -> Iterator[Linear]:
        return (
            m
            for m in self.modules()
            if isinstance(m, Linear) and isinstance(m.quantized, Fp8Weight)
        )

    @torch.no_grad()  # a graph from the scales back to the weight would keep the weight alive
    def quantize_int8(self) -> None:
        """Per-channel int8 for every linear layer (and the tied logits) whose shape fits the
        layout, from the loaded float weights."""
        self._quantize_linear_layers(self.modules(), quantize_int8, can_quantize)
        for experts in self._experts():
            for name in moe.PROJECTIONS:
                weights = getattr(experts, name)
                if name in experts.quantized or not can_quantize(*weights.shape[1:]):
                    continue
                absmax = weights.abs().amax(dim=2)
                if name == "down":  # row-parallel: a rank holds some columns of each row
                    self.tp.all_reduce_max(absmax)
                experts.quantize(name, quantize_int8, absmax)
        rows, hidden = self.shard.vocab_per_rank, self.spec.hidden_size
        if (
            self.spec.tie_word_embeddings
            and self.stage.is_last
            and self.tied_logits is None
            and can_quantize(rows, hidden)
        ):
            self.tied_logits = Linear(hidden, rows)
            self.tied_logits.set_quantized(quantize_int8(self.embed.weight))

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Per-channel e4m3 for the decoder layers' linear layers whose shape fits, from the
        loaded weights. The logits keep the model's dtype, as vLLM keeps them: the sampler reads
        their values directly, and an 8B model's are 6% of its weights."""
        self._quantize_linear_layers(self.layers.modules(), quantize_fp8, can_quantize_fp8)

    def _quantize_linear_layers(
        self,
        modules: Iterable[nn.Module],
        quantize: Callable[[torch.Tensor, torch.Tensor], object],
        fits: Callable[[int, int], bool],
    ) -> None:
        """Replace the float weight of each dense `Linear` among `modules` that `fits` by
        quantize(weight, max |w| of each whole row)."""
        row_parallel = {m for name, m in self.named_modules() if name.endswith((".o", ".down"))}
        for module in list(modules):
            dense = isinstance(module, Linear) and module.quantized is None
            if dense and fits(module.out_features, module.in_features):
                absmax = module.weight.abs().amax(dim=1)
                if module in row_parallel:  # a rank holds some columns: the whole row's largest
                    self.tp.all_reduce_max(absmax)
                module.set_quantized(quantize(module.weight, absmax))

    def use_int8_activations(self) -> int:
        """Lay every quantized linear layer (the tied logits' too) out for the kernels' integer
        products; returns how many there are."""
        layers = [m for m in self.modules() if isinstance(m, Linear) and m.quantized is not None]
        for module in layers:
            module.quantized = for_int8_activations(module.quantized)
        stacks = 0
        for experts in self._experts():
            for name, stack in experts.quantized.items():
                experts.quantized[name] = for_int8_activations(stack)
                stacks += 1
        return len(layers) + stacks

    def _experts(self) -> list[moe.Experts]:
        return [m for m in self.modules() if isinstance(m, moe.Experts)]

    def weight_formats(self) -> dict[str, int]:
        """How many linear layers (the logits' included) hold each format, e.g. {"Q4_1": 120}."""
        counts: dict[str, int] = {}
        for module in self.modules():
            if isinstance(module, Linear):
                dense = str(module.weight.dtype).removeprefix("torch.")
                name = module.quantized.source if module.quantized else dense
                if getattr(module.quantized, "int8_activations", False):
                    name += " with int8 activations"
                counts[name] = counts.get(name, 0) + 1
        for experts in self._experts():  # each projection's stack counts as one layer
            for name in moe.PROJECTIONS:
                stack = experts.quantized.get(name)
                held = "float32" if stack is None else stack.source
                if stack is not None and stack.int8_activations:
                    held += " with int8 activations"
                counts[f"{held} experts"] = counts.get(f"{held} experts", 0) + 1
        return counts

    def _quantized_experts(self, place: Placement) -> tuple[moe.Experts, str] | None:
        """The experts and the projection an expert's tensor belongs to, if planned quantized."""
        if place.expert is None:
            return None
        owner, _, projection = place.target.rpartition(".")
        module = self.get_submodule(owner)
        planned = isinstance(module, moe.Experts) and module.planned_quantized(projection)
        return (module, projection) if planned else None

    def _quantized_target(self, target: str) -> Linear | None:
        """The linear layer `target` (a weight's name) belongs to, if it was planned quantized."""
        if not target.endswith(".weight"):
            return None
        module = self.get_submodule(target.removesuffix(".weight"))
        planned = isinstance(module, Linear) and module.weight.numel() == 0
        return module if planned else None

    def checkpoint_names(self) -> set[str]:
        """The HF tensor names this model needs from a checkpoint."""
        return set(self.checkpoint_shapes())

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The HF tensors this model (its pipeline stage) needs from a checkpoint, by name, with
        their whole shapes (what a dummy load makes up; `load_weight` takes this rank's part of
        each)."""
        tied = self.spec.tie_word_embeddings
        shapes = self.whole_checkpoint_shapes()
        return {name: shape for name, shape in shapes.items() if self.stage.holds(name, tied)}

    def whole_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor of the model, by name, with its shape."""
        return checkpoint_shapes(self.spec)

    def _place(self, name: str) -> Placement | None:
        """Where checkpoint tensor `name` goes in this rank's model, and which part of it."""
        s, shard, local = self.spec, self.shard, self.local_spec
        if name == "model.embed_tokens.weight":
            return Placement("embed.weight", offset=0, rows=shard.vocab)
        if name == "model.norm.weight":
            return Placement("norm.weight")
        if name == "lm_head.weight" and not s.tie_word_embeddings:
            return Placement("lm_head.weight", offset=0, rows=shard.vocab)
        if not name.startswith("model.layers."):
            return None
        index, rest = name[len("model.layers.") :].split(".", 1)
        p = f"layers.{index}"
        if rest.startswith(("mlp.", "block_sparse_moe.")) and s.is_sparse(int(index)):
            return moe.place(rest, p, shard)
        q_size = local.num_heads * s.head_dim
        kv_size = local.num_kv_heads * s.head_dim
        qkv = {"q": (0, shard.q_heads), "k": (q_size, shard.kv_heads)}
        qkv["v"] = (q_size + kv_size, shard.kv_heads)
        for part, (offset, heads) in qkv.items():
            for kind in ("weight", "bias"):
                if rest == f"self_attn.{part}_proj.{kind}":
                    rows = heads_to_rows(heads, s.head_dim)
                    return Placement(f"{p}.attn.qkv.{kind}", offset=offset, rows=rows)
        if rest == "self_attn.o_proj.bias" and s.o_bias:  # added once, after the all-reduce
            return Placement(f"{p}.attn.o.bias")
        if rest == "self_attn.o_proj.weight":  # row-parallel: this rank's input columns
            return Placement(f"{p}.attn.o.weight", cols=heads_to_rows(shard.q_heads, s.head_dim))
        if rest == "mlp.down_proj.weight":
            return Placement(f"{p}.mlp.down.weight", cols=shard.intermediate)
        if rest == "mlp.gate_proj.weight":
            return Placement(f"{p}.mlp.gate_up.weight", offset=0, rows=shard.intermediate)
        if rest == "mlp.up_proj.weight":
            offset = local.intermediate_size
            return Placement(f"{p}.mlp.gate_up.weight", offset=offset, rows=shard.intermediate)
        replicated = {
            "input_layernorm.weight": "input_norm.weight",
            "post_attention_layernorm.weight": "post_attn_norm.weight",
        }
        if s.qk_norm:  # per head_dim: the same on every rank
            replicated["self_attn.q_norm.weight"] = "attn.q_norm.weight"
            replicated["self_attn.k_norm.weight"] = "attn.k_norm.weight"
        return Placement(f"{p}.{replicated[rest]}") if rest in replicated else None


def _row_reads(place: Placement) -> list[tuple[slice | None, int]]:
    """The reads of a checkpoint tensor's part: (its rows, their first row in the parameter).
    A vocabulary (the embedding, the LM head) is read VOCAB_ROWS_PER_READ rows at a time: read
    whole, its dequantized or unpacked copy would double the model's largest tensor for as long
    as it is copied."""
    offset = place.offset or 0
    if place.target not in ("embed.weight", "lm_head.weight") or place.rows is None:
        return [(place.rows, offset)]
    rows = place.rows
    return [
        (slice(start, min(rows.stop, start + VOCAB_ROWS_PER_READ)), offset + start - rows.start)
        for start in range(rows.start, rows.stop, VOCAB_ROWS_PER_READ)
    ]


def _fits(place: Placement) -> bool:
    """Whether a tensor's part lands on whole row groups and column blocks of the layout."""
    rows_ok = place.rows is None or (place.rows.stop - place.rows.start) % GROUP_ROWS == 0
    cols_ok = place.cols is None or (
        place.cols.start % BLOCK_COLS == 0 and place.cols.stop % BLOCK_COLS == 0
    )
    return rows_ok and cols_ok and (place.offset or 0) % GROUP_ROWS == 0
