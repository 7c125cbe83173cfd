"""LoRA deltas of a step whose tokens use different adapters (punica's grouped shrink and
expand): out[t] += B_s(A_s x[t]) for the adapter slot s of each token, the base model's tokens
(slot -1) untouched. Never merged into the base weights: one step serves every adapter.

Each projection group (q/k/v, o, gate/up, down) holds every slot's weights (`models/lora.py`):
`a` [slots, parts, in, rank] and `b` [slots, rank, out] (the scaling folded in), `ranks`
[slots, parts] (0: the slot leaves that part alone) and `part_ends` [parts], the parts' column
ends in `out`. Each token's sums run in a fixed order over its own row only, so a token's delta
is the same bits whatever else the step holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.ops import cpu_kernels


@dataclass
class ActiveSlots:
    """The running step's slot of each token ([T] int64, -1: the base model), set by the model
    around a forward whose step holds an adapted token; None otherwise."""

    tokens: torch.Tensor | None = None


@dataclass
class LoraGroup:
    """One projection group's weights for every slot, as the kernels read them."""

    a: torch.Tensor  # [slots, parts, in, rank]
    b: torch.Tensor  # [slots, rank, out]
    ranks: torch.Tensor  # [slots, parts] int64
    part_ends: torch.Tensor  # [parts] int64
    active: ActiveSlots

    @property
    def in_use(self) -> bool:
        return self.active.tokens is not None

    def add_(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out += this group's delta of x for the step's adapted tokens; returns out."""
        tokens = self.active.tokens
        if tokens is not None:
            lora_add_(out, x, tokens, self.a, self.b, self.ranks, self.part_ends)
        return out


def lora_add_reference_(
    out: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    part_ends: torch.Tensor,
) -> None:
    """The deltas in plain torch ops, slot by slot (the kernels' reference; reads `slots` and
    `ranks` on the host, so it is for tests and CPU tensors)."""
    slot_ids = slots.tolist()
    ends = part_ends.tolist()
    for s in sorted(set(slot_ids) - {-1}):
        rows = torch.tensor([t for t, v in enumerate(slot_ids) if v == s], dtype=torch.long)
        xs = x[rows]
        start = 0
        for p, end in enumerate(ends):
            rank = int(ranks[s, p])
            if rank:
                h = xs @ a[s, p, :, :rank]
                out[rows, start:end] += h @ b[s, :rank, start:end]
            start = end


def lora_add_(
    out: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    part_ends: torch.Tensor,
) -> None:
    """Add every adapted token's delta into `out` [T, out] in place (x [T, in], slots [T])."""
    if a.numel() == 0 or slots.numel() == 0:
        return
    if out.device.type == "cpu" and cpu_kernels.loaded():
        torch.ops.tandem.lora_add_(out, x, slots, a, b, ranks, part_ends)
    elif out.device.type == "cuda":
        from tandem.ops.triton_lora import lora_add_triton_

        lora_add_triton_(out, x, slots, a, b, ranks, part_ends)
    else:
        lora_add_reference_(out, x, slots, a, b, ranks, part_ends)
