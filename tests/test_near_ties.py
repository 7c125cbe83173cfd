"""The near-tie rule every greedy comparison with transformers goes through
(conftest.follow_near_ties): the reference follows the engine's token only where that token's
logit is within FAST_PATH_LOGITS_ATOL of the reference's top logit; any other difference fails."""

from __future__ import annotations

import torch

from conftest import (
    FAST_PATH_LOGITS_ATOL,
    _load_hf_model,
    follow_near_ties,
    hf_greedy_reference,
    hf_greedy_reference_allowing_near_ties,
)

BOUND = FAST_PATH_LOGITS_ATOL


def fake_reference(first_gap: float):
    """A greedy reference over ids 0-3 whose logits depend on the last token: at the start id 0
    leads id 1 by `first_gap`; then 0 -> 2 -> 0 -> 2 ..., and 1 -> 3 -> 3 ... (5 apart)."""
    after = {0: 2, 1: 3, 2: 0, 3: 3}

    def logits_after(prefix: list[int]) -> torch.Tensor:
        if not prefix:
            return torch.tensor([1.0, 1.0 - first_gap, 0.0, 0.0], dtype=torch.float64)
        row = torch.zeros(4, dtype=torch.float64)
        row[after[prefix[-1]]] = 5.0
        return row

    def continuation(prefix: list[int], n: int) -> list[int]:
        out = list(prefix)
        for _ in range(n):
            out.append(int(logits_after(out).argmax()))
        return out[len(prefix) :]

    return continuation, logits_after


def test_the_same_tokens_are_the_reference() -> None:
    continuation, logits_after = fake_reference(BOUND / 10)
    assert follow_near_ties([0, 2, 0, 2], 4, continuation, logits_after) == [0, 2, 0, 2]


def test_a_near_tie_is_followed_and_the_reference_continues_from_the_engines_token() -> None:
    continuation, logits_after = fake_reference(BOUND / 10)
    assert follow_near_ties([1, 3, 3, 3], 4, continuation, logits_after) == [1, 3, 3, 3]


def test_a_difference_beyond_the_bound_fails() -> None:
    """The helper must be able to fail: id 1 trails the top by twice the bound."""
    continuation, logits_after = fake_reference(2 * BOUND)
    assert follow_near_ties([1, 3, 3, 3], 4, continuation, logits_after) == [0, 2, 0, 2]


def test_after_a_near_tie_a_real_difference_still_fails() -> None:
    continuation, logits_after = fake_reference(BOUND / 10)
    assert follow_near_ties([1, 3, 2, 0], 4, continuation, logits_after) == [1, 3, 3, 3]


def test_the_reference_has_the_requested_length() -> None:
    """A run that stopped early (or ran long) differs from the reference in length."""
    continuation, logits_after = fake_reference(BOUND / 10)
    assert follow_near_ties([1, 3], 4, continuation, logits_after) == [1, 3, 3, 3]
    assert follow_near_ties([0, 2, 0, 2, 0], 4, continuation, logits_after) == [0, 2, 0, 2]


def test_the_near_tie_of_the_randomized_schedules_example(tiny_llama) -> None:
    """test_randomized's explicit example: ids 49 and 381 are 2.4e-7 apart at the 9th token of
    [572, 773, 174] (either may lead, by CPU); either passes, the third best does not."""
    prompt = [572, 773, 174]
    reference = hf_greedy_reference(tiny_llama, prompt, 9)
    with torch.no_grad():
        row = _load_hf_model(str(tiny_llama.resolve()))(torch.tensor([prompt + reference[:8]]))
    row = row.logits[0, -1]
    assert reference[8] in (49, 381) and abs(row[49] - row[381]) < BOUND
    rival = 49 + 381 - reference[8]
    tokens = reference[:8] + [rival]
    assert hf_greedy_reference_allowing_near_ties(tiny_llama, prompt, tokens) == tokens
    third = int(row.topk(3).indices[2])
    assert row.max() - row[third] > BOUND
    far = reference[:8] + [third]
    assert hf_greedy_reference_allowing_near_ties(tiny_llama, prompt, far) == reference
