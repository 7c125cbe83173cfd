"""The sparse mixture-of-experts MLP of Qwen3-MoE, Mixtral and Qwen2-MoE.

These models are the Llama family's layer with one change: some (Qwen: `decoder_sparse_step`,
`mlp_only_layers`) or all (Mixtral) layers replace the MLP with this block. A router (one
replicated matrix, never packed or quantized, so the experts chosen are transformers' own) picks
`top_k` experts per token; the experts run grouped by expert (`ops/moe.py`), each a SwiGLU MLP.
A layer's experts are two stacked parameters ([experts, 2 * inter, hidden] and [experts, hidden,
inter]), not a module per expert: Qwen3-30B-A3B has 6144 experts, and a module each costs a
minute to build. On the CPU fast path each expert's matrices are packed into panels for
Tandem's own GEMM, through `ops/linear.linear` as every dense layer does. The experts stay in
float under `quantization="int8"` and `"fp8"`, and a GGUF's expert blocks are dequantized.
Qwen2-MoE adds a shared expert that every token takes, scaled by a sigmoid gate.

Under tensor parallelism every expert's intermediate dimension is split across the ranks (gate
and up by rows, down by columns), as the dense MLP's is: each rank computes every expert on its
slice, the weighted partial sums add up like the dense MLP's, and the block ends with one
all-reduce. `docs/moe.md` says how expert parallelism would map onto the same code.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
from transformers import PretrainedConfig

from tandem.models.parallel import Placement, Shard, TensorParallel
from tandem.models.spec import LlamaSpec, MoESpec
from tandem.ops.linear import Linear, can_prepack, linear, prepack, shape_only
from tandem.ops.moe import grouped_experts, grouped_experts_on_device, grouped_mm_runs, route

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


class Experts(nn.Module):
    """A layer's experts, stacked; expert e's gate/up rows are `gate_up[e]`, its down `down[e]`."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return self.gate_up.shape[0]

    def prepack(self) -> bool:
        """Pack each expert's two matrices for the CPU GEMMs where they exist; True if it did.
        Panels replace the stacked float weights (as in `Linear.prepack`)."""
        if can_prepack(self.gate_up):
            self.packed = [
                (prepack(g), prepack(d)) for g, d in zip(self.gate_up, self.down, strict=True)
            ]
            if self.packed[0][0].dim() == 3:
                self.gate_up = shape_only(*self.gate_up.shape[:2])
                self.down = shape_only(*self.down.shape[:2])
        return self.packed is not None

    def forward(self, e: int, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        gate_up, down = self.packed[e] if self.packed is not None else (None, None)
        h = ops.silu_and_mul(linear(x, self.gate_up[e], None, gate_up))
        return linear(h, self.down[e], None, down)


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
        if grouped_mm_runs(x):  # no host sync (CUDA)
            e = self.experts
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
