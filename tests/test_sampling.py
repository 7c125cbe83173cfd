"""The sampler's per-row filters: a row that does not ask for one is left exactly as it is."""

from __future__ import annotations

import torch

from tandem.sampler.inputs import SamplingFlags, SamplingRows
from tandem.sampler.sampling import _top_k_top_p, sample


def _tensors(top_p: list[float], use_top_p: bool) -> SamplingRows:
    n = len(top_p)
    return SamplingRows(
        temperature=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        top_p=torch.tensor(top_p),
        min_p=torch.zeros(n),
        seed_keys=torch.arange(n, dtype=torch.int64) + 11,
        output_index=torch.zeros(n, dtype=torch.int64),
        flags=SamplingFlags(
            all_greedy=False, use_top_k=False, use_top_p=use_top_p, use_min_p=False
        ),
    )


def test_top_p_of_one_keeps_the_whole_row_beside_a_filtered_row():
    """In float32 the cumulative probability of a large vocabulary rounds past 1 before its
    end (here for thousands of tail tokens), so `mass_before >= 1` alone would drop them from
    a row that asked for no nucleus, only because another row in its batch did."""
    logits = torch.randn(2, 50000, generator=torch.Generator().manual_seed(0)) * 3
    probs = logits[1].softmax(-1).sort(descending=True).values
    assert ((probs.cumsum(-1) - probs) >= 1.0).any()  # the rounding this test is about
    filtered = _top_k_top_p(logits, _tensors([0.5, 1.0], use_top_p=True))
    assert torch.equal(filtered[1], logits[1])
    assert torch.isinf(filtered[0]).any()
    # So a row's token does not depend on whether its neighbour uses top_p.
    for i in range(5):
        t_mixed, t_plain = _tensors([0.5, 1.0], True), _tensors([1.0, 1.0], False)
        t_mixed.output_index[:] = i
        t_plain.output_index[:] = i
        assert sample(logits, t_mixed)[1] == sample(logits, t_plain)[1]
