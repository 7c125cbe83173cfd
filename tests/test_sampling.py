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


def test_sampling_flags_say_which_settings_any_row_uses():
    """The host's flags decide which sampler stages run (and which CUDA graph replays): a stage
    is skipped only when no row of the step uses it."""
    import numpy as np

    from tandem.request import Request, SamplingParams
    from tandem.sampler.inputs import build_sampler_inputs
    from tandem.scheduling.scheduler import ScheduledRequest

    def flags(*rows: tuple[float, int, float, float]):
        items = []
        for i, (temperature, top_k, top_p, min_p) in enumerate(rows):
            row = (temperature, top_k, top_p, min_p, 0)
            request = Request(f"r{i}", [5, 6], SamplingParams(), 0, row, 4, 0.0)
            items.append(ScheduledRequest(request, i, 0, 2, sample=True, output_index=0))
        return build_sampler_inputs(items, np.zeros(len(items), np.int64), 8, False).sampling.flags

    greedy = (0.0, 0, 1.0, 0.0)
    assert flags(greedy, greedy) == SamplingFlags(True, False, False, False)
    assert flags(greedy, (0.7, 0, 1.0, 0.0)) == SamplingFlags(False, False, False, False)
    assert flags(greedy, (0.7, 5, 1.0, 0.0)) == SamplingFlags(False, True, False, False)
    assert flags((0.7, 0, 0.9, 0.0), greedy) == SamplingFlags(False, False, True, False)
    assert flags((0.7, 0, 1.0, 0.05)) == SamplingFlags(False, False, False, True)
    assert flags() == SamplingFlags(True, False, False, False)  # no sampled row: nothing to do
