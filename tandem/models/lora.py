"""LoRA adapters over a Llama-family model: a PEFT checkpoint read and checked against the base
(`read_adapter`), and the slots every adapter in use is copied into (`AdapterSlots`).

A slot holds, per layer and projection group, the adapter's A and B in the layout the kernels
read (`ops/lora.py`): zero where the adapter leaves a part alone, its scaling folded into B.
Under tensor parallelism each rank's slots hold its slice: the rows of B for column-parallel
groups (q/k/v, gate/up), the columns of A for row-parallel ones (o, down), whose deltas are then
partial sums that the all-reduce after them completes.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tandem.lora import LoraError, LoRARequest
from tandem.models.parallel import Shard, heads_to_rows
from tandem.models.spec import LlamaSpec
from tandem.ops.linear import Linear
from tandem.ops.lora import ActiveSlots, LoraGroup

# PEFT's module name -> (projection group, part of the group).
MODULES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
GROUPS = ("qkv", "o", "gate_up", "down")
PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight"
)
_load_serial = itertools.count(1)


@dataclass
class AdapterWeights:
    """An adapter read and checked, on the host, whole (every rank slices its own part):
    per (layer, module name), A [rank, in] and B [out, rank] with the scaling folded in."""

    request: LoRARequest
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # The prefix cache's key: unique to this load (an unloaded name loaded again, from another
    # folder, must not find the old adapter's blocks).
    cache_key: str = field(default_factory=lambda: f"lora-{next(_load_serial)}")


def module_shapes(spec: LlamaSpec) -> dict[str, tuple[int, int]]:
    """Each adaptable module's whole [out, in]."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {
        "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
        "o_proj": (hidden, q), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }  # fmt: skip


def read_adapter(request: LoRARequest, spec: LlamaSpec, max_rank: int) -> AdapterWeights:
    """Read and check a PEFT checkpoint against the base model; LoraError names what does not
    fit (a missing file, a rank above `max_rank`, a shape of another model, a module or option
    the engine does not run)."""
    name = request.lora_name
    folder = Path(request.lora_path)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise LoraError(f"LoRA adapter {name!r}: no {path.name} in {folder}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} unreadable: {exc}") from None
    _check_config(name, config)
    shapes = module_shapes(spec)
    tensors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _TENSOR.fullmatch(key)
                if match is None:
                    raise LoraError(f"LoRA adapter {name!r}: tensor {key} adapts no projection "
                                    f"the engine runs ({', '.join(MODULES)})")  # fmt: skip
                layer, module, which = int(match[1]), match[2], match[3]
                if module not in MODULES:
                    raise LoraError(f"LoRA adapter {name!r}: module {module} is not one of "
                                    f"{', '.join(MODULES)}")  # fmt: skip
                tensors.setdefault((layer, module), {})[which] = f.get_tensor(key).float()
    except LoraError:
        raise
    except Exception as exc:  # a truncated or foreign file: safetensors' own message
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} unreadable: {exc}") from None
    if not tensors:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    modules = {}
    for (layer, module), pair in sorted(tensors.items()):
        where = f"LoRA adapter {name!r}: layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise LoraError(f"{where} lacks lora_{'B' if 'A' in pair else 'A'}")
        if layer >= spec.num_layers:
            raise LoraError(f"{where}: the base model has {spec.num_layers} layers")
        if module in ("gate_proj", "up_proj", "down_proj") and spec.is_sparse(layer):
            raise LoraError(f"{where}: LoRA on a mixture of experts' MLP is not supported")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        out, inp = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape != (out, rank):
            raise LoraError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                f"base model's {out} x {inp} projection (rank {rank})"
            )
        if rank > max_rank:
            raise LoraError(f"{where}: rank {rank} is above max_lora_rank {max_rank}")
        scaling = _scaling(config, f"model.layers.{layer}.{_owner(module)}.{module}", rank)
        modules[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    return AdapterWeights(request, modules)


def _owner(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def _check_config(name: str, config: dict) -> None:
    """Refuse by name the PEFT options whose arithmetic is not LoRA's plain delta."""
    refusals = {
        "use_dora": "DoRA",
        "fan_in_fan_out": "fan_in_fan_out weights",
        "modules_to_save": "modules_to_save (fully trained modules)",
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trainable tokens",
    }
    for key, what in refusals.items():
        if config.get(key):
            raise LoraError(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoraError(f"LoRA adapter {name!r}: LoRA biases are not supported")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: a {peft_type} adapter is not LoRA")
    if "r" not in config or "lora_alpha" not in config:
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} lacks r or lora_alpha")


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's: lora_alpha / r, or / sqrt(r) with rsLoRA; `alpha_pattern` may set a module's
    alpha (its keys match a module name's end, as PEFT matches them)."""
    alpha = float(config["lora_alpha"])
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = float(value)
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


class AdapterSlots:
    """`num_slots` adapters' weights on the device, per layer and projection group, each group
    hung on its linear layer (`Linear.lora`), so both the op-by-op and the one-call forward
    reach them. `active` holds the step's per-token slots while a forward runs."""

    def __init__(
        self, model: nn.Module, shard: Shard, num_slots: int, max_rank: int, device: torch.device
    ):
        self.shard = shard
        self.active = ActiveSlots()
        local = shard.local_spec
        q, kv = local.num_heads * local.head_dim, local.num_kv_heads * local.head_dim
        hidden, inter = local.hidden_size, local.intermediate_size
        ends = {"qkv": [q, q + kv, q + 2 * kv], "o": [hidden], "gate_up": [inter, 2 * inter],
                "down": [hidden]}  # fmt: skip
        ins = {"qkv": hidden, "o": q, "gate_up": hidden, "down": inter}
        self._part_starts = {name: [0, *e[:-1]] for name, e in ends.items()}
        self.held = model.stage.layers(len(model.layers))  # a pipeline stage's layers: its slots
        self.groups: list[dict[str, LoraGroup]] = []  # per model layer ({} for another stage's)
        for i, layer in enumerate(model.layers):
            groups = {}
            if i not in self.held:
                self.groups.append(groups)
                continue
            for name in GROUPS:
                linear = self._linear(layer, name)
                if linear is None or (name in ("gate_up", "down") and shard.spec.is_sparse(i)):
                    continue
                parts = PARTS[name]
                groups[name] = linear.lora = LoraGroup(
                    a=torch.zeros(num_slots, parts, ins[name], max_rank, device=device),
                    b=torch.zeros(num_slots, max_rank, ends[name][-1], device=device),
                    ranks=torch.zeros(num_slots, parts, dtype=torch.int64, device=device),
                    part_ends=torch.tensor(ends[name], dtype=torch.int64, device=device),
                    active=self.active,
                )
            self.groups.append(groups)

    @staticmethod
    def _linear(layer: nn.Module, name: str) -> Linear | None:
        owner = layer.attn if name in ("qkv", "o") else layer.mlp
        linear = getattr(owner, name, None)
        return linear if isinstance(linear, Linear) else None

    def flat(self) -> list[torch.Tensor]:
        """Per layer of the stage, each group's a, b, ranks and part_ends (empty for a group it
        lacks), in the order `tandem::llama_forward` reads them."""
        none = torch.empty(0)
        out = []
        for groups in self.groups[self.held.start : self.held.stop]:
            for name in GROUPS:
                g = groups.get(name)
                out += [g.a, g.b, g.ranks, g.part_ends] if g else [none] * 4
        return out

    @torch.no_grad()
    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Copy this rank's slice of `adapter` into `slot`, replacing what it held. Only the
        ranks are cleared first: the kernels read a part's A and B up to its rank alone, so
        what the previous adapter left beyond them is never read."""
        shard, spec = self.shard, self.shard.spec
        rows = {
            "q_proj": heads_to_rows(shard.q_heads, spec.head_dim),
            "k_proj": heads_to_rows(shard.kv_heads, spec.head_dim),
            "v_proj": heads_to_rows(shard.kv_heads, spec.head_dim),
            "gate_proj": shard.intermediate,
            "up_proj": shard.intermediate,
        }
        cols = {
            "o_proj": heads_to_rows(shard.q_heads, spec.head_dim),
            "down_proj": shard.intermediate,
        }
        for groups in self.groups:
            for g in groups.values():
                g.ranks[slot].zero_()
        for (layer, module), (a, b) in adapter.modules.items():
            if layer not in self.held:
                continue  # another pipeline stage's
            name, part = MODULES[module]
            g = self.groups[layer][name]
            rank = a.shape[0]
            a = a[:, cols[module]] if module in cols else a
            b = b[rows[module]] if module in rows else b
            start = self._part_starts[name][part]
            g.a[slot, part, :, :rank].copy_(a.T)
            g.b[slot, :rank, start : start + b.shape[0]].copy_(b.T)
            g.ranks[slot, part] = rank
