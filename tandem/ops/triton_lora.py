"""LoRA deltas (`ops/lora.py`) as two Triton kernels for CUDA steps: punica's grouped shrink
and expand, each token reading its own slot's weights.

Shrink: one program per (token, part) writes h[t, p, :rank] = x[t] @ a[s, p, :, :rank] into a
float32 scratch [T, P, R]. Expand: one program per (token, block of output columns) adds
sum_{r < rank} h[t, p(j), r] * b[s, r, j] to out[t, j], where p(j), the part that holds column j,
comes from `part_ends` (a block may straddle two parts) and the rank is the slot's for that part.
A token of slot -1 is left alone, and so is a part of rank 0; entries of h past a rank are never
written nor read. `slots` and `ranks` are read on the device only (no host sync), so a step can
be captured in a CUDA graph.

Each program sums one token's row only, in an order that depends on the shapes alone (the
shrink by K tiles in ascending order, the expand one rank at a time, ascending): a token's delta
is the same bits whatever else the step holds. Products and sums are float32 whatever the dtype
of x and out; the delta is added to out in float32 and rounded once to out's dtype.
tests/test_triton_lora.py runs the kernels in Triton's interpreter against
`lora.lora_add_reference_`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.ops.triton_launch import let_next_kernel_launch, pdl_options, wait_for_previous_kernel

BLOCK_N = 128  # output columns per expand program
SHRINK_TILE = 4096  # elements of a's [BLOCK_K, BLOCK_R] tile per shrink iteration
_LAUNCH = {"num_warps": 4, "enable_fp_fusion": True}  # explicit: Triton's default is changing


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [T, K], rows `stride_x` apart
    slots_ptr,  # int64 [T], -1: the base model
    a_ptr,  # [S, P, K, R] contiguous
    ranks_ptr,  # int64 [S, P]
    h_ptr,  # float32 [T, P, R] contiguous: h[t, p, :rank] written
    stride_x,
    K,
    P,
    R,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        rank = tl.minimum(tl.load(ranks_ptr + slot * P + part), R)  # never past a's columns
        if rank > 0:
            offs_r = tl.arange(0, BLOCK_R)
            mask_r = offs_r < rank
            offs_k = tl.arange(0, BLOCK_K)
            a_rows = a_ptr + (slot * P + part) * K * R
            acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                mask_k = kk < K
                xv = tl.load(x_ptr + token * stride_x + kk, mask=mask_k, other=0.0)
                av = tl.load(
                    a_rows + kk.to(tl.int64)[:, None] * R + offs_r[None, :],
                    mask=mask_k[:, None] & mask_r[None, :],
                    other=0.0,
                )
                acc += tl.sum(xv.to(tl.float32)[:, None] * av.to(tl.float32), axis=0)
            tl.store(h_ptr + (token * P + part) * R + offs_r, acc, mask=mask_r)
    let_next_kernel_launch(PDL)


@triton.jit
def _lora_expand_kernel(
    out_ptr,  # [T, N], rows `stride_out` apart: out[t, j] += the delta
    slots_ptr,
    b_ptr,  # [S, R, N] contiguous
    ranks_ptr,
    part_ends_ptr,  # int64 [P]: the parts' column ends (the last is N)
    h_ptr,  # float32 [T, P, R] from the shrink
    stride_out,
    N,
    P,
    R,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols < N
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        offs_p = tl.arange(0, BLOCK_P)
        mask_p = offs_p < P
        ranks = tl.load(ranks_ptr + slot * P + offs_p, mask=mask_p, other=0)
        max_rank = tl.minimum(tl.max(ranks, axis=0), R)
        if max_rank > 0:
            ends = tl.load(part_ends_ptr + offs_p, mask=mask_p, other=N)
            # p(j): how many parts end at or before column j
            part = tl.sum((cols[None, :] >= ends[:, None]).to(tl.int64), axis=0)
            part = tl.minimum(part, P - 1)  # masked columns past N stay in range
            rank = tl.minimum(tl.load(ranks_ptr + slot * P + part, mask=mask_n, other=0), R)
            h_row = h_ptr + (token * P + part) * R
            b_rows = b_ptr + slot * R * N + cols
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for r in range(0, max_rank):
                use = mask_n & (r < rank)
                hv = tl.load(h_row + r, mask=use, other=0.0)
                bv = tl.load(b_rows + r * N, mask=use, other=0.0)
                acc += hv * bv.to(tl.float32)
            at = out_ptr + token * stride_out + cols
            adapted = mask_n & (rank > 0)
            old = tl.load(at, mask=adapted, other=0.0)
            tl.store(at, (old.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=adapted)
    let_next_kernel_launch(PDL)


def lora_add_triton_(
    out: torch.Tensor,
    x: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    part_ends: torch.Tensor,
) -> None:
    """`lora.lora_add_` on CUDA tensors (and on CPU ones under Triton's interpreter): every
    adapted token's delta added into `out` [T, out] in place (x [T, in], slots [T])."""
    n_tokens, n_out = out.shape
    n_slots, n_parts, k, max_rank = a.shape
    if a.numel() == 0 or n_tokens == 0 or n_out == 0:
        return
    if not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError("LoRA weights a [S, P, in, R] and b [S, R, out] must be contiguous")
    if b.shape != (n_slots, max_rank, n_out) or x.shape != (n_tokens, k):
        raise ValueError(
            f"LoRA shapes do not match: out {tuple(out.shape)}, x {tuple(x.shape)}, "
            f"a {tuple(a.shape)}, b {tuple(b.shape)}"
        )
    if out.stride(1) != 1:
        raise ValueError("lora_add_ writes out's rows contiguously")
    if x.stride(1) != 1:
        x = x.contiguous()
    slots, ranks, part_ends = slots.contiguous(), ranks.contiguous(), part_ends.contiguous()
    h = torch.empty(n_tokens, n_parts, max_rank, dtype=torch.float32, device=out.device)
    options = pdl_options(out.device)
    block_r = triton.next_power_of_2(max_rank)
    block_k = min(max(16, SHRINK_TILE // block_r), triton.next_power_of_2(k))
    _lora_shrink_kernel[(n_tokens, n_parts)](
        x, slots, a, ranks, h, x.stride(0), k, n_parts, max_rank,
        BLOCK_K=block_k, BLOCK_R=block_r, **_LAUNCH, **options,
    )  # fmt: skip
    block_n = min(BLOCK_N, triton.next_power_of_2(n_out))
    _lora_expand_kernel[(n_tokens, triton.cdiv(n_out, block_n))](
        out, slots, b, ranks, part_ends, h, out.stride(0), n_out, n_parts, max_rank,
        BLOCK_N=block_n, BLOCK_P=triton.next_power_of_2(n_parts), **_LAUNCH, **options,
    )  # fmt: skip
