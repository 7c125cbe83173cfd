"""A grammar's token bitmask applied to logits on the device (the host builds it: engine/grammar.py).

xgrammar's layout: row r's bit t % 32 of int32 word t / 32 allows token t. On a CPU with the fused
kernels loaded, `tandem::apply_token_bitmask_` writes the disallowed logits in one pass; elsewhere
the bits are expanded with torch (the reference).
"""

from __future__ import annotations

import torch

from tandem.ops import cpu_kernels


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [G, V] float32 in place: tokens whose bit is clear become -inf."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_kernels.loaded():
        torch.ops.tandem.apply_token_bitmask_(logits, bitmask.contiguous())
        return
    logits.masked_fill_(~token_allowed(bitmask, logits.shape[-1]), float("-inf"))


def token_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[G, words] int32 -> [G, vocab] bool (little-endian bytes: bit t of the word is token t)."""
    one = torch.ones(8, dtype=torch.uint8, device=bitmask.device)  # made there: no copy
    values = one << torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    as_bytes = bitmask.contiguous().view(torch.uint8)
    return as_bytes.unsqueeze(-1).bitwise_and(values).ne(0).flatten(1)[:, :vocab]
