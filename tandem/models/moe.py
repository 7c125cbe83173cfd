"""The sparse mixture-of-experts MLP of Qwen3-MoE, Mixtral and Qwen2-MoE.

These models are the Llama family's layer with one change: some (Qwen: `decoder_sparse_step`,
`mlp_only_layers`) or all (Mixtral) layers replace the MLP with this block. A router (one
replicated matrix, never packed or quantized, so the experts chosen are transformers' own) picks
`top_k` experts per token; the experts run grouped by expert (`ops/moe.py`), each a SwiGLU MLP.
A layer's experts are two stacked parameters ([experts, 2 * inter, hidden] and [experts, hidden,
inter]), not a module per expert: Qwen3-30B-A3B has 6144 experts, and a module each costs a
minute to build. On the CPU fast path each projection of every expert is packed into panels
for Tandem's own GEMM, or held in quantized blocks (a GGUF's own, or `quantization="int8"`),
and runs in one kernel call for all experts (`Experts`). Under `"fp8"` the experts stay in the
model's dtype. Qwen2-MoE adds a shared expert that every token takes, scaled by a sigmoid gate.

Under tensor parallelism every expert's intermediate dimension is split across the ranks (gate
and up by rows, down by columns), as the dense MLP's is: each rank computes every expert on its
slice, the weighted partial sums add up like the dense MLP's, and the block ends with one
all-reduce. `docs/moe.md` says how expert parallelism would map onto the same code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn
from transformers import PretrainedConfig

from tandem.models.parallel import Placement, Shard, TensorParallel
from tandem.models.spec import LlamaSpec, MoESpec
from tandem.ops import cpu_kernels
from tandem.ops.linear import (
    Linear,
    can_pack_panels,
    linear,
    pack_panels,
    panels_shape,
    rows_from_panels,
    shape_only,
)
from tandem.ops.moe import (
    experts_in_one_pass,
    grouped_experts,
    grouped_experts_on_device,
    grouped_mm_runs,
    route,
)
from tandem.ops.quantized import (
    QuantizedExperts,
    QuantizedWeight,
    copy_rows,
    dequantize,
    quantized_linear,
    zero_rows,
)

ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
# A checkpoint's expert part -> which of gate, up, down it is (Qwen's names, then Mixtral's).
_PARTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down",
          "w1": "gate", "w3": "up", "w2": "down"}  # fmt: skip


def moe_spec(arch: str, config: PretrainedConfig) -> MoESpec | None:
    """The MoE part of a config (None for a dense architecture), as transformers builds it."""
    layers = config.num_hidden_layers
    if arch == "MixtralForCausalLM":
        return MoESpec(
            config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
            norm_topk_prob=True, sparse_layers=tuple(range(layers)), naming="mixtral",
            float32_weights=True,
        )  # fmt: skip
    if arch not in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        return None
    dense = set(config.mlp_only_layers or ())
    step = config.decoder_sparse_step
    sparse = tuple(
        i for i in range(layers)
        if i not in dense and config.num_experts > 0 and (i + 1) % step == 0
    )  # fmt: skip
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = config.shared_expert_intermediate_size
    return MoESpec(
        config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
        bool(config.norm_topk_prob), sparse, shared,
    )  # fmt: skip


class Expert(nn.Module):
    """One SwiGLU MLP (an expert, or the shared expert) without the all-reduce."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = Linear(hidden, 2 * intermediate)
        self.down = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        return self.down(self.gate_up.silu_and_mul(x, ops))


PROJECTIONS = ("gate_up", "down")


class Experts(nn.Module):
    """A layer's experts, stacked; expert e's gate/up rows are `gate_up[e]`, its down `down[e]`.

    Each projection is held one of three ways: the float stack (its parameter); on the CPU fast
    path, every expert's matrix packed into panels, stacked ([experts, panels, in, width]: one
    buffer, which replaces the float stack); or quantized (`quantized[name]`: a GGUF's blocks as
    they are, or int8), the parameter then left empty. The kernels run a projection of every
    expert in one call (`ops/moe.experts_in_one_pass`)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.out_features = {"gate_up": 2 * intermediate, "down": hidden}
        self.in_features = {"gate_up": hidden, "down": intermediate}
        self.panels: dict[str, torch.Tensor] = {}
        self.quantized: dict[str, QuantizedExperts] = {}

    def __len__(self) -> int:
        return self.gate_up.shape[0]

    def plan_quantized(self, name: str) -> None:
        """Keep no float stack for projection `name`: it is to be loaded quantized."""
        setattr(self, name, shape_only(len(self), self.out_features[name]))

    def planned_quantized(self, name: str) -> bool:
        return getattr(self, name).shape[-1] == 0 and name not in self.panels

    def load_quantized(self, name: str, expert: int, first_row: int, part: QuantizedWeight) -> None:
        """Copy one expert's rows [first_row, ...) of projection `name` in the kernels' layout
        (gate and up are two parts of one matrix); the first part sets the stack's format."""
        stack = self.quantized.get(name)
        if stack is None:
            one = zero_rows(self.out_features[name], part)
            stack = self.quantized[name] = QuantizedExperts.empty_like(len(self), one)
        into = stack[expert]  # views of the stack
        copy_rows(into, first_row, part)
        stack.source = into.source

    def quantize(self, name: str, quantize_one: Callable, absmax: torch.Tensor) -> None:
        """Replace the float stack of `name` by each expert's quantize_one(weight, absmax[e])."""
        weights = getattr(self, name)
        one_by_one = [quantize_one(w, a) for w, a in zip(weights, absmax, strict=True)]
        self.quantized[name] = QuantizedExperts.stack(one_by_one)
        self.plan_quantized(name)

    def prepack(self) -> bool:
        """Pack each float projection's experts into stacked panels for the CPU GEMMs where the
        kernels are loaded; True if every projection runs packed or quantized."""
        for name in PROJECTIONS:
            weights = getattr(self, name)
            if name in self.quantized or name in self.panels or not can_pack_panels(weights):
                continue
            shape = (len(self), *panels_shape(self.out_features[name], self.in_features[name]))
            panels = torch.empty(shape)
            for e in range(len(self)):
                pack_panels(weights[e], panels[e])
            self.panels[name] = panels
            setattr(self, name, shape_only(len(self), self.out_features[name]))
        return self.packed_or_quantized

    @property
    def nbytes(self) -> int:
        """Bytes of every expert's weights as they are held (quantized, packed or float)."""
        total = 0
        for name in PROJECTIONS:
            if name in self.quantized:
                total += self.quantized[name].nbytes
            else:
                held = self.panels.get(name, getattr(self, name))
                total += held.numel() * held.element_size()
        return total

    @property
    def packed_or_quantized(self) -> bool:
        return all(n in self.quantized or n in self.panels for n in PROJECTIONS)

    def runs_in_one_pass(self, x: torch.Tensor) -> bool:
        """Whether every projection runs all its experts in one kernel call for x."""
        kernels = cpu_kernels.loaded() and x.device.type == "cpu" and x.dtype == torch.float32
        return kernels and self.packed_or_quantized

    def flat(self, name: str) -> list[torch.Tensor]:
        """Projection `name` as the fused forward reads it (csrc: LayerWeight): an empty [out, 0]
        tensor (the out features), the stacked panels or quantized values, scales, offsets, and
        an empty tensor."""
        none = torch.empty(0)
        outs = torch.empty(self.out_features[name], 0)
        if name in self.quantized:
            values, scales, offsets = self.quantized[name].flat()
            return [outs, values, scales, offsets, none]
        return [outs, self.panels[name], none, none, none]

    def project(self, name: str, rows: torch.Tensor, row_ends: torch.Tensor) -> torch.Tensor:
        """Projection `name` of each expert's rows (sorted by expert, `row_ends`), in one call."""
        if name in self.quantized:
            return torch.ops.tandem.quantized_experts(rows, row_ends, *self.quantized[name].flat())
        out = self.out_features[name]
        return torch.ops.tandem.gemm_experts(rows, row_ends, self.panels[name], out)

    def forward(self, e: int, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        h = ops.silu_and_mul(self._expert(e, "gate_up", x))
        return self._expert(e, "down", h)

    def _expert(self, e: int, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in self.quantized:
            return quantized_linear(x, self.quantized[name][e])
        if name in self.panels:
            return linear(x, getattr(self, name)[e], None, self.panels[name][e])
        return linear(x, getattr(self, name)[e])

    def float_weights(self, name: str) -> torch.Tensor:
        """Projection `name` of every expert, [experts, out, in] in float32, however it is held
        (for inspection)."""
        if name in self.quantized:
            return torch.stack([dequantize(self.quantized[name][e]) for e in range(len(self))])
        if name in self.panels:
            rows = torch.arange(self.out_features[name])
            return torch.stack([rows_from_panels(panels, rows) for panels in self.panels[name]])
        return getattr(self, name).detach()


class SparseMoE(nn.Module):
    """The MLP of a sparse layer: route, run the chosen experts grouped by expert, add the
    shared expert, all-reduce once."""

    def __init__(self, spec: LlamaSpec, tp: TensorParallel):
        super().__init__()
        self.moe = moe = spec.moe  # this rank's sizes
        self.tp = tp
        self.router = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, spec.hidden_size, moe.intermediate_size)
        self.shared: Expert | None = None
        if moe.shared_intermediate_size:
            self.shared = Expert(spec.hidden_size, moe.shared_intermediate_size)
            self.shared_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        m = self.moe
        weights, ids = route(self.router(x), m.top_k, m.norm_topk_prob, m.float32_weights)
        e = self.experts
        if e.runs_in_one_pass(x):  # the CPU kernels: each projection of every expert in one call
            out = experts_in_one_pass(
                x, weights, ids, m.num_experts, functools.partial(e.project, "gate_up"),
                functools.partial(e.project, "down"), ops.silu_and_mul,
            )  # fmt: skip
        elif grouped_mm_runs(x) and not e.quantized:  # no host sync (CUDA)
            out = grouped_experts_on_device(x, weights, ids, e.gate_up, e.down, ops.silu_and_mul)
        else:
            out = grouped_experts(
                x, weights, ids, m.num_experts, lambda e, rows: self.experts(e, rows, ops)
            )
        if self.shared is not None:
            out += torch.sigmoid(self.shared_gate(x)) * self.shared(x, ops)
        return self.tp.all_reduce(out)


def place(rest: str, layer: str, shard: Shard) -> Placement | None:
    """Where a sparse layer's checkpoint tensor `rest` (the name after `model.layers.N.`) goes
    in this rank's model (`layer`: "layers.N"), and which part of it."""
    moe, local = shard.spec.moe, shard.local_spec.moe
    parts = rest.split(".")
    block = "block_sparse_moe" if moe.naming == "mixtral" else "mlp"
    if parts[0] != block or parts[-1] != "weight":
        return None
    if parts[1:] == ["gate", "weight"]:
        return Placement(f"{layer}.mlp.router.weight")
    if len(parts) == 5 and parts[1] == "experts" and parts[2].isdigit() and parts[3] in _PARTS:
        expert = int(parts[2])
        if expert >= moe.num_experts:
            return None
        part = _PARTS[parts[3]]
        if part == "down":
            return Placement(f"{layer}.mlp.experts.down", cols=shard.expert_intermediate,
                             expert=expert)  # fmt: skip
        offset = 0 if part == "gate" else local.intermediate_size
        return Placement(f"{layer}.mlp.experts.gate_up", offset=offset,
                         rows=shard.expert_intermediate, expert=expert)  # fmt: skip
    if not moe.shared_intermediate_size:
        return None
    if parts[1:] == ["shared_expert_gate", "weight"]:
        return Placement(f"{layer}.mlp.shared_gate.weight")
    if len(parts) == 4 and parts[1] == "shared_expert" and parts[2] in _PARTS:
        part, rows = _PARTS[parts[2]], shard.shared_intermediate
        if part == "down":
            return Placement(f"{layer}.mlp.shared.down.weight", cols=rows)
        offset = 0 if part == "gate" else local.shared_intermediate_size
        return Placement(f"{layer}.mlp.shared.gate_up.weight", offset=offset, rows=rows)
    return None
