"""The LoRA shrink and expand Triton kernels (CUDA steps) against `lora_add_reference_`.

They run under Triton's interpreter on CPU tensors (conftest sets it). Sums are float32 in
another order than torch's matmuls, so deltas are within float32 rounding of the reference's;
what the op must leave alone (tokens of slot -1, parts of rank 0) is compared bit for bit, and
so is each token's row alone against the same row in a batch.
"""

from __future__ import annotations

import pytest
import torch

from tandem.ops import triton_lora
from tandem.ops.lora import lora_add_reference_
from tandem.ops.triton_lora import lora_add_triton_

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch) -> None:
    """Tiles the test shapes cross: output blocks that straddle parts, several K tiles."""
    monkeypatch.setattr(triton_lora, "BLOCK_N", 16)
    monkeypatch.setattr(triton_lora, "SHRINK_TILE", 128)


def _weights(parts: list[int], k: int, ranks: list[list[int]], max_rank: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n_slots, n_parts, n_out = len(ranks), len(parts), sum(parts)
    a = torch.randn(n_slots, n_parts, k, max_rank, generator=g) / k**0.5
    b = torch.randn(n_slots, max_rank, n_out, generator=g) / max_rank
    part_ends = torch.tensor(parts, dtype=torch.long).cumsum(0)
    return a, b, torch.tensor(ranks, dtype=torch.long), part_ends


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)  # -0.0 and +0.0 differ


def _check(out, x, slots, a, b, ranks, part_ends) -> torch.Tensor:
    """The kernels' `out` against the reference's, and what neither may touch, unchanged (even
    a -0.0, which adding a zero delta would turn into +0.0)."""
    out[:, ::5] = -0.0
    before = out.clone()
    ref = out.clone()
    lora_add_reference_(ref, x, slots, a, b, ranks, part_ends)
    lora_add_triton_(out, x, slots, a, b, ranks, part_ends)
    torch.testing.assert_close(out, ref, **TOL)
    starts = [0, *part_ends.tolist()]
    for t, s in enumerate(slots.tolist()):
        for p in range(len(starts) - 1):
            if s < 0 or ranks[s, p] == 0:
                cols = slice(starts[p], starts[p + 1])
                assert torch.equal(_bits(out[t, cols]), _bits(before[t, cols]))
    return out


QKV = [40, 12, 12]  # q, k, v column ranges: part ends 40, 52, 64 (off the 16-column blocks)
QKV_RANKS = [[8, 4, 0], [0, 0, 0], [3, 8, 5], [1, 0, 8]]  # 0: the slot leaves that part alone


@pytest.mark.parametrize("tokens", [1, 37])
def test_three_parts_of_different_ranks(tokens) -> None:
    a, b, ranks, part_ends = _weights(QKV, 50, QKV_RANKS, 8, seed=tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, 50, generator=g)
    out = torch.randn(tokens, 64, generator=g)
    if tokens == 1:
        for slot in (-1, 0, 1, 2, 3):
            _check(out.clone(), x, torch.tensor([slot]), a, b, ranks, part_ends)
    else:
        slots = torch.randint(-1, 4, (tokens,), generator=g)
        slots[:5] = torch.tensor([-1, 0, 1, 2, 3])  # every slot and the base model
        _check(out, x, slots, a, b, ranks, part_ends)


@pytest.mark.parametrize(("max_rank", "ranks"), [(8, [[8], [2], [0]]), (6, [[6], [5], [1]])])
def test_one_part_and_ranks_below_the_max(max_rank, ranks) -> None:
    """o/down: one part. A max rank of 6 pads the rank tile to 8; slots use less than it."""
    a, b, ranks, part_ends = _weights([72], 40, ranks, max_rank, seed=max_rank)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 40, generator=g)
    slots = torch.randint(-1, 3, (37,), generator=g)
    _check(torch.randn(37, 72, generator=g), x, slots, a, b, ranks, part_ends)


def test_strided_rows_of_x_and_out() -> None:
    """x and out as views of wider tensors (a fused projection's output keeps its row stride)."""
    a, b, ranks, part_ends = _weights(QKV, 50, QKV_RANKS, 8, seed=3)
    g = torch.Generator().manual_seed(4)
    wide_x = torch.randn(9, 80, generator=g)
    wide_out = torch.randn(9, 100, generator=g)
    slots = torch.tensor([0, -1, 2, 3, 1, 2, -1, 0, 3])
    out = _check(wide_out[:, 10:74], wide_x[:, :50], slots, a, b, ranks, part_ends)
    assert out.data_ptr() == wide_out[:, 10:74].data_ptr()  # in place


def test_a_tokens_delta_does_not_depend_on_the_batch() -> None:
    a, b, ranks, part_ends = _weights(QKV, 50, QKV_RANKS, 8, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(37, 50, generator=g)
    out = torch.randn(37, 64, generator=g)
    slots = torch.randint(-1, 4, (37,), generator=g)
    batch = out.clone()
    lora_add_triton_(batch, x, slots, a, b, ranks, part_ends)
    for t in (0, 5, 17, 36):
        alone = out[t : t + 1].clone()
        lora_add_triton_(alone, x[t : t + 1], slots[t : t + 1], a, b, ranks, part_ends)
        assert torch.equal(_bits(alone[0]), _bits(batch[t]))


def test_nothing_to_do() -> None:
    """No tokens, or a group without weights (an MoE layer's MLP), leave out as it was."""
    a, b, ranks, part_ends = _weights([16], 8, [[4]], 4, seed=8)
    out = torch.zeros(0, 16)
    lora_add_triton_(
        out, torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), a, b, ranks, part_ends
    )
    out = torch.ones(2, 16)
    empty = torch.zeros(1, 1, 8, 0)
    lora_add_triton_(out, torch.ones(2, 8), torch.tensor([0, 0]), empty, b[:, :0], ranks, part_ends)
    assert torch.equal(out, torch.ones(2, 16))
