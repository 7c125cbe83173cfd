"""Mixture-of-experts routing and the grouped expert computation.

Routing is transformers' own arithmetic (softmax in float32, top-k, optional renormalisation),
so the experts chosen and their weights are the reference's bit for bit. The experts then run
grouped by expert: the (token, choice) pairs are sorted by expert, each active expert runs one
GEMM pair over all of its tokens, and its weighted rows are added into the output with
`index_add_`. Experts are visited in ascending order, as transformers' eager loop does, so each
token's contributions are summed in the reference's order too (for top-2, any order gives the
same bits).

`grouped_experts_on_device` computes the same sums with no host sync: every (token, choice) row
sorted by expert goes through one `torch._grouped_mm` per projection over the stacked weights,
the groups' ends found by `searchsorted` on the device. The loop reads each expert's row count on
the host, which on CUDA stalls the stream once per sparse layer; CUDA steps take this path where
the grouped GEMM runs (bfloat16).
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
    rows = x.index_select(0, tokens)  # every expert's rows, one slice each
    ys = torch.empty_like(rows)
    end = 0
    for e, n in enumerate(counts):
        if n:
            start, end = end, end + n
            ys[start:end] = expert(e, rows[start:end])
    out = torch.zeros_like(x)
    # One add for all: row by row in order, so each token's terms still add by ascending expert.
    return out.index_add_(0, tokens, (ys * sorted_weights[:, None]).to(out.dtype))


def experts_in_one_pass(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    gate_up: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    down: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`grouped_experts` with each projection of every expert in one call: `gate_up(rows,
    row_ends)` and `down(rows, row_ends)` take all the rows sorted by expert and each expert's
    end row (the CPU kernels run them as one task list: a layer's experts at decode are a
    handful of small products, each too small for a parallel region of its own)."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # by expert, tokens ascending within each
    tokens = order // top_k
    row_ends = torch.bincount(flat, minlength=num_experts).cumsum(0)  # on the CPU: no sync
    # Each intermediate freed as the next is made: a long prefill's rows are tokens x top-k.
    ys = down(act(gate_up(x.index_select(0, tokens), row_ends)), row_ends)
    ys.mul_(weights.flatten()[order, None])
    # Row by row in order, so each token's terms add by ascending expert, as in the loop.
    return torch.zeros_like(x).index_add_(0, tokens, ys.to(x.dtype))


def grouped_experts_on_device(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,  # [experts, 2 * inter, hidden]
    down: torch.Tensor,  # [experts, hidden, inter]
    act: Callable[[torch.Tensor], torch.Tensor],  # gate_up rows -> inter rows (SiLU-and-mul)
) -> torch.Tensor:
    """`grouped_experts` of the SwiGLU experts `gate_up`, `down`, in two grouped GEMMs."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    experts = torch.arange(gate_up.shape[0], device=ids.device, dtype=flat.dtype)
    ends = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)
    rows = x.index_select(0, tokens)
    h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=ends)
    y = torch._grouped_mm(act(h), down.transpose(1, 2), offs=ends)
    out = torch.zeros_like(x)
    out.index_add_(0, tokens, (y * weights.flatten()[order, None]).to(out.dtype))
    return out


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether `grouped_experts_on_device` is the path for x: CUDA in bfloat16, where torch has
    its grouped GEMM (the CPU takes the loop, whose packed GEMMs are faster there)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
