"""Draft verification: how many of a request's drafts its own samples confirm.

Every token of a verifying request is a sampling row, sampled exactly as without speculation
(the same seeded noise, keyed by the output index of the position it predicts). A draft is
accepted when the sample of the position before it equals it, and only while every earlier
draft of the request was: so the accepted run is the tokens decoding without drafts would have
produced, greedy or seeded. With a draft that is a fixed guess (ngram) this accepts a draft with
its probability under the target, as rejection sampling does; a draft model that samples with
the same noise as the target (see `execution/drafting.py`) is accepted whenever both draws agree.
"""

from __future__ import annotations

import torch

from tandem.sampler.inputs import VerifyRows


def count_accepted(
    ids: torch.Tensor, input_ids: torch.Tensor, v: VerifyRows[torch.Tensor], max_drafts: int
) -> torch.Tensor:
    """Tokens each verifying request keeps ([V] int64, 1 + its accepted drafts) from the step's
    sampled `ids` and its `input_ids` (where the drafts are)."""
    confirmed = ids[v.check_rows] == input_ids[v.draft_batch]
    matrix = torch.zeros(len(v.table_rows), max_drafts, dtype=torch.int64, device=ids.device)
    matrix[v.draft_item, v.draft_index] = confirmed.to(torch.int64)
    return 1 + matrix.cumprod(dim=1).sum(dim=1)
