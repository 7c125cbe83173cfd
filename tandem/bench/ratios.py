"""Ratios of two variants' figures, paired by repeat.

Why paired: on a shared machine the speed drifts between minutes by more than two variants
differ, and repeat i of every variant runs within the same minute, so the ratio of each repeat's
pair holds the drift out where a ratio of two medians mixes it in.
"""

from __future__ import annotations

import statistics


def paired_ratio(ours: list[float], theirs: list[float]) -> tuple[float, float, float]:
    """Median, min and max over the repeats of ours[i] / theirs[i] (NaN where nothing pairs)."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True) if b and a == a and b == b]
    if not ratios:
        return (float("nan"),) * 3
    return statistics.median(ratios), min(ratios), max(ratios)
