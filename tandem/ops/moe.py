"""Mixture-of-experts routing and the grouped expert computation.

Routing is transformers' own arithmetic (softmax in float32, top-k, optional renormalisation),
so the experts chosen and their weights are the reference's bit for bit. The experts then run
grouped by expert: the (token, choice) pairs are sorted by expert, each active expert runs one
GEMM pair over all of its tokens, and its weighted rows are added into the output with
`index_add_`. Experts are visited in ascending order, as transformers' eager loop does, so each
token's contributions are summed in the reference's order too (for top-2, any order gives the
same bits).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, float32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k]), largest first."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return (weights if float32_weights else weights.to(logits.dtype)), ids


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_j weights[t, j] * expert(ids[t, j], x[t]) for every token t, one call of `expert`
    (rows of x -> rows of the output) per expert that any token chose."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # by expert, tokens ascending within each
    tokens = order // top_k
    sorted_weights = weights.flatten()[order]
    # The one host sync of the block: how many rows each expert's GEMMs take.
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = torch.zeros_like(x)
    end = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        start, end = end, end + n
        rows = tokens[start:end]
        y = expert(e, x.index_select(0, rows))
        out.index_add_(0, rows, (y * sorted_weights[start:end, None]).to(out.dtype))
    return out
